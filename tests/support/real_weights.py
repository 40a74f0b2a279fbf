"""Layer weights of real checkpoints against the models' own parameters: each family's
documented layout written out (independent of actdb's behavioural search), and each head's OV
circuit against a float64 NumPy SVD of the product (tests/slow/test_smollm2.py,
tests/slow/test_layer_weights_real.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from actdb.ingestion.circuits import SVD_BOUND
from actdb.store.layer_weights import array_name, read_manifest
from actdb.store.store import Store


def rows(w: Any, heads: int) -> np.ndarray:
    """[heads * d_head, d] rows of a [heads, d_head, d] block layout, float32."""
    return w.detach().float().numpy().reshape(heads * (w.shape[0] // heads), -1)


def check_layer_weights(store: Path, model: Any, layout: Any) -> None:
    """Every stored matrix of model 0 equals `layout(model, layer)` bit for bit; the OV
    circuits' singular values of the first and last head of each layer match NumPy's."""
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


def llama_layout(model: Any, i: int) -> dict[str, np.ndarray]:
    a, f = model.model.layers[i].self_attn, model.model.layers[i].mlp
    return {"W_Q": a.q_proj.weight.detach().float().numpy(),
            "W_K": a.k_proj.weight.detach().float().numpy(),
            "W_V": a.v_proj.weight.detach().float().numpy(),
            "W_O": rows(a.o_proj.weight.t(), model.config.num_attention_heads),
            "W_in": f.up_proj.weight.detach().float().numpy(),
            "W_gate": f.gate_proj.weight.detach().float().numpy(),
            "W_out": f.down_proj.weight.t().detach().float().numpy()}


def bert_layout(model: Any, i: int) -> dict[str, np.ndarray]:
    b = model.encoder.layer[i]
    s = b.attention.self
    return {"W_Q": s.query.weight.detach().float().numpy(),
            "W_K": s.key.weight.detach().float().numpy(),
            "W_V": s.value.weight.detach().float().numpy(),
            "W_O": rows(b.attention.output.dense.weight.t(), model.config.num_attention_heads),
            "W_in": b.intermediate.dense.weight.detach().float().numpy(),
            "W_out": b.output.dense.weight.t().detach().float().numpy()}
