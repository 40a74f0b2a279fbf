"""A model's extracted weights (weights.py) as the store's arrays and manifest, with each
head's circuits (circuits.py) computed from them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from ..activations import identify
from ..store.layer_weights import array_name
from .circuits import SVD_BOUND, head_circuits
from .weight_records import AttentionWeights, MlpWeights, ModelWeights


def _host(t: torch.Tensor | None) -> np.ndarray | None:
    """float32 on the host: exact for float32, bfloat16 and float16 weights."""
    return None if t is None else t.detach().float().cpu().numpy()


def _rows(t: torch.Tensor) -> np.ndarray:
    """[heads, d_head, d] -> [heads * d_head, d]."""
    out = _host(t)
    assert out is not None
    return out.reshape(-1, out.shape[-1])


def weight_arrays(weights: ModelWeights, gains: Mapping[str, np.ndarray | None]
                  ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays by name, manifest). `gains`: each site's measured gain (None: ones), folded
    into the circuits of the attention that reads that site's output."""
    arrays: dict[str, np.ndarray] = {}
    layers: dict[int, dict[str, Any]] = {}
    for a, circuits in zip(weights.attention, _all_circuits(weights, gains), strict=True):
        layers.setdefault(a.layer, {})["attn"] = _attention(a, gains, circuits, arrays)
    for m in weights.mlps:
        layers.setdefault(m.layer, {}).setdefault("mlp", []).append(_mlp(m, arrays))
    manifest = {
        "version": 1,
        "layers": [{"layer": i, "attn": v.get("attn"), "mlp": v.get("mlp", [])}
                   for i, v in sorted(layers.items())],
        "refused": [{"layer": r.layer, "part": r.part, "module": r.module, "reason": r.reason}
                    for r in weights.refused],
        "svd_bound": SVD_BOUND,
        "rotary": None if weights.rotary is None else {
            "inv_freq": list(weights.rotary.inv_freq), "scaling": weights.rotary.scaling,
            "dims": weights.rotary.dims, "reason": weights.rotary.reason},
        "bytes": int(sum(v.nbytes for v in arrays.values())),
    }
    return arrays, manifest


Circuits = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]


def _all_circuits(weights: ModelWeights, gains: Mapping[str, np.ndarray | None]
                  ) -> list[Circuits]:
    """Every block's circuits (head_circuits), the blocks on threads (LAPACK releases the
    GIL), each with one BLAS thread: OpenBLAS's threads on these small [d, d_head] factors
    spin against each other and against other work, and cost far more than they share. The
    same calls, one at a time: the same bytes."""
    def one(a: AttentionWeights) -> Circuits:
        gain = gains.get(a.reads) if a.reads is not None else None
        wq, wk, wv, wo = (_rows(w).reshape(w.shape) for w in (a.w_q, a.w_k, a.w_v, a.w_o))
        return head_circuits(wq, wk, wv, wo, a.kv_of_head, gain)

    workers = max(1, min(len(weights.attention), len(os.sched_getaffinity(0))))
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, weights.attention))


def _attention(a: AttentionWeights, gains: Mapping[str, np.ndarray | None],
               circuits: Circuits, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    names = []
    for name, value in (("W_Q", a.w_q), ("W_K", a.w_k), ("W_V", a.w_v), ("W_O", a.w_o)):
        arrays[array_name(a.layer, "attn", name)] = _rows(value)
        names.append(name)
    for name, b in (("b_Q", a.b_q), ("b_K", a.b_k), ("b_V", a.b_v), ("b_O", a.b_o)):
        host = _host(b)
        if host is not None:
            arrays[array_name(a.layer, "attn", name)] = host
            names.append(name)
    gain = gains.get(a.reads) if a.reads is not None else None
    for kind, (sigma, u, v) in circuits.items():
        part = f"circuits/{kind}"
        arrays[array_name(a.layer, part, "sigma")] = sigma.astype(np.float32)
        arrays[array_name(a.layer, part, "u")] = u.reshape(-1, u.shape[-1]).astype(np.float32)
        arrays[array_name(a.layer, part, "v")] = v.reshape(-1, v.shape[-1]).astype(np.float32)
    return {"module": a.module, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads,
            "d_head": a.d_head, "kv_of_head": list(a.kv_of_head), "reads": a.reads,
            "gain_folded": gain is not None, "scale": a.scale, "arrays": names}


def _mlp(m: MlpWeights, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    part = "mlp" if m.expert is None else f"mlp.{m.expert}"
    names = []
    for name, value in (("W_in", m.w_in), ("W_gate", m.w_gate), ("W_out", m.w_out),
                        ("b_in", m.b_in), ("b_gate", m.b_gate), ("b_out", m.b_out)):
        host = _host(value)
        if host is not None:
            arrays[array_name(m.layer, part, name)] = host
            names.append(name)
    # the formula the model's own activation computes, found by calling it (activations.py)
    act, act_error = identify(m.act_fn) if m.act_fn is not None else (None, float("inf"))
    return {"expert": m.expert, "shared": m.shared, "module": m.module,
            "n_neurons": int(m.w_in.shape[0]),
            "gated": m.w_gate is not None, "activation": m.activation, "reads": m.reads,
            "act": act, "act_error": act_error if act_error < float("inf") else None,
            "arrays": names}
