"""Every head's attention weights for a batch (`ingest --attention`), from the model's own
forward pass with `output_attentions`.

Attention weights exist only where the model computes them: its eager attention (fused
kernels, SDPA and flash attention, never form them). The stored vectors come from the batch's
first pass with the model's own implementation, untouched; this is a second pass over the same
inputs with the implementation switched to eager for its duration, and switched back after.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import IngestError


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """The model's attention implementation set to eager, and restored on the way out."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    switch = getattr(model, "set_attn_implementation", None)
    if before in (None, "eager") or not callable(switch):
        yield
        return
    switch("eager")
    try:
        yield
    finally:
        switch(before)


def batch_attention(model: nn.Module, runner: nn.Module, inputs: Mapping[str, torch.Tensor],
                    extra: Mapping[str, Any], lengths: list[int], name: str
                    ) -> list[np.ndarray]:
    """Each input's weights, float32 [layers, heads, n, n] (n its length, right-padded)."""
    with torch.no_grad(), eager_attention(model):
        out = runner(**inputs, **extra, output_attentions=True)
    layers = getattr(out, "attentions", None)
    if not layers or any(not isinstance(a, torch.Tensor) for a in layers):
        raise IngestError(f"model {name!r} gives no attention weights with "
                          "output_attentions=True in eager mode, so --attention cannot store "
                          "them; ingest without it")
    width = int(inputs["input_ids"].shape[1])
    if any(a.dim() != 4 or a.shape[-1] != width or a.shape[-2] != width for a in layers):
        raise IngestError(f"model {name!r}: its attention weights are not [batch, heads, "
                          f"{width}, {width}] for {width} tokens (a model attending over "
                          "other positions than its tokens); ingest without --attention")
    stacked = torch.stack([a.detach() for a in layers], dim=1)  # [B, L, H, T, T]
    return [stacked[b, :, :, :n, :n].float().cpu().numpy() for b, n in enumerate(lengths)]
