"""The maths of a normalization site, in torch, shared by ingest and query.

Every site is replayed with one formula, whatever the module's class: optionally centre,
divide by the root mean square plus eps, then a per-dimension affine `y = gain * z + bias`
whose gain and bias are the *effective* ones measured by probing the module at ingest
(a Gemma-style `(1 + weight)` is already folded into the stored gain).

Imports nothing of ours but lazy.py, so `ingestion/` and `query/` can both use it without
importing each other.
All functions take float tensors whose last dimension is the site width `d`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

# Kind names are for information (what the module looked like); the maths reads `centered`.
KINDS = ("layernorm", "rmsnorm", "layernorm_1p", "rmsnorm_1p")


def split(x: torch.Tensor, *, out: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x -> (unit direction, norm, mean); direction is all zeros where norm == 0 (or NaN).

    The direction is a new float32 tensor the caller may overwrite, or `out` (float32, x's
    shape) when given: the ingest passes a buffer it reuses for every site and batch, since
    fresh buffers of that size cost a page fault every 4 KiB. One division and no
    `torch.where` over the whole batch unless some norm is 0: the ingest runs this on every
    norm input, and a where over [n, d] is several passes over memory."""
    x = x.float()
    norm = torch.linalg.vector_norm(x, dim=-1)  # [...]
    mean = x.mean(dim=-1)  # [...]
    nonzero = norm > 0
    if bool(nonzero.all()):
        return torch.div(x, norm.unsqueeze(-1), out=out), norm, mean
    safe = torch.where(nonzero, norm, torch.ones_like(norm)).unsqueeze(-1)
    direction = torch.div(x, safe, out=out)
    return direction.masked_fill_(~nonzero.unsqueeze(-1), 0.0), norm, mean


def normalize(
    centered: bool, x: torch.Tensor, eps: float, mean: torch.Tensor | None = None
) -> torch.Tensor:
    """z: the norm's output before gain and bias. `mean` may pass the exact stored mean."""
    d = x.shape[-1]
    if centered:
        m = x.mean(dim=-1, keepdim=True) if mean is None else mean.unsqueeze(-1)
        x = x - m  # [..., d]
    ms = (x * x).sum(dim=-1, keepdim=True) / d
    return x / torch.sqrt(ms + eps)


def apply(
    centered: bool,
    x: torch.Tensor,
    *,
    gain: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """y: the site's real output from its effective gain and bias (None: ones, zeros).

    Without a stored `mean`, torch's fused layer_norm / rms_norm kernels compute the same
    formulas in one pass (the ingest's faithfulness check runs this on every vector); a
    per-head gain [heads, d] broadcasts over x [..., heads, d].
    """
    fused = (mean is None and (gain is None or gain.dim() == 1)
             and (bias is None or bias.dim() == 1))
    if fused and x.dtype in (torch.float32, torch.float64):
        d = x.shape[-1]
        if centered:
            return torch.nn.functional.layer_norm(x, (d,), gain, bias, eps)
        y = torch.nn.functional.rms_norm(x, (d,), gain, eps)
        return y + bias if bias is not None else y
    z = normalize(centered, x, eps, mean)
    if gain is not None:
        z = z * gain
    if bias is not None:
        z = z + bias
    return z


def apply_(centered: bool, x: torch.Tensor, *, gain: torch.Tensor | None,
           bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`apply` computed in x's own buffer (float32 or float64; x is overwritten and
    returned): the ingest's faithfulness check runs it on every vector it stores, in a
    buffer it reuses, where `apply`'s new output would fault in fresh pages each time."""
    d = x.shape[-1]
    if centered:
        x.sub_(x.mean(dim=-1, keepdim=True))
    rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).div_(d ** 0.5)
    x.mul_(rms.square_().add_(eps).rsqrt_())
    if gain is not None:
        x.mul_(gain)
    if bias is not None:
        x.add_(bias)
    return x


def legacy_centered(kind: str) -> bool:
    """Format version 1 stored no `centered` column: only its `layernorm` kind centred."""
    return kind == "layernorm"


def legacy_gain(kind: str, gain: torch.Tensor | None) -> torch.Tensor | None:
    """Format version 1 stored Gemma's raw weight for `rmsnorm_1p`: its effective gain is
    1 + weight (version 2 stores the effective gain for every kind)."""
    return 1.0 + gain if kind == "rmsnorm_1p" and gain is not None else gain
