"""Measure what a norm module does by calling it on inputs we choose.

Whatever its class, its parameters' names or offsets, a norm site is replayed as: centre or
not, divide by sqrt(mean square + eps), then `y = g * z + b` per dimension. This module
recovers (centred, eps, g, b) from the module's responses:

- normalization is odd in x, so `b = (y(x) + y(-x)) / 2` and `g * z(x) = (y(x) - y(-x)) / 2`;
- a constant vector has a zero odd part exactly when the module centres;
- the odd part at two magnitudes of one input gives eps (the ratio depends only on it);
- with eps known, z(x) is known, so `g = odd / z` dimension by dimension.

The probe runs on a float64 copy of the module where the module allows it (then the recovered
numbers are exact up to the module's own internal precision), else on the module itself in its
own dtype and device. A last check replays random inputs at several scales; a module that no
centred or uncentred normalization plus per-dimension affine reproduces is an error.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import norms
from ..errors import ModelLoadError
from .capture import output_tensor

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "rms_norm_eps")
# Worst relative error of the replay that still counts as a fit, by the dtype the probe ran in.
_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4, torch.float16: 5e-3,
              torch.bfloat16: 3e-2}


@dataclass(frozen=True, kw_only=True)
class NormFit:
    """What a norm module does: y = gain * normalize(x) + bias (float64, None = ones/zeros)."""

    centered: bool
    eps: float
    gain: torch.Tensor | None  # [d]
    bias: torch.Tensor | None  # [d]
    kind: str  # for information: layernorm, rmsnorm, and _1p where gain = 1 + weight
    error: float  # worst relative error of the replay on random inputs


def declared_eps(module: nn.Module) -> float | None:
    for attr in _EPS_ATTRS:
        v = getattr(module, attr, None)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None


def _runner(module: nn.Module, width: int, heads: int, layout: str, dtype: torch.dtype,
            device: torch.device) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]:
    """A float64 function of [n, heads, d] inputs that calls the module in its own layout
    (`btd`, `bthd`, `bhtd`, or a feature map `bhwc` / `bchw`): a float64 copy of the module
    when that works, else the module itself in its dtype and on its device."""

    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layout == "bthd":
            inp = x.unsqueeze(0)  # [1, n, H, d]
        elif layout == "bhtd":
            inp = x.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        elif layout == "bhwc":
            inp = x[:, 0].reshape(1, -1, 1, x.shape[-1])  # [1, n, 1, d]: a column of positions
        elif layout == "bchw":
            inp = x[:, 0].T.reshape(1, x.shape[-1], -1, 1)  # [1, d, n, 1]
        else:
            inp = x[:, 0].unsqueeze(0)  # [1, n, d]
        y = output_tensor(m(inp))
        if y is None or y.shape != inp.shape:
            raise ModelLoadError("it returned no tensor of its input's shape")
        if layout == "bhtd":
            return y[0].transpose(0, 1)
        if layout == "bhwc":
            return y[0, :, 0].unsqueeze(1)
        if layout == "bchw":
            return y[0, :, :, 0].T.unsqueeze(1)
        return y[0] if layout == "bthd" else y[0].unsqueeze(1)

    try:
        twin = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
        test = torch.linspace(-1.0, 2.0, width, dtype=torch.float64).expand(2, heads, width)
        out = call(twin, test)
        if out.dtype == torch.float64 and bool(torch.isfinite(out).all()):
            return (lambda x: call(twin, x).double()), torch.float64
    except Exception:  # noqa: BLE001 - any failure means: probe the module as it is
        pass
    return (lambda x: call(module, x.to(device=device, dtype=dtype)).double().cpu()), dtype


def _collapse(v: torch.Tensor) -> torch.Tensor:
    """[H, d] -> [d] where every head has the same values (one module broadcast over heads)."""
    return v[0] if v.shape[0] == 1 or bool((v == v[0]).all()) else v


def _snap(measured: torch.Tensor, params: list[torch.Tensor], tol: float, offset: bool
          ) -> tuple[torch.Tensor | None, bool]:
    """The module's own parameter (or 1 + it) where the measurement agrees with it: the stored
    numbers are then the checkpoint's exactly, not a rounding of them. (value, was 1 + p)."""
    scale = float(measured.abs().max()) + 1e-12
    for p in params:
        if p.numel() != measured.numel():
            continue
        p = p.reshape(measured.shape)
        for plus in ((False, True) if offset else (False,)):
            cand = p + 1.0 if plus else p
            if float((cand - measured).abs().max()) <= tol * max(scale, 1.0):
                return cand, plus
    return measured, False


@torch.no_grad()
def measure_norm(module: nn.Module, width: int, *, dtype: torch.dtype, device: torch.device,
                 name: str, heads: int | None = None, layout: str = "btd") -> NormFit:
    """Probe `module` (which normalizes a last axis of `width`, over `heads` heads laid out
    as `layout`) and return what it does; gain and bias are [heads, d] where heads differ.

    Raises ModelLoadError, naming `name`, when no normalization + affine fits.
    """
    try:
        run, ran_in = _runner(module, width, heads or 1, layout, dtype, device)
        return _measure(module, width, heads or 1, run, ran_in)
    except ModelLoadError as e:
        raise ModelLoadError(
            f"norm module {name!r} ({type(module).__name__}) is not a centred or uncentred "
            f"normalization followed by a per-dimension affine: {e}"
        ) from None
    except Exception as e:  # noqa: BLE001 - the module's own failure, said in one sentence
        raise ModelLoadError(
            f"norm module {name!r} ({type(module).__name__}) failed when probed: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def _measure(module: nn.Module, d: int, heads: int,
             run: Callable[[torch.Tensor], torch.Tensor], ran_in: torch.dtype) -> NormFit:
    tol = _TOLERANCE.get(ran_in, 3e-2)
    gen = torch.Generator().manual_seed(20240917)

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(ran_in).double()  # what the module really receives

    # Two independent probes, offset so that centring matters; each dim gets its gain from
    # the probe where its normalized value is farther from zero.
    probes = rounded(torch.randn(2, d, generator=gen, dtype=torch.float64) + 0.5)
    const = rounded(torch.ones(1, d, dtype=torch.float64))
    hint = declared_eps(module) or 1e-6

    def odd_even(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Odd and even parts of the response to x [n, d], the same vector in every head."""
        xx = torch.cat([x, -x]).unsqueeze(1).expand(-1, heads, -1).contiguous()
        y = run(xx)  # [2n, H, d]
        yp, ym = y[: len(x)], y[len(x):]
        return (yp - ym) / 2, (yp + ym) / 2

    odd1, even1 = odd_even(probes)  # [2, H, d] each
    if not bool(torch.isfinite(odd1).all()):
        raise ModelLoadError("its output is not finite on a plain input")
    scale_out = float(odd1.abs().max().detach())
    if scale_out == 0.0:
        raise ModelLoadError("its output does not depend on its input")
    odd_c, _ = odd_even(const)
    centered = float(odd_c.abs().max().detach()) <= 1e-3 * scale_out

    w = probes - probes.mean(-1, keepdim=True) if centered else probes  # [2, d]
    ms = (w * w).mean(-1)  # [2]
    # A small magnitude where eps is about as large as the mean square, against magnitude 1.
    m_small = math.sqrt(hint / float(ms.max()))
    small = rounded(probes * m_small)
    odd_s, _ = odd_even(small)
    # odd_s / odd1 = m * sqrt(ms + eps) / sqrt(m^2 ms + eps) for each probe (same for all dims);
    # m is the scale the module really received (rounding may shift it a little)
    m = ((small * probes).sum(-1) / (probes * probes).sum(-1)).unsqueeze(-1)  # [2, 1]
    ratio = (odd_s * odd1).sum(-1) / (odd1 * odd1).sum(-1)  # [2, H]
    k2 = (ratio / m) ** 2
    eps_each = ms.unsqueeze(-1) * (1.0 - k2 * m * m) / (k2 - 1.0)
    eps = max(float(eps_each.mean()), 0.0)
    declared = declared_eps(module)
    if declared is not None and abs(eps - declared) <= 1e-2 * max(declared, eps) + 1e-15:
        eps = declared  # the config's own number, which the measurement confirms

    z = w / torch.sqrt(ms + eps).unsqueeze(-1)  # [2, d]
    pick = z.abs().argmax(0)  # [d]
    cols = torch.arange(d)
    gain = _collapse(odd1[pick, :, cols].T / z[pick, cols])  # [H, d] or [d]
    bias = _collapse(even1.mean(0))

    params = [p.detach().double().cpu() for p in module.parameters(recurse=False)]
    g_snap, plus = _snap(gain, params, 10 * tol, offset=True)
    b_snap, _ = _snap(bias, params, 10 * tol, offset=False)
    ones = torch.ones_like(gain)
    if not plus and float((gain - ones).abs().max()) <= 10 * tol * 1e-2:
        g_snap = None
    if float(bias.abs().max()) <= 10 * tol * 1e-2 * max(scale_out, 1.0):
        b_snap = None

    # Replay: random inputs at several scales and offsets, against the module itself.
    check = torch.randn(6, heads, d, generator=gen, dtype=torch.float64)
    check = check * torch.tensor([1e-2, 0.3, 1.0, 3.0, 30.0, 1e3],
                                 dtype=torch.float64)[:, None, None]
    check = rounded(check + torch.tensor([0.0, 0.1, -1.0, 2.0, 5.0, -300.0],
                                         dtype=torch.float64)[:, None, None])
    y = run(check)
    y_hat = norms.apply(centered, check, gain=g_snap, bias=b_snap, eps=eps)
    err = float((torch.linalg.vector_norm(y_hat - y, dim=-1)
                 / torch.linalg.vector_norm(y, dim=-1).clamp_min(1e-30)).max())
    if not err <= tol:
        raise ModelLoadError(
            f"the best fit ({'centred' if centered else 'uncentred'}, eps {eps:.3g}) leaves a "
            f"relative error of {err:.3g}"
        )
    kind = ("layernorm" if centered else "rmsnorm") + ("_1p" if plus else "")
    return NormFit(centered=centered, eps=eps, gain=g_snap, bias=b_snap, kind=kind, error=err)
