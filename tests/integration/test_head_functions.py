"""head_write and qk_score (query/head_kernels.py) against the model's own modules: the
pre-attention norm's real output (hooked, from the unrounded input) through the model's own
value and output projections, and its query and key projections with the model's own rotary
function; and qk_score's softmax against the attention weights of an eager forward pass
(output_attentions). Each stays within the float16 bound `actdb functions` states."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.tiny_models import CORPUS, make_tiny_model

import actdb
from actdb.plot.weight_reading import weight_reading
from actdb.store.layer_weights import array_name, read_manifest
from actdb.store.store import Store

PROMPTS = list(CORPUS[:2])
# LayerNorm, fused qkv, biases, no rotary; RMSNorm, grouped-query, rotary, q/k biases;
# partial rotary over a fused per-head qkv
FAMILIES = ["gpt2", "qwen2", "gpt_neox"]


@pytest.fixture(autouse=True)
def _no_grad() -> Any:
    with torch.no_grad():
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def stored(request: Any, tmp_path_factory: Any) -> tuple[str, Any, Path]:
    family = request.param
    model, tok = make_tiny_model(family)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # biases that matter (the families initialize them to zero)
        for name, param in model.named_parameters():
            if name.endswith(".bias") and "norm" not in name and "ln" not in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp(family) / "s.actdb"
    actdb.ingest(path, model=model, tokenizer=tok, prompts=PROMPTS, device="cpu",
                 batch_size=1)
    return family, model, path


def _attention_parts(family: str, model: Any, layer: int) -> dict[str, Any]:
    """The layer's attention modules by job, as each family names them (independent of the
    behavioural search the ingest does)."""
    if family == "gpt2":
        a = model.transformer.h[layer].attn

        def qkv(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(a.c_attn(y).split(64, dim=-1))
        return {"attn": a, "qkv": qkv, "o": a.c_proj, "kv_heads": 4}
    if family == "gpt_neox":
        a = model.gpt_neox.layers[layer].attention

        def qkv(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            t = a.query_key_value(y).reshape(*y.shape[:-1], 4, 3, 16)  # per head [q, k, v]
            return tuple(t[..., i, :].reshape(*y.shape[:-1], 64) for i in range(3))
        return {"attn": a, "qkv": qkv, "o": a.dense, "kv_heads": 4,
                "rotary": model.gpt_neox.rotary_emb}
    a = model.model.layers[layer].self_attn

    def qkv(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return a.q_proj(y), a.k_proj(y), a.v_proj(y)
    return {"attn": a, "qkv": qkv, "o": a.o_proj, "kv_heads": a.k_proj.out_features // 16,
            "rotary": model.model.rotary_emb}


def _rows(db: Any, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    return db.sql(sql, params=params).fetchall()


def _norm_outputs(model: Any, module: str, ids: list[int]) -> tuple[torch.Tensor, Any]:
    """The norm module's real output for one prompt (float32 [n, d]) and the forward's
    output with the attention weights (eager)."""
    seen: dict[str, torch.Tensor] = {}
    m = model.get_submodule(module)
    def keep(module: Any, args: Any, out: torch.Tensor) -> None:
        seen.setdefault("y", out.detach())

    handle = m.register_forward_hook(keep)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        handle.remove()
    return seen["y"][0], out


def _sin_angle(y_site_kind: str, x: np.ndarray) -> np.ndarray:
    if "RMS" in y_site_kind:
        return np.ones(len(x))
    cos = x.sum(-1) / (np.linalg.norm(x, axis=-1) * math.sqrt(x.shape[-1]))
    return np.sqrt(1 - cos**2)


def test_head_write_is_the_heads_output(stored: tuple[str, Any, Path]) -> None:
    family, model, path = stored
    st = Store(path)
    manifest = read_manifest(st.arrays, 0)
    assert manifest is not None
    db = actdb.connect(path)
    d = model.config.hidden_size
    for entry in manifest["layers"]:
        layer, attn = entry["layer"], entry["attn"]
        site, module, kind = _rows(db, "SELECT site, module, kind FROM sites WHERE role = "
                                       "'pre_attn' AND layer = $l", l=layer)[0]
        assert attn["reads"] == site
        parts = _attention_parts(family, model, layer)
        sigma = st.arrays.weight(0, array_name(layer, "circuits/OV", "sigma"))
        assert sigma is not None
        group = attn["n_heads"] // parts["kv_heads"]
        ids = [r[0] for r in _rows(db, "SELECT token_id FROM tokens WHERE prompt_id = 0 "
                                       "ORDER BY position")]
        y, _ = _norm_outputs(model, module, ids)
        _, _, v = parts["qkv"](y)  # [n, kv_heads * 16]
        got = _rows(db, "SELECT h.range, head_write(vec, $l, h.range), to_list(vec) "
                        "FROM acts, range($H) h WHERE prompt_id = 0 AND site = $s "
                        "ORDER BY h.range, position", l=layer, H=attn["n_heads"], s=site)
        for h in range(attn["n_heads"]):
            kv = h // group
            slot = torch.zeros(len(ids), attn["n_heads"] * 16)
            slot[:, h * 16 : (h + 1) * 16] = v[:, kv * 16 : (kv + 1) * 16]
            ref = (parts["o"](slot) - parts["o"](torch.zeros_like(slot))).double()
            mine = [r for r in got if r[0] == h]
            out = torch.tensor([r[1] for r in mine], dtype=torch.float64)
            x = np.array([r[2] for r in mine])
            err = (out - ref).norm(dim=-1).numpy()
            bound = 2.0**-9 * math.sqrt(d) * float(sigma[h, 0]) / _sin_angle(kind, x)
            assert (err <= bound).all(), (family, layer, h, float(err.max()))
            # and far inside it: the stored rows are faithful to 2^-11
            assert (err <= bound / 4).all(), (family, layer, h, err.max(), bound.min())


def _rotate(family: str, parts: dict[str, Any], t: torch.Tensor, pos: torch.Tensor
            ) -> torch.Tensor:
    """[n, dh] turned by the model's own rotary module and apply function."""
    if "rotary" not in parts:
        return t
    if family == "gpt_neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
    else:
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    cos, sin = parts["rotary"](t.unsqueeze(0), pos.unsqueeze(0))
    x = t.unsqueeze(0).unsqueeze(0)  # [1, 1, n, dh]
    out, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return out[0, 0]


def test_qk_score_is_the_models_attention_logit(stored: tuple[str, Any, Path]) -> None:
    family, model, path = stored
    st = Store(path)
    manifest = read_manifest(st.arrays, 0)
    assert manifest is not None
    db = actdb.connect(path)
    d = model.config.hidden_size
    rotary = family != "gpt2"
    for entry in manifest["layers"]:
        layer, attn = entry["layer"], entry["attn"]
        site, module, kind = _rows(db, "SELECT site, module, kind FROM sites WHERE role = "
                                       "'pre_attn' AND layer = $l", l=layer)[0]
        parts = _attention_parts(family, model, layer)
        scale = parts["attn"].scaling
        group = attn["n_heads"] // parts["kv_heads"]
        ids = [r[0] for r in _rows(db, "SELECT token_id FROM tokens WHERE prompt_id = 0 "
                                       "ORDER BY position")]
        n = len(ids)
        y, out = _norm_outputs(model, module, ids)
        q_all, k_all, _ = parts["qkv"](y)
        g = model.get_submodule(module).weight.detach().double()
        pos = torch.arange(n)
        for h in range(attn["n_heads"]):
            kv = h // group
            q = _rotate(family, parts, q_all[:, h * 16 : (h + 1) * 16], pos).double()
            k = _rotate(family, parts, k_all[:, kv * 16 : (kv + 1) * 16], pos).double()
            ref = (q @ k.T) * scale  # [n, n]
            got = _rows(db, """
                SELECT a.position, b.position, qk_score(a.vec, b.vec, $l, $h, a.position,
                       b.position), qk_score(a.vec, b.vec, $l, $h),
                       to_list(a.vec), to_list(b.vec)
                FROM acts a JOIN acts b USING (prompt_id, site)
                WHERE prompt_id = 0 AND site = $s ORDER BY 1, 2""", l=layer, h=h, s=site)
            score = np.zeros((n, n))
            for i, j, s, bare, _, _ in got:
                score[i, j] = s
                assert (bare is None) == rotary, (family, bare)  # NULL without positions
            xq = np.array([r[4] for r in got])
            xk = np.array([r[5] for r in got])
            wq = st.arrays.weight(0, array_name(layer, "attn", "W_Q"))
            wk = st.arrays.weight(0, array_name(layer, "attn", "W_K"))
            assert wq is not None and wk is not None
            gq = wq.reshape(-1, 16, d)[h] * g.numpy()
            gk = wk.reshape(-1, 16, d)[kv] * g.numpy()
            qn = np.repeat(q.norm(dim=-1).numpy(), n)
            kn = np.tile(k.norm(dim=-1).numpy(), n)
            bound = (2.0**-9 * math.sqrt(d) * scale
                     * (np.linalg.norm(gq, 2) * kn + np.linalg.norm(gk, 2) * qn)
                     / np.minimum(_sin_angle(kind, xq), _sin_angle(kind, xk)))
            err = np.abs(score.reshape(-1) - ref.numpy().reshape(-1))
            assert (err <= bound).all(), (family, layer, h, err.max())
            # The model's own attention weights: the softmax of the row's scores over the
            # keys it may see (causal), from the eager forward pass.
            weights = out.attentions[layer][0, h].double().numpy()
            for i in range(n):
                p = np.exp(score[i, : i + 1] - score[i, : i + 1].max())
                p /= p.sum()
                assert np.abs(p - weights[i, : i + 1]).max() <= 4 * bound.max(), (family, i)


def test_head_functions_say_what_is_wrong(stored: tuple[str, Any, Path]) -> None:
    family, _, path = stored
    db = actdb.connect(path)
    with pytest.raises(actdb.QueryError, match="reads rows of site"):
        db.sql("SELECT head_write(vec, 1, 0) FROM acts WHERE role = 'pre_attn' "
               "AND layer = 0 LIMIT 1").fetchall()
    with pytest.raises(actdb.QueryError, match="head 9 is out of range"):
        db.sql("SELECT head_write(vec, 0, 9) FROM acts WHERE role = 'pre_attn' "
               "AND layer = 0 LIMIT 1").fetchall()
    with pytest.raises(actdb.QueryError, match="no stored attention at layer 7"):
        db.sql("SELECT qk_score(vec, vec, 7, 0) FROM acts WHERE role = 'pre_attn' "
               "AND layer = 0 LIMIT 1").fetchall()


def test_a_store_without_weights_says_so(tmp_path: Path) -> None:
    model, tok = make_tiny_model("gpt2")
    path = tmp_path / "s.actdb"
    actdb.ingest(path, model=model, tokenizer=tok, prompts=PROMPTS[:1], device="cpu",
                 weights="none")
    with actdb.connect(path) as db:
        with pytest.raises(actdb.QueryError, match="stored without its layer weights"):
            db.sql("SELECT head_write(vec, 0, 0) FROM acts WHERE role = 'pre_attn' "
                   "LIMIT 1").fetchall()
        # the report's weight reading is skipped with a sentence
        section = weight_reading(db, db.sql("SELECT model FROM models").fetchall()[0][0])
    assert section.skipped and section.figure is None
    assert "stored without its layer weights" in section.finding
