"""A block's attention weights, per head, read from what its projections did in the log pass
and in two probe passes (weights.py says how; attention_probes.py runs the passes): the plan
from the log pass, the values from the one-token pass, the queries and keys from the
two-token pass with perturbed columns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .rotary import attention_scale
from .weight_probes import (
    Unmapped,
    affine,
    count_heads,
    projections_of,
    same,
    tolerance,
)
from .weight_records import AttentionWeights

_SLOTS = 256  # value slots compared at once: [rows, 256, columns] float64


@dataclass(frozen=True, kw_only=True)
class AttentionPlan:
    """One block's attention as the log pass shows it: which projections read its input and
    which writes the model width, and their matrices."""

    layer: int
    path: str
    module: nn.Module  # the attention module at `path`
    leaves: dict[str, nn.Module]  # its projections that ran
    readers: list[str]  # the projections reading the attention's input, in call order
    writer: str
    x: torch.Tensor | None  # the input the readers read
    n_heads: int
    d_head: int
    width: int  # what the writer reads: n_heads * d_head
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    mats: dict[str, tuple[torch.Tensor, torch.Tensor | None]]  # each reader's (W, b)
    offsets: dict[str, int]  # each reader's first column among all readers' columns
    n_cols: int

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype if self.x is not None else torch.float32


@dataclass(frozen=True, kw_only=True)
class ValueMap:
    """Which reader columns are each head's values, and the blocks of d_head columns left
    (the queries' and keys')."""

    starts: list[int]  # each key-value head's first value column
    kv_of_head: tuple[int, ...]
    qk_blocks: list[list[int]]


def plan_attention(model: nn.Module, layer: int, path: str, calls: Mapping[str, Any],
                   config: Any, d_model: int) -> AttentionPlan:
    """The attention at `path` as the log pass `calls` shows it."""
    attn = model.get_submodule(path)
    leaves = {p: m for p, m in projections_of(model, path).items() if p in calls}
    if not leaves:
        raise Unmapped("no projection runs in the attention")
    # The first projection's input: the attention's own, or its inner norm's output
    # (RoBERTa-PreLayerNorm norms inside its attention module).
    x = calls[min(leaves, key=lambda p: calls[p].start)].input
    readers = [p for p in leaves if same(calls[p].input, x)]
    writers = [p for p in leaves if calls[p].output is not None
               and calls[p].output.shape[-1] == d_model and p not in readers]
    if not readers or not writers:
        raise Unmapped("no projection reads the attention's input and another writes the "
                        "model width (not a softmax attention over projections: linear "
                        "attention or a state-space mixer)")
    writer = max(writers, key=lambda p: calls[p].start)
    n_heads = count_heads(attn, config)
    w_o, b_o = affine(leaves[writer], calls[writer].input, calls[writer].output)
    width = int(w_o.shape[1])
    if n_heads is None or width % n_heads:
        raise Unmapped(f"the output projection reads {width} values, not a whole number of "
                        f"heads ({n_heads})")
    mats = {p: affine(leaves[p], calls[p].input, calls[p].output) for p in readers}
    offsets, at = {}, 0
    for p in readers:
        offsets[p], at = at, at + int(mats[p][0].shape[0])
    return AttentionPlan(layer=layer, path=path, module=attn, leaves=leaves, readers=readers,
                         writer=writer, x=x, n_heads=n_heads, d_head=width // n_heads,
                         width=width, w_o=w_o, b_o=b_o, mats=mats, offsets=offsets, n_cols=at)


def map_values(plan: AttentionPlan, rec: Mapping[str, torch.Tensor]) -> ValueMap:
    """The values, from a one-token pass (`rec`: each reader's output and the writer's input
    as "o_in", float64): with one key, softmax gives it the weight 1, so the writer's input
    is each head's value itself."""
    if "o_in" not in rec or any(p not in rec for p in plan.readers):
        raise Unmapped("its projections do not run on a one-token input")
    n_heads, dh, width = plan.n_heads, plan.d_head, plan.width
    cols = torch.cat([rec[p].reshape(-1, rec[p].shape[-1]) for p in plan.readers],
                     dim=1)  # [B, C]
    o_in = rec["o_in"].reshape(-1, width)  # [B, H*dh]
    scale = cols.abs().amax(0).clamp_min(1e-30)  # [C]
    v_col: list[int] = []
    # Each value slot's nearest reader column, a block of slots at a time (a loop over the
    # slots was a few small operations each: thousands of them, each a GPU round trip)
    for lo in range(0, width, _SLOTS):
        o = o_in[:, lo : lo + _SLOTS]  # [B, S]
        diff = (cols[:, None, :] - o[:, :, None]).abs().amax(0) / scale  # [S, C]
        best = diff.argmin(1)  # [S]
        if bool((diff.gather(1, best[:, None]) > max(1e-4, tolerance(plan.dtype))).any()):
            raise Unmapped("a head's value is not a column of the projections reading the "
                            "residual (values through a latent, or a gated output)")
        v_col += best.tolist()
    vt = torch.tensor(v_col).reshape(n_heads, dh)
    if not bool((vt[:, 1:] - vt[:, :-1] == 1).all()):
        raise Unmapped("a head's value dimensions are not consecutive columns")
    starts = sorted({int(s) for s in vt[:, 0]})
    kv_of_head = tuple(starts.index(int(s)) for s in vt[:, 0])
    n_kv = len(starts)
    v_cols = {c for s in starts for c in range(s, s + dh)}
    rest = [c for c in range(plan.n_cols) if c not in v_cols]
    if len(rest) != (n_heads + n_kv) * dh:
        raise Unmapped(f"{len(rest)} query and key columns for {n_heads} query and {n_kv} "
                        f"key-value heads of {dh}")
    qk_blocks = [rest[k : k + dh] for k in range(0, len(rest), dh)]
    if any(b[-1] - b[0] != dh - 1 for b in qk_blocks):
        raise Unmapped("a query or key block is not consecutive columns")
    return ValueMap(starts=starts, kv_of_head=kv_of_head, qk_blocks=qk_blocks)


def perturb(plan: AttentionPlan, values: ValueMap, reader: str, n_rows: int,
            gen: torch.Generator, y: torch.Tensor) -> torch.Tensor:
    """`reader`'s output `y` over a two-token pass of `n_rows` equal rows, with, per block
    of query or key columns, four rows changed at the first or the second token, by a large
    vector or its negative: a softmax that the baseline saturates (a token attending to one
    key alone) is pushed off it by one of the two signs. Row 0 is left as is."""
    lo = plan.offsets[reader]
    width_p = int(plan.mats[reader][0].shape[0])
    y = y.clone()
    flat = y.reshape(n_rows, -1, width_p)
    for b, block in enumerate(values.qk_blocks):
        cs = [c - lo for c in block if lo <= c < lo + width_p]
        if not cs:
            continue
        amp = 10.0 * (float(flat[:, :, cs].abs().max()) + 1.0)
        for pos in (0, 1):
            noise = torch.randn(len(cs), generator=gen).to(y) * amp
            flat[1 + 4 * b + 2 * pos, pos, cs] += noise
            flat[2 + 4 * b + 2 * pos, pos, cs] -= noise
    return y


def map_heads(plan: AttentionPlan, values: ValueMap, o_in: torch.Tensor) -> AttentionWeights:
    """The weights per head, from the writer's input `o_in` (float64) over the perturbed
    two-token pass: a key block changed at the first token changes what the second token's
    heads read, a query block does not; changed at the second token, a query block changes
    its one head, a key block every head of its group."""
    n_heads, dh, width = plan.n_heads, plan.d_head, plan.width
    qk_blocks, kv_of_head, starts = values.qk_blocks, values.kv_of_head, values.starts
    n_kv = len(starts)
    n_rows = o_in.shape[0]
    o2 = o_in.reshape(n_rows, -1, width)[:, -1].reshape(n_rows, n_heads, dh)
    # Rows computed apart from the change agree to rounding (a batch's rows may round apart)
    tol = tolerance(plan.dtype) * (float(o2[0].abs().max()) or 1.0)
    moved = (o2 - o2[:1]).abs().amax(-1) > tol  # [R, H]
    q_of: dict[int, list[int]] = {}
    k_of: dict[int, list[int]] = {}
    for b, block in enumerate(qk_blocks):
        first = moved[1 + 4 * b] | moved[2 + 4 * b]
        second = moved[3 + 4 * b] | moved[4 + 4 * b]
        heads = [int(h) for h in torch.nonzero(second).flatten()]
        if not bool(first.any()) and len(heads) == 1:
            q_of.setdefault(heads[0], []).extend(block)
        elif bool(first.any()) and heads:
            kv = {kv_of_head[h] for h in heads}
            group = [h for h in range(n_heads) if kv_of_head[h] in kv]
            if len(kv) != 1 or heads != group:
                raise Unmapped("a key block's heads are not one key-value group")
            k_of.setdefault(kv.pop(), []).extend(block)
        elif not bool(first.any()) and heads:
            raise Unmapped("a query block moves several heads: a norm over all heads' "
                            "queries or keys (OLMo 2's q_norm) mixes them, so no head has "
                            "a query map of its own")
        else:
            raise Unmapped("a block of projection columns acts as neither a query nor a key")
    if sorted(q_of) != list(range(n_heads)) or sorted(k_of) != list(range(n_kv)) or any(
            len(v) != dh for v in (*q_of.values(), *k_of.values())):
        raise Unmapped("queries and keys do not map one block a head")

    mats = plan.mats
    w_all = torch.cat([mats[p][0] for p in plan.readers], dim=0)  # [C, d], the model's values
    biases = [mats[p][1] for p in plan.readers]
    b_all = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(int(mats[p][0].shape[0]), dtype=w_all.dtype, device=w_all.device)
         if b is None else b for p, b in zip(plan.readers, biases, strict=True)])

    def take(order: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        idx = torch.tensor(order, device=w_all.device)  # [heads, dh]
        return w_all[idx], None if b_all is None else b_all[idx]

    w_q, b_q = take([q_of[h] for h in range(n_heads)])
    w_k, b_k = take([k_of[j] for j in range(n_kv)])
    w_v, b_v = take([list(range(s, s + dh)) for s in starts])
    return AttentionWeights(
        layer=plan.layer, module=plan.path, w_q=w_q, w_k=w_k, w_v=w_v,
        w_o=plan.w_o.t().reshape(n_heads, dh, -1), b_q=b_q, b_k=b_k, b_v=b_v, b_o=plan.b_o,
        kv_of_head=kv_of_head, scale=attention_scale(plan.module))
