"""head_write, qk_score and --attention checked on a stored Llama-architecture checkpoint
(SmolLM2) against its own modules: v_proj / o_proj and q_proj / k_proj on the hooked
input_layernorm output, its own rotary module and apply_rotary_pos_emb, and output_attentions
of an eager forward pass; each within the float16 bound `actdb functions` states."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

import actdb
from actdb.store.layer_weights import array_name
from actdb.store.store import Store


def check_llama_heads(store: Path, model: Any, layers: tuple[int, ...] = (0, 14, 29)) -> None:
    """The store holds one prompt of `model`, with --attention and its blocks' ln1 sites."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    st = Store(store)
    db = actdb.connect(store, device="cpu")
    ids = [r[0] for r in db.sql("SELECT token_id FROM tokens ORDER BY position").fetchall()]
    n = len(ids)
    seen: dict[int, torch.Tensor] = {}
    def keep(i: int) -> Any:
        def hook(module: Any, args: Any, out: torch.Tensor) -> None:
            seen.setdefault(i, out.detach()[0])
        return hook

    hooks = [model.model.layers[i].input_layernorm.register_forward_hook(keep(i))
             for i in layers]
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(impl)
        for h in hooks:
            h.remove()
    # --attention: the model's own weights, every layer and head
    rows = db.sql("SELECT layer, head, query_position, key_position, weight "
                  "FROM attention").fetchnumpy()
    ref = torch.stack(out.attentions, dim=1)[0].numpy()
    got = np.full(ref.shape, np.nan)
    got[rows["layer"], rows["head"], rows["query_position"], rows["key_position"]] = \
        rows["weight"]
    assert np.abs(got - ref).max() <= 1e-6
    d = model.config.hidden_size
    pos = torch.arange(n)
    with torch.no_grad():
        for i in layers:
            a = model.model.layers[i].self_attn
            dh = a.head_dim
            y = seen[i]
            q_all, k_all, v_all = a.q_proj(y), a.k_proj(y), a.v_proj(y)
            cos, sin = model.model.rotary_emb(y.unsqueeze(0), pos.unsqueeze(0))
            sigma = st.arrays.weight(0, array_name(i, "circuits/OV", "sigma"))
            assert sigma is not None
            site = f"blocks.{i}.ln1"
            for h in (0, 4, 8):
                kv = h // a.num_key_value_groups
                slot = torch.zeros(n, a.o_proj.in_features)
                slot[:, h * dh:(h + 1) * dh] = v_all[:, kv * dh:(kv + 1) * dh]
                write_ref = a.o_proj(slot).double()  # o_proj has no bias
                w = torch.tensor([r[0] for r in db.sql(
                    "SELECT head_write(vec, $l, $h) FROM acts WHERE site = $s ORDER BY "
                    "position", params={"l": i, "h": h, "s": site}).fetchall()],
                    dtype=torch.float64)
                bound = 2.0**-9 * math.sqrt(d) * float(sigma[h, 0])
                assert float((w - write_ref).norm(dim=-1).max()) <= bound, (i, h)
                q = q_all[:, h * dh:(h + 1) * dh].reshape(1, 1, n, dh)
                k = k_all[:, kv * dh:(kv + 1) * dh].reshape(1, 1, n, dh)
                qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
                score_ref = (qr[0, 0] @ kr[0, 0].T).double() * a.scaling
                s = db.sql("SELECT qk_score(q.vec, k.vec, $l, $h, q.position, k.position) "
                           "FROM acts q JOIN acts k USING (prompt_id, site) WHERE site = $s "
                           "ORDER BY q.position, k.position",
                           params={"l": i, "h": h, "s": site}).fetchnumpy()
                score = s[next(iter(s))].reshape(n, n)
                # the stated bound: 2^-9 sqrt(d) scale (||W_Q,h diag(g)|| ||k|| +
                # ||W_K,h diag(g)|| ||q||), the norms of q and k rotated alike
                g = model.model.layers[i].input_layernorm.weight.detach().double()
                sq = torch.linalg.matrix_norm(a.q_proj.weight[h * dh:(h + 1) * dh].double()
                                              * g, ord=2)
                sk = torch.linalg.matrix_norm(a.k_proj.weight[kv * dh:(kv + 1) * dh].double()
                                              * g, ord=2)
                qn = qr[0, 0].double().norm(dim=-1)[:, None]
                kn = kr[0, 0].double().norm(dim=-1)[None, :]
                bound_s = (2.0**-9 * math.sqrt(d) * a.scaling * (sq * kn + sk * qn)).numpy()
                err = np.abs(score - score_ref.numpy())
                assert (err <= bound_s).all(), (i, h, err.max(), bound_s.min())
                for qi in range(n):  # softmax over the visible keys: the model's weights
                    p = np.exp(score[qi, :qi + 1] - score[qi, :qi + 1].max())
                    assert np.abs(p / p.sum() - ref[i, h, qi, :qi + 1]).max() < 2e-2, (i, h)
