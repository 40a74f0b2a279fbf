"""Top-k over a whole vocabulary at matrix speed, equal to the float32 answer.

`top_logits` and `nearest_anchors` score every row against every vocabulary row: a matrix
product [n, d] x [d, V]. Where the device multiplies bfloat16 much faster than float32 (CUDA
tensor cores; CPUs with AVX-512 BF16 or AMX), candidates come from a bfloat16 product and are
rescored exactly in float32. The result is the float32 top-k, proven row by row.

The bound. Write s_t = x . w_t (exact), S = ||x|| * max_t ||w_t||, u = 2^-8 (bfloat16's unit
roundoff) and g = d * 2^-23 / (1 - d * 2^-23) (a float32 sum of d terms in any order, FMA or
not, is off by at most g times the sum of their magnitudes; 2^-23, not 2^-24, because GPU
tensor cores may truncate while they accumulate). The product rounds x and w to
bfloat16 (each element off by at most u of itself), multiplies them exactly (8-bit
significands), sums in float32 and rounds the sum p_t to bfloat16: a_t. So

    |p_t - s_t| <= (2u + u^2 + g (1 + u)^2) * S                                      (1)

(Cauchy-Schwarz: sum_i |x_i w_ti| <= ||x|| ||w_t||). Take the m best tokens by a; theta is
the m-th best a. A token t left out has a_t <= theta, and rounding is monotone, so p_t is at
most theta plus half the gap to the next bfloat16 above theta, at most u |theta|. With a bias
b (top_logits), a_t + b_t is summed in float32 (then |p_t| <= (1 + 3u) S bounds the
rounding instead, and the sum is off by at most 2^-24 |theta|). The candidates' float32
rescores r_c are off by at most g S (+ 2^-23 |r_c| with a bias). So with tau the k-th best
rescore, every token left out scores below k candidates, and the candidates hold the float32
top k, when

    theta + u |theta| + (2u + u^2 + g (2 + 2u + u^2)) S + tiny < tau           (no bias)
    theta + 2^-24 |theta| + 2^-23 |tau| + (3u + 4u^2 + 3g) S + tiny < tau      (bias)

`tiny` = 2^-126 (4d + 2 + sqrt(d) (1 + u) (||x|| + max ||w_t||)) covers subnormal inputs,
products and sums flushed to zero (oneDNN's bfloat16 kernel reads subnormal inputs as zero);
the norms are computed in float64 (in float32 the norm of a tiny row underflows to 0), S is
taken 1 + u larger for their rounding, and the test runs in float64. The bound needs g well
below u: rows of width 2^15 or more rank in float32. Rows that fail it are tried
again with 8 times as many candidates from the same product, then computed in float32 over
the whole vocabulary. Elsewhere (this CPU without BF16 instructions, or
ACTDB_LOWP_MATMUL=fp32) the float32 product is the only path, and it too only proposes: every
token it scores within twice the bound on its difference from a rescore of its k-th best is
rescored (`_reach`), so both paths give the k best rescores, ties lower id first, also where
the k-th place falls among tied tokens. ACTDB_LOWP_MATMUL=bf16 forces the candidate path
(tests, benchmarks).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..lazy import lazy_module
from .dots import row_dots
from .threads import threads_for, torch_threads

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

ENV = "ACTDB_LOWP_MATMUL"
_U = 2.0**-8  # bfloat16 unit roundoff
# float32 values of candidate rows gathered at once to rescore them ([rows, m, d]: 27 MiB)
_RESCORE_FLOATS = 64 * 138 * 768
# (id(w), what) -> (w itself, weakly; w's version when made; a value made from w): values kept
# while w lives and is not changed in place (weights are cached). Tensors compare by value, so
# they cannot be the keys of a WeakKeyDictionary.
_PER_WEIGHT: dict[tuple[int, object], tuple[weakref.ref[torch.Tensor], int, Any]] = {}
# The bound needs d * 2^-23 well below u (the module docstring): wider rows rank in float32.
MAX_LOWP_WIDTH = 1 << 15


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


def margin(d: int, theta: torch.Tensor, tau: torch.Tensor, scale: torch.Tensor,
           norms: torch.Tensor, *, bias: bool) -> torch.Tensor:
    """float64 [n]: how far above `theta` (the m-th best bfloat16 score of each row) a token
    left out can score at most, from `tau` (the k-th best float32 rescore), `scale`
    (||x|| * max ||w_t||) and `norms` (||x|| + max ||w_t||), both computed in float64: the
    bound in the module's docstring."""
    if d >= MAX_LOWP_WIDTH:
        raise ValueError(f"no bfloat16 bound for rows of width {d} (at most {MAX_LOWP_WIDTH})")
    g = d * 2.0**-23 / (1 - d * 2.0**-23)
    s = scale.double() * (1 + _U)
    tiny = 2.0**-126 * (4 * d + 2 + d**0.5 * (1 + _U) * norms.double())
    theta, tau = theta.double(), tau.double()
    if bias:
        return (2.0**-24 * theta.abs() + 2.0**-23 * tau.abs()
                + (3 * _U + 4 * _U**2 + 3 * g) * s + tiny)
    return _U * theta.abs() + (2 * _U + _U**2 + g * (2 + 2 * _U + _U**2)) * s + tiny


def _per_weight(w: torch.Tensor, what: object, make: Callable[[], Any]) -> Any:
    """`make()`, kept for `w` and `what` while w lives and is not changed in place."""
    hit = _PER_WEIGHT.get((id(w), what))
    if hit is None or hit[0]() is not w or hit[1] != w._version:
        for key in [key for key, (ref, _, _) in _PER_WEIGHT.items() if ref() is None]:
            del _PER_WEIGHT[key]
        hit = _PER_WEIGHT[(id(w), what)] = (weakref.ref(w), w._version, make())
    return hit[2]


def _lowp_weight(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """w in `dtype` and the largest row norm of w (`_row_norm_max`), kept with w."""
    return _per_weight(w, dtype, lambda: w.to(dtype)), _row_norm_max(w)


def topk(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int, *,
         lowp: torch.dtype | None, transform: Callable[[torch.Tensor], torch.Tensor] | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, k], ids [n, k]): the k largest of transform(x @ w.T + b) per row.

    `transform` must be non-decreasing (the model's logit scale and soft-cap are): ranks are
    taken before it, values after. `lowp`: the candidate dtype, or None for float32 alone.
    """
    n, V = x.shape[0], w.shape[0]
    m = min(V, max(2 * k, k + 32))
    if x.shape[1] >= MAX_LOWP_WIDTH:
        lowp = None
    # The whole product's pool: its candidates, rescoring and checks are vocabulary-wide too.
    with torch_threads(threads_for(2.0 * n * w.numel(), x.device)):
        if lowp is None or m >= V or n == 0:
            vals, ids = _exact(x, w, b, k)
        else:
            vals, ids = _candidates(x, w, b, k, m, lowp)
    return (transform(vals) if transform is not None else vals), ids


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 top k by `rescored`'s values, ties lower id first. The product only
    proposes: its rounding differs from the rescores' (and between equal rows at different
    places in it), so every token it scores within twice the gap the two can have of its
    k-th best (`_reach`) is rescored, and the k best of those are kept. The product's m best
    hold them all in nearly every row; a row whose m-th best is still within reach (ties
    across the vocabulary, NaN) is finished alone (`_row_exact`)."""
    n, V = x.shape[0], w.shape[0]
    if n == 0 or k == 0:
        return (torch.empty((n, k), dtype=x.dtype, device=x.device),
                torch.empty((n, k), dtype=torch.long, device=x.device))
    scores = x @ w.T  # [n, V]
    if b is not None:
        scores += b
    m = min(V, max(2 * k, k + 32))
    top, cand = torch.topk(scores, m, dim=-1)  # [n, m], descending
    floor = _reach(x, w, b, top[:, k - 1]).unsqueeze(-1)
    reach = ~(top < floor)  # NaN ranks first in torch.topk: counted in reach
    c = max(k, int(reach.sum(-1).max()))
    vals = torch.empty((n, k), dtype=x.dtype, device=x.device)
    ids = torch.empty((n, k), dtype=torch.long, device=x.device)
    step = max(1, _RESCORE_FLOATS // (c * x.shape[1]))  # gathered rows [step, c, d] at most
    for lo in range(0, n, step):
        v, i = rescored(x[lo : lo + step], w, b, cand[lo : lo + step, :c])
        vals[lo : lo + step], ids[lo : lo + step] = v[:, :k], i[:, :k]
    if m < V:
        for i in torch.nonzero(reach[:, -1]).flatten().tolist():
            vals[i], ids[i] = _row_exact(x[i], w, b, k, scores[i], floor[i])
    return vals, ids


def _row_exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int,
               scores: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_exact` for one row `x` [d] whose tokens within reach are more than the product's m
    best: a zero row (every score ties: its rescores are exactly the biases, when w is
    finite), or every token within reach rescored, a block of the vocabulary at a time."""
    if not bool(x.any()) and math.isfinite(_row_norm_max(w)):
        within = torch.arange(w.shape[0], device=x.device)
        # + 0.0: a bias of -0.0 rescores as 0 + -0.0 = +0.0
        vals = b.float() + 0.0 if b is not None else torch.zeros(len(within), dtype=x.dtype,
                                                                 device=x.device)
    else:
        within = torch.nonzero(~(scores < floor)).flatten()  # ascending ids
        vals = torch.empty(len(within), dtype=x.dtype, device=x.device)
        step = max(1, _RESCORE_FLOATS // max(1, x.shape[0]))
        for lo in range(0, len(within), step):
            part = within[lo : lo + step]
            vals[lo : lo + step] = row_dots(w[part], x, overwrite=True)
        if b is not None:
            vals += b[within]
    top, at = torch.sort(vals, descending=True, stable=True)
    return top[:k], within[at[:k]]


def _reach(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kth: torch.Tensor
           ) -> torch.Tensor:
    """float32 [n]: a score below which no token of the float32 top k can fall in the product.

    The product's score p_t and the rescore r_t (dots.row_dots) of a token are each a float32
    sum of d terms, off from the exact dot product by at most g S, g = d 2^-23 / (1 - d 2^-23)
    and S = ||x|| max ||w_t|| (module docstring); a float32 product that rounds its inputs
    by v each (`_input_rounding`: TF32 or bfloat16 where torch's settings allow it) adds
    (2v + v^2) S. So |p_t - r_t| <= e, and with a bias each sum adds 2^-24 of its magnitude
    (sums that overflow, |x| |w_t| near float32's largest, are not covered). The k tokens with
    p >= kth have r >= kth - e, so the k-th best rescore is at least that, and any token of
    the true top k has p >= kth - 2e. The floor is taken lower still by the subnormal term of
    `margin`, and rounded down to float32."""
    d = x.shape[1]
    g = d * 2.0**-23 / (1 - d * 2.0**-23)
    v = _input_rounding(x.device)
    x_norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)
    w_max = _row_norm_max(w)
    s = x_norm * w_max * (1 + 2.0**-20)
    e = (2 * v + v * v + 3 * g) * s + 2.0**-126 * (4 * d + 2 + d**0.5 * (x_norm + w_max))
    top = kth.double()
    if b is not None:
        e = e + 2.0**-22 * (top.abs() + 2 * e)
    floor = top - 2 * e
    low = floor.float()
    below = torch.nextafter(low, torch.full_like(low, -torch.inf))
    return torch.where(low.double() > floor, below, low)


def _input_rounding(device: torch.device) -> float:
    """How far a float32 product on `device` may round each input: 0 (IEEE float32), 2^-10
    (TF32) or 2^-8 (bfloat16), as torch's settings allow: the backend's `fp32_precision`
    (then torch's own) where set, else the legacy `float32_matmul_precision` and `allow_tf32`
    (torch refuses to read those once the new settings are used). Whatever cannot be read
    counts as the coarsest."""
    try:
        backend = (torch.backends.cuda.matmul if device.type == "cuda"
                   else getattr(getattr(torch.backends, "mkldnn", None), "matmul", None))
        fp32 = str(getattr(backend, "fp32_precision", "none"))
        if fp32 == "none":
            fp32 = str(getattr(torch.backends, "fp32_precision", "none"))
        rounding = {"ieee": 0.0, "tf32": 2.0**-10, "bf16": 2.0**-8}.get(fp32)
        if rounding is not None:
            return rounding
        precision = torch.get_float32_matmul_precision()
        legacy_tf32 = device.type == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        return 2.0**-8
    if precision == "medium":
        return 2.0**-8
    if precision == "high" or legacy_tf32:
        return 2.0**-10
    return 0.0


def _row_norm_max(w: torch.Tensor) -> float:
    """The largest row norm of w (in float64: a float32 norm of tiny rows underflows to 0),
    kept with w."""
    def make() -> float:
        norms = torch.linalg.vector_norm(w, dim=-1, dtype=torch.float64)
        return float(norms.max()) if len(norms) else 0.0

    return float(_per_weight(w, "norm", make))


def rescored(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ids: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [n, k], best first: tokens `ids` scored by `row_dots` (dots.py), so a
    value equals `logit(vec, token)` bit for bit whatever rows the product held (a BLAS
    product's rounding changes with its number of rows)."""
    ids = torch.sort(ids, dim=-1).values  # ties keep the lower id first, as in _best_of
    vals = row_dots(w[ids], x.unsqueeze(1), overwrite=True)  # [n, k]
    if b is not None:
        vals += b[ids]
    vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)
    return vals, torch.gather(ids, 1, order)


def _candidates(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int, m: int,
                lowp: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    wl, w_max = _lowp_weight(w, lowp)
    with _full_precision_sums():
        approx = x.to(lowp) @ wl.T  # [n, V], in `lowp`: its values are the a_t of the proof
    if b is not None:
        approx = approx.float() + b
    x_norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)
    scale, norms = x_norm * w_max, x_norm + w_max
    vals, ids, unsure = _best_of(approx, x, w, b, k, m, scale, norms)
    if bool(unsure.any()):  # more candidates from the same product
        redo = torch.nonzero(unsure).squeeze(-1)
        m2 = min(w.shape[0], 8 * m)
        v2, i2, still = _best_of(approx[redo], x[redo], w, b, k, m2, scale[redo], norms[redo])
        vals[redo], ids[redo] = v2, i2
        if m2 < w.shape[0] and bool(still.any()):  # then the whole vocabulary in float32
            last = redo[still]
            vals[last], ids[last] = _exact(x[last], w, b, k)
    return vals, ids


def _best_of(approx: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             k: int, m: int, scale: torch.Tensor, norms: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top k of each row's m best candidates by `approx`, rescored in float32, and the
    rows where the bound does not prove them the float32 top k (module docstring)."""
    top_approx, cand = torch.topk(approx, m, dim=-1)  # [n, m], descending
    # Ascending ids, then a stable sort of the rescores below: equal float32 scores keep the
    # lower id first, on every device (torch.topk leaves the order of ties unspecified).
    cand = torch.sort(cand, dim=-1).values
    exact = torch.empty(cand.shape, dtype=x.dtype, device=x.device)
    step = max(1, _RESCORE_FLOATS // (m * x.shape[1]))
    for lo in range(0, x.shape[0], step):
        hi = lo + step
        rows = w[cand[lo:hi]]  # [r, m, d], a gathered copy
        exact[lo:hi] = row_dots(rows, x[lo:hi].unsqueeze(1), overwrite=True)
    if b is not None:
        exact += b[cand]
    vals, at = torch.sort(exact, dim=-1, descending=True, stable=True)
    vals, at = vals[:, :k], at[:, :k]  # [n, k]
    ids = torch.gather(cand, 1, at)
    theta, tau = top_approx[:, -1], vals[:, -1]
    safe = theta.double() + margin(x.shape[1], theta, tau, scale, norms, bias=b is not None)
    return vals, ids, ~(safe < tau.double())


class _full_precision_sums:  # noqa: N801 - used as a context manager, like torch's own
    """On CUDA, keep cuBLAS from reducing bfloat16 products in bfloat16 (the bound assumes
    float32 sums). The setting is process-wide: the first thread in turns it off and the
    last one out restores it, so one thread's exit never turns it back on under another's
    product."""

    _lock = threading.Lock()
    _inside = 0
    _before = False

    def __enter__(self) -> None:
        cls = type(self)
        with cls._lock:
            if cls._inside == 0:
                cls._before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            cls._inside += 1

    def __exit__(self, *exc: object) -> None:
        cls = type(self)
        with cls._lock:
            cls._inside -= 1
            if cls._inside == 0:
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = cls._before
