"""Towers: roles and layers are assigned within each stack of a multimodal model, so its text
decoder keeps pre_attn / pre_mlp and its own layer numbers when the vision tower is deeper
(as in Qwen2-VL-2B/7B and PaliGemma-3B). Tiny models built from configs; the reference for
each site's place is the decoder's own module list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as T
from support.tiny_models import build_family_tokenizer

import actdb

VISION_DEPTH, TEXT_DEPTH = 4, 2


def _text(vocab: int) -> dict[str, object]:
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                num_hidden_layers=TEXT_DEPTH, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128)


def _build(kind: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llava":
        return T.LlavaForConditionalGeneration(T.LlavaConfig(
            vision_config=T.CLIPVisionConfig(
                hidden_size=16, intermediate_size=32, num_hidden_layers=VISION_DEPTH,
                num_attention_heads=2, image_size=8, patch_size=2).to_dict(),
            text_config=T.LlamaConfig(**_text(vocab)).to_dict(), image_token_index=vocab - 1))
    if kind == "qwen2_vl":
        return T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
            text_config={**_text(vocab), "rope_scaling": {"type": "mrope",
                                                         "mrope_section": [1, 1, 2]}},
            vision_config=dict(depth=VISION_DEPTH, embed_dim=16, hidden_size=32, num_heads=2,
                               patch_size=2, spatial_merge_size=1, temporal_patch_size=1),
            image_token_id=vocab - 1, video_token_id=vocab - 2,
            vision_start_token_id=vocab - 3))
    assert kind == "paligemma"
    return T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16,
                           intermediate_size=32, num_hidden_layers=VISION_DEPTH,
                           num_attention_heads=2, image_size=8, patch_size=2),
        text_config=dict(model_type="gemma", **_text(vocab), head_dim=8),
        image_token_index=vocab - 1))


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "paligemma"])
def test_text_decoder_keeps_its_roles_beside_a_deeper_vision_tower(kind: str,
                                                                   tmp_path: Path) -> None:
    tok = build_family_tokenizer("llama")
    model = _build(kind, len(tok)).eval()
    decoder = model.model.language_model
    assert len(decoder.layers) == TEXT_DEPTH < VISION_DEPTH
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, tokenizer=tok, name=kind,
                 prompts=["the capital of France is", "one two three"])
    db = actdb.connect(store)
    sites = db.sql("SELECT module, site, layer, role, tower FROM sites ORDER BY site_id"
                   ).fetchall()
    want = []
    for i, layer in enumerate(decoder.layers):
        prefix = f"model.language_model.layers.{i}"
        assert isinstance(layer.input_layernorm, torch.nn.Module)
        want += [(f"{prefix}.input_layernorm", f"blocks.{i}.ln1", i, "pre_attn", "text"),
                 (f"{prefix}.post_attention_layernorm", f"blocks.{i}.ln2", i, "pre_mlp",
                  "text")]
    want.append(("model.language_model.norm", "final", TEXT_DEPTH, "final", "text"))
    assert sites == want
    n_layers, towers = db.sql("SELECT n_layers, towers FROM models").fetchall()[0]
    assert n_layers == TEXT_DEPTH
    import json

    assert json.loads(towers) == {"vision": VISION_DEPTH, "text": TEXT_DEPTH}
    # delta() reads the next residual site: what block 0's attention wrote, the input of its
    # MLP's norm minus its own
    rows = db.sql("SELECT to_list(vec), delta(vec) FROM acts WHERE prompt_id = 0 "
                  "AND site = 'blocks.0.ln1' AND position = 1").fetchall()
    nxt = db.sql("SELECT to_list(vec) FROM acts WHERE prompt_id = 0 AND site = 'blocks.0.ln2' "
                 "AND position = 1").fetchall()
    np.testing.assert_allclose(np.array(rows[0][1]), np.array(nxt[0][0]) - np.array(rows[0][0]),
                               rtol=1e-2, atol=1e-4)


def test_a_model_of_one_stack_is_one_tower(tmp_path: Path, model_dir: object) -> None:
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=["hello there"])  # type: ignore[operator]
    db = actdb.connect(store)
    assert {r[0] for r in db.sql("SELECT tower FROM sites").fetchall()} == {"text"}
    towers = db.sql("SELECT n_layers, towers FROM models").fetchall()[0]
    import json

    assert json.loads(towers[1]) == {"text": towers[0]}


def test_a_text_tower_of_an_encoder_and_a_decoder_is_two_towers(tmp_path: Path) -> None:
    """Florence-2's language model is a BART: its encoder and decoder are towers of their own
    beside the vision tower, each with its own roles and layers (read from the module lists),
    as a BART's are alone; the decoder, which the head reads, keeps the plain names."""
    tok = build_family_tokenizer("llama")
    torch.manual_seed(0)
    model = T.Florence2ForConditionalGeneration(T.Florence2Config(
        vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2],
                           patch_padding=[3, 1], patch_prenorm=[False, True], embed_dim=[16, 32],
                           num_heads=[2, 2], num_groups=[2, 2], window_size=2,
                           projection_dim=32),
        text_config=dict(vocab_size=len(tok), d_model=32, encoder_layers=TEXT_DEPTH,
                         decoder_layers=TEXT_DEPTH, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         encoder_attention_heads=2, decoder_attention_heads=2,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                         eos_token_id=0, decoder_start_token_id=0),
        image_token_id=len(tok) - 1)).eval()
    store = tmp_path / "s.actdb"
    summary = actdb.ingest(store, model=model, tokenizer=tok, name="florence2",
                           inputs=[{"text": "one two three", "target": "four five"}])
    assert max(summary.max_rel_error.values()) < 1e-2
    db = actdb.connect(store)
    sites = db.sql("SELECT module, site, layer, tower FROM sites ORDER BY site_id").fetchall()
    lm = "model.language_model"
    want = [(f"{lm}.encoder.layernorm_embedding", "encoder.embed", -1, "encoder")]
    for i in range(TEXT_DEPTH):
        want += [(f"{lm}.encoder.layers.{i}.{n}", f"encoder.blocks.{i}.{s}", i, "encoder")
                 for n, s in (("self_attn_layer_norm", "ln1_post"),
                              ("final_layer_norm", "ln2_post"))]
    want.append((f"{lm}.decoder.layernorm_embedding", "embed", -1, "decoder"))
    for i in range(TEXT_DEPTH):
        names = (("self_attn_layer_norm", "ln1_post"), ("encoder_attn_layer_norm",
                                                         "ln_cross_post"))
        if i < TEXT_DEPTH - 1:  # the last block's last norm is the model's final one
            names += (("final_layer_norm", "ln2_post"),)
        want += [(f"{lm}.decoder.layers.{i}.{n}", f"blocks.{i}.{s}", i, "decoder")
                 for n, s in names]
    want.append((f"{lm}.decoder.layers.{TEXT_DEPTH - 1}.final_layer_norm", "final",
                 TEXT_DEPTH, "decoder"))
    assert sorted(sites) == sorted(want)
    # the reference: the model's own pass given the target as labels (it shifts them itself)
    seen: dict[str, torch.Tensor] = {}
    read: list[torch.Tensor] = []
    def keep(path: str) -> Any:
        def hook(_m: torch.nn.Module, args: tuple[Any, ...], _out: Any) -> None:
            seen.setdefault(path, args[0][0].detach().double())
        return hook

    handles = [m.register_forward_hook(keep(p)) for p, m in model.named_modules()
               if p in {s[0] for s in sites}]
    decoder = model.model.language_model.decoder
    handles.append(decoder.register_forward_pre_hook(
        lambda _m, _a, kw: read.append(kw["input_ids"][0].clone()), with_kwargs=True))
    with torch.no_grad():
        model(**tok("one two three", return_tensors="pt"),
              labels=tok(text_target="four five", return_tensors="pt")["input_ids"])
    for h in handles:
        h.remove()
    assert [r[0] for r in db.sql("SELECT token_id FROM tokens WHERE tower = 'decoder' "
                                 "ORDER BY position").fetchall()] == read[0].tolist()
    for module, site, _, _ in sites:
        got = [r[0] for r in db.sql("SELECT norm FROM acts WHERE site = $s ORDER BY position",
                                    params={"s": site}).fetchall()]
        np.testing.assert_allclose(got, seen[module].norm(dim=-1).numpy(), rtol=1e-5)
