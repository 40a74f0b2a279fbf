"""Every family: stored fields reproduce the hooked norm input and output (float64 reference),
sites get the right roles, and token rows are the tokenizer's output without padding."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch
import zarr
from support.prompts import PROMPTS
from support.tiny_models import FAMILIES, load_tiny_model, norm_modules

# Roles each family must show (by where its norms run, not by their names).
EXPECTED_ROLES = {
    "gpt2": {"pre_attn", "pre_mlp", "final"},
    "gpt_neox": {"pre_attn", "pre_mlp", "final"},
    "opt": {"pre_attn", "pre_mlp", "final"},
    "bloom": {"embed", "pre_attn", "pre_mlp", "final"},
    "llama": {"pre_attn", "pre_mlp", "final"},
    "mistral": {"pre_attn", "pre_mlp", "final"},
    "qwen2": {"pre_attn", "pre_mlp", "final"},
    "qwen3": {"pre_attn", "pre_mlp", "final", "q_norm", "k_norm"},
    "gemma": {"pre_attn", "pre_mlp", "final"},
    "gemma2": {"pre_attn", "post_attn", "pre_mlp", "post_mlp", "final"},
    "phi3": {"pre_attn", "pre_mlp", "final"},
    "olmo2": {"post_attn", "post_mlp", "final", "q_norm", "k_norm"},
    "bert": {"embed", "post_attn", "post_mlp"},
}
EXPECTED_KIND = {"gemma": "rmsnorm_1p", "gemma2": "rmsnorm_1p", "gpt2": "layernorm",
                 "gpt_neox": "layernorm", "opt": "layernorm", "bloom": "layernorm",
                 "bert": "layernorm", "llama": "rmsnorm", "mistral": "rmsnorm",
                 "qwen2": "rmsnorm", "qwen3": "rmsnorm", "phi3": "rmsnorm", "olmo2": "rmsnorm"}


def _reference(family: str, path: Path) -> tuple[dict[str, list[tuple[np.ndarray, np.ndarray]]],
                                                 list[list[int]]]:
    """Per module path, per prompt (run alone, unpadded): (input, output) in float64."""
    model, tok = load_tiny_model(family, path)
    captured: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    handles = []
    for name, module in norm_modules(model):
        def hook(mod, args, output, name=name):  # noqa: ANN001
            captured.setdefault(name, []).append(
                (args[0].detach().double().numpy(), output.detach().double().numpy())
            )
        handles.append(module.register_forward_hook(hook))
    ids = []
    try:
        with torch.no_grad():
            for text in PROMPTS:
                enc = tok(text, return_tensors="pt")
                ids.append(enc["input_ids"][0].tolist())
                model(**enc)
    finally:
        for h in handles:
            h.remove()
    return captured, ids


def _ref_output(centered: bool, x: np.ndarray, gain: np.ndarray | None,
                bias: np.ndarray | None, eps: float) -> np.ndarray:
    """The one formula of format version 2: gain and bias are the effective ones."""
    d = x.shape[-1]
    if centered:
        xc = x - x.mean(-1, keepdims=True)
        z = xc / np.sqrt((xc**2).sum(-1, keepdims=True) / d + eps)
    else:
        z = x / np.sqrt((x**2).sum(-1, keepdims=True) / d + eps)
    if gain is not None:
        z = z * gain
    return z + bias if bias is not None else z


@pytest.mark.parametrize("family", FAMILIES)
def test_family_round_trip(family: str, family_store: Callable[[str], Path],
                           model_dir: Callable[[str], Path]) -> None:
    store = family_store(family)
    captured, ref_ids = _reference(family, model_dir(family))
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    sites = con.execute(
        "SELECT site, role, kind, d, n_heads, eps, module, has_gain, has_bias, max_rel_error, "
        "centered FROM sites WHERE model = ? ORDER BY site_id", [family]).fetchall()
    prompt_rows = con.execute(
        "SELECT p.text, r.row_start, r.n_tokens FROM prompt_runs r JOIN prompts p USING "
        "(prompt_id) WHERE r.model = ?", [family]).fetchall()
    model_id = con.execute("SELECT model_id FROM models WHERE model = ?", [family]).fetchone()[0]
    tokens = con.execute(
        "SELECT p.text, t.position, t.token_id FROM tokens t JOIN prompts p USING (prompt_id) "
        "WHERE t.model = ? ORDER BY t.row", [family]).fetchall()
    con.close()

    assert {s[1] for s in sites} == EXPECTED_ROLES[family]
    assert {s[2] for s in sites} == {EXPECTED_KIND[family]}
    assert {s[6] for s in sites} == set(captured), "every norm module that runs is a site"

    # Token rows are exactly the tokenizer's output for each prompt, no padding.
    by_text: dict[str, list[int]] = {}
    for text, pos, tid in tokens:
        by_text.setdefault(text, []).append(tid)
        assert pos == len(by_text[text]) - 1
    assert [by_text[t] for t in PROMPTS] == ref_ids

    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    start = {text: (row, n) for text, row, n in prompt_rows}
    model, _ = load_tiny_model(family, model_dir(family))
    modules = dict(model.named_modules())
    for site, _role, kind, d, n_heads, eps, module, has_gain, has_bias, err, centered in sites:
        assert centered == (kind == "layernorm")
        acts = group[f"models/{model_id}/acts/{site}"]
        gain = np.asarray(group[f"models/{model_id}/sites/{site}/gain"][...], np.float64) \
            if has_gain else None
        bias = np.asarray(group[f"models/{model_id}/sites/{site}/bias"][...], np.float64) \
            if has_bias else None
        assert err is not None and err < 1e-2
        # The stored gain is the effective one: Gemma's 1 + weight, the weight elsewhere.
        weight = modules[module].weight.detach().double().numpy()
        np.testing.assert_allclose(gain, 1.0 + weight if kind.endswith("_1p") else weight,
                                   rtol=1e-6, atol=1e-6)
        for i, text in enumerate(PROMPTS):
            row, n = start[text]
            x_ref, y_ref = captured[module][i]
            x_ref = x_ref.reshape(n, *((n_heads, d) if n_heads else (d,)))
            y_ref = y_ref.reshape(x_ref.shape)
            direction = np.asarray(acts["direction"][row : row + n], np.float64)
            norm = np.asarray(acts["norm"][row : row + n], np.float64)
            mean = np.asarray(acts["mean"][row : row + n], np.float64)
            x = direction * norm[..., None]
            rel = np.linalg.norm(x - x_ref, axis=-1) / np.linalg.norm(x_ref, axis=-1)
            assert rel.max() < 2e-3, (site, rel.max())
            np.testing.assert_allclose(norm, np.linalg.norm(x_ref, axis=-1), rtol=1e-5)
            np.testing.assert_allclose(mean, x_ref.mean(-1), atol=1e-5 * norm.max())
            y = _ref_output(centered, x, gain, bias, eps)
            rel_y = np.linalg.norm(y - y_ref, axis=-1) / np.linalg.norm(y_ref, axis=-1)
            assert rel_y.max() < 5e-3, (site, kind, rel_y.max())


def test_per_head_sites_store_one_vector_per_head(family_store: Callable[[str], Path]) -> None:
    store = family_store("qwen3")
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    rows = con.execute("SELECT site, d, n_heads FROM sites WHERE role IN ('q_norm', 'k_norm') "
                       "ORDER BY site_id").fetchall()
    con.close()
    assert rows and all(d == 16 and h in (2, 4) for _, d, h in rows)
