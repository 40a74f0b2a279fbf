"""neuron_pre and neuron_act of a store against the model's own MLPs, captured with hooks on
every pre-MLP row: the activation module's input (the pre-activation) and output, and in a
gated MLP the up projection's output and the down projection's input (act(gate) * up); each
within the float16 bound `actdb functions` states. The bound's row norms ||g * W[n]|| come
from the view neurons, whose rows tests/integration/test_weight_views.py checks against the
model. One forward pass a prompt, every layer hooked at once (the real-family and
real-checkpoint tests call it on the stores they ingest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import actdb
from actdb.store.layer_weights import read_manifest
from actdb.store.store import Store

# the activation's largest slope near any input (relu2's grows: 2 (|pre| + eps))
SLOPE = {"relu": 1.0, "gelu": 1.13, "gelu_tanh": 1.13, "silu": 1.1, "quick_gelu": 1.1}
DOWN = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "fc_out", "w2")
UP = ("up_proj", "gate_up_proj", "w3")


def _parts(mlp_mod: Any, activation: str) -> tuple[Any, Any, Any]:
    """The MLP's activation module (of the class the manifest names), its output projection
    and its up projection."""
    named = dict(mlp_mod.named_modules())
    act = next(m for n, m in named.items() if n and type(m).__name__ == activation)
    down = next((m for n, m in named.items() if n.rsplit(".", 1)[-1] in DOWN), None)
    up = next((m for n, m in named.items() if n.rsplit(".", 1)[-1] in UP), None)
    return act, down, up


def check_neurons(path: Path, model: Any, neurons: int | None = None) -> int:
    """Check every dense MLP of the store's model 0 (`neurons`: that many, evenly spread, of
    each layer; None: all); the number of (row, layer) pairs checked."""
    db = actdb.connect(path)
    manifest = read_manifest(Store(path).arrays, 0)
    assert manifest is not None
    layers = []
    for entry in manifest["layers"]:
        if len(entry["mlp"]) != 1 or entry["mlp"][0]["expert"] is not None:
            if entry["mlp"]:  # a mixture: which experts a row uses is the router's choice
                site = entry["mlp"][0]["reads"]
                with pytest.raises(actdb.QueryError, match="is a mixture of"):
                    db.sql("SELECT neuron_pre(vec, 0) FROM acts WHERE site = $s",
                           params={"s": site}).fetchall()
            continue
        mlp = entry["mlp"][0]
        if mlp["reads"] is None:  # the MLP reads the residual itself (norms after sublayers)
            continue
        if mlp["act"] is None:  # an activation none of actdb's formulas computes: refused
            with pytest.raises(actdb.QueryError, match="matches none of the formulas"):
                db.sql("SELECT neuron_act(vec, 0) FROM acts WHERE site = $s",
                       params={"s": mlp["reads"]}).fetchall()
        n_all = mlp["n_neurons"]
        chosen = list(range(0, n_all, max(1, n_all // neurons) if neurons else 1))
        module, kind, d = db.sql("SELECT module, kind, d FROM sites WHERE site = $s",
                                 params={"s": mlp["reads"]}).fetchone()
        act, down, up = _parts(model.get_submodule(mlp["module"]), mlp["activation"])
        sql = ("SELECT neuron, vec_norm(w_gate), vec_norm(w_in) FROM neurons WHERE layer = $l "
               "ORDER BY neuron")
        norms = np.array(db.sql(sql, params={"l": entry["layer"]}).fetchall(), dtype=float)
        value = "neuron_act(vec, neuron)" if mlp["act"] is not None else "0.0"
        got = db.sql(f"SELECT prompt_id, position, neuron, neuron_pre(vec, neuron), {value} "
                     "FROM acts, unnest($n) t(neuron) WHERE site = $s "
                     "ORDER BY prompt_id, position, neuron",
                     params={"n": chosen, "s": mlp["reads"]}).fetchall()
        layers.append({"mlp": mlp, "chosen": chosen, "norm": model.get_submodule(module),
                       "layernorm": kind.startswith("layernorm"), "d": d, "act": act,
                       "down": down, "up": up, "norms": norms[chosen],
                       "values": np.array([r[3:] for r in got]).reshape(-1, len(chosen), 2)})
    prompts = [r[0] for r in db.sql("SELECT prompt_id FROM prompts ORDER BY 1").fetchall()]
    at, checked = 0, 0
    for pid in prompts:
        ids = [r[0] for r in db.sql("SELECT token_id FROM tokens WHERE prompt_id = $p "
                                    "ORDER BY position", params={"p": pid}).fetchall()]
        seen = _hooks(model, ids, layers)
        t = len(ids)
        for i, lay in enumerate(layers):
            _check_layer(lay, {k[1]: v for k, v in seen.items() if k[0] == i}, at, t)
            checked += t
        at += t
    assert all(at == len(lay["values"]) for lay in layers)
    return checked


def _hooks(model: Any, ids: list[int], layers: list[dict[str, Any]]) -> dict[Any, Any]:
    """(layer index, part) -> (input, output) of that part's call in one forward pass; a
    module several layers share (XLM's one activation) gives each its call in order."""
    calls: dict[int, list[Any]] = {}
    mods = {id(lay[p]): lay[p] for lay in layers for p in ("norm", "act", "down", "up")
            if lay[p] is not None}

    def keep(key: int) -> Any:
        def hook(mod: Any, args: Any, out: Any) -> None:
            x = args[0] if args else None
            calls.setdefault(key, []).append(
                (x[0].double() if x is not None else None, out[0].double()))
        return hook

    handles = [m.register_forward_hook(keep(k)) for k, m in mods.items()]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]),
                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    seen: dict[Any, Any] = {}
    used: dict[tuple[int, str], int] = {}
    for i, lay in enumerate(layers):
        for part in ("norm", "act", "down", "up"):
            if lay[part] is None:
                continue
            k = id(lay[part])
            n = used.get((k, part), 0)
            used[(k, part)] = n + 1
            seen[(i, part)] = calls[k][n]
    return seen


def _check_layer(lay: dict[str, Any], seen: dict[str, Any], at: int, t: int) -> None:
    mlp, chosen, d = lay["mlp"], lay["chosen"], lay["d"]
    values = lay["values"][at : at + t]
    pre, value = values[..., 0], values[..., 1]
    x = seen["norm"][0]
    sin = (torch.sqrt(1 - x.sum(-1) ** 2 / (d * (x**2).sum(-1))).numpy()
           if lay["layernorm"] else np.ones(t))
    gated = mlp["gated"]
    size = lay["norms"][:, 1 if gated else 2]  # ||g * W_gate[n]|| or ||g * W_in[n]||
    eps = 2.0**-10 * np.sqrt(d) * size[None, :] / sin[:, None]
    pre_ref = seen["act"][0].numpy()[:, chosen]
    act_out = seen["act"][1].numpy()[:, chosen]
    assert (np.abs(pre - pre_ref) <= eps).all(), (mlp["module"], np.abs(pre - pre_ref).max())
    if mlp["act"] is None:
        return
    slope = SLOPE.get(mlp["act"])
    slope_at = slope if slope is not None else 2 * (np.abs(pre_ref) + eps)
    if gated:
        up = seen["up"][1].numpy()
        n_all = mlp["n_neurons"]
        if up.shape[-1] == 2 * n_all:  # a fused [gate; up] projection
            up = up[:, n_all:]
        up = up[:, chosen]
        e_up = 2.0**-10 * np.sqrt(d) * lay["norms"][:, 2][None, :] / sin[:, None]
        value_ref = seen["down"][0].numpy()[:, chosen]
        bound = slope_at * eps * np.abs(up) + np.abs(act_out) * e_up + slope_at * eps * e_up
    else:
        value_ref, bound = act_out, slope_at * eps
    assert (np.abs(value - value_ref) <= bound).all(), (
        mlp["module"], np.abs(value - value_ref).max())
