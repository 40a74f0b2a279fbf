"""Device choice shared by ingest and query: `auto` is CUDA when present, else CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import DeviceError
from .lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)


def resolve_device(device: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:i` -> a torch device that exists here."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise DeviceError(f"unknown device {device!r}; use auto, cpu or cuda[:i]") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {device!r} asked for, but CUDA is not available here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"device {device!r} asked for, but there are "
                          f"{torch.cuda.device_count()} CUDA devices")
    return dev
