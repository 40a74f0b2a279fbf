"""Row-wise dot products whose value never depends on the rows computed with them.

A row's result must not change with the query that asks for it: `logit(vec, t)` of one
prompt alone, in a full scan, in 3-row blocks or in a store merged from shards, is the same
float32 number, and equals the value `top_logits` reports for that token. BLAS matrix-vector
and small matrix products do not promise that: their rounding changes with the number of
rows in the call (measured with torch 2.13 on this CPU: 1-ulp differences for blocks of 1-3,
7, 15 or 17 rows). Here every dot product is one reduction: the elementwise products, then
torch.sum over the last dimension, which reduces each contiguous row on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)


def row_dots(x: torch.Tensor, v: torch.Tensor, *, overwrite: bool = False) -> torch.Tensor:
    """sum(x * v, -1): `x` [..., d] against `v` broadcast to it ([d] or [..., d]).
    `overwrite`: `x` is a temporary that the products may replace (no second copy)."""
    return torch.sum(x.mul_(v) if overwrite else x * v, -1)
