"""The logit lens as a distribution: softmax of the model's own logits read at any residual site.

Every kernel here passes the handles through the model's final norm and LM head, applies the
model's logit transforms (bias, scale, soft-cap: kernels._to_logits), and reduces each block
of rows against the whole vocabulary ([block, V] at a time, never one Python call per row).
Rows of sites that never meet the LM head (inner, q_norm, k_norm) stay NULL, as for `logit`.
`delta` (what a block wrote into the residual stream) lives here too: it reads the next
residual site's input for each row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import QueryError
from ..lazy import lazy_module
from . import vocab_rank, vocab_scan
from .dots import row_dots
from .kernels import Arg, _final_normed, _head_groups, _per_value, _require_width, _to_logits
from .lists import ListResults, float_lists
from .threads import threads_for, torch_threads
from .timeout import check
from .vectors import VectorSource

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

_BLOCK = 512  # rows per [block, V] logit matrix


class LensRows:
    """Final-normed vectors of a batch of handles, one row per handle, with their model:
    `model_id[i]` is -1 where the row has no lens (an off-stream site)."""

    def __init__(self, src: VectorSource, h: np.ndarray, name: str) -> None:
        self.src, self.name = src, name
        self.model_id = np.full(len(h), -1, dtype=np.int64)
        self.hn: dict[int, torch.Tensor] = {}  # model_id -> [n, d], rows of other models 0
        for g in _head_groups(src, h, name):
            w, _ = src.weights.unembed(g.model)
            _require_width(name, g, w.shape[1], "the LM head's width")
            mid = g.model.model_id
            if mid not in self.hn:
                self.hn[mid] = torch.zeros((len(h), w.shape[1]), dtype=w.dtype, device=src.device)
            self.hn[mid][torch.from_numpy(g.index).to(src.device)] = _final_normed(src, g)
            self.model_id[g.index] = mid

    def by_model(self) -> Iterator[tuple[Any, np.ndarray, torch.Tensor]]:
        """(model record, row indices, final-normed rows [m, d]) per model in the batch."""
        for mid, hn in self.hn.items():
            rows = np.nonzero(self.model_id == mid)[0]
            yield self.src.model(mid), rows, hn[torch.from_numpy(rows).to(hn.device)]

    def logits(self, model: Any, hn: torch.Tensor, *, own_threads: bool = True
               ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """`logits_of` this batch's source."""
        return LensRows.logits_of(self.src, model, hn, own_threads=own_threads)

    @staticmethod
    def logits_of(src: VectorSource, model: Any, hn: torch.Tensor, *,
                  own_threads: bool = True) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, logits [hi - lo, V]) over blocks of rows, with the model's transforms.

        The product and the caller's reductions over each [block, V] (it runs while this is
        suspended at its yield) get the threads their size earns (`lens_threads`), as the
        top-k's product does: the UDF around them runs at one thread, which would leave the
        product on one core. A caller that
        walks two of these at once sets the threads itself around both (`own_threads=False`):
        two settings held open and closed in the same order would leave the wrong one behind."""
        w, b = src.weights.unembed(model)
        with lens_threads(w, hn) if own_threads else contextlib.nullcontext():
            for lo in range(0, hn.shape[0], _BLOCK):
                check()  # each block is a vocabulary-wide product: a query past its limit stops
                scores = hn[lo : lo + _BLOCK] @ w.T  # [block, V]
                if b is not None:
                    scores = scores + b
                yield lo, min(lo + _BLOCK, hn.shape[0]), _to_logits(model, scores)


def lens_threads(w: torch.Tensor, hn: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """torch's threads for the [block, V] products of rows `hn` with the LM head `w`, and the
    reductions over them: what `threads_for` gives one block's product."""
    return torch_threads(threads_for(2.0 * min(hn.shape[0], _BLOCK) * w.numel(), hn.device))


def _token_ids(src: VectorSource, model: Any, rows: np.ndarray, token: Arg, ttype: Arg
               ) -> torch.Tensor:
    """The token id of each row (a token argument may differ from row to row)."""
    ids = np.empty(len(rows), dtype=np.int64)
    for (t, ty), pos in _per_value([token, ttype], rows).items():
        ids[pos] = src.tokens.resolve_token(model, t, ty)
    return torch.from_numpy(ids).to(src.device)


def _token_logit(logits: torch.Tensor, tid: torch.Tensor) -> torch.Tensor:
    return logits.gather(1, tid.unsqueeze(1))[:, 0]  # [block]


def _fast_blocks(src: VectorSource, model: Any, hn: torch.Tensor
                 ) -> Iterator[tuple[int, int, torch.Tensor, vocab_scan.Packed | None]]:
    """(lo, hi, ok [hi - lo], packed head or None) over blocks of rows: rows `ok` go to the
    bfloat16 kernel (vocab_scan.py), the others (every row where it is not usable) to the
    float32 product."""
    head = None
    if vocab_scan.usable(hn.device, model):
        w, b = src.weights.unembed(model)
        head = vocab_scan.pack(w, b)
    for lo in range(0, hn.shape[0], _BLOCK):
        check()  # each block is a vocabulary-wide product: a query past its limit stops
        hi = min(lo + _BLOCK, hn.shape[0])
        ok = (vocab_scan.takes(hn[lo:hi], head) if head is not None
              else torch.zeros(hi - lo, dtype=torch.bool))
        yield lo, hi, ok, head


def _target_logits(src: VectorSource, model: Any, x: torch.Tensor, tid: torch.Tensor
                   ) -> torch.Tensor:
    """float64 [n]: each row's logit of its token, each product of float32 values exact."""
    w, b = src.weights.unembed(model)
    val = (x.double() * w[tid].double()).sum(-1)
    return val + b[tid].double() if b is not None else val


def logprob(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg, ttype: Arg) -> None:
    lens = LensRows(src, h, "logprob")
    for model, rows, hn in lens.by_model():
        tid = _token_ids(src, model, rows, token, ttype)
        slow = []
        for lo, _hi, ok, head in _fast_blocks(src, model, hn):
            at = torch.nonzero(ok).flatten() + lo
            if head is not None and len(at):
                sums = vocab_scan.lse(hn[at], head)
                mine = _target_logits(src, model, hn[at], tid[at]).numpy()
                out[rows[at.numpy()]] = mine - sums.lse
            slow.append(torch.nonzero(~ok).flatten() + lo)
        _logprob_f32(src, model, rows, hn, tid, torch.cat(slow), out)


def _logprob_f32(src: VectorSource, model: Any, rows: np.ndarray, hn: torch.Tensor,
                 tid: torch.Tensor, at: torch.Tensor, out: np.ndarray) -> None:
    """logprob of rows `at` from the float32 product."""
    if not len(at):
        return
    sub = rows[at.numpy()]
    for lo, hi, lg in LensRows.logits_of(src, model, hn[at]):
        lp = _token_logit(lg, tid[at][lo:hi]) - torch.logsumexp(lg, dim=-1)
        out[sub[lo:hi]] = lp.double().cpu().numpy()


def prob(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg, ttype: Arg) -> None:
    logprob(src, h, out, token, ttype)
    np.exp(out, out=out)


def token_rank(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg, ttype: Arg
               ) -> None:
    lens = LensRows(src, h, "token_rank")
    rank16 = vocab_rank.usable()  # the CPU's flags and the environment, read once a call
    for model, rows, hn in lens.by_model():
        tid = _token_ids(src, model, rows, token, ttype)
        w, b = src.weights.unembed(model)
        slow = []
        for lo, _hi, ok, head in _fast_blocks(src, model, hn):
            at = torch.nonzero(ok).flatten() + lo
            if head is not None and len(at) and rank16:
                got, done = vocab_rank.ranks(hn[at], w, b, tid[at], vocab_rank.pack(w))
                out[rows[at[done].numpy()]] = got.rank[done].double().numpy()
                at = at[~done]  # integer sums that might overflow: the bfloat16 kernel's
            if head is not None and len(at):
                got = vocab_scan.ranks(hn[at], w, b, tid[at], head)
                out[rows[at.numpy()]] = got.rank.double().numpy()
            slow.append(torch.nonzero(~ok).flatten() + lo)
        at = torch.cat(slow)
        if len(at):
            sub = rows[at.numpy()]
            for lo, hi, lg in LensRows.logits_of(src, model, hn[at]):
                mine = _token_logit(lg, tid[at][lo:hi]).unsqueeze(1)
                # 1 + the tokens with a strictly larger logit: ties share the better rank.
                out[sub[lo:hi]] = (1 + (lg > mine).sum(-1)).double().cpu().numpy()


def entropy(src: VectorSource, h: np.ndarray, out: np.ndarray) -> None:
    lens = LensRows(src, h, "entropy")
    for model, rows, hn in lens.by_model():
        slow = []
        for lo, _hi, ok, head in _fast_blocks(src, model, hn):
            at = torch.nonzero(ok).flatten() + lo
            if head is not None and len(at):
                sums = vocab_scan.lse(hn[at], head, moments=True)
                assert sums.mean is not None
                out[rows[at.numpy()]] = sums.lse - sums.mean
            slow.append(torch.nonzero(~ok).flatten() + lo)
        at = torch.cat(slow)
        if len(at):
            sub = rows[at.numpy()]
            for lo, hi, lg in LensRows.logits_of(src, model, hn[at]):
                lp = torch.log_softmax(lg, dim=-1)
                out[sub[lo:hi]] = (-(lp.exp() * lp).sum(-1)).double().cpu().numpy()


def kl_to(src: VectorSource, h1: np.ndarray, h2: np.ndarray, out: np.ndarray) -> None:
    """KL(p_target || p_v) with v = h1 and target = h2, row by row, in nats."""
    v, target = LensRows(src, h1, "kl_to"), LensRows(src, h2, "kl_to")
    both = (v.model_id >= 0) & (target.model_id >= 0)
    if np.any(both & (v.model_id != target.model_id)):
        i = int(np.nonzero(both & (v.model_id != target.model_id))[0][0])
        a, b = src.model(v.model_id[i]).model, src.model(target.model_id[i]).model
        raise QueryError(f"kl_to compares the lens of one model; got models {a!r} and {b!r} "
                         "in one row")
    for mid, hv_all in v.hn.items():
        model = src.model(mid)
        rows = np.nonzero((v.model_id == mid) & both)[0]
        if not len(rows):  # every target off the residual stream: NULL
            continue
        at = torch.from_numpy(rows).to(src.device)
        hv, ht = hv_all[at], target.hn[mid][at]
        pairs = torch.stack([hv, ht], 1).reshape(2 * len(rows), -1)  # v0, t0, v1, t1, ...
        slow = []
        for lo, _hi, ok, head in _fast_blocks(src, model, pairs):
            ok = ok.reshape(-1, 2).all(-1)  # [pairs]: both rows taken
            sel = torch.nonzero(ok).flatten() + lo // 2
            if head is not None and len(sel):
                both_rows = torch.stack([2 * sel, 2 * sel + 1], 1).flatten()
                sums = vocab_scan.lse(pairs[both_rows], head, pairs=True)
                assert sums.cross is not None
                kl = sums.cross[1::2] - sums.lse[1::2] + sums.lse[0::2]
                out[rows[sel.numpy()]] = np.maximum(kl, 0.0)
            slow.append(torch.nonzero(~ok).flatten() + lo // 2)
        _kl_f32(src, model, rows, hv, ht, torch.cat(slow), out)


def _kl_f32(src: VectorSource, model: Any, rows: np.ndarray, hv: torch.Tensor,
            ht: torch.Tensor, at: torch.Tensor, out: np.ndarray) -> None:
    """kl_to of pairs `at` from the float32 product."""
    if not len(at):
        return
    sub, hv, ht = rows[at.numpy()], hv[at], ht[at]
    w, _ = src.weights.unembed(model)
    with lens_threads(w, hv):
        for (lo, hi, lv), (_, _, lt) in zip(LensRows.logits_of(src, model, hv, own_threads=False),
                                            LensRows.logits_of(src, model, ht, own_threads=False),
                                            strict=True):
            lpv, lpt = torch.log_softmax(lv, dim=-1), torch.log_softmax(lt, dim=-1)
            kl = (lpt.exp() * (lpt - lpv)).sum(-1).clamp_min(0.0)
            out[sub[lo:hi]] = kl.double().cpu().numpy()


def logit_diff(src: VectorSource, h: np.ndarray, out: np.ndarray, t1: Arg, ty1: Arg, t2: Arg,
               ty2: Arg) -> None:
    lens = LensRows(src, h, "logit_diff")
    for model, rows, hn in lens.by_model():
        w, b = src.weights.unembed(model)
        a, c = _token_ids(src, model, rows, t1, ty1), _token_ids(src, model, rows, t2, ty2)
        pre = torch.stack([row_dots(hn, w[a]), row_dots(hn, w[c])])  # [2, m]
        if b is not None:
            pre = pre + torch.stack([b[a], b[c]])
        lg = _to_logits(model, pre)
        out[rows] = (lg[0] - lg[1]).double().cpu().numpy()


# -- what a block wrote ---------------------------------------------------------------------

# The roles whose input is the residual stream itself (pre-norm blocks and the final norm):
# consecutive ones in forward order bracket one sublayer's write (a decoder block's
# cross-attention between its self-attention and its MLP).
RESIDUAL_ROLES = ("pre_attn", "pre_cross", "pre_mlp", "final")


def next_residual_site(src: VectorSource, model: Any, site: Any) -> Any:
    """The residual site after `site` in forward order within its tower, or None (not
    residual, or the last)."""
    if site.role not in RESIDUAL_ROLES[:3]:
        return None
    chain = sorted((s for (mid, _), s in src.sites.items()
                    if mid == model.model_id and s.role in RESIDUAL_ROLES
                    and s.tower == site.tower and s.d == site.d and s.n_heads is None
                    and s.grid == site.grid),
                   key=lambda s: (s.layer if s.layer is not None else 1 << 30, s.site_id))
    at = next(i for i, s in enumerate(chain) if s.site_id == site.site_id)
    return chain[at + 1] if at + 1 < len(chain) else None


def delta(src: VectorSource, h: np.ndarray, out: ListResults) -> None:
    """x at the next residual site minus x here, same token; NULL where there is none."""
    for g in src.groups(h):
        if g.view != "raw":
            raise QueryError("delta takes a raw vec (a residual site's input), not a view")
        nxt = next_residual_site(src, g.model, g.site)
        if nxt is None:
            continue
        here = g.direction.float() * g.norm.unsqueeze(-1)  # [n, d]
        there = (torch.from_numpy(src.reader.field(g.model, nxt, "direction", g.rows, g.heads))
                 .to(src.device).float()
                 * torch.from_numpy(src.reader.field(g.model, nxt, "norm", g.rows, g.heads))
                 .to(src.device).unsqueeze(-1))
        out.put(g.index, float_lists((there - here).cpu().numpy()))
