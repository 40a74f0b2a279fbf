"""The maths of the normalization kinds actdb stores, in torch, shared by ingest and query.

Imports nothing of ours, so `ingest/` and `query/` can both use it without importing each other.
All functions take float tensors whose last dimension is the site width `d`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KINDS = ("layernorm", "rmsnorm", "rmsnorm_1p")


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x -> (unit direction, norm, mean); direction is all zeros where norm == 0."""
    x = x.float()
    norm = torch.linalg.vector_norm(x, dim=-1)  # [...]
    mean = x.mean(dim=-1)  # [...]
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    direction = torch.where((norm > 0).unsqueeze(-1), x / safe.unsqueeze(-1), torch.zeros_like(x))
    return direction, norm, mean


def normalize(
    kind: str, x: torch.Tensor, eps: float, mean: torch.Tensor | None = None
) -> torch.Tensor:
    """z: the norm's output before gain and bias. `mean` may pass the exact stored mean."""
    d = x.shape[-1]
    if kind == "layernorm":
        m = x.mean(dim=-1, keepdim=True) if mean is None else mean.unsqueeze(-1)
        xc = x - m  # [..., d]
        var = (xc * xc).sum(dim=-1, keepdim=True) / d
        return xc / torch.sqrt(var + eps)
    if kind in ("rmsnorm", "rmsnorm_1p"):
        ms = (x * x).sum(dim=-1, keepdim=True) / d
        return x / torch.sqrt(ms + eps)
    raise ValueError(f"unknown norm kind {kind!r}; kinds are {KINDS}")


def apply(
    kind: str,
    x: torch.Tensor,
    *,
    gain: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """y: the site's real output, gain and bias included (Gemma's `(1 + weight)` for rmsnorm_1p).

    Without a stored `mean`, torch's fused layer_norm / rms_norm kernels compute the same
    formulas in one pass (the ingest's faithfulness check runs this on every vector).
    """
    if mean is None and kind in KINDS:
        d = x.shape[-1]
        g = None if gain is None else (1.0 + gain if kind == "rmsnorm_1p" else gain)
        if kind == "layernorm":
            return F.layer_norm(x, (d,), g, bias, eps)
        y = F.rms_norm(x, (d,), g, eps)
        return y + bias if bias is not None else y
    z = normalize(kind, x, eps, mean)
    if gain is not None:
        z = z * (1.0 + gain) if kind == "rmsnorm_1p" else z * gain
    if bias is not None:
        z = z + bias
    return z


def effective_gain(kind: str, gain: torch.Tensor | None, d: int) -> torch.Tensor:
    """The per-dimension factor the output is scaled by: gain, 1 + gain, or ones."""
    if gain is None:
        return torch.ones(d)
    return 1.0 + gain if kind == "rmsnorm_1p" else gain
