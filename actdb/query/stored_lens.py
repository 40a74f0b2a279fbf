"""The lens functions answered from the materialized lens, where the store holds one.

A model ingested with `lens=K` stores, per row of each lens site, the top K tokens and logits
of its logit lens (logit descending, ties lower id first), the log-sum-exp and entropy over the
vocabulary, and the logit and rank of the model's own prediction (store/lens_layout.py). Those
rows (raw `vec` handles of a lens site) are answered here by a lookup:

- `top_logits(v, k)` with k <= K: the stored top k;
- `entropy(v)`: the stored entropy;
- `logprob(v, t)`, `prob(v, t)`: where t is among the stored top K or is the prediction,
  its stored logit minus the stored log-sum-exp;
- `token_rank(v, t)`: the prediction's stored rank, or, for t in the top K, 1 + the stored
  top logits strictly larger than its own (every larger logit is among them).

Every other row (another token, k > K, a view, a model without the lens) is computed by the
vocabulary-wide kernel as before. The stored values were computed at ingest from the same
stored fields with the same formulas, in float32, so they agree with the computed ones within
float32 rounding of the product; where two logits lie within that rounding, their order (and
so a rank or a top-k order) may differ between the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..lazy import lazy_module
from ..store.lens_layout import ENTROPY, LSE, PRED_RANK, is_lens_site
from . import kernels, lens
from .kernels import Arg, _check_k, _per_value
from .lists import ListResults, struct_lists
from .vectors import VectorSource
from .weight_rows import ROLE as WEIGHT_ROLE

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read


@dataclass(frozen=True, kw_only=True)
class Stored:
    """The stored lens of some rows of a batch: `index`, their positions in it."""

    model: Any
    index: np.ndarray
    k: int
    ids: np.ndarray  # int64 [n, K + 1]: the top K, then the prediction
    logits: np.ndarray  # float64 [n, K + 1]
    stats: np.ndarray  # float64 [n, 3]: lse, entropy, prediction's rank

    def at(self, token: Arg, ttype: Arg, src: VectorSource
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each row's token (the batch's argument columns): whether it is stored (in the
        top K, or the prediction), and then its logit and its rank."""
        tid = lens._token_ids(src, self.model, self.index, token, ttype).cpu().numpy()
        top = self.ids[:, : self.k] == tid[:, None]  # [n, K]
        in_top = top.any(-1)
        j = top.argmax(-1)
        rows = np.arange(len(tid))
        logit = np.where(in_top, self.logits[rows, j], self.logits[:, self.k])
        rank = np.where(in_top, 1 + (self.logits[:, : self.k] > logit[:, None]).sum(-1),
                        self.stats[:, PRED_RANK])
        return in_top | (self.ids[:, self.k] == tid), logit, rank


def stored(src: VectorSource, h: np.ndarray) -> tuple[list[Stored], np.ndarray]:
    """The rows of the batch `h` whose lens is stored, by model and site, and the positions
    of the others (rows no group holds, final_norm views of off-stream sites, are NULL)."""
    found, rest = [], []
    if not any(m.lens_k for m in src.models.values()):  # a store without the lens: all computed
        return [], np.arange(len(h))
    for g in src.groups(h):
        # a weight row (neurons, circuits) has no stored lens: computed
        if g.view != "raw" or g.site.role == WEIGHT_ROLE or not is_lens_site(g.model, g.site):
            rest.append(g.index)
            continue

        def read(name: str, g: Any = g) -> np.ndarray:
            return src.reader.field(g.model, g.site, name, g.rows, g.heads)

        found.append(Stored(model=g.model, index=g.index, k=int(g.model.lens_k or 0),
                            ids=read("lens_ids").astype(np.int64),
                            logits=read("lens_logits").astype(np.float64),
                            stats=read("lens_stats").astype(np.float64)))
    return found, np.sort(np.concatenate(rest)) if rest else np.zeros(0, dtype=np.int64)


class _Placed:
    """A kernel's results for a subset of a batch's rows, put at their places in `out`."""

    def __init__(self, out: ListResults, at: np.ndarray) -> None:
        self.out, self.at = out, at

    def __len__(self) -> int:
        return len(self.at)

    def __setitem__(self, i: int, value: Any) -> None:
        self.out[int(self.at[i])] = value

    def put(self, index: np.ndarray, values: pa.Array) -> None:
        self.out.put(self.at[np.asarray(index, dtype=np.int64)], values)


def _compute(kernel: Callable[..., None], src: VectorSource, h: np.ndarray, at: np.ndarray,
             out: Any, *args: Arg) -> None:
    """`kernel` over the rows `at` of the batch only (positions, sorted)."""
    if not len(at):
        return
    if len(at) == len(h):  # every row (at is sorted and distinct): no copies
        kernel(src, h, out, *args)
        return
    sub_args = [Arg(a.values, a.codes[at]) for a in args]
    if isinstance(out, np.ndarray):
        sub = np.full(len(at), np.nan)
        kernel(src, h[at], sub, *sub_args)
        out[at] = sub
    else:
        kernel(src, h[at], _Placed(out, at), *sub_args)


def entropy(src: VectorSource, h: np.ndarray, out: np.ndarray) -> None:
    found, rest = stored(src, h)
    for s in found:
        out[s.index] = s.stats[:, ENTROPY]
    _compute(lens.entropy, src, h, rest, out)


def logprob(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg, ttype: Arg) -> None:
    found, rest = stored(src, h)
    left = [rest]
    for s in found:
        ok, logit, _ = s.at(token, ttype, src)
        out[s.index[ok]] = logit[ok] - s.stats[ok, LSE]
        left.append(s.index[~ok])
    _compute(lens.logprob, src, h, np.sort(np.concatenate(left)), out, token, ttype)


def prob(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg, ttype: Arg) -> None:
    logprob(src, h, out, token, ttype)
    np.exp(out, out=out)


def token_rank(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg, ttype: Arg
               ) -> None:
    found, rest = stored(src, h)
    left = [rest]
    for s in found:
        ok, _, rank = s.at(token, ttype, src)
        out[s.index[ok]] = rank[ok]
        left.append(s.index[~ok])
    _compute(lens.token_rank, src, h, np.sort(np.concatenate(left)), out, token, ttype)


def top_logits(src: VectorSource, h: np.ndarray, out: ListResults, k: Arg) -> None:
    found, rest = stored(src, h)
    left = [rest]
    for s in found:
        tokens = src.tokens.token_column(s.model)
        for (kv,), pos in _per_value([k], s.index).items():
            kk = _check_k("top_logits", kv, s.model.vocab_size or kv)
            if kk > s.k:  # more than are stored: computed
                left.append(s.index[pos])
                continue
            flat = s.ids[pos, :kk].reshape(-1)
            out.put(s.index[pos], struct_lists(kk, {
                "token_id": pa.array(flat),
                "token": tokens.take(pa.array(flat, mask=flat >= len(tokens))),
                "logit": pa.array(s.logits[pos, :kk].reshape(-1)),
            }))
    _compute(kernels.top_logits, src, h, np.sort(np.concatenate(left)), out, k)


__all__ = ["Stored", "entropy", "logprob", "prob", "stored", "token_rank", "top_logits"]
