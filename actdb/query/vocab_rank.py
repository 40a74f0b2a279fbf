"""token_rank's candidate pass in 16-bit integers, with its error proven: the rank stays exact.

`token_rank(v, t)` counts the tokens whose logit is larger than t's. Where the CPU has AVX-512
VNNI (every CPU with AVX-512 BF16 has it), the compiled kernel `_native.rank_scan`
(actdb/_native_rank.c) compares each row with every token by one exact integer dot product of
16-bit values, a third of the bfloat16 kernel's terms (vocab_scan.py splits each value in
three), and rescores only the tokens it cannot place in float64.

The product. Each row x (float32 [d]) gets a scale s_x = max(max |x_i| / 32767,
max_run ||x_run|| / 46000, 2^-60) rounded up to float32 (a run: 64 consecutive values), and
q = rint(x / s_x) (|q_i| <= 32767); each token's row w_t likewise s_t and p_t (rank_pack). The
residuals dx = x - s_x q and dw_t = w_t - s_t p_t are exact in float64 (a 24-bit scale times
a 16-bit integer). A run's sum q^2 times the largest run's sum p_t^2 is below 2^62 (checked
per row; the runs' norms near 46000 keep it so), so by Cauchy-Schwarz no partial sum of a
run's q . p_t leaves int32: each run's sum is exact. With X' = s_x ||q||, N_t = ||w_t|| and
D_t = ||dw_t||, the exact Q_t = q . p_t satisfies

    x . w_t - s_x s_t Q_t = dx . w_t + (s_x q) . dw_t,
    so |x . w_t - s_x s_t Q_t| <= ||dx|| N_t + X' D_t.

The kernel's value a_t = fl(fl(F_t fl(s_x s_t)) + b_t), F_t the float32 sum of the R runs'
sums, adds at most 2R + 3 float32 roundings of the product (at most (2R + 3) 2^-24 1.01
sum_i |q_i p_t,i| s_x s_t <= rho X' (N_t + D_t), Cauchy-Schwarz again; the scales are normal,
>= 2^-60, so the product does not underflow) and the bias's (2^-23 |a_t|). The logits
compared are float64 (vs_dot64: each product exact, the sum in a fixed order, within
d 2^-52 X N_t of the exact one; the bias added). So with

    e_x = (||dx|| + rho X' + d 2^-52 ||x||) (1 + 2^-18),  e_y = X' (1 + rho) (1 + 2^-18)

(each rounded up to float32, N_t and D_t too), a token with a_t > c + W_t has a larger logit
than c (the target's float64 logit), one with a_t < c - W_t a smaller, W_t = e_x N_t + e_y D_t +
2^-120 + 2^-20 (|a_t| + |c|): the 2^-18 covers the float32 arithmetic of the threshold (a few
2^-24 of it), the 2^-20 the roundings of a_t's bias and of c, and 2^-120 a flushed subnormal.
The kernel counts the first kind and computes the band in float64 as it computed c. So the
rank is exact: ties share the better rank, as the float32 path and vocab_scan.ranks give it.

The band is about ||dx|| N_t + X' D_t wide, some 1e-4 X N_t for d = 768 (a run's norm near
46000 steps where the whole row's would be): about the bfloat16 kernel's, some tens to a
hundred tokens of 50,257 on a GPT-2-sized lens, each computed in float64.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..lazy import lazy_module
from . import topk, vocab_scan
from .threads import threads_for

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

try:  # the compiled kernel (actdb/_native_rank.c, part of _native)
    from .. import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None  # type: ignore[assignment]

CHUNK = 32  # pairs (64 values) summed exactly in int32 before the float32 sum of the runs
_NORM = 46000.0  # a run's largest integer norm (rank_pack's RK_NORM)
_SMALLEST = 2.0**-60  # the smallest scale: products of two stay normal floats


def usable() -> bool:
    """Whether the 16-bit kernel runs here (the bfloat16 kernel's conditions hold, and the CPU
    has AVX-512 VNNI); ACTDB_VOCAB_SCAN=bf16 keeps the bfloat16 kernel (tests compare them)."""
    if os.environ.get(vocab_scan.ENV, "auto").lower() == "bf16":
        return False
    return _native is not None and hasattr(_native, "rank_scan") and "avx512_vnni" in (
        vocab_scan._flags().split())


@dataclass(frozen=True, kw_only=True)
class Packed16:
    """The LM head as rank_scan reads it, kept with the weight (topk._per_weight)."""

    panels: torch.Tensor  # int32 [P * 16 * ceil(d / 2)]: 16-token panels of int16 pairs
    sw: torch.Tensor  # float32 [V]: each token's scale
    nt: torch.Tensor  # float32 [V]: ||w_t|| rounded up
    dt: torch.Tensor  # float32 [V]: ||w_t - s_t p_t|| rounded up
    p2max: int  # the largest sum of p_t^2 over a run of CHUNK pairs
    d: int
    vocab: int


def pack(w: torch.Tensor) -> Packed16:
    """W_U as 16-bit integers in panels, with each token's scale and bound factors."""
    return topk._per_weight(w, "rank16", lambda: _pack(w))


def _pack(w: torch.Tensor) -> Packed16:
    V, d = w.shape
    k2 = (d + 1) // 2
    panels = torch.empty(4 * ((V + 63) // 64) * 16 * k2, dtype=torch.int32)
    sw, nt, dt = (torch.empty(V, dtype=torch.float32) for _ in range(3))
    wf = w.detach().float().contiguous()
    p2max = _native.rank_pack(wf.numpy(), panels.numpy(), sw.numpy(), nt.numpy(), dt.numpy(),
                              d, CHUNK)
    return Packed16(panels=panels, sw=sw, nt=nt, dt=dt, p2max=int(p2max), d=d, vocab=V)


@dataclass(frozen=True, kw_only=True)
class Rows16:
    """Rows as rank_scan reads them: q pairs, and per row s_x, e_x, e_y; `ok` the rows whose
    integer norms keep every sum in int32 (the others: vocab_scan.ranks)."""

    a: torch.Tensor  # int32 [n4, ceil(d / 2)]: int16 pairs, zero rows up to a multiple of 4
    sx: torch.Tensor  # float32 [n4]
    ex: torch.Tensor  # float32 [n4]
    ey: torch.Tensor  # float32 [n4]
    ok: torch.Tensor  # bool [n]


def rows(x: torch.Tensor, head: Packed16) -> Rows16:
    """q = rint(x / s_x) and the bound's factors of rows x [n, d] (float32, finite)."""
    n, d = x.shape
    k2 = (d + 1) // 2
    runs = -(-k2 // CHUNK)
    xd = torch.cat([x.double(), torch.zeros((n, 2 * runs * CHUNK - d), dtype=torch.float64)], -1)
    big = xd.abs().amax(-1)
    norm = torch.linalg.vector_norm(xd, dim=-1)
    run_norm = torch.linalg.vector_norm(xd.reshape(n, runs, 2 * CHUNK), dim=-1).amax(-1)
    sx = vocab_scan._up(torch.maximum(torch.maximum(big / 32767.0, run_norm * (1 + 2.0**-40)
                                                    / _NORM),
                                      torch.full_like(norm, _SMALLEST)))
    q = torch.round(xd.float() / sx.unsqueeze(-1)).clamp(-32767, 32767)  # [n, 2 runs CHUNK]
    dx = torch.linalg.vector_norm(xd - sx.double().unsqueeze(-1) * q.double(), dim=-1)
    qs = q.long() ** 2
    ok = qs.reshape(n, runs, 2 * CHUNK).sum(-1).amax(-1).double() * float(head.p2max) < 2.0**62
    xq = sx.double() * torch.sqrt(qs.sum(-1).double()) * (1 + 2.0**-40)
    rho = (2 * runs + 3) * 2.0**-24 * 1.01  # the float32 sum of the runs and the scaling
    grow = (1 + 2.0**-18) * (1 + 2.0**-40)
    ex = vocab_scan._up((dx + rho * xq + d * 2.0**-52 * norm) * grow)
    ey = vocab_scan._up(xq * (1 + rho) * grow)
    qi = q[:, : 2 * k2].to(torch.int16)
    pad = (-n) % 4
    if pad:
        qi = torch.cat([qi, torch.zeros((pad, qi.shape[1]), dtype=torch.int16)])
        zero = torch.zeros(pad, dtype=torch.float32)
        sx, ex, ey = (torch.cat([t, zero]) for t in (sx, ex, ey))
    return Rows16(a=qi.contiguous().view(torch.int32), sx=sx.contiguous(), ex=ex.contiguous(),
                  ey=ey.contiguous(), ok=ok)


def ranks(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tid: torch.Tensor,
          head: Packed16) -> tuple[vocab_scan.Ranks, torch.Tensor]:
    """(ranks, done [n]): 1 + the number of tokens whose logit, in float64, is larger than
    token tid's, for the rows of x [n, d] (finite, `vocab_scan.takes`) that are `done`."""
    r = rows(x, head)
    n = x.shape[0]
    n4 = r.a.shape[0]
    xf = torch.cat([x.float(), torch.zeros((n4 - n, head.d), dtype=torch.float32)]).contiguous()
    t = torch.cat([torch.where(r.ok, tid.long(), 0), torch.zeros(n4 - n, dtype=torch.long)])
    # a row that might overflow is scanned as a zero row (q = 0) and its answer dropped
    a = torch.where(torch.cat([r.ok, torch.zeros(n4 - n, dtype=torch.bool)]).unsqueeze(-1),
                    r.a, 0).contiguous()
    T = threads_for(2.0 * n4 * head.vocab * head.d)
    c = np.empty(n4, dtype=np.float64)
    above = np.empty((T, n4), dtype=np.int64)
    band = np.empty((T, n4), dtype=np.int64)
    bias = (b.detach().float().contiguous().numpy() if b is not None
            else np.empty(0, dtype=np.float32))
    _native.rank_scan(a.numpy(), head.panels.numpy(), head.sw.numpy(), head.nt.numpy(),
                      head.dt.numpy(), bias, head.vocab, n4, head.d, CHUNK, T, xf.numpy(),
                      w.detach().float().contiguous().numpy(), t.numpy(), r.sx.numpy(),
                      r.ex.numpy(), r.ey.numpy(), c, above, band)
    got = vocab_scan.Ranks(rank=torch.from_numpy(1 + above.sum(0)[:n]),
                           logit=torch.from_numpy(c[:n].copy()),
                           band=torch.from_numpy(band.sum(0)[:n]))
    return got, r.ok

