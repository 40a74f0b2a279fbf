"""Layer weights stored at ingest (ingestion/weights.py, store/layer_weights.py): every stored
matrix equals the model's own parameter, bit for bit, sliced as the family's documented layout
says (written out here per family, independent of the behavioural search in the code); what
the stored heads and neurons compute equals what the model's own modules computed (hooks);
each head's circuits match a float64 NumPy SVD of the product, with the norm's gain taken
from the norm module itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.real_families import build
from support.tiny_models import CORPUS, build_family_tokenizer, make_tiny_model
from transformers.activations import ACT2FN

import actdb
from actdb.ingestion.circuits import SVD_BOUND
from actdb.store.layer_weights import array_name, read_manifest
from actdb.store.store import Store

PROMPTS = list(CORPUS[:3])
Tensor = torch.Tensor


def _ingest(tmp_path: Path, model: Any, tok: Any, **kw: Any) -> Path:
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, tokenizer=tok, prompts=PROMPTS, device="cpu", **kw)
    return store


def _stored(store: Path) -> tuple[dict[str, Any], Callable[[str], np.ndarray]]:
    st = Store(store)
    manifest = read_manifest(st.arrays, 0)
    assert manifest is not None

    def get(name: str) -> np.ndarray:
        out = st.arrays.weight(0, name)
        assert out is not None
        return out
    return manifest, get


def _model(family: str) -> tuple[Any, Any]:
    if family in ("gpt2", "gpt_neox", "bloom", "llama", "mistral", "phi3", "bert", "opt"):
        return make_tiny_model(family)
    return build(family, 400), build_family_tokenizer("llama")


# The documented layouts, per family: (W_Q, W_K, W_V, W_O) of layer i as [heads, d_head, d]
# rows, and (W_in, W_gate, W_out) as [neurons, d].
def _split(w: Tensor, heads: int) -> Tensor:
    return w.reshape(heads, -1, w.shape[-1])


def _gpt2(m: Any, i: int) -> tuple[Tensor, ...]:
    b = m.transformer.h[i]
    q, k, v = b.attn.c_attn.weight.t().chunk(3)  # Conv1D: [in, out]
    return (_split(q, 4), _split(k, 4), _split(v, 4), _split(b.attn.c_proj.weight, 4),
            b.mlp.c_fc.weight.t(), None, b.mlp.c_proj.weight)


def _neox(m: Any, i: int) -> tuple[Tensor, ...]:
    b = m.gpt_neox.layers[i]
    qkv = b.attention.query_key_value.weight.reshape(4, 3, 16, 64)  # per head [q, k, v]
    return (qkv[:, 0], qkv[:, 1], qkv[:, 2], _split(b.attention.dense.weight.t(), 4),
            b.mlp.dense_h_to_4h.weight, None, b.mlp.dense_4h_to_h.weight.t())


def _bloom(m: Any, i: int) -> tuple[Tensor, ...]:
    b = m.transformer.h[i]
    qkv = b.self_attention.query_key_value.weight.reshape(4, 3, 16, 64)
    return (qkv[:, 0], qkv[:, 1], qkv[:, 2], _split(b.self_attention.dense.weight.t(), 4),
            b.mlp.dense_h_to_4h.weight, None, b.mlp.dense_4h_to_h.weight.t())


def _llama(m: Any, i: int) -> tuple[Tensor, ...]:
    a, f = m.model.layers[i].self_attn, m.model.layers[i].mlp
    kv = a.k_proj.weight.shape[0] // 16
    return (_split(a.q_proj.weight, 4), _split(a.k_proj.weight, kv),
            _split(a.v_proj.weight, kv), _split(a.o_proj.weight.t(), 4),
            f.up_proj.weight, f.gate_proj.weight, f.down_proj.weight.t())


def _phi3(m: Any, i: int) -> tuple[Tensor, ...]:
    a, f = m.model.layers[i].self_attn, m.model.layers[i].mlp
    q, k, v = a.qkv_proj.weight.split([64, 64, 64])
    gate, up = f.gate_up_proj.weight.chunk(2)
    return (_split(q, 4), _split(k, 4), _split(v, 4), _split(a.o_proj.weight.t(), 4),
            up, gate, f.down_proj.weight.t())


def _bert(m: Any, i: int) -> tuple[Tensor, ...]:
    b = m.encoder.layer[i]
    s = b.attention.self
    return (_split(s.query.weight, 4), _split(s.key.weight, 4), _split(s.value.weight, 4),
            _split(b.attention.output.dense.weight.t(), 4), b.intermediate.dense.weight, None,
            b.output.dense.weight.t())


def _opt(m: Any, i: int) -> tuple[Tensor, ...]:
    b = m.model.decoder.layers[i]
    a = b.self_attn
    return (_split(a.q_proj.weight, 4), _split(a.k_proj.weight, 4), _split(a.v_proj.weight, 4),
            _split(a.out_proj.weight.t(), 4), b.fc1.weight, None, b.fc2.weight.t())


def _falcon(m: Any, i: int) -> tuple[Tensor, ...]:
    b = m.transformer.h[i]
    # new architecture: per key-value group [2 queries, its key, its value]
    g = b.self_attention.query_key_value.weight.reshape(2, 4, 16, 64)
    q = g[:, :2].reshape(4, 16, 64)
    return (q, g[:, 2], g[:, 3], _split(b.self_attention.dense.weight.t(), 4),
            b.mlp.dense_h_to_4h.weight, None, b.mlp.dense_4h_to_h.weight.t())


def _bigcode(m: Any, i: int) -> tuple[Tensor, ...]:
    b = m.transformer.h[i]
    q, k, v = b.attn.c_attn.weight.split([64, 16, 16])  # multi-query: one key-value head
    return (_split(q, 4), k[None], v[None], _split(b.attn.c_proj.weight.t(), 4),
            b.mlp.c_fc.weight, None, b.mlp.c_proj.weight.t())


LAYOUTS = {"gpt2": _gpt2, "gpt_neox": _neox, "bloom": _bloom, "llama": _llama,
           "mistral": _llama, "phi3": _phi3, "bert": _bert, "opt": _opt, "falcon": _falcon,
           "gpt_bigcode": _bigcode}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_stored_weights_are_the_models_own(tmp_path: Path, family: str) -> None:
    model, tok = _model(family)
    manifest, get = _stored(_ingest(tmp_path, model, tok))
    assert not manifest["refused"]
    for entry in manifest["layers"]:
        i = entry["layer"]
        want = LAYOUTS[family](model, i)
        attn = entry["attn"]
        for name, ref in zip(("W_Q", "W_K", "W_V", "W_O"), want[:4], strict=True):
            got = get(array_name(i, "attn", name))
            ref = ref.detach().float().numpy()
            assert np.array_equal(got, ref.reshape(-1, ref.shape[-1])), (family, i, name)
        assert len(attn["kv_of_head"]) == attn["n_heads"] == 4
        (mlp,) = entry["mlp"]
        assert mlp["gated"] == (want[5] is not None)
        for name, ref in zip(("W_in", "W_gate", "W_out"), want[4:], strict=True):
            if ref is None:
                assert name not in mlp["arrays"]
                continue
            got = get(array_name(i, "mlp", name))
            assert np.array_equal(got, ref.detach().float().numpy()), (family, i, name)


def _hooked_run(model: Any, ids: Tensor, modules: dict[str, torch.nn.Module]
                ) -> dict[str, tuple[Tensor, Tensor]]:
    seen: dict[str, tuple[Tensor, Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(mod: Any, args: Any, kwargs: Any, out: Any) -> None:
            x = args[0] if args else next(iter(kwargs.values()))
            y = out[0] if isinstance(out, tuple) else out
            seen.setdefault(name, (x.detach().double().clone(), y.detach().double().clone()))
        return hook

    handles = [m.register_forward_hook(keep(n), with_kwargs=True) for n, m in modules.items()]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    return seen


# Families beyond the layout table: what the stored weights compute is checked against the
# model's own modules (a one-token value path, and the MLP on every stored pre-MLP row).
BEHAVIOUR = ["llama", "gpt2", "bert", "cohere", "gemma3_text", "stablelm", "gptj", "phi",
             "persimmon", "codegen", "mpt", "xglm", "biogpt", "gpt_neo", "glm", "starcoder2",
             "nemotron", "xlm", "roberta-prelayernorm", "falcon", "gpt_bigcode", "bloom"]


# Families whose config names no activation: the one their MLP module applies.
ACTIVATION = {"xlm": "gelu", "mpt": "gelu", "bloom": "gelu_new"}
# The output and an input projection of an attention, by the names families give them.
WRITERS = ("o_proj", "out_proj", "dense", "c_proj", "out_lin")
MLP_WRITERS = ("down_proj", "c_proj", "fc2", "dense_4h_to_h", "fc_out", "lin2")
MLP_READERS = ("fc1", "up_proj", "gate_proj", "c_fc", "dense_h_to_4h", "fc_in", "lin1",
               "gate_up_proj")
READERS = ("q_proj", "query", "c_attn", "query_key_value", "qkv_proj", "Wqkv", "q_lin")


@pytest.mark.slow
@pytest.mark.parametrize("family", BEHAVIOUR)
def test_stored_weights_compute_what_the_model_computes(tmp_path: Path, family: str) -> None:
    model, tok = _model(family)
    store = _ingest(tmp_path, model, tok)
    manifest, get = _stored(store)
    act_name = ACTIVATION.get(family) or next(
        getattr(model.config, a) for a in ("hidden_act", "activation_function",
                                            "hidden_activation", "activation")
        if isinstance(getattr(model.config, a, None), str))
    act = ACT2FN[act_name]
    for entry in manifest["layers"]:
        i, attn = entry["layer"], entry["attn"]
        if attn:
            # One token: softmax weighs its one key 1, so the attention's output projection
            # writes sum_h W_O[h]^T (W_V[kv(h)] x + b_V) + b_O: its own output.
            o = model.get_submodule(attn["module"])
            named = dict(o.named_modules())
            writer = next(m for n, m in named.items() if n.rsplit(".", 1)[-1] in WRITERS)
            reader = next(m for n, m in named.items() if n.rsplit(".", 1)[-1] in READERS)
            ids = torch.tensor([[5]])
            seen = _hooked_run(model, ids, {"w": writer, "r": reader})
            x = seen["r"][0].reshape(-1)
            h, dh = attn["n_heads"], attn["d_head"]
            wv = get(array_name(i, "attn", "W_V")).astype(np.float64).reshape(-1, dh, x.numel())
            wo = get(array_name(i, "attn", "W_O")).astype(np.float64).reshape(h, dh, -1)
            bv = (get(array_name(i, "attn", "b_V")).reshape(-1, dh) if "b_V" in attn["arrays"]
                  else np.zeros((len(wv), dh)))
            bo = get(array_name(i, "attn", "b_O")) if "b_O" in attn["arrays"] else 0.0
            xv = x.numpy()
            out = sum(wo[j].T @ (wv[attn["kv_of_head"][j]] @ xv + bv[attn["kv_of_head"][j]])
                      for j in range(h)) + bo
            real = seen["w"][1].reshape(-1).numpy()
            assert np.abs(out - real).max() <= 1e-5 * np.abs(real).max() + 1e-6, (family, i)
        for mlp in entry["mlp"]:
            # Every token of a prompt: the MLP's output from the stored neurons.
            mod = model.get_submodule(mlp["module"])
            ids = torch.tensor([tok(PROMPTS[0])["input_ids"][:12]])
            named = dict(mod.named_modules())
            down = [m for n, m in named.items() if n.rsplit(".", 1)[-1] in MLP_WRITERS]
            if not down:  # BERT's intermediate: the writer is its sibling, output.dense
                continue
            up = next(m for n, m in named.items() if n.rsplit(".", 1)[-1] in MLP_READERS)
            seen = _hooked_run(model, ids, {"r": up, "w": down[-1]})
            x, y = seen["r"][0], seen["w"][1]
            part = "mlp"
            w_in = torch.tensor(get(array_name(i, part, "W_in")), dtype=torch.float64)
            pre = x @ w_in.T
            if "b_in" in mlp["arrays"]:
                pre = pre + torch.tensor(get(array_name(i, part, "b_in")), dtype=torch.float64)
            if mlp["gated"]:
                w_g = torch.tensor(get(array_name(i, part, "W_gate")), dtype=torch.float64)
                g = x @ w_g.T
                if "b_gate" in mlp["arrays"]:
                    g = g + torch.tensor(get(array_name(i, part, "b_gate")), dtype=torch.float64)
                hidden = act(g) * pre
            else:
                hidden = act(pre)
            out = hidden @ torch.tensor(get(array_name(i, part, "W_out")), dtype=torch.float64)
            if "b_out" in mlp["arrays"]:
                out = out + torch.tensor(get(array_name(i, part, "b_out")), dtype=torch.float64)
            err = float((out - y).abs().max()) / float(y.abs().max())
            assert err <= 1e-5, (family, i, err)


def _norm_gain(model: Any, family: str, i: int) -> np.ndarray:
    """The pre-attention norm's gain, read from the module's own parameter."""
    if family == "gpt2":
        return model.transformer.h[i].ln_1.weight.detach().double().numpy()
    layer = model.model.layers[i].input_layernorm
    w = layer.weight.detach().double().numpy()
    return 1.0 + w if "Gemma" in type(layer).__name__ else w


@pytest.mark.parametrize("family", ["gpt2", "mistral"])
def test_circuits_match_a_float64_svd(tmp_path: Path, family: str) -> None:
    model, tok = _model(family)
    manifest, get = _stored(_ingest(tmp_path, model, tok))
    for entry in manifest["layers"]:
        i, attn = entry["layer"], entry["attn"]
        assert attn["gain_folded"]
        g = _norm_gain(model, family, i)
        wq, wk, wv, wo = (w.detach() for w in LAYOUTS[family](model, i)[:4])
        for kind in ("OV", "QK"):
            sigma = get(array_name(i, f"circuits/{kind}", "sigma"))
            u = get(array_name(i, f"circuits/{kind}", "u")).reshape(attn["n_heads"], -1, len(g))
            v = get(array_name(i, f"circuits/{kind}", "v")).reshape(attn["n_heads"], -1, len(g))
            for h in range(attn["n_heads"]):
                kv = attn["kv_of_head"][h]
                if kind == "OV":
                    m = (g[:, None] * wv[kv].double().numpy().T) @ wo[h].double().numpy()
                else:
                    m = (g[:, None] * wq[h].double().numpy().T) @ (
                        wk[kv].double().numpy() * g[None, :])
                ru, rs, rvt = np.linalg.svd(m)
                r = sigma.shape[1]
                assert np.abs(sigma[h] - rs[:r]).max() <= SVD_BOUND * rs[0], (family, i, h)
                # vectors up to sign, where the singular value stands apart from its neighbours
                gaps = np.minimum(np.abs(np.diff(rs[: r + 1], prepend=np.inf)),
                                  np.abs(np.diff(rs[: r + 1], append=-np.inf)))[:r]
                for k in np.nonzero(gaps[:r] > 1e-3 * rs[0])[0]:
                    sign = np.sign(rvt[k] @ v[h, k])
                    assert np.abs(sign * v[h, k] - rvt[k]).max() < 1e-4, (family, i, h, k)
                    assert np.abs(sign * u[h, k] - ru[:, k]).max() < 1e-4, (family, i, h, k)


def test_weights_none_stores_none(tmp_path: Path) -> None:
    model, tok = make_tiny_model("gpt2")
    store = _ingest(tmp_path, model, tok, weights="none")
    st = Store(store)
    assert read_manifest(st.arrays, 0) is None
    info = actdb.connect(store).info()
    assert info.models[0]["weights"] is None


def test_refused_layers_say_why(tmp_path: Path) -> None:
    model, tok = _model("deepseek_v2")  # latent attention: values pass through a latent
    manifest, _ = _stored(_ingest(tmp_path, model, tok))
    refused = [r for r in manifest["refused"] if r["part"] == "attn"]
    assert len(refused) == 2 and all("latent" in r["reason"] for r in refused)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_experts_are_the_models_own(tmp_path: Path, family: str) -> None:
    """Each routed expert's rows are its slice of the experts' 3-D parameters (the fused
    [gate; up] rows and the transposed output), and a shared expert is its own MLP."""
    model, tok = _model(family)
    manifest, get = _stored(_ingest(tmp_path, model, tok))
    assert not manifest["refused"]
    for entry in manifest["layers"]:
        i = entry["layer"]
        moe = model.model.layers[i].mlp
        experts = moe.experts
        n = experts.down_proj.shape[2]
        routed = [m for m in entry["mlp"] if not m["shared"]]
        assert [m["expert"] for m in routed] == list(range(experts.gate_up_proj.shape[0]))
        for m in routed:
            e, part = m["expert"], f"mlp.{m['expert']}"
            gu = experts.gate_up_proj[e].detach().numpy()
            assert np.array_equal(get(array_name(i, part, "W_gate")), gu[:n])
            assert np.array_equal(get(array_name(i, part, "W_in")), gu[n:])
            assert np.array_equal(get(array_name(i, part, "W_out")),
                                  experts.down_proj[e].detach().numpy().T)
        shared = [m for m in entry["mlp"] if m["shared"]]
        if family == "qwen2_moe":
            (m,) = shared
            part, se = f"mlp.{m['expert']}", moe.shared_expert
            assert np.array_equal(get(array_name(i, part, "W_gate")),
                                  se.gate_proj.weight.detach().numpy())
            assert np.array_equal(get(array_name(i, part, "W_in")),
                                  se.up_proj.weight.detach().numpy())
            assert np.array_equal(get(array_name(i, part, "W_out")),
                                  se.down_proj.weight.detach().numpy().T)
        else:
            assert not shared
