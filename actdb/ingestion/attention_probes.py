"""The probe passes that read every block's attention weights (attention_weights.py says what
each pass shows): one pass of one-token rows for the values, one of two-token rows with
perturbed query and key columns for the queries and keys, each over the whole model with
every block's hooks at once.

A pass for one block runs the model up to that block, so a pass a block would cost passes
over L(L+1)/2 blocks. In the shared two-token pass, each block perturbs the same rows, so
after its writer's input is read, its attention's output for every row is set back to the
unperturbed row's: the next block reads what it would read in a pass of its own. Before
perturbing, each block checks that every row reads what row 0 reads; a block that does not
(a model where a block reads another's perturbation through another path: a cache shared
across layers), or whose hooked modules run other than once before its writer, and every
block when a shared pass fails, is probed in passes of its own, exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .attention_weights import AttentionPlan, ValueMap, map_heads, map_values, perturb
from .capture import first_tensor, output_tensor
from .weight_probes import Stop, Unmapped, first_line, hooked, run_probe, tolerance
from .weight_records import AttentionWeights

# What a model's own forward raises when a probe is not what it can run.
MODEL_ERRORS = (RuntimeError, ValueError, IndexError, TypeError)

# A block's attention: its weights and the input its projections read, or why not.
Probed = tuple[AttentionWeights, torch.Tensor | None] | str


def failed(e: BaseException) -> str:
    return f"its probe pass failed ({first_line(e)})"


@dataclass
class _Seen:
    """What one block's hooks saw in a pass: each hooked output (float64), and whether the
    pass can stand for one of the block's own (each hook ran once, none after the writer,
    every row alike before the perturbation)."""

    rec: dict[str, torch.Tensor] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    done: bool = False  # the writer's input is recorded
    alone: bool = False  # probe this block in passes of its own

    def called(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.done or self.calls[name] > 1:
            self.alone = True


def find_attentions(plans: list[AttentionPlan], target: nn.Module, ids1: torch.Tensor,
                    ids2: torch.Tensor) -> dict[int, Probed]:
    """Each planned block's attention, by layer."""
    out: dict[int, Probed] = {}
    alone: list[AttentionPlan] = []
    if len(plans) > 1 and not _shared_modules(plans):
        try:
            values, seen = _values_pass(target, plans, ids1, merged=True)
        except MODEL_ERRORS:
            values, seen = {}, {p.layer: _Seen(alone=True) for p in plans}
        ready: dict[int, ValueMap] = {}
        for p in plans:
            v = values.get(p.layer)
            if seen[p.layer].alone or v is None:
                alone.append(p)
            elif isinstance(v, str):
                out[p.layer] = v
            else:
                ready[p.layer] = v
        if ready:
            mapped = [p for p in plans if p.layer in ready]
            try:
                heads = _heads_pass(target, mapped, ready, ids2, merged=True)
            except MODEL_ERRORS:
                heads = {p.layer: None for p in mapped}
            for p in mapped:
                got = heads[p.layer]
                if got is None:
                    alone.append(p)
                else:
                    out[p.layer] = got
    else:
        alone = list(plans)
    for p in sorted(alone, key=lambda q: q.layer):
        try:
            values, _ = _values_pass(target, [p], ids1, merged=False)
            v = values[p.layer]
            if isinstance(v, str):
                out[p.layer] = v
                continue
            got = _heads_pass(target, [p], {p.layer: v}, ids2, merged=False)[p.layer]
            assert got is not None
            out[p.layer] = got
        except MODEL_ERRORS as e:
            out[p.layer] = failed(e)
    return out


def _shared_modules(plans: list[AttentionPlan]) -> bool:
    """Whether two blocks hook one module (ALBERT's layers are one module, run again)."""
    mods = [m for p in plans for m in {id(m) for m in (
        p.module, *(p.leaves[r] for r in p.readers), p.leaves[p.writer])}]
    return len(mods) != len(set(mods))


def _keep(s: _Seen, name: str, left: list[int], merged: bool) -> Callable[..., None]:
    """A hook recording into `s` a reader's output (`name`) or, as "o_in", the writer's input;
    after the writer, the pass stops once every block's (`left`) is recorded, or at once for a
    block's own pass."""

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        s.called(name)
        if s.done:
            return
        t = first_tensor(args, kwargs) if name == "o_in" else output_tensor(output)
        if t is not None:
            s.rec[name] = t.detach().double()
        if name == "o_in":
            s.done = True
            left[0] -= 1
            if left[0] == 0 or not merged:
                raise Stop
    return hook


def _values_pass(target: nn.Module, plans: list[AttentionPlan], ids1: torch.Tensor, *, merged: bool
                 ) -> tuple[dict[int, ValueMap | str], dict[int, _Seen]]:
    """One pass of one-token rows: each block's ValueMap (or why not), and what its hooks
    saw."""
    seen = {p.layer: _Seen() for p in plans}
    left = [len(plans)]
    hooks = [(p.leaves[r], _keep(seen[p.layer], r, left, merged)) for p in plans
             for r in p.readers]
    hooks += [(p.leaves[p.writer], _keep(seen[p.layer], "o_in", left, merged)) for p in plans]
    with hooked(hooks):
        run_probe(target, ids1)
    values: dict[int, ValueMap | str] = {}
    for p in plans:
        if merged and not seen[p.layer].done:
            seen[p.layer].alone = True  # its verdict is its own pass's, which stops there
            continue
        try:
            values[p.layer] = map_values(p, seen[p.layer].rec)
        except Unmapped as e:
            values[p.layer] = str(e)
        except MODEL_ERRORS as e:
            values[p.layer] = failed(e)
    return values, seen


def _heads_pass(target: nn.Module, plans: list[AttentionPlan], values: dict[int, ValueMap],
                ids2: torch.Tensor, *, merged: bool) -> dict[int, Probed | None]:
    """One pass of two-token rows with each block's query and key columns perturbed: each
    block's weights (or why not; None: probe it in passes of its own)."""
    n_rows = 1 + 4 * max(len(values[p.layer].qk_blocks) for p in plans)
    ids = ids2[:1].expand(n_rows, -1).contiguous()
    seen = {p.layer: _Seen() for p in plans}
    left = [len(plans)]

    def change(p: AttentionPlan, reader: str, gen: torch.Generator) -> Callable[..., Any]:
        s = seen[p.layer]

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            s.called(reader)
            y = output_tensor(output)
            assert y is not None
            if merged and not _rows_alike(y, n_rows, p.dtype):
                s.alone = True  # an earlier block's perturbation reached this one
            y = perturb(p, values[p.layer], reader, n_rows, gen, y)
            if isinstance(output, tuple):
                return (y, *output[1:])
            return y
        return hook

    def restore(p: AttentionPlan) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            y = output_tensor(output)
            if y is not None and y.dim() > 0 and y.shape[0] == n_rows:
                y[1:] = y[:1]  # in place: every row goes on as the unperturbed one
        return hook

    hooks: list[tuple[nn.Module, Any]] = []
    for p in plans:
        gen = torch.Generator().manual_seed(p.layer)
        hooks += [(p.leaves[r], change(p, r, gen)) for r in p.readers]
        hooks.append((p.leaves[p.writer], _keep(seen[p.layer], "o_in", left, merged)))
        if merged:
            hooks.append((p.module, restore(p)))
    with hooked(hooks):
        run_probe(target, ids)
    out: dict[int, Probed | None] = {}
    for p in plans:
        s = seen[p.layer]
        if merged and (s.alone or "o_in" not in s.rec
                       or any(s.calls.get(r) != 1 for r in p.readers)):
            out[p.layer] = None
            continue
        if "o_in" not in s.rec:
            raise RuntimeError("the attention's output projection did not run on two tokens")
        try:
            out[p.layer] = (map_heads(p, values[p.layer], s.rec["o_in"]), p.x)
        except Unmapped as e:
            out[p.layer] = str(e)
        except MODEL_ERRORS as e:
            out[p.layer] = failed(e)
    return out


def _rows_alike(y: torch.Tensor, n_rows: int, dtype: torch.dtype) -> bool:
    """Whether every row of `y` (rows first) is row 0's, to rounding."""
    flat = y.detach().reshape(n_rows, -1).double()
    return float((flat - flat[:1]).abs().max()) <= tolerance(dtype) * (
        float(flat[0].abs().max()) or 1.0)
