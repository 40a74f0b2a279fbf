"""A block's MLP weights (gated or not, and each expert of a mixture), read from probe
passes (weights.py says how)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .capture import output_tensor
from .weight_probes import Unmapped, affine, close_enough, first_line, projections_of, same
from .weight_records import MlpWeights


def find_mlp(model: nn.Module, layer: int, path: str | None, attn_path: str | None,
         block_leaves: list[str], calls: Mapping[str, Any], every: Mapping[str, list[Any]],
         d_model: int) -> tuple[list[MlpWeights], torch.Tensor | None]:
    """The MLP's weights (one entry, or one an expert), and the input its readers read."""
    if path is not None:
        experts = _experts(model, layer, path, calls, every, d_model)
        if experts is not None:
            return experts, calls[path].input
    after = calls[attn_path].end if attn_path is not None else -1
    region = [p for p in (projections_of(model, path) if path is not None else {}) if p in calls]
    # A block whose MLP is no module of its own (OPT), or whose MLP writes through a sibling
    # (BERT's intermediate, then output.dense): the block's other projections after it.
    region += [p for p in block_leaves if calls[p].start > after and p not in region]
    region = [p for p in region if calls[p].start > after or path is not None]
    if not region:
        raise Unmapped("no projection found in the MLP")
    first = min(region, key=lambda p: calls[p].start)
    x = calls[first].input
    readers = [p for p in region if same(calls[p].input, x)]
    writers = [p for p in region if p not in readers and calls[p].output is not None
               and calls[p].output.shape[-1] == d_model]
    if not writers:
        raise Unmapped("no projection writes the model width after the MLP's readers")
    writer = max(writers, key=lambda p: calls[p].start)
    if len(readers) > 2 or len(region) != len(readers) + 1:
        raise Unmapped(f"the MLP has {len(region)} projections, not an input (and a gate) "
                        "and an output (a shared expert beside a router, or a mixer)")
    mods = {p: model.get_submodule(p) for p in region}
    w_out, b_out = affine(mods[writer], calls[writer].input, calls[writer].output)
    h = calls[writer].input.double()
    n = int(w_out.shape[1])
    mats = {p: affine(mods[p], calls[p].input, calls[p].output) for p in readers}
    outs = {p: calls[p].output.double() for p in readers}
    act = _activation(model, path, calls, every, readers, writer)
    if act is None:
        raise Unmapped("no activation module between the MLP's projections")
    act_call, act_mod = act
    a_in = act_call.input.double()
    a_out = act_call.output.double()
    # Columns of the readers: (reader, lo, hi) of the activation's input and of the rest.
    pieces = [(p, lo, lo + n) for p in readers for lo in range(0, int(outs[p].shape[-1]), n)]
    if len(pieces) not in (1, 2) or any(hi > int(outs[p].shape[-1]) for p, _, hi in pieces):
        raise Unmapped("the MLP's readers are not one or two blocks of its width")
    dtype = calls[writer].input.dtype
    gate = next((q for q in pieces if close_enough(outs[q[0]][..., q[1]:q[2]], a_in, dtype)), None)
    if gate is None:
        raise Unmapped("the activation's input is no reader's output")
    up = next((q for q in pieces if q != gate), None)
    want = a_out if up is None else a_out * outs[up[0]][..., up[1]:up[2]]
    if not close_enough(want, h, dtype):
        raise Unmapped("the output projection does not read act(gate) * up")

    def piece(q: tuple[str, int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, b = mats[q[0]]
        return w[q[1]:q[2]], None if b is None else b[q[1]:q[2]]

    g_w, g_b = piece(gate)
    if up is None:
        w_in, b_in, w_gate, b_gate = g_w, g_b, None, None
    else:
        (w_in, b_in), w_gate, b_gate = piece(up), g_w, g_b
    return [MlpWeights(layer=layer, expert=None, module=path or first.rsplit(".", 1)[0],
                       w_in=w_in, w_gate=w_gate, w_out=w_out.t(), b_in=b_in, b_gate=b_gate,
                       b_out=b_out, activation=type(act_mod).__name__, act_fn=act_mod)], x


def _activation(model: nn.Module, path: str | None, calls: Mapping[str, Any],
                every: Mapping[str, list[Any]], readers: list[str], writer: str
                ) -> tuple[Any, nn.Module] | None:
    """The call of a module without a matrix weight made between the readers and the writer
    (XLM shares one activation module across its blocks: the call in this block's window)."""
    lo = min(calls[p].end for p in readers)
    hi = calls[writer].start
    for p, cs in every.items():
        if p in readers or (path is not None and not p.startswith(path + ".")):
            continue
        m = model.get_submodule(p)
        if any(q.dim() > 1 for q in m.parameters()):
            continue
        for c in cs:
            if lo < c.start < hi and c.input is not None and c.output is not None:
                return c, m
    return None


def _experts(model: nn.Module, layer: int, path: str, calls: Mapping[str, Any],
             every: Mapping[str, list[Any]], d_model: int) -> list[MlpWeights] | None:
    """A mixture's routed experts, kept as 3-D parameters (a fused [experts, 2n, d] gate and
    input, an [experts, d, n] output), each read by calling the experts module with every
    token sent to that one expert at weight 1; then its shared experts, each a dense MLP
    beside them. None where the MLP has no such experts."""
    root = model.get_submodule(path)
    found = next(((sub, m) for sub, m in root.named_modules()
                  if sum(1 for q in m.parameters(recurse=False) if q.dim() == 3) >= 2), None)
    if found is None:
        return None
    sub, experts = found
    where = f"{path}.{sub}"
    params = dict(experts.named_parameters(recurse=False))
    three = [q for q in params.values() if q.dim() == 3]
    if len(three) != 2 or len(params) != 2:
        raise Unmapped(f"the experts of {where} keep {len(params)} parameters, not a fused "
                        "gate and input and an output without biases")
    n_experts = int(three[0].shape[0])
    widths = [int(q.shape[1] * q.shape[2] // d_model) for q in three]
    if widths[0] == 2 * widths[1]:
        fused, down = three
    elif widths[1] == 2 * widths[0]:
        down, fused = three
    else:
        raise Unmapped(f"the experts of {where} are not a fused gate and input beside an "
                        "output")
    n = min(widths)
    fused, down = fused.detach(), down.detach()  # read here, never trained
    act = next((m for m in experts.children() if not any(True for _ in m.parameters())), None)
    x = calls[path].input
    if act is None or x is None:
        raise Unmapped(f"the experts of {where} have no activation module")
    x2 = x.reshape(-1, d_model).detach()
    ones = torch.ones(len(x2), 1, dtype=x2.dtype, device=x2.device)
    out: list[MlpWeights] = []
    for e in range(n_experts):
        index = torch.full((len(x2), 1), e, dtype=torch.long, device=x2.device)
        try:
            with torch.no_grad():
                y = experts(x2, index, ones)
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            raise Unmapped(f"the experts of {where} cannot be called with one expert a "
                            f"token ({first_line(err)})") from None
        y = output_tensor(y)
        assert y is not None
        gu = fused[e] if fused.shape[1] == 2 * n else fused[e].t()  # [2n, d]
        rows = [down[e].t(), down[e]] if down.shape[1] != down.shape[2] else [down[e].t()]
        found_map = None
        for w_out in rows:
            if tuple(w_out.shape) != (n, d_model):
                continue
            for gate, up in ((gu[:n], gu[n:]), (gu[n:], gu[:n])):
                h = act(x2 @ gate.t()) * (x2 @ up.t())
                if close_enough(h @ w_out, y, x2.dtype):
                    found_map = (gate, up, w_out)
                    break
            if found_map:
                break
        if found_map is None:
            raise Unmapped(f"expert {e} of {where} does not compute act(gate) * up, then "
                            "its output, from its parameters")
        gate, up, w_out = (t.detach() for t in found_map)
        out.append(MlpWeights(layer=layer, expert=e, module=where, w_in=up, w_gate=gate,
                              w_out=w_out, b_in=None, b_gate=None, b_out=None,
                              activation=type(act).__name__, act_fn=act))
    # Shared experts: the MLP's other children that are MLPs of their own (a router is one
    # projection, so not one).
    for name, child in root.named_children():
        child_path = f"{path}.{name}"
        leaves = [p for p in projections_of(model, child_path) if p in calls]
        if child is experts or len(leaves) < 2:
            continue
        shared, _ = find_mlp(model, layer, child_path, None, [], calls, every, d_model)
        out += [replace(m, expert=n_experts + j, shared=True) for j, m in enumerate(shared)]
    return out
