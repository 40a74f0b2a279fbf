"""Row-wise dot products whose value never depends on the rows computed with them.

A row's result must not change with the query that asks for it: `logit(vec, t)` of one
prompt alone, in a full scan, in 3-row blocks or in a store merged from shards, is the same
float32 number, and equals the value `top_logits` reports for that token. BLAS matrix-vector
and small matrix products do not promise that: their rounding changes with the number of
rows in the call (measured with torch 2.13 on this CPU: 1-ulp differences for blocks of 1-3,
7, 15 or 17 rows). Here every dot product is one reduction: the elementwise products, then
torch.sum over the last dimension, which on the CPU reduces each contiguous row on its own.

CUDA's reduction kernel does not: it gives one row more threads when the call has fewer rows
(Reduce.cuh's block shape: 512 threads on a row of 768 alone, 32 among many rows), which
changes the order of the sum. On a GPU the sum is therefore a fixed tree of elementwise
halvings (`tree_sum`), whose order depends on the width alone; a GPU's values may differ from
the CPU's in the last bit, never from one query to another on the same device.
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
    products = x.mul_(v) if overwrite else x * v
    return torch.sum(products, -1) if products.device.type == "cpu" else tree_sum(products)


def tree_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension by halving it with elementwise adds (an odd element left
    over is carried to the next level): each row is summed in the same order whatever the
    number of rows, on any device."""
    while p.shape[-1] > 1:
        half = p.shape[-1] // 2
        summed = p[..., :half] + p[..., half : 2 * half]
        p = summed if p.shape[-1] % 2 == 0 else torch.cat([summed, p[..., 2 * half :]], -1)
    return p[..., 0] if p.shape[-1] == 1 else p.sum(-1)  # width 0: zeros


def unit_rows(w: torch.Tensor) -> torch.Tensor:
    """Each row of `w` [n, d] over its norm, in float32 (zero rows stay zero). The norm is a
    float64 `tree_sum` of squares (no float32 underflow for tiny rows), so a row's result is
    the same bits whether it is normalized alone or among the whole vocabulary, on any
    device: one token's anchor is made without the others."""
    w64 = w.double()
    n = torch.sqrt(tree_sum(w64 * w64)).unsqueeze(-1)
    return (w64 / torch.where(n > 0, n, torch.ones_like(n))).float()
