"""The probe passes that find what each projection of a sublayer is (weights.py says how):
hooks that record calls or stop a pass, a projection's orientation, and the float tolerances."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from .sites import is_norm_module
from .sites import is_projection as _is_projection

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "attention_heads",
               "encoder_attention_heads")


class Unmapped(Exception):
    """A sublayer whose weights cannot be mapped; the message is the reason."""


def affine(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor,
                                                                         torch.Tensor | None]:
    """(W [out, in], bias [out] or None) of a projection, oriented by what it computed:
    nn.Linear keeps [out, in], GPT-2's Conv1D [in, out]; a square weight is tried both ways."""
    w = cast(torch.Tensor, module.weight).detach()
    b = getattr(module, "bias", None)
    b = b.detach() if isinstance(b, torch.Tensor) else None
    x2 = x.reshape(-1, x.shape[-1]).double()
    y2 = y.reshape(-1, y.shape[-1]).double()
    best, best_err = None, float("inf")
    for cand in (w, w.t()):
        if cand.shape != (y2.shape[1], x2.shape[1]):
            continue
        pred = x2 @ cand.double().t() + (0 if b is None else b.double())
        err = float((pred - y2).abs().max()) / (float(y2.abs().max()) or 1.0)
        if err < best_err:
            best, best_err = cand, err
    if best is None or best_err > 1e-2:
        raise Unmapped(f"projection {type(module).__name__} is not x W^T + b of its weight")
    return best, b


def count_heads(attn: nn.Module, config: Any) -> int | None:
    for m in attn.modules():
        for a in _HEAD_ATTRS:
            v = getattr(m, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    for a in _HEAD_ATTRS:
        v = getattr(config, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


class Stop(Exception):
    """Raised by a hook once what a probe pass needs is recorded."""


@contextmanager
def hooked(hooks: list[tuple[nn.Module, Any]]) -> Iterator[None]:
    handles = [m.register_forward_hook(fn, with_kwargs=True) for m, fn in hooks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run_probe(target: nn.Module, ids: torch.Tensor) -> None:
    mask = torch.ones_like(ids)
    try:
        with torch.no_grad():
            target(input_ids=ids, attention_mask=mask)
    except Stop:
        pass


def projections_of(model: nn.Module, path: str) -> dict[str, nn.Module]:
    root = model.get_submodule(path)
    return {f"{path}.{sub}" if sub else path: m for sub, m in root.named_modules()
            if _is_projection(m) or (not sub and _is_projection(root))}


def functions(root: nn.Module, path: str) -> dict[str, nn.Module]:
    """Leaf modules without parameters (activations), dropout and identities left out."""
    return {f"{path}.{sub}" if sub else path: m for sub, m in root.named_modules()
            if not list(m.children()) and not any(q.dim() > 1 for q in m.parameters())
            and not isinstance(m, nn.Dropout | nn.Identity) and not is_norm_module(m)}


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is not None and b is not None and a.numel() == b.numel()
            and torch.equal(a.reshape(-1), b.reshape(-1)))


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def tolerance(dtype: torch.dtype) -> float:
    """Relative difference two computations of one value may show in `dtype`: a bfloat16
    model's activation rounds to about 2^-8."""
    return max(1e-5, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5


def close_enough(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    if a.numel() != b.numel():
        return False
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    return float((a - b).abs().max()) <= tolerance(dtype) * (float(b.abs().max()) or 1.0)
