"""Tiny vision, video and multimodal models of the families `transformers` ships, built from
configs for the survey (tests/support/vision_scan.py) and the tests.

Each family's config gets the common small sizes below where it has a field of that name and
kind (a list for a list, a number for a number), in its own config and in each of its
sub-configs (a multimodal model's `vision_config` and `text_config`, ...), passed to the
constructors so that fields derived from them (per-layer lists) follow; `OVERRIDES` holds
what a family's config needs beside them (a survey config's needs, not actdb's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IMAGE = 32  # pixels a side
FRAMES = 4  # a video's frames

# Sizes a tiny model of most families accepts; hierarchical ones read their own names.
SIZES: dict[str, Any] = dict(
    image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=2, intermediate_size=64, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
    hidden_sizes=[16, 32], num_labels=3, window_size=2, embed_dims=[16, 32],
    num_encoder_blocks=2, sr_ratios=[2, 1], mlp_ratios=[2, 2], num_stages=2, dims=[16, 32],
    num_key_value_heads=2, head_dim=16, num_frames=FRAMES, tubelet_size=2, depth=2,
    num_layers=2, max_position_embeddings=128, vision_feature_layer=-1,
    # DETR-style models' convolutional backbone from transformers, not timm's (not installed)
    use_timm_backbone=False, use_pretrained_backbone=False)
# A text decoder's, besides (the vocabulary is the survey tokenizer's, whose special tokens
# are 0; four layers, so that a hybrid's pattern of linear and full attention keeps one of
# each).
TEXT: dict[str, Any] = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                            shared_expert_intermediate_size=32, top_k_experts=2,
                            tie_word_embeddings=False,
                            pad_token_id=0, bos_token_id=0, eos_token_id=0,
                            num_hidden_layers=4)

INKLING: dict[str, Any] = dict(
    unpadded_vocab_size=400, swa_num_attention_heads=2, swa_num_key_value_heads=2,
    swa_head_dim=16, n_layers_per_attn_res_block=2, layer_types=["hybrid_sliding", "hybrid"] * 2)

# A speech encoder nested a level down, which the common sizes do not reach.
SPEECH: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, num_mel_bins=16)

# Multimodal families whose forward pass cannot read text alone, though its error names no
# image: what each reads beside its text (the survey goes on to actdb's refusal).
BESIDE_TEXT: dict[str, str] = {
    # a step's token ids are its text token and one code per audio codebook: [B, T, 1 + K]
    "kyutai_speech_to_text": "audio codes in its token ids",
}

# A VQ image tokenizer's small sizes, and its codebook's names in the text vocabulary.
VQ: dict[str, Any] = dict(num_embeddings=16, embed_dim=16, latent_channels=16, base_channels=32,
                          channel_multiplier=[1, 1], num_res_blocks=1, resolution=IMAGE)


def _vq_vocabulary(style: str) -> dict[str, int]:
    """The vocabulary map of a 16-entry codebook (ids 380 to 395) and the image placeholder
    (399), named as Chameleon's (`IMGIMG` and the index in letters) or Emu3's tokenizer does."""
    def name(i: int) -> str:
        if style == "chameleon":
            return "IMGIMG" + "".join(chr(ord("A") + int(c)) for c in str(i)) + "Z"
        return f"<|visual token{i:06d}|>"

    return {"<image>": 399, "<|extra_200|>": 398, **{name(i): 380 + i for i in range(16)}}


# A BART text model's sizes (its fields have names of their own).
BART: dict[str, Any] = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, encoder_attention_heads=2,
                            decoder_attention_heads=2)

# Latent (MLA) attention's widths: the rotated part of a head as wide as the survey's heads
# (its rotary embedding is built for `head_dim`), latents narrower than the model.
MLA: dict[str, Any] = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=16,
                           qk_nope_head_dim=16, qk_head_dim=32, v_head_dim=16, head_dim=16)

# A Whisper-style audio encoder's sizes (the omni models' thinkers), its output as wide as
# the text decoder.
AUDIO: dict[str, Any] = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2,
                             encoder_ffn_dim=64, output_dim=32, downsample_hidden_size=16)

# A DETR-style detector over transformers' own ResNet (its default backbone is timm's, not
# installed), four stages as the detectors read them; a few object queries.
DETR: dict[str, Any] = dict(
    backbone_config=dict(model_type="resnet", embedding_size=8, hidden_sizes=[8, 16, 24, 32],
                         depths=[1, 1, 1, 1], layer_type="basic"),
    num_queries=4, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)

OVERRIDES: dict[str, dict[str, Any]] = {
    "bit": dict(num_groups=2, embedding_size=16),
    # its stage s reads drop-path rate s of a list as long as its depth: depth[s] > s
    "cvt": dict(embed_dim=[16, 32, 48], num_heads=[1, 2, 2], depth=[1, 2, 3]),
    "levit": dict(hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
                  key_dim=[8, 8, 8], patch_size=16,
                  down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]]),
    "hiera": dict(image_size=[IMAGE, IMAGE], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                  masked_unit_attention=[True, False], num_query_pool=1,
                  patch_size=[3, 3], patch_stride=[2, 2], patch_padding=[1, 1],
                  masked_unit_size=[4, 4], stage_names=["stem", "stage1", "stage2"],
                  out_features=None, out_indices=None),
    "pvt": dict(num_encoder_blocks=2, depths=[1, 1], sequence_reduction_ratios=[2, 1],
                hidden_sizes=[16, 32], patch_sizes=[4, 2], strides=[4, 2],
                num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
    "pvt_v2": dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                   patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                   mlp_ratios=[2, 2], image_size=[IMAGE, IMAGE], stage_names=["stage1", "stage2"],
                   out_features=None, out_indices=None),
    "segformer": dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                      hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                      num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
    "mobilevit": dict(hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                      image_size=64, patch_size=2),
    "mobilevitv2": dict(image_size=64, patch_size=2, base_attn_unit_dims=[16, 24, 32],
                        n_attn_blocks=[1, 1, 1], width_multiplier=0.25),
    "hgnet_v2": dict(hidden_sizes=[128, 512, 1024, 2048], depths=[3, 4, 6, 3]),
    "textnet": dict(hidden_sizes=[64, 64, 128, 256, 512], depths=[3, 4, 4, 4]),
    "swin2sr": dict(patch_size=1),  # a super-resolution model: one pixel a position
    "vivit": dict(tubelet_size=[2, 4, 4]),
    "perceiver": dict(num_latents=16, d_latents=32, d_model=32, num_self_attends_per_block=2,
                      num_self_attention_heads=2, num_cross_attention_heads=1,
                      image_size=IMAGE),
    # Multimodal families whose validators tie their towers' sizes together. Token ids a
    # model replaces with image or audio features are the survey tokenizer's last (ids the
    # survey's texts never read); a dict for a sub-config amends its sized fields.
    "apertus1p5": dict(
        image_token_id=396, audio_token_id=397, image_token_offset=200, audio_token_offset=300,
        vision_config=dict(codebook_size=100, base_channels=32, latent_channels=32,
                           channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[],
                           resolution=IMAGE),
        audio_config=dict(codebook_size=100, codebook_dim=32, decoder_hidden_size=32,
                          decoder_intermediate_size=64, decoder_num_layers=1,
                          decoder_attention_num_groups=4, upsampling_ratios=[2, 2],
                          num_filters=8)),
    # rotary parameters per layer type, none by default (which its rotary embedding indexes)
    "cohere_compass": dict(text_config=dict(
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={t: dict(rope_type="default", rope_theta=10000.0,
                                 mrope_section=[2, 3, 3])
                         for t in ("sliding_attention", "full_attention")})),
    # latent (MLA) attention, indexed and sliding, its sliding layers' widths per layer; a
    # vision tower of dense then expert MLPs; adapters to the text width
    "dots3_note": dict(
        text_config=dict(
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=8,
            shared_experts_intermediate_size=32, sliding_window=8,
            layer_types=["indexed_attention"] * 2 + ["sliding_attention"] * 2,
            per_layer_config={i: dict(num_attention_heads=2, num_key_value_heads=2,
                                      q_lora_rank=16, kv_lora_rank=16, head_dim=16,
                                      qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
                              for i in (2, 3)},
            rope_parameters={t: dict(rope_type="default", rope_theta=10000.0)
                             for t in ("indexed_attention", "sliding_attention")}),
        vision_config=dict(adapter_in_dim=32, adapter_out_dim=32, moe_intermediate_size=32,
                           num_local_experts=4, mlp_layer_types=["dense", "sparse"],
                           per_layer_config={1: dict(num_local_experts=4,
                                                     num_experts_per_tok=2)}),
        audio_config=dict(adapter_input_size=32, adapter_out_dim=32, downsample_hidden_size=16,
                          feature_size=16),
        image_token_id=396, video_token_id=397, audio_token_id=398),
    "fun_asr_nano": dict(adaptor_config=dict(intermediate_size=8)),  # a quarter of the text width
    "granite_docling": dict(vision_config=dict(out_hidden_size=32)),  # the text width
    # latent (MLA) attention whose rotary slice is the head width the rotary sections fill
    "hy_v4_vl": dict(text_config=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                      qk_rope_head_dim=16, v_head_dim=16, index_head_dim=16,
                                      index_n_heads=2, index_topk=8),
                     vision_config=dict(out_hidden_size=32, max_image_size=64)),
    # the vision projection to the text width; sliding and full layers alternating, in
    # attention-residual blocks of two; the loop's middle two layers run twice
    "inkling2": dict(vision_config=dict(text_hidden_size=32, projection_hidden_dim=64),
                     text_config=dict(INKLING)),
    "inkling2_loop": dict(vision_config=dict(text_hidden_size=32, projection_hidden_dim=64),
                          text_config=dict(INKLING, loop_layer_index_start=2,
                                           loop_layer_index_end=4, loop_num_passes=2,
                                           loop_gate_rank=8)),
    "molmo2": dict(adapter_config=dict(vision_feature_layer=[-1, -2])),  # of two layers
    # an audio encoder's patch size per layer, its output at the text width; the vision
    # adapter reads 2 x 2 merged patches
    "muse_spark": dict(audio_config=dict(patch_sizes=[4, 4], out_hidden_size=32),
                       text_config=dict(moe_hidden_size=32), out_hidden_size=4 * 32,
                       projector_hidden_size=64),
    # the image tokens' names in the vocabulary (a VQ codebook of 16, the survey tokenizer's
    # last ids but the few the models replace), whose logits Chameleon masks
    "chameleon": dict(vocabulary_map=_vq_vocabulary("chameleon"), vq_config=VQ),
    "emu3": dict(vocabulary_map=_vq_vocabulary("emu3"),
                 vq_config=dict(codebook_size=16, embed_dim=4, latent_channels=4,
                                base_channels=32, channel_multiplier=[1, 1], num_res_blocks=1,
                                attn_resolutions=[])),
    # a DaViT vision tower of two stages, projected to the text width of a BART
    "florence2": dict(
        vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2],
                           patch_padding=[3, 1], patch_prenorm=[False, True], embed_dim=[16, 32],
                           num_heads=[2, 2], num_groups=[2, 2], projection_dim=32),
        text_config=dict(BART)),
    # deepstack projectors (a Q-Former with a head per 64 vision channels) from the vision
    # tower's last two layers into the text decoder's first two, 2 x 2 queries a 4 x 4 window
    "granite4_vision": dict(
        vision_config=dict(hidden_size=64, intermediate_size=128),
        downsample_rate="2/4", deepstack_layer_map=[[-1, 0], [-2, 1]],
        spatial_target_layers=[2, 3], image_grid_pinpoints=[[IMAGE, IMAGE]],
        qformer_config=dict(intermediate_size=64)),
    "kosmos-2": dict(text_config=dict(embed_dim=32, layers=4, ffn_dim=64, attention_heads=2),
                     latent_query_num=4),  # its text fields' own names
    # two audio codebooks of 16 codes after the text vocabulary, then the audio padding
    "kyutai_speech_to_text": dict(num_codebooks=2, codebook_vocab_size=16, audio_bos_token_id=15,
                                  audio_pad_token_id=400 + 2 * 16, ffn_dim=64,
                                  codec_config=dict(upsample_groups=32, codebook_size=16,
                                                    codebook_dim=16, num_quantizers=2,
                                                    vector_quantization_hidden_dimension=16,
                                                    num_filters=8)),
    # the indexed attention's indexer (no default), linear attention and hyper-connections
    # at the survey's widths
    "qwen4_exp": dict(text_config=dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
        indexer_compress_ratio=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, hc_lowrank=8, ple_embed_dim=32)),
    # speech tokenizers' encoders: a stage a downsampling ratio, and a stem
    "vibevoice_asr": {f"{k}_tokenizer_encoder_config": dict(
        downsampling_ratios=[2, 2], depths=[1, 1, 1], num_filters=8)
        for k in ("acoustic", "semantic")},
    # a word timestamp head's blank class, its last
    "nemo_speechlm": dict(
        word_timestamp_config=dict(blank_token_id=399),
        # a hybrid text decoder (Mamba, attention, experts) whose pattern names its layers
        text_config=dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
                         mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
                         chunk_size=16, moe_shared_expert_intermediate_size=32),
        audio_config=dict(asr_config=dict(SPEECH),
                          diarization_config=dict(audio_config=dict(SPEECH),
                                                  head_config=dict(audio_hidden_size=32,
                                                                   hidden_size=16)))),
    # its rotary sections are (height, width, time), height and width interleaved: equal
    "ernie4_5_vl_moe": dict(text_config=dict(
        rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[3, 3, 2]),
        moe_intermediate_size=[32, 32], moe_k=2, moe_num_experts=4, moe_num_shared_experts=1)),
    # DeepSeek-V3's experts in one group of the survey's four
    "kimi_k25": dict(text_config=dict(MLA, n_group=1, topk_group=1)),
    # its rotary embedding turns half of `head_dim`: the latent attention's rotated part
    "mistral4": dict(MLA, head_dim=32),
    # the thinker's rotary index reads a field only the whole omni model's config has (a
    # token the survey's texts never read)
    "qwen2_5_omni_thinker": dict(vision_start_token_id=399, audio_config=AUDIO),
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=399, audio_config=AUDIO),
    "qwen2_5_omni": dict(thinker_config=dict(audio_config=AUDIO)),
    # its talker reads a shared expert's width and a merge size its config does not define
    "qwen3_omni_moe": dict(thinker_config=dict(audio_config=AUDIO), talker_config=dict(
        spatial_merge_size=2, text_config=dict(shared_expert_intermediate_size=32))),
    # it makes a sliding window's mask whatever its layers are: a window, and layers using it
    "step3p7": dict(text_config=dict(
        sliding_window=8, num_sliding_attention_heads=2,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    # no default for which of its layers have experts
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense"] + ["sparse"] * 3)),
    # latent attention without rotation, its indexer's and linear attention's heads small
    "glm5_next": dict(
        text_config=dict(kv_lora_rank=16, q_lora_rank=16, v_head_dim=16, qk_nope_head_dim=16,
                         qk_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=16,
                         linear_head_dim=16, linear_num_heads=2),
        vision_config=dict(num_heads=2, out_hidden_size=32, projection_intermediate_size=64)),
    # an image cut into overlapping 16 x 16 patches at two scales, each read by a DINOv2
    # whose last layer gives the features (of the survey's two)
    "depth_pro": dict(
        patch_size=16, intermediate_hook_ids=[1, 0], intermediate_feature_dims=[16, 16],
        scaled_images_ratios=[0.5, 1], scaled_images_overlap_ratios=[0.0, 0.25],
        scaled_images_feature_dims=[32, 16], fusion_hidden_size=16,
        **{k: dict(image_size=16, out_features=["stage2"], out_indices=[2])
           for k in ("image_model_config", "patch_model_config", "fov_model_config")}),
    **{t: DETR for t in ("detr", "conditional_detr", "dab-detr", "table-transformer")},
    # its extra level's GroupNorm needs more than one position: images of 128 pixels (the
    # survey reads `image_size`), 4 x 4 after the backbone
    "deformable_detr": dict(DETR, image_size=128),
    # a T5: its decoder starts from the pad token
    "udop": dict(decoder_start_token_id=0),
    "t5gemma2": dict(decoder_start_token_id=0),  # its decoder starts from the BOS token
}


@dataclass(frozen=True)
class Family:
    """A model type and how the survey runs it: `image` (an image classifier on images),
    `backbone` (a vision model without a head, on images), `video` (a video classifier on
    frames), `multimodal` (an image-text-to-text model on text alone)."""

    model_type: str
    kind: str


def families() -> list[Family]:
    """Every vision, video and multimodal model type `transformers` knows, once, under the
    first kind that names it (a classifier before its backbone)."""
    from transformers.models.auto import modeling_auto as m

    kinds = (("image", m.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES),
             ("video", m.MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES),
             ("multimodal", {**m.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                             **m.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES}),
             ("backbone", m.MODEL_FOR_IMAGE_MAPPING_NAMES))
    seen: set[str] = set()
    out = []
    for kind, names in kinds:
        for mt in sorted(names):
            if mt not in seen:
                seen.add(mt)
                out.append(Family(mt, kind))
    return out


def _fits(default: Any, value: Any) -> bool:
    """Whether `value` is of the kind of the field's default (a list for a list, ...)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, int | float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(default, list | tuple):
        return isinstance(value, list | tuple)
    return default is None


def _sized(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """The sizes `config` has a field of that kind for."""
    have = config.to_dict()
    return {k: v for k, v in sizes.items() if k in have and _fits(have[k], v)}


def _resized(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """A sub-config's fields with `sizes` applied, less its per-layer lists (one entry a
    layer of its default depth), which its constructor derives again for the new depth, its
    per-layer settings keyed by layers past the new depth, and its multimodal rotary sections
    scaled to the new head width."""
    have = config.to_dict()
    sized = _sized(config, sizes)
    depth = have.get("num_hidden_layers")
    new_depth = sized.get("num_hidden_layers", depth)
    if "num_hidden_layers" in sized and isinstance(depth, int):
        have = {k: v for k, v in have.items()
                if not (isinstance(v, list) and len(v) == depth and k not in sized)}
        have = {k: ({i: c for i, c in v.items() if int(i) < new_depth}
                    if isinstance(v, dict) and v and all(str(i).isdigit() for i in v) else v)
                for k, v in have.items()}
    head = sized.get("head_dim", have.get("head_dim"))
    if not head and "num_attention_heads" in sized and "hidden_size" in sized:
        head = sized["hidden_size"] // sized["num_attention_heads"]
    for k, v in list(have.items()):
        if isinstance(v, dict) and isinstance(v.get("mrope_section"), list) and head:
            have[k] = {**v, "mrope_section": _sections(v["mrope_section"], _half(head, v))}
    rope = have.get("rope_parameters")
    if (isinstance(rope, dict) and rope and "mrope_section" not in rope and head
            and _uses_mrope(config)):
        # multimodal rotary sections that the model's code defaults for its full width
        have["rope_parameters"] = {**rope, "mrope_section": _sections([2, 3, 3],
                                                                      _half(head, rope))}
    return {**have, **sized}


def _half(head: Any, rope: dict[str, Any]) -> int:
    """Half the rotary width of a head (its sections' sum): a part of it where the rotary
    parameters rotate only part of each head (GLM-4V's half)."""
    return int(int(head) * float(rope.get("partial_rotary_factor") or 1.0)) // 2


def _uses_mrope(config: Any) -> bool:
    """Whether the config's model family splits rotary dimensions into sections (Qwen2-VL's
    multimodal rotary embedding), read from its modeling code."""
    import importlib
    import inspect

    module = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        return "mrope_section" in inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return False


def _sections(parts: list[int], total: int) -> list[int]:
    """`parts` scaled to sum to `total` (each at least 1), the last taking the rounding."""
    scaled = [max(1, p * total // sum(parts)) for p in parts[:-1]]
    return [*scaled, total - sum(scaled)]


def _sub_config(sub: Any, vocab_size: int | None) -> dict[str, Any]:
    """A sub-config's fields at the survey's sizes (a text decoder's too, where it has a
    vocabulary and one is given), and so its own sub-configs' (a vision tower's encoder, an
    omni model's thinker and its towers)."""
    from transformers import PretrainedConfig

    sizes = dict(SIZES)
    if vocab_size is not None and "vocab_size" in sub.to_dict():
        sizes.update(TEXT, vocab_size=vocab_size)
    out = _resized(sub, sizes)
    for name in [k for k, v in out.items() if isinstance(v, dict)]:  # a sub-config's dict
        inner = getattr(sub, name, None)
        if isinstance(inner, PretrainedConfig):
            out[name] = _sub_config(inner, vocab_size)
    return out


def config_for(model_type: str, *, vocab_size: int | None = None) -> Any:
    """The family's config at the survey's sizes (sub-configs too)."""
    from transformers import AutoConfig, PretrainedConfig

    default = AutoConfig.for_model(model_type)
    kwargs = _sized(default, SIZES)
    for name in list(default.to_dict()):
        sub = getattr(default, name, None)
        if not isinstance(sub, PretrainedConfig):
            continue
        kwargs[name] = _sub_config(sub, vocab_size)
    if vocab_size is not None and "vocab_size" in default.to_dict():
        kwargs.update(_sized(default, {**TEXT, "vocab_size": vocab_size}))
    kwargs = _amended(kwargs, OVERRIDES.get(model_type, {}))
    config = AutoConfig.for_model(model_type, **kwargs)
    if config.architectures is None:  # auto classes iterate it where a type has several
        config.architectures = []
    return config


def _amended(fields: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`fields` with `changes`: a dict for a (nested) sub-config amends its fields, anything
    else replaces the field."""
    out = dict(fields)
    for name, value in changes.items():
        old = out.get(name)
        if hasattr(old, "to_dict"):  # a nested sub-config left as a config object
            old = old.to_dict()
        out[name] = (_amended(old, value) if isinstance(value, dict) and isinstance(old, dict)
                     else value)
    return out


def image_processor(size: int = IMAGE, model_type: str | None = None) -> Any:
    """A plain image processor: resize to `size` x `size`, rescale, normalize; the family's own
    where its model reads something else than an image's pixels (Siglip2: flattened patches,
    with their mask and grid shapes)."""
    if model_type == "siglip2":
        from transformers import Siglip2ImageProcessorPil

        patches = (size // int(SIZES["patch_size"])) ** 2
        return Siglip2ImageProcessorPil(patch_size=SIZES["patch_size"], max_num_patches=patches)
    from transformers import ViTImageProcessor

    return ViTImageProcessor(size={"height": size, "width": size})


def build_classifier(model_type: str, *, seed: int = 0) -> tuple[Any, Any]:
    """(image classifier in eval mode, its processor) of the family, tiny."""
    import torch
    from transformers import AutoModelForImageClassification

    torch.manual_seed(seed)
    model = AutoModelForImageClassification.from_config(config_for(model_type)).eval()
    return model, image_processor(_image_size(model.config))


def _image_size(config: Any) -> int:
    size = getattr(getattr(config, "vision_config", None) or config, "image_size", IMAGE)
    return int(size[0] if isinstance(size, list | tuple) else size)


def build(family: Family, *, vocab_size: int | None = None, seed: int = 0) -> tuple[Any, int]:
    """(the family's model in eval mode, the image size it reads) for its kind."""
    import torch
    import transformers as T

    auto = {"image": T.AutoModelForImageClassification,
            "video": T.AutoModelForVideoClassification, "backbone": T.AutoModel,
            "multimodal": T.AutoModelForImageTextToText}[family.kind]
    config = config_for(family.model_type,
                        vocab_size=vocab_size if family.kind == "multimodal" else None)
    torch.manual_seed(seed)
    try:
        model = auto.from_config(config)
    except ValueError:
        if family.kind != "multimodal":
            raise
        try:
            model = T.AutoModelForMultimodalLM.from_config(config)  # an audio-text model
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):
                raise
            # the auto classes miss a config class that transformers registers under a
            # second model type too (Evolla's, as "EvollaModel"): the class the mapping names
            from transformers.models.auto import modeling_auto as m

            name = {**m.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
                    **m.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}[family.model_type]
            model = getattr(T, name)(config)
    return model.float().eval(), _image_size(model.config)


def random_images(n: int, *, size: int = IMAGE, seed: int = 0) -> list[Any]:
    """`n` RGB PIL images of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
            for _ in range(n)]
