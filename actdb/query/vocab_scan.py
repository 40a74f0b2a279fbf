"""The lens's vocabulary-wide functions at bfloat16 speed, with their error proven.

`token_rank`, `logprob`, `prob`, `entropy` and `kl_to` read each row against every row of the
LM head. Where the CPU has AVX-512 BF16, the product runs in bfloat16 in the compiled kernel
`_native.vocab_scan` (actdb/_native_vocab.c), which reduces each tile of it in registers
(counts against a threshold band, sums of exp()) instead of writing a [rows, V] matrix out.
Elsewhere (a GPU, a CPU without BF16 instructions, a model whose logits are scaled or
soft-capped, ACTDB_LOWP_MATMUL=fp32) lens.py's float32 product is the only path.

The product. Each float32 value y (of the row x, or of W_U's rows w_t) is split into two
bfloat16 values, y_hi = bf16(y) and y_lo = bf16(y - y_hi) (to nearest, so |y - y_hi - y_lo|
<= u^2 |y|, u = 2^-8). The kernel sums, in this order, the 2d terms x_lo,i w_hi,i and
x_hi,i w_lo,i, then the d terms x_hi,i w_hi,i, then (with an LM-head bias) b_hi, b_lo, b_lo2
against 1: K terms, each exact in float32, in one float32 accumulator. The terms left out
(x_lo w_lo and the residuals) are at most (3u^2 + 5u^3) A_t, A_t = sum_i |x_i w_ti| + |b_t|.
Each addition rounds (or truncates) by at most 2^-23 of the partial sum, which is at most
(1 + g_K) times the magnitudes summed so far (g_n = n 2^-23 / (1 - n 2^-23)); the 2d small
terms come first, so the sum is off by at most

    s A_t,  s = 2^-23 (1 + g_K) (2d L + (K - 2d) (L + H)),  L = 2u (1 + u)^2,  H = (1 + u)^3.

With X = ||(x, 1)|| and N_t = ||(w_t, b_t)|| (the 1 and b_t only with a bias), A_t <= X N_t
(Cauchy-Schwarz), so each approximate logit a_t is within

    E_t = k X N_t + tiny,    k = 3u^2 + 5u^3 + s                                          (1)

of the exact x . w_t + b_t; tiny = 2^-126 (2K + 2 + 2 sqrt(K) (1 + u) (X + max N)) covers the
subnormal inputs, products and sums the instruction flushes to zero (topk.py's argument).
For d = 768, k = 1.4e-4.

token_rank counts the tokens whose logit is larger than the target's, the logits compared in
float64 (each product of the stored float32 values exact, the sum in a fixed order: equal rows
give equal values, and a value is off the exact one by at most d 2^-53 A_t). A token with
a_t > c + W_t is larger than c (the target's float64 logit), one with a_t < c - W_t smaller,
W_t = E_t (1 + 2^-18) + 2^-21 (|a_t| + |c|) (the slack covers the float32 rounding of c and of
the threshold); the kernel counts the first kind and computes the rest, the band, in float64
as it computed c. So the rank is exact: ties share the better rank.

The log-sum-exp. The kernel keeps the largest a_t (m) and sums exp(a_t - m) in float64 over
a float32 exp with relative error below 2^-20 (tests/unit/test_vocab_scan.py measures it);
with the float32 rounding of a_t - m (at most 2^-24 * 87.3 relative where it matters) each
term is off by less than 2^-17 relative. log-sum-exp moves by at most the largest change of
a logit, so LSE = m + log(sum) is within E + 2^-16 of the exact one, E = max_t E_t. From
this, with the target's logit computed in float64:

    logprob: |error| <= E + 2^-16 (and prob's relative error <= exp of that, minus 1)
    entropy: |error| <= 2 E' e^(2 E') (sd + E') + 2^-16,  E' = E + 2^-16
    kl_to:   |error| <= 2 E'_v + (e^(2 E'_t) - 1) D + 2 E'_t e^(2 E'_t)

where sd is the logits' standard deviation under the lens distribution and D = sum_t p_t,target
|log p_t,target - log p_t,v| (bounded by the kernel's sum_t p_t,target |a_t,target - a_t,v|
plus |LSE_target - LSE_v|). Entropy: H has gradient -p (l - mean), and on the segment
between the two logit vectors sum p |l - mean| <= 2 e^(2E) (sd + E) of the computed point.
KL(p_t || p_v): a change of at most E_v in v's logits moves each log p_v by at most 2 E_v; one
of at most E_t in the target's moves each log p_t by delta, |delta| <= 2 E_t, and p_t by a
factor e^delta. E is below `stated_error`'s c X max N, which `actdb functions` states for both
paths (the float32 product's own error, g_d X max N, is below it too): the kernel needs no
fallback for its bound, only for rows it cannot take (not finite, or so large that a product
could overflow float32), which lens.py computes in float32.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..lazy import lazy_module
from . import topk
from .dots import row_dots
from .threads import threads_for

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

try:  # the compiled kernel (actdb/_native_vocab.c, part of _native)
    from .. import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None  # type: ignore[assignment]

ENV = "ACTDB_VOCAB_SCAN"
U = 2.0**-8  # bfloat16's unit roundoff
# Logits are sums of products: beyond this, a product or a sum could overflow float32.
_LARGEST = 2.0**60


def stated_error(d: int) -> float:
    """c of `actdb functions`: a logit computed by the lens (either path) is within
    c X max N of the exact one; at least k of (1), and the float32 product's g_d."""
    return 2.0**-14 + (5 * d + 8) * 2.0**-23


def _gamma(terms: int) -> float:
    return terms * 2.0**-23 / (1 - terms * 2.0**-23)


def width(d: int, bias: bool) -> int:
    """K: the kernel's terms per logit (padded to even with a zero term)."""
    k = 3 * d + (3 if bias else 0)
    return k + k % 2


def approx_factor(d: int, bias: bool) -> float:
    """k of (1): the product's error over X N_t."""
    K = width(d, bias)
    low, high = 2 * U * (1 + U) ** 2, (1 + U) ** 3
    s = 2.0**-23 * (1 + _gamma(K)) * (2 * d * low + (K - 2 * d) * (low + high))
    return 3 * U**2 + 5 * U**3 + s


def usable(device: torch.device, model: Any) -> bool:
    """Whether the kernel takes this model's rows here: a CPU with AVX-512 BF16 (and the
    bfloat16 path not turned off), and logits that are the head's output unchanged.
    ACTDB_VOCAB_SCAN=off keeps the float32 product (benchmarks and tests compare the two)."""
    if os.environ.get(ENV, "auto").lower() in ("off", "0", "no", "false"):
        return False
    if device.type != "cpu" or _native is None or not hasattr(_native, "vocab_scan"):
        return False
    if topk.lowp_dtype(device) is None or not _cpu_has_avx512_bf16():
        return False
    scale, cap = model.logit_scale, model.logit_softcap
    return (scale is None or scale == 1.0) and not cap


def _cpu_has_avx512_bf16() -> bool:
    return topk._cpu_has_bf16() and "avx512_bf16" in _flags()


def _flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


@dataclass(frozen=True, kw_only=True)
class Packed:
    """The LM head as the kernel reads it, kept with the weight (topk._per_weight)."""

    panels: torch.Tensor  # int32 [P * 16 * K / 2]: 16-token panels of bfloat16 pairs
    nt: torch.Tensor  # float32 [V]: N_t rounded up
    n_max: float
    width: int  # K, even
    d: int
    vocab: int
    bias: bool
    ok: bool  # finite, and small enough that no product overflows


def _split(y: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """y (float32) as `parts` bfloat16 tensors whose sum approximates it (to nearest)."""
    out, rest = [], y.float()
    for _ in range(parts):
        p = rest.bfloat16()
        out.append(p)
        rest = rest - p.float()
    return out


def pack(w: torch.Tensor, b: torch.Tensor | None) -> Packed:
    """W_U (and b_U) split, laid out in panels, with the per-token bound factors."""
    return topk._per_weight(w, ("vocab_scan", b is not None), lambda: _pack(w, b))


def _pack(w: torch.Tensor, b: torch.Tensor | None) -> Packed:
    V, d = w.shape
    k = width(d, b is not None)
    panels = torch.empty(4 * ((V + 63) // 64) * 16 * k // 2, dtype=torch.int32)
    nt = torch.empty(V, dtype=torch.float32)
    n_max, finite = _native.vocab_pack(_float32(w).numpy(),
                                       _float32(b).numpy() if b is not None
                                       else np.empty(0, dtype=np.float32),
                                       panels.numpy(), nt.numpy(), d)
    return Packed(panels=panels, nt=nt, n_max=n_max, width=k, d=d, vocab=V,
                  bias=b is not None, ok=finite and n_max < _LARGEST)


def _rows(x: torch.Tensor, head: Packed) -> tuple[torch.Tensor, int]:
    """The kernel's rows for x [n, d] (float32): (x_lo, x_hi) pairs, then x_hi, then
    (1, 1, 1) with a bias, zero rows added up to a multiple of 4; and n."""
    n = x.shape[0]
    hi, lo = _split(x, 2)
    cols = [torch.stack([lo, hi], -1).reshape(n, 2 * head.d), hi]
    if head.bias:
        cols.append(torch.ones((n, 3), dtype=torch.bfloat16))
    have = sum(c.shape[-1] for c in cols)
    if have < head.width:
        cols.append(torch.zeros((n, head.width - have), dtype=torch.bfloat16))
    a = torch.cat(cols, -1)
    if n % 4:
        a = torch.cat([a, torch.zeros((4 - n % 4, head.width), dtype=torch.bfloat16)])
    return a.contiguous().view(torch.int32), n


def row_scale(x: torch.Tensor, head: Packed) -> torch.Tensor:
    """X = ||(x, 1)|| (the 1 only with a bias) per row, in float64."""
    sq = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64) ** 2
    return torch.sqrt(sq + 1.0) if head.bias else torch.sqrt(sq)


def _tiny(head: Packed, scale: torch.Tensor) -> torch.Tensor:
    k = head.width
    return 2.0**-126 * (2 * k + 2 + 2 * math.sqrt(k) * (1 + U) * (scale + head.n_max))


def takes(x: torch.Tensor, head: Packed) -> torch.Tensor:
    """bool [n]: rows the kernel can take (finite, far from overflow); others go exact."""
    finite = torch.isfinite(x).all(-1)
    return finite & (row_scale(torch.where(finite.unsqueeze(-1), x, 0.0), head)
                     * head.n_max < _LARGEST) & head.ok


def _threads(n: int, head: Packed) -> int:
    return threads_for(2.0 * n * head.vocab * head.width)


def _up(t: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded up (a bound stays a bound)."""
    f = t.float()
    return torch.where(f.double() < t, torch.nextafter(f, torch.full_like(f, math.inf)), f)


# -- token_rank ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """Per row: the rank, the target's float64 logit, and how many tokens were in the band."""

    rank: torch.Tensor  # int64 [n]
    logit: torch.Tensor  # float64 [n]
    band: torch.Tensor  # int64 [n]


def ranks(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tid: torch.Tensor,
          head: Packed) -> Ranks:
    """1 + the number of tokens whose logit, in float64, is larger than token tid's, for rows
    x [n, d] that `takes` (module docstring)."""
    scale = row_scale(x, head)
    e = _up(approx_factor(head.d, head.bias) * (1 + 2.0**-18) * scale)
    t0 = _up(_tiny(head, scale) * (1 + 2.0**-18))
    a, n = _rows(x, head)
    rows = a.shape[0]
    pad = rows - n

    def padded(v: torch.Tensor) -> np.ndarray:
        return torch.cat([v, torch.zeros(pad, dtype=v.dtype)]).contiguous().numpy()

    xf = torch.cat([x, torch.zeros((pad, head.d), dtype=torch.float32)]).contiguous()
    T = _threads(rows, head)
    c = np.empty(rows, dtype=np.float64)
    above, band = np.empty((T, rows), dtype=np.int64), np.empty((T, rows), dtype=np.int64)
    e32, e64 = np.empty(0, dtype=np.float32), np.empty(0, dtype=np.float64)
    _native.vocab_scan(a.numpy(), head.panels.numpy(), head.nt.numpy(), head.vocab, rows,
                       head.d, 0, T, xf.numpy(), _float32(w).numpy(),
                       _float32(b).numpy() if b is not None else e32,
                       padded(tid.long()), padded(e), padded(t0), c, above, band, e32, e64,
                       e64, e64, e64)
    return Ranks(rank=torch.from_numpy(1 + above.sum(0)[:n]),
                 logit=torch.from_numpy(c[:n].copy()), band=torch.from_numpy(band.sum(0)[:n]))


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


# -- top_logits ----------------------------------------------------------------------------

TOP_MAX_K = 64  # larger k: topk.py's path
TOP_CAP = 512  # candidates listed per row and thread; a row with more takes topk.py's path


def top_factor(d: int, bias: bool) -> float:
    """The one-product error over X N_t: x_hi . w_hi (+ the bias's three parts) against
    x . w + b, (2u + u^2 + u^3) A_t left out, the float32 sum of d + 4 terms g_(d+4)
    (1 + u)^2 A_t."""
    return 2 * U + U**2 + U**3 + _gamma(d + 4) * (1 + U) ** 2


def rescore_factor(d: int) -> float:
    """g_(d+1): a float32 rescore's error over X N_t (d products and sums, and the bias)."""
    return _gamma(d + 1)


def top_usable(device: torch.device) -> bool:
    """Whether top_logits' candidates can come from the kernel here (any logit transform:
    ranks are taken before it)."""
    if os.environ.get(ENV, "auto").lower() in ("off", "0", "no", "false"):
        return False
    if device.type != "cpu" or _native is None or not hasattr(_native, "vocab_top"):
        return False
    return topk.lowp_dtype(device) is not None and _cpu_has_avx512_bf16()


def top_k(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int, head: Packed
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [n, k], ids [n, k], done [n]): the k largest float32 logits (row_dots + b, as
    `logit` computes them; ties lower id first, as topk.py lists them) of rows x [n, d] that
    `takes` (`done` False for a row with too many candidates: topk.py's path takes it).

    The kernel's one bfloat16 product a_t (x_hi . w_hi, + b) is within E_t = f X N_t + tiny of
    the exact logit s_t (f = `top_factor`) and a rescore r_t within e_t = g_(d+1) X N_t +
    2^-24 |r_t| of s_t. Each row keeps its k largest a so far and lists every token within
    W = 2 (f + g_(d+1)) X max N + 2 tiny (+ the kernel's slack for |a| and the k-th) below the
    k-th of them when seen. Let theta be the row's final k-th largest a: the k tokens with
    a >= theta are listed, and each has r >= theta - E - e; a token left out had a < theta - W,
    so r < theta - W + E + e, below all k of them. The k best rescores of the listed tokens
    are therefore the float32 top k, ties broken by id as topk.py does."""
    n = x.shape[0]
    d = head.d
    scale = row_scale(x, head)
    e = _up((2 * (top_factor(d, head.bias) + rescore_factor(d)) * scale * head.n_max
             + 2 * _tiny(head, scale)) * (1 + 2.0**-18))
    hi = x.bfloat16()
    cols = [hi]
    if head.bias:
        cols.append(torch.ones((n, 3), dtype=torch.bfloat16))
    have = d + (3 if head.bias else 0)
    if have < head.width - 2 * d:
        cols.append(torch.zeros((n, head.width - 2 * d - have), dtype=torch.bfloat16))
    a = torch.cat(cols, -1)
    rows = n + (-n) % 4
    if rows > n:
        a = torch.cat([a, torch.zeros((rows - n, a.shape[1]), dtype=torch.bfloat16)])
        e = torch.cat([e, torch.zeros(rows - n, dtype=torch.float32)])
    T = _threads(rows, head)
    cand = np.empty((T, rows, TOP_CAP), dtype=np.int32)
    cand_v = np.empty((T, rows, TOP_CAP), dtype=np.float32)
    count = np.empty((T, rows), dtype=np.int64)
    _native.vocab_top(a.contiguous().view(torch.int32).numpy(), head.panels.numpy(),
                      head.vocab, rows, k, TOP_CAP, T, e.contiguous().numpy(), cand, cand_v,
                      count)
    count = count[:, :n]
    done = torch.from_numpy((count <= TOP_CAP).all(0))
    listed = np.minimum(count, TOP_CAP)  # [T, n]
    # Every thread's candidates side by side; a row's final k-th largest value among them
    # (its k best tokens are all listed) then drops those listed under a lower threshold.
    keep = np.arange(TOP_CAP)[None, None, :] < listed[:, :, None]  # [T, n, cap]
    vals_a = np.where(keep, cand_v[:, :n], -np.inf).transpose(1, 0, 2).reshape(n, -1)
    ids_a = np.where(keep, cand[:, :n].astype(np.int64), head.vocab)
    ids_a = ids_a.transpose(1, 0, 2).reshape(n, -1)
    kk = min(k, vals_a.shape[1])
    theta = -np.partition(-vals_a, kk - 1, axis=1)[:, kk - 1]  # [n]
    e_np = e[:n].numpy().astype(np.float64)
    floor = (theta - e_np)[:, None] - 2.0**-21 * (np.abs(vals_a) + np.abs(theta)[:, None])
    ids_a = np.where(vals_a >= floor, ids_a, head.vocab)
    m = max(k, int((ids_a < head.vocab).sum(1).max()) if n else k)
    ids = np.sort(ids_a, axis=1)[:, :m]  # ascending: the listed ids first, V after
    ids_t = torch.from_numpy(ids)  # ascending: ties keep the lower id
    none = ids_t == head.vocab
    safe = ids_t.clamp(max=head.vocab - 1)
    vals = row_dots(w[safe], x.unsqueeze(1), overwrite=True)  # [n, m]
    if b is not None:
        vals += b[safe]
    vals[none] = -math.inf
    vals, at = torch.sort(vals, dim=-1, descending=True, stable=True)
    return vals[:, :k], torch.gather(ids_t, 1, at[:, :k]), done


# -- log-sum-exp and its relatives ----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Sums:
    """Per row, in float64: the log-sum-exp of the approximate logits, the mean and standard
    deviation of the logits under their softmax (moments) or, for pairs, sum_t p_t (a_t - a_v)
    and sum_t p_t |a_t - a_v| on the target rows; and E, the bound on a logit's error."""

    lse: np.ndarray
    mean: np.ndarray | None
    sd: np.ndarray | None
    cross: np.ndarray | None
    cross_abs: np.ndarray | None
    err: np.ndarray


def lse(x: torch.Tensor, head: Packed, *, moments: bool = False, pairs: bool = False) -> Sums:
    """The kernel's sums for rows x [n, d] (with `pairs`, rows 2i and 2i + 1 are (v, target),
    n even)."""
    a, n = _rows(x, head)
    rows = a.shape[0]
    T = _threads(rows, head)
    mode = 2 if moments else 3 if pairs else 1
    m = np.empty((T, rows), dtype=np.float32)
    s0, s1, s2, cross = (np.empty((T, rows), dtype=np.float64) for _ in range(4))
    f32, f64, i64 = (np.empty(0, dtype=t) for t in (np.float32, np.float64, np.int64))
    _native.vocab_scan(a.numpy(), head.panels.numpy(), f32, head.vocab, rows, head.d, mode, T,
                       f32, f32, f32, i64, f32, f32, f64, i64, i64, m, s0, s1, s2, cross)
    m64 = m.astype(np.float64)[:, :n]
    top = m64.max(0)  # [n]
    with np.errstate(invalid="ignore", over="ignore"):
        f = np.exp(m64 - top)  # each thread's part to the common largest value
        f = np.where(m64 == -np.inf, 0.0, f)
        d = np.where(m64 == -np.inf, 0.0, m64 - top)
        z = (f * s0[:, :n]).sum(0)
        z1 = (f * (s1[:, :n] + d * s0[:, :n])).sum(0)
        z2 = (f * (s2[:, :n] + 2 * d * s1[:, :n] + d * d * s0[:, :n])).sum(0)
        cr = (f * cross[:, :n]).sum(0)
        lse_ = top + np.log(z)
    scale = row_scale(x, head).numpy()
    err = approx_factor(head.d, head.bias) * scale * head.n_max + _tiny(
        head, torch.from_numpy(scale)).numpy()
    mean = sd = cx = cabs = None
    if moments:
        mean_y = z1 / z
        mean = top + mean_y
        sd = np.sqrt(np.maximum(z2 / z - mean_y**2, 0.0))
    if pairs:  # the kernel kept sum p |a_t - a_v| in s1 of the target rows
        cx, cabs = cr / z, (f * s1[:, :n]).sum(0) / z
    return Sums(lse=lse_, mean=mean, sd=sd, cross=cx, cross_abs=cabs, err=err)


def entropy_bound(s: Sums) -> np.ndarray:
    """The entropy's computation error bound (module docstring)."""
    assert s.sd is not None
    e = s.err + 2.0**-16
    return 2 * e * np.exp(2 * e) * (s.sd + e) + 2.0**-16


def blocks(n: int, step: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)
