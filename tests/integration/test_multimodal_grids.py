"""Text and images in one input for multimodal decoders whose image tokens are no one-for-one
grid of patches: Qwen2-VL (patches of any image size, merged 2 x 2 for the decoder, its vision
tower reading every image's patches as one sequence) and Idefics3 (an image split into tiles
and a global image, each pixel-shuffled into fewer tokens), tiny models built from configs.

References: each input alone through plain transformers (its processor's token ids, its
logits, each norm module's input captured with forward hooks, float64), and for Qwen2-VL's
image tokens the model's own multimodal rotary positions (`get_rope_index`: an image token's
height and width indices are its merged patch's row and column)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.vision_models import build_multimodal_grid

import actdb

PROMPTS = {
    "qwen2_vl": ["<|vision_start|><|image_pad|><|vision_end|>what is this",
                 "a picture <|vision_start|><|image_pad|><|vision_end|> of cats and dogs",
                 "hi <|vision_start|><|image_pad|><|vision_end|>"],
    "idefics3": ["<image>what is this", "a picture <image> of cats and dogs", "hi <image>"],
}
# (height, width): Qwen2-VL's 8 x 12 pixels are 4 x 6 patches, 2 x 3 merged (rows and columns
# told apart); Idefics3's 16 x 16 are four 8 x 8 tiles and a global image
SIZE = {"qwen2_vl": (8, 12), "idefics3": (16, 16)}


def _images(kind: str) -> list[Any]:
    from PIL import Image

    rng = np.random.default_rng(2)
    return [Image.fromarray(rng.integers(0, 256, (*SIZE[kind], 3), dtype=np.uint8))
            for _ in PROMPTS[kind]]


def _alone(model: torch.nn.Module, processor: Any, image: Any, text: str, modules: list[str]
           ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], np.ndarray]:
    """One input alone: (its processor's tensors, each module's first input as rows [n, d],
    its logits [T, V])."""
    x = dict(processor(images=[image], text=[text], return_tensors="pt"))
    kept: dict[str, np.ndarray] = {}
    named = dict(model.named_modules())

    def keep(name: str) -> Any:
        def hook(m: torch.nn.Module, args: tuple[torch.Tensor, ...], o: object) -> None:
            if name not in kept:
                x = args[0].detach().double()
                kept[name] = x.reshape(-1, x.shape[-1]).numpy()
        return hook

    handles = [named[n].register_forward_hook(keep(n)) for n in modules]
    try:
        with torch.no_grad():
            logits = model(**x).logits[0].double().numpy()
    finally:
        for h in handles:
            h.remove()
    return x, kept, logits


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3"])
def ingested(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[str, Path, torch.nn.Module, Any]:
    import transformers as T

    kind = request.param
    folder, processor = build_multimodal_grid(kind, tmp_path_factory.mktemp(kind))
    store = folder.parent / "s.actdb"
    inputs = [{"image": im, "text": t} for im, t in zip(_images(kind), PROMPTS[kind],
                                                         strict=True)]
    actdb.ingest(store, model=str(folder), processor=processor, inputs=inputs, batch_size=2,
                 device="cpu")
    model = T.AutoModelForImageTextToText.from_pretrained(folder).eval()
    return kind, store, model, processor


def test_every_site_is_the_models_own_input(ingested: tuple[str, Path, torch.nn.Module, Any]
                                            ) -> None:
    """Each site's rows of each input (batched two at a time) are its norm module's input
    with the input run alone, in the module's own order: the vision tower's patches (Qwen2-VL:
    every image's as one sequence; Idefics3: tile by tile, the global image last), then the
    decoder's sequence; the decoder's tokens are the processor's; the LM head's logits at the
    final site are the model's own."""
    kind, store, model, processor = ingested
    db = actdb.connect(store)
    sites = db.sql("SELECT site, module, tower FROM sites").fetchall()
    assert {s[2] for s in sites} == {"vision", "text"}
    for p, (image, text) in enumerate(zip(_images(kind), PROMPTS[kind], strict=True)):
        x, kept, logits = _alone(model, processor, image, text, [s[1] for s in sites])
        got_ids = db.sql("SELECT token_id FROM acts WHERE prompt_id = $p AND site = 'final' "
                         "ORDER BY position", params={"p": p}).fetchall()
        assert [g[0] for g in got_ids] == x["input_ids"][0].tolist()
        for site, module, _ in sites:
            got = db.vectors("SELECT vec FROM acts WHERE prompt_id = $p AND site = $s ORDER BY "
                             "position", params={"p": p, "s": site}).double().numpy()
            want = kept[module]
            assert got.shape == want.shape, (site, got.shape, want.shape)
            np.testing.assert_allclose(got, want, rtol=2e-3,
                                       atol=2e-3 * float(np.abs(want).max()), err_msg=site)
        top = db.sql("SELECT top_logits(vec, 1)[1] FROM acts WHERE prompt_id = $p "
                     "AND site = 'final' ORDER BY position", params={"p": p}).fetchall()
        got_top = np.array([t[0]["logit"] for t in top])
        np.testing.assert_allclose(got_top, logits.max(-1), rtol=2e-3, atol=2e-3)
        # the stored top token is the model's, or one within rounding of its logit
        own = logits[np.arange(len(top)), [t[0]["token_id"] for t in top]]
        np.testing.assert_allclose(own, logits.max(-1), rtol=2e-3, atol=2e-3)


def test_image_tokens_carry_their_patches(ingested: tuple[str, Path, torch.nn.Module, Any]
                                          ) -> None:
    """Qwen2-VL: an image token's (patch_row, patch_col) is its merged patch's, which is where
    the model's own rotary positions put it (height and width index less the image's first);
    Idefics3: NULL (its tokens are pixel-shuffled tiles, whose arrangement only the text's
    <row_i_col_j> tokens say). The vision tower's rows are NULL in both: their order is the
    tower's own (Qwen2-VL's merge blocks, Idefics3's tiles), which no grid of the image is."""
    kind, store, model, processor = ingested
    db = actdb.connect(store)
    image_id = model.config.image_token_id
    for p, (image, text) in enumerate(zip(_images(kind), PROMPTS[kind], strict=True)):
        rows = db.sql("SELECT token_id, patch_row, patch_col FROM acts WHERE prompt_id = $p "
                      "AND site = 'final' ORDER BY position", params={"p": p}).fetchall()
        vision = db.sql("SELECT count(*), count(patch_row), count(patch_col) FROM acts "
                        "WHERE prompt_id = $p AND site = 'vision.blocks.0.ln1'",
                        params={"p": p}).fetchall()[0]
        assert vision[0] > 0 and vision[1:] == (0, 0)
        image_rows = [(r[1], r[2]) for r in rows if r[0] == image_id]
        assert all((r[1], r[2]) == (None, None) for r in rows if r[0] != image_id)
        if kind == "idefics3":
            assert len(image_rows) == 5 * 4 and set(image_rows) == {(None, None)}
            continue
        x = processor(images=[image], text=[text], return_tensors="pt")
        pos, _ = model.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"],
                                            image_grid_thw=x["image_grid_thw"],
                                            attention_mask=x["attention_mask"])
        at = x["input_ids"][0] == image_id
        h, w = pos[1, 0][at], pos[2, 0][at]
        want = list(zip((h - h.min()).tolist(), (w - w.min()).tolist(), strict=True))
        assert image_rows == want
        assert max(r for r, _ in want) == 1 and max(c for _, c in want) == 2  # 2 x 3


def test_images_of_other_sizes_are_refused(ingested: tuple[str, Path, torch.nn.Module, Any]
                                           ) -> None:
    """Qwen2-VL's vision tower reads every image's patches as one sequence, so a batch of a
    36-patch and a 12-patch image has the 48 rows of two 24-patch ones: images whose tensors
    differ from the first input's are refused in one sentence, before anything is stored."""
    from PIL import Image

    from actdb.errors import IngestError

    kind, store, _, processor = ingested
    if kind != "qwen2_vl":
        pytest.skip("Idefics3's processor resizes every image to one size of tiles")
    rng = np.random.default_rng(3)
    sizes = [(8, 12)] * 4 + [(12, 12), (4, 12)]  # the last two batched together: 36 + 12
    inputs = [{"image": Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)),
               "text": f"{PROMPTS[kind][0]} {i}"} for i, s in enumerate(sizes)]
    other = store.parent / "other.actdb"
    with pytest.raises(IngestError, match=r"^input 4's media give model '.*' other tensors "
                       r"than input 0's \(image_grid_thw values \[1, 6, 6\], not \[1, 4, 6\]; "
                       r"pixel_values \[36, 24\], not \[24, 24\]\)[^\n]*$"):
        actdb.ingest(other, model=str(store.parent / kind), processor=processor,
                     inputs=inputs, batch_size=2, device="cpu")
    assert not other.exists()
