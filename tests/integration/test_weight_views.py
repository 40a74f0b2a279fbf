"""The views neurons and circuits, and neuron_pre / neuron_act / active_fraction, against the
model itself: each neuron's rows are the model's own parameters (the input rows times the gain
of the norm module the MLP reads), each circuit a float64 NumPy SVD of the product of the
model's own projection weights, and the neuron functions the MLP's own activation input and
down projection input, captured with hooks, on every pre-MLP row, within the bound `actdb
functions` states. Stores without weights (--weights none, and the same store rewritten as an
older actdb left it) say so in one sentence and query as before."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from support.tiny_models import CORPUS, make_tiny_model

import actdb
from actdb.cli import cli
from actdb.ingestion.circuits import SVD_BOUND

PROMPTS = list(CORPUS[:2])
# RMSNorm, a gated SiLU MLP, rotary; LayerNorm, an ungated tanh-GELU MLP with biases
FAMILIES = ["llama", "gpt2"]


@pytest.fixture(autouse=True)
def _no_grad() -> Any:
    with torch.no_grad():
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def stored(request: Any, tmp_path_factory: Any) -> tuple[str, Any, Any, Path]:
    family = request.param
    model, tok = make_tiny_model(family)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # biases that matter (the families initialize them to zero)
        for name, param in model.named_parameters():
            if name.endswith(".bias") and "ln" not in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp(family) / "s.actdb"
    # a materialized lens (the lens functions read it for acts rows, never for weight rows)
    actdb.ingest(path, model=model, tokenizer=tok, prompts=PROMPTS, device="cpu", lens=4)
    return family, model, tok, path


def _mlp(family: str, model: Any, i: int) -> dict[str, Any]:
    """Layer i's MLP as the family lays it out: its norm, modules and [neurons, d] rows."""
    if family == "llama":
        block = model.model.layers[i]
        f = block.mlp
        return {"norm": block.post_attention_layernorm, "act": f.act_fn, "down": f.down_proj,
                "up": f.up_proj, "W_in": f.up_proj.weight, "W_gate": f.gate_proj.weight,
                "b_in": None, "b_gate": None, "W_out": f.down_proj.weight.t()}
    block = model.transformer.h[i]
    f = block.mlp
    return {"norm": block.ln_2, "act": f.act, "down": f.c_proj, "up": None,
            "W_in": f.c_fc.weight.t(), "W_gate": None, "b_in": f.c_fc.bias, "b_gate": None,
            "W_out": f.c_proj.weight}


def _attn(family: str, model: Any, i: int) -> tuple[Any, ...]:
    """Layer i's (gain, W_Q, W_K, W_V, W_O) as [heads, d_head, d] rows, float64."""
    if family == "llama":
        block = model.model.layers[i]
        a = block.self_attn
        q, k, v = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
        o = a.o_proj.weight.t()
        gain = block.input_layernorm.weight
    else:
        block = model.transformer.h[i]
        q, k, v = block.attn.c_attn.weight.t().chunk(3)
        o = block.attn.c_proj.weight
        gain = block.ln_1.weight
    return tuple(w.detach().double().numpy() for w in (gain, q.reshape(4, -1, q.shape[-1]),
                 k.reshape(4, -1, k.shape[-1]), v.reshape(4, -1, v.shape[-1]),
                 o.reshape(4, -1, o.shape[-1])))


def _np(t: Any) -> np.ndarray | None:
    return None if t is None else t.detach().double().numpy()


def test_neurons_are_the_models_rows(stored: tuple[str, Any, Any, Path]) -> None:
    family, model, _, path = stored
    db = actdb.connect(path)
    rows = db.sql("SELECT layer, expert, neuron, to_list(w_in), to_list(w_gate), "
                  "to_list(w_out), vec_norm(w_out), cosine_to_anchor(w_out, 7) FROM neurons "
                  "ORDER BY layer, neuron").fetchall()
    n = _mlp(family, model, 0)["W_in"].shape[0]
    assert len(rows) == 2 * n
    w_u = model.get_output_embeddings().weight.detach().double().numpy()
    for layer in (0, 1):
        ref = _mlp(family, model, layer)
        gain = _np(ref["norm"].weight)
        got = [r for r in rows if r[0] == layer]
        assert [r[2] for r in got] == list(range(n)) and all(r[1] is None for r in got)
        w_in, w_out = np.array([r[3] for r in got]), np.array([r[5] for r in got])
        # the model reads W_in . (gain * z + bias): the row in z's space is gain * W_in
        assert np.allclose(w_in, _np(ref["W_in"]) * gain, rtol=1e-6, atol=1e-7), family
        assert np.array_equal(w_out, _np(ref["W_out"]).astype(np.float32))
        if ref["W_gate"] is None:
            assert all(r[4] is None for r in got)
        else:
            w_gate = np.array([r[4] for r in got])
            assert np.allclose(w_gate, _np(ref["W_gate"]) * gain, rtol=1e-6, atol=1e-7)
        norms = np.linalg.norm(_np(ref["W_out"]), axis=1)
        assert np.allclose([r[6] for r in got], norms, rtol=1e-6)
        cos = _np(ref["W_out"]) @ w_u[7] / (norms * np.linalg.norm(w_u[7]))
        assert np.allclose([r[7] for r in got], cos, atol=1e-6)
    (top,) = db.sql("SELECT nearest_anchors(w_out, 3) FROM neurons WHERE layer = 1 AND "
                    "neuron = 5").fetchone()
    row = _np(_mlp(family, model, 1)["W_out"])[5]
    want = np.argsort(-(w_u @ row / np.linalg.norm(w_u, axis=1)))[:3]
    assert [t["token_id"] for t in top] == want.tolist()
    # the logit lens of a weight row: the row through the final norm, then the LM head
    (lens,) = db.sql("SELECT top_logits(w_out, 3) FROM neurons WHERE layer = 1 AND "
                     "neuron = 5").fetchone()
    final = model.model.norm if family == "llama" else model.transformer.ln_f
    x = row - row.mean() if family == "gpt2" else row
    eps = final.eps if family == "gpt2" else final.variance_epsilon
    z = x / np.sqrt((x**2).mean() + eps)
    hn = z * _np(final.weight) + (_np(final.bias) if family == "gpt2" else 0.0)
    logits = w_u @ hn
    assert [t["token_id"] for t in lens] == np.argsort(-logits)[:3].tolist()
    assert np.allclose([t["logit"] for t in lens], np.sort(logits)[::-1][:3], atol=1e-4)


def test_circuits_are_a_float64_svd_of_the_models_heads(stored: tuple[str, Any, Any, Path]
                                                         ) -> None:
    family, model, _, path = stored
    db = actdb.connect(path)
    rows = db.sql("SELECT layer, head, circuit, rank, sigma, to_list(u), to_list(v), rotary "
                  "FROM circuits ORDER BY layer, circuit, head, rank").fetchall()
    assert len(rows) == 2 * 2 * 4 * 16
    assert {(r[2], r[7]) for r in rows} == {("OV", False), ("QK", family == "llama")}
    for layer in (0, 1):
        g, wq, wk, wv, wo = _attn(family, model, layer)
        for h in range(4):
            for circuit in ("OV", "QK"):
                m = ((g[:, None] * wv[h].T) @ wo[h] if circuit == "OV"
                     else (g[:, None] * wq[h].T) @ (wk[h] * g[None, :]))
                ru, rs, rvt = np.linalg.svd(m)
                got = [r for r in rows if r[:3] == (layer, h, circuit)]
                assert [r[3] for r in got] == list(range(1, 17))
                sigma = np.array([r[4] for r in got])
                assert np.abs(sigma - rs[:16]).max() <= SVD_BOUND * rs[0]
                u, v = np.array([r[5] for r in got]), np.array([r[6] for r in got])
                for k in range(16):  # vectors up to sign, where sigma stands apart
                    if min(abs(rs[k] - rs[k + 1]), abs(rs[k] - rs[k - 1]) if k else 1.0) \
                            < 1e-3 * rs[0]:
                        continue
                    sign = np.sign(rvt[k] @ v[k])
                    assert np.abs(sign * v[k] - rvt[k]).max() < 1e-4, (layer, h, circuit, k)
                    assert np.abs(sign * u[k] - ru[:, k]).max() < 1e-4, (layer, h, circuit, k)


def _hooked(model: Any, ids: list[int], modules: dict[str, Any]) -> dict[str, Any]:
    """Each module's (input, output) in a forward pass over `ids`, float64."""
    seen: dict[str, Any] = {}

    def keep(name: str) -> Any:
        def hook(mod: Any, args: Any, out: Any) -> None:
            seen[name] = (args[0][0].double(), out[0].double())
        return hook

    handles = [m.register_forward_hook(keep(k)) for k, m in modules.items() if m is not None]
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


def test_neuron_functions_are_the_mlps_own(stored: tuple[str, Any, Any, Path]) -> None:
    family, model, _, path = stored
    db = actdb.connect(path)
    n = _mlp(family, model, 0)["W_in"].shape[0]
    for layer in (0, 1):
        ref = _mlp(family, model, layer)
        site = db.sql("SELECT site FROM sites WHERE role = 'pre_mlp' AND layer = $l",
                      params={"l": layer}).fetchone()[0]
        got = db.sql(
            "SELECT prompt_id, position, neuron, neuron_pre(vec, neuron), "
            "neuron_act(vec, neuron) FROM acts, range($n) t(neuron) WHERE site = $s "
            "ORDER BY prompt_id, position, neuron", params={"n": n, "s": site}).fetchall()
        frac = db.sql("SELECT prompt_id, position, active_fraction(vec) FROM acts WHERE "
                      "site = $s ORDER BY prompt_id, position", params={"s": site}).fetchall()
        pre_all = np.array([r[3] for r in got])
        act_all = np.array([r[4] for r in got])
        d = ref["W_in"].shape[1]
        gain = _np(ref["norm"].weight)
        reader = ref["W_gate"] if ref["W_gate"] is not None else ref["W_in"]
        eps_row = 2.0**-10 * np.sqrt(d) * np.linalg.norm(gain * _np(reader), axis=1)  # [N]
        eps_up = 2.0**-10 * np.sqrt(d) * np.linalg.norm(gain * _np(ref["W_in"]), axis=1)
        at = 0
        for pid in range(len(PROMPTS)):
            ids = [r[0] for r in db.sql("SELECT token_id FROM tokens WHERE prompt_id = $p "
                                        "ORDER BY position", params={"p": pid}).fetchall()]
            seen = _hooked(model, ids, {"norm": ref["norm"], "act": ref["act"],
                                        "down": ref["down"], "up": ref["up"]})
            x = seen["norm"][0]  # the norm's input: its angle to the ones vector
            sin = torch.sqrt(1 - x.sum(-1) ** 2 / (x.shape[-1] * (x**2).sum(-1))).numpy()
            pre_ref, act_out = seen["act"][0].numpy(), seen["act"][1].numpy()
            value_ref = seen["down"][0].numpy()  # what multiplies W_out: act(gate) * up
            t = len(ids)
            pre = pre_all[at : at + t * n].reshape(t, n)
            value = act_all[at : at + t * n].reshape(t, n)
            at += t * n
            scale = 1 / sin[:, None] if family == "gpt2" else 1.0
            eps = eps_row[None, :] * scale
            assert (np.abs(pre - pre_ref) <= eps).all(), (family, layer,
                                                          np.abs(pre - pre_ref).max())
            slope = 1.13 if family == "gpt2" else 1.1
            if ref["up"] is None:
                bound = slope * eps
            else:
                up = seen["up"][1].numpy()
                e_up = eps_up[None, :] * scale
                bound = slope * eps * np.abs(up) + np.abs(act_out) * e_up + slope * eps * e_up
            assert (np.abs(value - value_ref) <= bound).all(), (
                family, layer, np.abs(value - value_ref).max())
            # active: the model's own activation output past zero; those near it either way
            on = act_out > 0
            sure = np.abs(pre_ref) > eps
            f = np.array([r[2] for r in frac if r[0] == pid])
            lo, hi = (on & sure).mean(-1), (on | ~sure).mean(-1)
            assert ((f >= lo - 1e-12) & (f <= hi + 1e-12)).all(), (family, layer)
        assert at == len(got)


def test_neuron_functions_say_what_is_wrong(stored: tuple[str, Any, Any, Path]) -> None:
    _, _, _, path = stored
    db = actdb.connect(path)
    cases = [
        ("SELECT neuron_pre(vec, 0) FROM acts WHERE role = 'pre_attn' LIMIT 1",
         "read by no stored MLP"),
        ("SELECT neuron_act(vec, 100000) FROM acts WHERE role = 'pre_mlp' LIMIT 1",
         "neuron 100000 is out of range"),
        ("SELECT active_fraction(normalized(vec)) FROM acts WHERE role = 'pre_mlp' LIMIT 1",
         "got a normalized view"),
        ("SELECT neuron_pre(w_out, 0) FROM neurons LIMIT 1", "not a weight row"),
        ("SELECT normed(w_in) FROM neurons LIMIT 1", "not a weight row"),
        ("SELECT rotation_angle(u) FROM circuits LIMIT 1", "is a weight row"),
        ("SELECT cosine_to_anchor(w_in::DOUBLE::DECIMAL(38, 0), 3) FROM neurons LIMIT 1",
         "not a vec handle"),
    ]
    for sql, match in cases:
        with pytest.raises(actdb.QueryError, match=match):
            db.sql(sql).fetchall()


def _to_format_2(store: Path) -> None:
    """Rewrite a store as an actdb before 0.3 left it: no chunk digests, format 2."""
    con = duckdb.connect(str(store / "catalog.duckdb"))
    con.execute("DROP TABLE chunk_digests")
    con.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    con.close()
    root = store / "tensors.zarr" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["actdb_format_version"] = 2
    root.write_text(json.dumps(doc))


def test_stores_without_weights_say_so(tmp_path: Path) -> None:
    model, tok = make_tiny_model("gpt2")
    none = tmp_path / "none.actdb"
    actdb.ingest(none, model=model, tokenizer=tok, prompts=PROMPTS[:1], device="cpu",
                 weights="none")
    old = tmp_path / "old.actdb"
    shutil.copytree(none, old)
    _to_format_2(old)
    for path in (none, old):
        db = actdb.connect(path)
        assert db.sql("SELECT count(*), count(cosine_to_anchor(vec, 3)) FROM acts "
                      "WHERE role = 'pre_mlp'").fetchone()[0] > 0
        for view in ("neurons", "circuits"):
            with pytest.raises(actdb.QueryError, match="holds no layer weights.*--weights none"):
                db.sql(f"SELECT * FROM {view}").fetchall()
        with pytest.raises(actdb.QueryError, match="stored without its layer weights"):
            db.sql("SELECT neuron_pre(vec, 0) FROM acts WHERE role = 'pre_mlp'").fetchall()
        # still answers the rest, on the same connection
        assert db.sql("SELECT count(*) FROM acts").fetchone()[0] > 0
        res = CliRunner().invoke(cli, ["query", str(path), "SELECT count(*) FROM neurons"])
        assert res.exit_code == 1
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and "holds no layer weights" in lines[0], res.output
        assert "Traceback" not in res.output
