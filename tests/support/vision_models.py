"""A real trained vision model for the tests: a small ViT classifier trained on scikit-learn's
handwritten digits (8x8 grey images, shipped with the package: no network), saved with its
image processor, and the held-out images written as PNG files.

No pretrained vision weights are reachable offline; a model trained here reads real images
the way a checkpoint does (its class token carries the class), which random weights do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

LABELS = {i: f"digit {i}" for i in range(10)}


@dataclass(frozen=True)
class Digits:
    model: Path  # a folder: the model and its image processor
    images: Path  # held-out images as PNG files, sorted by name as their labels are
    labels: list[int]  # the held-out images' true digits
    accuracy: float  # held-out accuracy of the trained model


def _pixels(images: np.ndarray) -> np.ndarray:
    """Digits (0-16) as the uint8 RGB pixels of a PNG: [N, 8, 8, 3]."""
    grey = np.rint(images * (255.0 / 16.0)).astype(np.uint8)
    return np.repeat(grey[..., None], 3, axis=-1)


def train_digits(folder: Path, *, held_out: int = 48, epochs: int = 20, seed: int = 0) -> Digits:
    """Train the classifier (a few seconds on two cores) and save it, its processor and
    `held_out` held-out images under `folder`."""
    import torch
    from PIL import Image
    from sklearn.datasets import load_digits
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(seed)
    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.images))
    n_test = 297
    train, test = order[:-n_test], order[-n_test:]
    pixels = _pixels(data.images)
    # As the processor prepares a PNG: rescale by 1/255, normalize with mean 0.5, std 0.5.
    x = torch.tensor((pixels / 255.0 - 0.5) / 0.5, dtype=torch.float32).permute(0, 3, 1, 2)
    y = torch.tensor(data.target)
    config = ViTConfig(image_size=8, patch_size=2, num_channels=3, hidden_size=48,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                       num_labels=10, id2label=LABELS,
                       label2id={v: k for k, v in LABELS.items()})
    model = ViTForImageClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    steps = epochs * -(-len(train) // 64)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: one thread is fastest, and shares the machine
    try:
        rng = np.random.default_rng(seed)
        for _ in range(epochs):
            model.train()
            rng.shuffle(train)
            for i in range(0, len(train), 64):
                b = torch.from_numpy(train[i:i + 64])
                loss = model(pixel_values=x[b], labels=y[b]).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        model.eval()
        with torch.no_grad():
            pred = model(pixel_values=x[torch.from_numpy(test)]).logits.argmax(-1)
    finally:
        torch.set_num_threads(threads)
    accuracy = float((pred == y[torch.from_numpy(test)]).float().mean())
    out = folder / "vit-digits"
    model.save_pretrained(out)
    ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5] * 3,
                      image_std=[0.5] * 3).save_pretrained(out)
    images = folder / "digits"
    images.mkdir()
    kept = test[:held_out]
    for n, i in enumerate(kept):
        Image.fromarray(pixels[i]).save(images / f"{n:03d}.png")
    return Digits(model=out, images=images, labels=[int(data.target[i]) for i in kept],
                  accuracy=accuracy)


def build_contrastive(kind: str, folder: Path, *, seed: int = 0) -> Path:
    """A tiny random contrastive model (`clip` or `siglip`) from its config, saved in `folder`
    with its processor (image processor and the tests' offline tokenizer): images of 8x8
    pixels, 2x2 patches."""
    import torch
    import transformers as T

    from .tiny_models import build_tokenizer

    tok = build_tokenizer(kind="bpe")
    torch.manual_seed(seed)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, image_size=8, patch_size=2)
    text = dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    out = folder / kind
    if kind == "clip":
        model = T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=vision,
                                         projection_dim=12))
        images = T.CLIPImageProcessor(size={"shortest_edge": 8},
                                      crop_size={"height": 8, "width": 8})
        processor = T.CLIPProcessor(image_processor=images, tokenizer=tok)
    else:
        assert kind == "siglip", kind
        model = T.SiglipModel(T.SiglipConfig(text_config=text, vision_config=vision))
        with torch.no_grad():  # a logit scale and bias of a trained model's size
            model.logit_scale.fill_(2.3)
            model.logit_bias.fill_(-1.5)
        processor = T.SiglipProcessor(
            image_processor=T.SiglipImageProcessor(size={"height": 8, "width": 8}),
            tokenizer=tok)
    model.eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out


def build_multimodal(kind: str, folder: Path, *, seed: int = 0, vision_width: int = 16
                     ) -> Path:
    """A tiny random multimodal decoder (`llava` or `paligemma`) from its config, saved in
    `folder` with its processor: images of 8x8 pixels in 2x2 patches, each image 16 image
    tokens (`<image>`, added to the tests' offline tokenizer) in the decoder's sequence. The
    vision tower `vision_width` wide (the text decoder: 32)."""
    import torch
    import transformers as T

    from .tiny_models import build_tokenizer

    tok = build_tokenizer(kind="bpe")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    vision = dict(hidden_size=vision_width, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, image_size=8, patch_size=2)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                pad_token_id=tok.pad_token_id)
    out = folder / kind
    if kind == "llava":
        model = T.LlavaForConditionalGeneration(T.LlavaConfig(
            vision_config=T.CLIPVisionConfig(**vision).to_dict(),
            text_config=T.LlamaConfig(**text).to_dict(), image_token_index=image))
        processor = T.LlavaProcessor(
            image_processor=T.CLIPImageProcessor(size={"shortest_edge": 8},
                                                 crop_size={"height": 8, "width": 8}),
            tokenizer=tok, patch_size=2, vision_feature_select_strategy="default",
            image_token="<image>", num_additional_image_tokens=1)
    else:
        assert kind == "paligemma", kind
        model = T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
            vision_config=dict(model_type="siglip_vision_model", **vision),
            text_config=dict(model_type="gemma", **text, head_dim=8),
            image_token_index=image, projection_dim=32))
        images = T.SiglipImageProcessor(size={"height": 8, "width": 8})
        images.image_seq_length = 16
        processor = T.PaliGemmaProcessor(image_processor=images, tokenizer=tok)
    model.eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out


def build_multimodal_grid(kind: str, folder: Path, *, seed: int = 0) -> tuple[Path, object]:
    """A tiny random multimodal decoder whose image tokens are no one-for-one patch grid,
    saved in `folder`, and its processor (built here, offline): `qwen2_vl` (images of any size
    as patches of 2x2 pixels, merged 2x2 for the decoder: `image_grid_thw`), `idefics3` (16 x
    16 images split into four 8 x 8 tiles and a global 8 x 8 image, 2x2-pixel patches, each
    tile's 16 patches pixel-shuffled into 4 image tokens) or `gemma3` (16 x 16 images, 8 x 8
    patches average-pooled into 16 image tokens; per-head q_norm and k_norm in its decoder)."""
    import torch
    import transformers as T

    from .tiny_models import build_tokenizer

    tok = build_tokenizer(kind="bpe")
    torch.manual_seed(seed)
    text = dict(vocab_size=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                pad_token_id=tok.pad_token_id)
    out = folder / kind
    processor: object
    if kind == "qwen2_vl":
        from transformers.processing_utils import ProcessorMixin

        tok.add_special_tokens({"additional_special_tokens": [
            "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]})
        text.update(vocab_size=len(tok), model_type="qwen2_vl_text", rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
        model = T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2,
                               patch_size=2, spatial_merge_size=2, temporal_patch_size=2),
            text_config=text, image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>")))

        class ImagesOnly(T.Qwen2VLProcessor):  # type: ignore[misc]
            """Qwen2-VL's processor less its video processor, which needs torchvision (not
            installed): its own code expands each image's token by `image_grid_thw`."""

            def __init__(self, image_processor: object, tokenizer: object) -> None:
                self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
                self.image_token_id = tok.convert_tokens_to_ids(self.image_token)
                self.video_token_id = tok.convert_tokens_to_ids(self.video_token)
                ProcessorMixin.__init__(self, image_processor, tokenizer)

        processor = ImagesOnly(T.Qwen2VLImageProcessorPil(
            size={"shortest_edge": 16, "longest_edge": 4096}, patch_size=2,
            temporal_patch_size=2, merge_size=2), tok)
    elif kind == "gemma3":
        marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                 "image_token": "<image_soft_token>"}
        tok.add_special_tokens({"additional_special_tokens": list(marks.values())})
        for key, mark in marks.items():  # what Gemma 3's processor reads off its tokenizer
            setattr(tok, key, mark)
            setattr(tok, f"{key}_id", tok.convert_tokens_to_ids(mark))
        text.update(vocab_size=len(tok), head_dim=8, sliding_window=16)
        model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, image_size=16, patch_size=2),
            text_config=text, image_token_index=tok.image_token_id,
            boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
            mm_tokens_per_image=16))
        processor = T.Gemma3Processor(
            image_processor=T.Gemma3ImageProcessorPil(size={"height": 16, "width": 16}),
            tokenizer=tok, image_seq_length=16)
    else:
        assert kind == "idefics3", kind
        tok.add_special_tokens({"additional_special_tokens": [
            "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
            *[f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]]})
        text.update(vocab_size=len(tok), model_type="llama")
        model = T.Idefics3ForConditionalGeneration(T.Idefics3Config(
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, image_size=8, patch_size=2),
            text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
            scale_factor=2))
        processor = T.Idefics3Processor(
            image_processor=T.Idefics3ImageProcessorPil(
                size={"longest_edge": 16}, max_image_size={"longest_edge": 8},
                do_image_splitting=True),
            tokenizer=tok, image_seq_len=4)
    model.eval().save_pretrained(out)
    return out, processor
