"""Top-k over a whole vocabulary at matrix speed, equal to the float32 answer.

`top_logits` and `nearest_anchors` score every row against every vocabulary row: a matrix
product [n, d] x [d, V]. Where the device multiplies bfloat16 much faster than float32 (CUDA
tensor cores; CPUs with AVX-512 BF16 or AMX), candidates come from a bfloat16 product and are
rescored exactly in float32. The result is the float32 top-k, proven row by row:

    Inputs rounded to bfloat16 (unit roundoff u = 2^-8), products accumulated in float32 and
    the sum rounded to bfloat16 give |approx_t - s_t| <= E = c * ||x|| * max_t ||w_t|| with
    c = 2 * (3u + d * 2^-23) (Cauchy-Schwarz bounds sum_i |x_i w_ti|; the factor 2 covers
    libraries that sum in blocks). Take the m best tokens by approx; theta is the m-th approx
    score and tau the k-th exact score among them. Any token left out scores at most
    theta + E exactly, so if theta + E < tau the candidates hold the true top k.

Rows where the margin does not separate are computed again in float32 over the whole
vocabulary. Elsewhere (this CPU without BF16 instructions, or ACTDB_LOWP_MATMUL=fp32) the
float32 product is the only path. ACTDB_LOWP_MATMUL=bf16 forces the candidate path (tests,
benchmarks).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..lazy import lazy_module
from .threads import threads_for, torch_threads

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

ENV = "ACTDB_LOWP_MATMUL"
_U = 2.0**-8  # bfloat16 unit roundoff
_RESCORE_ROWS = 64  # rows rescored at once: [rows, m, d] gathered float32 candidates
# id(w) -> (w itself, weakly; w in low precision; max row norm of w). Tensors compare by
# value, so they cannot be the keys of a WeakKeyDictionary.
_LOWP: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, float]] = {}


@functools.cache
def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def lowp_dtype(device: torch.device) -> torch.dtype | None:
    """bfloat16 where this device multiplies it fast (or ACTDB_LOWP_MATMUL=bf16), else None."""
    choice = os.environ.get(ENV, "auto").lower()
    if choice in ("fp32", "float32", "off"):
        return None
    if choice in ("bf16", "bfloat16"):
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and _cpu_has_bf16() else None


def margin_factor(d: int) -> float:
    """c in the bound E = c * ||x|| * max||w|| on a bfloat16 score's error (module doc)."""
    return 2.0 * (3 * _U + d * 2.0**-23)


def _lowp_weight(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """w in `dtype` and the largest row norm of w, kept while w lives (weights are cached)."""
    hit = _LOWP.get(id(w))
    if hit is None or hit[0]() is not w or hit[1].dtype != dtype:
        for key in [key for key, (ref, _, _) in _LOWP.items() if ref() is None]:
            del _LOWP[key]
        hit = (weakref.ref(w), w.to(dtype), float(torch.linalg.vector_norm(w, dim=-1).max()))
        _LOWP[id(w)] = hit
    return hit[1], hit[2]


def topk(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int, *,
         lowp: torch.dtype | None, transform: Callable[[torch.Tensor], torch.Tensor] | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, k], ids [n, k]): the k largest of transform(x @ w.T + b) per row.

    `transform` must be non-decreasing (the model's logit scale and soft-cap are): ranks are
    taken before it, values after. `lowp`: the candidate dtype, or None for float32 alone.
    """
    n, V = x.shape[0], w.shape[0]
    m = min(V, max(4 * k, k + 128))
    if lowp is None or m >= V or n == 0:
        vals, ids = _exact(x, w, b, k)
    else:
        vals, ids = _candidates(x, w, b, k, m, lowp)
    return (transform(vals) if transform is not None else vals), ids


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    with torch_threads(threads_for(2.0 * x.shape[0] * w.numel())):
        scores = x @ w.T  # [n, V]
    if b is not None:
        scores += b
    return torch.topk(scores, k, dim=-1)


def _candidates(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int, m: int,
                lowp: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    wl, w_max = _lowp_weight(w, lowp)
    with torch_threads(threads_for(2.0 * x.shape[0] * w.numel())), _full_precision_sums():
        approx = (x.to(lowp) @ wl.T).float()  # [n, V]
    if b is not None:
        approx += b
    top_approx, cand = torch.topk(approx, m, dim=-1)  # [n, m], descending
    del approx
    exact = torch.empty_like(top_approx)
    for lo in range(0, x.shape[0], _RESCORE_ROWS):
        hi = lo + _RESCORE_ROWS
        rows = w[cand[lo:hi]]  # [r, m, d]
        exact[lo:hi] = torch.bmm(rows, x[lo:hi].unsqueeze(-1)).squeeze(-1)
    if b is not None:
        exact += b[cand]
    vals, at = torch.topk(exact, k, dim=-1)  # [n, k]
    ids = torch.gather(cand, 1, at)
    theta = top_approx[:, -1]  # the best score of any token left out, before its error
    bound = margin_factor(x.shape[1]) * torch.linalg.vector_norm(x, dim=-1) * w_max
    bound = bound + 2.0**-22 * theta.abs()  # the float32 bias addition
    unsure = ~(theta + bound < vals[:, -1])
    if bool(unsure.any()):
        redo = torch.nonzero(unsure).squeeze(-1)
        vals[redo], ids[redo] = _exact(x[redo], w, b, k)
    return vals, ids


class _full_precision_sums:  # noqa: N801 - used as a context manager, like torch's own
    """On CUDA, keep cuBLAS from reducing bfloat16 products in bfloat16 (the bound assumes
    float32 sums)."""

    def __enter__(self) -> None:
        self.before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    def __exit__(self, *exc: object) -> None:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = self.before
