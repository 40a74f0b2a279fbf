"""A block's attention weights, per head, read from probe passes (weights.py says how)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .capture import first_tensor, output_tensor
from .rotary import attention_scale
from .weight_probes import (
    Stop,
    Unmapped,
    affine,
    count_heads,
    hooked,
    projections_of,
    run_probe,
    same,
    tolerance,
)
from .weight_records import AttentionWeights


def find_attention(model: nn.Module, target: nn.Module, layer: int, path: str,
               calls: Mapping[str, Any], config: Any, d_model: int,
               ids1: torch.Tensor, ids2: torch.Tensor
               ) -> tuple[AttentionWeights, torch.Tensor | None]:
    """The attention's weights per head, and the input its projections read."""
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
    dh = width // n_heads
    mats = {p: affine(leaves[p], calls[p].input, calls[p].output) for p in readers}
    offsets, at = {}, 0
    for p in readers:
        offsets[p], at = at, at + int(mats[p][0].shape[0])
    n_cols = at

    # One token: the writer's input is the values themselves.
    rec: dict[str, torch.Tensor] = {}
    rec_dtype = [x.dtype if x is not None else torch.float32]

    def keep(name: str, stop: bool = False) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            t = first_tensor(args, kwargs) if name == "o_in" else output_tensor(output)
            if t is not None:
                rec[name] = t.detach().double()
            if stop:
                raise Stop
        return hook

    with hooked([(leaves[p], keep(p)) for p in readers]
                 + [(leaves[writer], keep("o_in", stop=True))]):
        run_probe(target, ids1)
    if "o_in" not in rec or any(p not in rec for p in readers):
        raise Unmapped("its projections do not run on a one-token input")
    cols = torch.cat([rec[p].reshape(-1, rec[p].shape[-1]) for p in readers], dim=1)  # [B, C]
    o_in = rec["o_in"].reshape(-1, width)  # [B, H*dh]
    scale = cols.abs().amax(0).clamp_min(1e-30)
    v_col = []
    for s in range(width):
        diff = (cols - o_in[:, s : s + 1]).abs().amax(0) / scale
        j = int(diff.argmin())
        if float(diff[j]) > max(1e-4, tolerance(x.dtype)):
            raise Unmapped("a head's value is not a column of the projections reading the "
                            "residual (values through a latent, or a gated output)")
        v_col.append(j)
    vt = torch.tensor(v_col).reshape(n_heads, dh)
    if not bool((vt[:, 1:] - vt[:, :-1] == 1).all()):
        raise Unmapped("a head's value dimensions are not consecutive columns")
    starts = sorted({int(s) for s in vt[:, 0]})
    kv_of_head = tuple(starts.index(int(s)) for s in vt[:, 0])
    n_kv = len(starts)
    v_cols = {c for s in starts for c in range(s, s + dh)}
    rest = [c for c in range(n_cols) if c not in v_cols]
    if len(rest) != (n_heads + n_kv) * dh:
        raise Unmapped(f"{len(rest)} query and key columns for {n_heads} query and {n_kv} "
                        f"key-value heads of {dh}")
    qk_blocks = [rest[k : k + dh] for k in range(0, len(rest), dh)]
    if any(b[-1] - b[0] != dh - 1 for b in qk_blocks):
        raise Unmapped("a query or key block is not consecutive columns")

    # Two tokens: a row left as is, and per block four rows changing it at the first or the
    # second token, by a large vector or its negative: a softmax that the baseline saturates
    # (a token attending to one key alone) is pushed off it by one of the two signs.
    n_rows = 1 + 4 * len(qk_blocks)
    ids = ids2[:1].expand(n_rows, -1).contiguous()
    gen = torch.Generator().manual_seed(layer)

    def perturb(p: str) -> Any:
        lo = offsets[p]
        width_p = int(mats[p][0].shape[0])

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            y = output_tensor(output)
            assert y is not None
            y = y.clone()
            flat = y.reshape(n_rows, -1, width_p)
            for b, block in enumerate(qk_blocks):
                cs = [c - lo for c in block if lo <= c < lo + width_p]
                if not cs:
                    continue
                amp = 10.0 * (float(flat[:, :, cs].abs().max()) + 1.0)
                for pos in (0, 1):
                    noise = torch.randn(len(cs), generator=gen).to(y) * amp
                    flat[1 + 4 * b + 2 * pos, pos, cs] += noise
                    flat[2 + 4 * b + 2 * pos, pos, cs] -= noise
            if isinstance(output, tuple):
                return (y, *output[1:])
            return y
        return hook

    rec.clear()
    with hooked([(leaves[p], perturb(p)) for p in readers]
                 + [(leaves[writer], keep("o_in", stop=True))]):
        run_probe(target, ids)
    o2 = rec["o_in"].reshape(n_rows, -1, width)[:, -1].reshape(n_rows, n_heads, dh)
    # Rows computed apart from the change agree to rounding (a batch's rows may round apart)
    tol = tolerance(rec_dtype[0]) * (float(o2[0].abs().max()) or 1.0)
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

    w_all = torch.cat([mats[p][0] for p in readers], dim=0)  # [C, d], the model's values
    biases = [mats[p][1] for p in readers]
    b_all = None if all(b is None for b in biases) else torch.cat(
        [torch.zeros(int(mats[p][0].shape[0]), dtype=w_all.dtype, device=w_all.device)
         if b is None else b for p, b in zip(readers, biases, strict=True)])

    def take(order: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        idx = torch.tensor(order, device=w_all.device)  # [heads, dh]
        return w_all[idx], None if b_all is None else b_all[idx]

    w_q, b_q = take([q_of[h] for h in range(n_heads)])
    w_k, b_k = take([k_of[j] for j in range(n_kv)])
    w_v, b_v = take([list(range(s, s + dh)) for s in starts])
    return AttentionWeights(
        layer=layer, module=path, w_q=w_q, w_k=w_k, w_v=w_v,
        w_o=w_o.t().reshape(n_heads, dh, -1), b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
        kv_of_head=kv_of_head, scale=attention_scale(attn)), x
