"""head_write and qk_score: activations read through a head's stored weights (head_weights.py).

Both read a row v of the site whose output the layer's attention reads (its pre-attention
norm, in a pre-norm model): the attention's input is that site's output y = gain * z + bias
(`normed(v)`), so the norm's gain and bias are applied exactly as the model applies them.

- head_write(v, layer, h) = (W_V[kv(h)] y + b_V[kv(h)]) W_O[h]: what head h adds to the
  residual stream for a query that attends with weight 1 to v's position. The value bias is
  included (it reaches the output through any attention weights summing to 1); the output
  projection's bias b_O is not: it is added once for all heads, belongs to none of them.
- qk_score(vq, vk, layer, h [, q_pos, k_pos]) = scale * q . k with q = W_Q[h] yq + b_Q[h],
  k = W_K[kv(h)] yk + b_K[kv(h)], each turned by the model's rotary table at its position
  where the model has one, and `scale` the attention's own (its module's `scaling`, usually
  d_head^-0.5): the logit the model's softmax takes, before its mask (and ALiBi's bias).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import QueryError
from ..lazy import lazy_module
from .head_weights import LayerAttention, RotaryTable
from .kernels import Arg, _per_value
from .lists import ListResults, float_lists
from .vectors import VectorSource

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

NO_POSITION = -1  # qk_score's q_pos and k_pos when not given (functions.py)


def _inputs(src: VectorSource, h: np.ndarray, what: str
            ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The attention inputs y [n, d] (float32) of opened handles `h`, each row's site name
    and model id: a raw vec's site output (normed), or a normed view as it is."""
    sites = np.empty(len(h), dtype=object)
    models = np.full(len(h), -1, dtype=np.int64)
    out: torch.Tensor | None = None
    for g in src.groups(h):
        if g.view not in ("raw", "normed"):
            raise QueryError(f"{what} reads a vec (or normed(vec)): the attention's input is "
                             f"the norm's output; got a {g.view} view")
        y = g.x if g.view == "normed" else src.site_output(g.model, g.site, g.x, g.mean,
                                                             g.heads)
        if out is None:
            out = torch.empty((len(h), y.shape[-1]), dtype=torch.float32, device=src.device)
        if y.shape[-1] != out.shape[-1]:
            raise QueryError(f"{what}: rows of widths {out.shape[-1]} and {y.shape[-1]} in "
                             "one call; select one model's residual sites")
        out[torch.from_numpy(g.index).to(src.device)] = y.float()
        sites[g.index] = g.site.site
        models[g.index] = g.model.model_id
    if out is None or (models < 0).any():  # final_norm views off the residual stream
        raise QueryError(f"{what} reads a vec (or normed(vec)): the attention's input is "
                         "the norm's output; got a final_norm view")
    return out, sites, models


def _check_reads(what: str, lay: LayerAttention, sites: np.ndarray, model: str) -> None:
    bad = [s for s in set(sites.tolist()) if s != lay.reads]
    if lay.reads is None:
        raise QueryError(f"{what}: the attention of layer {lay.layer} of model {model!r} "
                         "reads no stored site's output")
    if bad:
        raise QueryError(f"{what} reads rows of site {lay.reads!r}, whose output the "
                         f"attention of layer {lay.layer} of model {model!r} reads; got rows "
                         f"of site {bad[0]!r} (e.g. WHERE site = '{lay.reads}')")


def _ints(arg: Arg, index: np.ndarray) -> np.ndarray:
    return np.asarray(arg.values, dtype=np.int64)[arg.codes[index]]


def head_write(src: VectorSource, h: np.ndarray, out: ListResults, layer: Arg,
               head: Arg) -> None:
    y, sites, models = _inputs(src, h, "head_write")
    for mid in np.unique(models):
        model = src.model(int(mid))
        rows = np.nonzero(models == mid)[0]
        for (li, hi), pos in _per_value([layer, head], rows).items():
            at = rows[pos]
            lay = src.heads.head(model, int(li), int(hi), "head_write")
            _check_reads("head_write", lay, sites[at], model.model)
            kv = lay.kv_of_head[int(hi)]
            value = y[torch.from_numpy(at).to(src.device)] @ lay.w_v[kv].T  # [n, dh]
            if lay.b_v is not None:
                value = value + lay.b_v[kv]
            written = value @ lay.w_o[int(hi)]  # [n, d]
            out.put(at, float_lists(written.cpu().numpy()))


def rotate(x: torch.Tensor, pos: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Queries or keys [n, dh] turned to positions `pos` [n] as the model's rotary module and
    `apply_rotary_pos_emb` do it, in float32: cos and sin of pos * inv_freq (each half
    repeated, times the table's scaling), rotate_half over the first 2 * len(inv_freq) dims."""
    assert table.inv_freq is not None
    freqs = pos.float().unsqueeze(-1) * table.inv_freq.unsqueeze(0)  # [n, r / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, r]
    cos, sin = emb.cos() * table.scaling, emb.sin() * table.scaling
    r = emb.shape[-1]
    turned, rest = x[:, :r], x[:, r:]
    half = r // 2
    rotated = torch.cat((-turned[:, half:], turned[:, :half]), dim=-1)
    return torch.cat((turned * cos + rotated * sin, rest), dim=-1)


def qk_score(src: VectorSource, hq: np.ndarray, hk: np.ndarray, out: np.ndarray, layer: Arg,
             head: Arg, q_pos: Arg, k_pos: Arg) -> None:
    yq, sq, mq = _inputs(src, hq, "qk_score")
    yk, sk, mk = _inputs(src, hk, "qk_score")
    if (mq != mk).any():
        raise QueryError("qk_score takes a query row and a key row of one model")
    for mid in np.unique(mq):
        model = src.model(int(mid))
        rows = np.nonzero(mq == mid)[0]
        table = src.heads.rotary(model)
        for (li, hi), pos in _per_value([layer, head], rows).items():
            at = rows[pos]
            lay = src.heads.head(model, int(li), int(hi), "qk_score")
            _check_reads("qk_score", lay, sq[at], model.model)
            _check_reads("qk_score", lay, sk[at], model.model)
            _refuse_normed_heads(src, model, int(li))
            if lay.scale is None:
                raise QueryError(f"qk_score: the attention of layer {int(li)} of model "
                                 f"{model.model!r} states no scale (no `scaling` on its module)")
            hh = int(hi)
            kv = lay.kv_of_head[hh]
            dev = torch.from_numpy(at).to(src.device)
            q = yq[dev] @ lay.w_q[hh].T  # [n, dh]
            k = yk[dev] @ lay.w_k[kv].T
            if lay.b_q is not None:
                q = q + lay.b_q[hh]
            if lay.b_k is not None:
                k = k + lay.b_k[kv]
            ok = np.ones(len(at), dtype=bool)
            if table is not None:
                pq, pk = _ints(q_pos, at), _ints(k_pos, at)
                ok = (pq >= 0) & (pk >= 0)  # without positions: NULL (the score needs them)
                if ok.any() and table.reason is not None:
                    raise QueryError(f"qk_score: model {model.model!r}: {table.reason}")
                if ok.any():
                    q = rotate(q, torch.from_numpy(np.where(ok, pq, 0)).to(src.device), table)
                    k = rotate(k, torch.from_numpy(np.where(ok, pk, 0)).to(src.device), table)
            score = (q * k).sum(-1) * lay.scale
            out[at] = np.where(ok, score.double().cpu().numpy(), np.nan)


def _refuse_normed_heads(src: VectorSource, model: object, layer: int) -> None:
    """Queries or keys normed per head (q_norm, k_norm sites) are not linear in the input:
    the score is not W_Q . W_K's."""
    mid = getattr(model, "model_id", None)
    normed = [s.site for (m, _), s in src.sites.items()
              if m == mid and s.layer == layer and s.role in ("q_norm", "k_norm")]
    if normed:
        raise QueryError(f"qk_score: layer {layer} of model {getattr(model, 'model', '')!r} "
                         f"norms each head's queries and keys ({', '.join(normed)}), so its "
                         "score is not a product of the stored W_Q and W_K")
