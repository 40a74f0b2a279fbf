"""Find the weights that read from and write to the residual stream, by what they do.

No per-model table of parameter names. In each block, the attention module and the MLP are the
sublayers sites.py finds; their projections are the leaf modules with a matrix weight
(nn.Linear, GPT-2's Conv1D, ...), and what each one is is read from forward passes:

- A projection's orientation (`[out, in]` or Conv1D's `[in, out]`) is the one that reproduces
  its recorded output from its recorded input.
- The attention's readers are the projections whose input is the attention's input; its
  writer is the last projection to run that writes the model width (its input is the heads,
  merged).
- Values: with one token, softmax gives its only key the weight 1, so the writer's input is
  each head's value itself: the reader columns equal to the writer's input columns are the
  values, and which head slots each feeds gives the grouped-query map.
- Queries and keys: the other reader columns, in blocks of d_head. Over two tokens, a key
  block changed at the first token changes what the second token's heads read; a query block
  does not (the first token's query meets one key). Changed at the second token, a query
  block changes its one head, a key block every head of its group.
- The MLP: its readers are the projections reading its input; its activation module's input
  is the gate (or the one reader, ungated), and the writer's input must equal
  act(gate) * up (or act(in)): checked on the probe, or the MLP is refused with the reason.
- Mixtures of experts keep each expert's matrices in 3-D parameters ([experts, 2n, d] and
  [experts, d, n]); which half is the gate is read from the experts' activation input.

What cannot be mapped (latent attention, linear attention, gated attention outputs) is
refused per layer with the reason, never guessed. Matrices are the model's own values
(sliced and transposed, never computed), so storing them as float32 is exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn

from .capture import Call, CallLog, first_tensor, output_tensor
from .sites import FoundSite, block_sublayers, forward_module, is_norm_module
from .sites import is_projection as _is_projection

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "attention_heads",
               "encoder_attention_heads")


@dataclass(frozen=True, kw_only=True)
class AttentionWeights:
    """One block's attention, per head; rows are directions in the residual stream (d).

    `w_q[h, i]` is the direction whose dot product with the attention's input gives query
    dimension i of head h (before bias, rotary and scaling); `w_o[h, i]` what value dimension
    i of head h writes. Keys and values are per key-value head; `kv_of_head[h]` maps.
    """

    layer: int
    module: str
    w_q: torch.Tensor  # [H, dh, d]
    w_k: torch.Tensor  # [Hkv, dh, d]
    w_v: torch.Tensor  # [Hkv, dh, d]
    w_o: torch.Tensor  # [H, dh, d]
    b_q: torch.Tensor | None  # [H, dh]
    b_k: torch.Tensor | None  # [Hkv, dh]
    b_v: torch.Tensor | None  # [Hkv, dh]
    b_o: torch.Tensor | None  # [d]
    kv_of_head: tuple[int, ...]
    reads: str | None = None  # the site whose output the attention reads (its gain folds in)

    @property
    def n_heads(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def n_kv_heads(self) -> int:
        return int(self.w_k.shape[0])

    @property
    def d_head(self) -> int:
        return int(self.w_q.shape[1])


@dataclass(frozen=True, kw_only=True)
class MlpWeights:
    """One MLP (or one expert of a mixture): neuron n reads `w_in[n]` (and `w_gate[n]`),
    and writes `w_out[n]`: out = sum_n act(w_gate[n] . x) * (w_in[n] . x) * w_out[n]
    (ungated: act(w_in[n] . x + b_in[n]))."""

    layer: int
    expert: int | None
    module: str
    w_in: torch.Tensor  # [n, d]
    w_gate: torch.Tensor | None  # [n, d]
    w_out: torch.Tensor  # [n, d]
    b_in: torch.Tensor | None
    b_gate: torch.Tensor | None
    b_out: torch.Tensor | None  # [d]
    activation: str  # the activation module's class name (e.g. SiLUActivation, NewGELU...)
    reads: str | None = None  # the site whose output the MLP reads
    shared: bool = False  # a mixture's shared expert (numbered after the routed ones)
    act_fn: Any = field(default=None, compare=False, repr=False)  # the model's own callable


@dataclass(frozen=True, kw_only=True)
class Refusal:
    layer: int
    part: str  # "attn" or "mlp"
    module: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ModelWeights:
    attention: list[AttentionWeights]
    mlps: list[MlpWeights]
    refused: list[Refusal]


class _Unmapped(Exception):
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
        raise _Unmapped(f"projection {type(module).__name__} is not x W^T + b of its weight")
    return best, b


def _heads(attn: nn.Module, config: Any) -> int | None:
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


@contextmanager
def _recorded(modules: Mapping[str, nn.Module]) -> Iterator[CallLog]:
    """Every call of `modules` in order, with copies of its input and output: a model may
    change an output in place after the call (Falcon adds the attention's output to the
    MLP's)."""
    log = CallLog()

    def make(name: str) -> tuple[Any, Any]:
        def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            x = first_tensor(args, kwargs)
            log.calls.setdefault(name, []).append(
                Call(start=log.tick(), input=None if x is None else x.detach().clone()))

        def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            call = log.calls[name][-1]
            call.end = log.tick()
            y = output_tensor(output)
            call.output = None if y is None else y.detach().clone()
        return pre, post

    handles = []
    try:
        for name, module in modules.items():
            pre, post = make(name)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        yield log
    finally:
        for h in handles:
            h.remove()


class _Stop(Exception):
    """Raised by a hook once what a probe pass needs is recorded."""


@contextmanager
def _hooked(hooks: list[tuple[nn.Module, Any]]) -> Iterator[None]:
    handles = [m.register_forward_hook(fn, with_kwargs=True) for m, fn in hooks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _run(target: nn.Module, ids: torch.Tensor) -> None:
    mask = torch.ones_like(ids)
    try:
        with torch.no_grad():
            target(input_ids=ids, attention_mask=mask)
    except _Stop:
        pass


def _leaves(model: nn.Module, path: str) -> dict[str, nn.Module]:
    root = model.get_submodule(path)
    return {f"{path}.{sub}" if sub else path: m for sub, m in root.named_modules()
            if _is_projection(m) or (not sub and _is_projection(root))}


def _functions(root: nn.Module, path: str) -> dict[str, nn.Module]:
    """Leaf modules without parameters (activations), dropout and identities left out."""
    return {f"{path}.{sub}" if sub else path: m for sub, m in root.named_modules()
            if not list(m.children()) and not any(q.dim() > 1 for q in m.parameters())
            and not isinstance(m, nn.Dropout | nn.Identity) and not is_norm_module(m)}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is not None and b is not None and a.numel() == b.numel()
            and torch.equal(a.reshape(-1), b.reshape(-1)))


def extract(model: nn.Module, found: list[FoundSite], tokens: list[int], *,
            device: torch.device) -> ModelWeights:
    """Every block's attention and MLP weights, or the reason one cannot be mapped.

    `tokens`: token ids to run probe passes on (the prompts' own)."""
    # The blocks of the tower the model's head reads (a multimodal model's text stack).
    # (the last site's, in a model without a final norm: BERT's encoder is post-norm)
    final = next((f for f in reversed(found) if f.record.role == "final"), found[-1])
    tower = final.record.tower
    norm_paths = [p for f in found if f.record.tower == tower for p, _ in f.hooks]
    blocks, sublayers = block_sublayers(model, norm_paths)
    config = getattr(model, "config", None)
    pretrained: Any = model  # a transformers model: get_input_embeddings is its method
    embed = pretrained.get_input_embeddings()
    d_model = int(embed.weight.shape[1])
    paths = [p for f in found for p, _ in f.hooks]
    target = forward_module(model, paths)
    pool = tokens or [0]
    ids1 = torch.tensor([[pool[(7 * r) % len(pool)]] for r in range(6)], device=device)
    ids2 = torch.tensor([[pool[(5 * r) % len(pool)], pool[(5 * r + 3) % len(pool)]]
                         for r in range(3)], device=device)

    watched: dict[str, nn.Module] = {p: model.get_submodule(p) for p in sublayers}
    for i in range(blocks.n):
        for _, child_path, child in blocks.children(model, i):
            if is_norm_module(child):
                continue
            watched.update(_leaves(model, child_path))
            watched.update(_functions(child, child_path))
    site_of = {f.hooks[0][0]: f.record.site for f in found if len(f.hooks) == 1
               and f.record.n_heads is None}
    watched.update({p: model.get_submodule(p) for p in site_of})
    try:
        with torch.no_grad(), _recorded(watched) as log:
            target(input_ids=ids2, attention_mask=torch.ones_like(ids2))
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        return ModelWeights(attention=[], mlps=[], refused=[Refusal(
            layer=-1, part="model", module="", reason=f"its probe pass failed ({_first(e)})")])
    calls = {k: v[0] for k, v in log.calls.items() if v}
    every = {k: list(v) for k, v in log.calls.items()}

    def reads(x: torch.Tensor | None) -> str | None:
        """The site whose output `x` is (None: no stored site's)."""
        return next((site for p, site in site_of.items() for c in every.get(p, ())
                     if _same(c.output, x)), None)

    out = ModelWeights(attention=[], mlps=[], refused=[])
    for i in range(blocks.n):
        mine = {p: k for p, (k, j) in sublayers.items() if j == i}
        attn_path = next((p for p, k in mine.items() if k == "attn" and p in calls), None)
        if attn_path is not None:
            try:
                a, x = _attention(model, target, i, attn_path, calls, config, d_model, ids1,
                                  ids2)
                out.attention.append(replace(a, reads=reads(x)))
            except _Unmapped as e:
                out.refused.append(Refusal(layer=i, part="attn", module=attn_path,
                                           reason=str(e)))
            except (RuntimeError, ValueError, IndexError, TypeError) as e:  # the model's own
                out.refused.append(Refusal(layer=i, part="attn", module=attn_path,
                                           reason=f"its probe pass failed ({_first(e)})"))
        mlp_path = next((p for p, k in mine.items() if k == "mlp" and p in calls), None)
        block_leaves = [p for _, cp, _ in blocks.children(model, i) if cp not in sublayers
                        for p in _leaves(model, cp) if p in calls]
        if mlp_path is None and not block_leaves:
            continue
        try:
            mlps, x = _mlp(model, i, mlp_path, attn_path, block_leaves, calls, every, d_model)
            out.mlps.extend(replace(m, reads=reads(x)) for m in mlps)
        except _Unmapped as e:
            out.refused.append(Refusal(layer=i, part="mlp", module=mlp_path or "?",
                                       reason=str(e)))
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            out.refused.append(Refusal(layer=i, part="mlp", module=mlp_path or "?",
                                       reason=f"its probe pass failed ({_first(e)})"))
    return out


def _attention(model: nn.Module, target: nn.Module, layer: int, path: str,
               calls: Mapping[str, Any], config: Any, d_model: int,
               ids1: torch.Tensor, ids2: torch.Tensor
               ) -> tuple[AttentionWeights, torch.Tensor | None]:
    """The attention's weights per head, and the input its projections read."""
    attn = model.get_submodule(path)
    leaves = {p: m for p, m in _leaves(model, path).items() if p in calls}
    if not leaves:
        raise _Unmapped("no projection runs in the attention")
    # The first projection's input: the attention's own, or its inner norm's output
    # (RoBERTa-PreLayerNorm norms inside its attention module).
    x = calls[min(leaves, key=lambda p: calls[p].start)].input
    readers = [p for p in leaves if _same(calls[p].input, x)]
    writers = [p for p in leaves if calls[p].output is not None
               and calls[p].output.shape[-1] == d_model and p not in readers]
    if not readers or not writers:
        raise _Unmapped("no projection reads the attention's input and another writes the "
                        "model width (not a softmax attention over projections: linear "
                        "attention or a state-space mixer)")
    writer = max(writers, key=lambda p: calls[p].start)
    n_heads = _heads(attn, config)
    w_o, b_o = affine(leaves[writer], calls[writer].input, calls[writer].output)
    width = int(w_o.shape[1])
    if n_heads is None or width % n_heads:
        raise _Unmapped(f"the output projection reads {width} values, not a whole number of "
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
                raise _Stop
        return hook

    with _hooked([(leaves[p], keep(p)) for p in readers]
                 + [(leaves[writer], keep("o_in", stop=True))]):
        _run(target, ids1)
    if "o_in" not in rec or any(p not in rec for p in readers):
        raise _Unmapped("its projections do not run on a one-token input")
    cols = torch.cat([rec[p].reshape(-1, rec[p].shape[-1]) for p in readers], dim=1)  # [B, C]
    o_in = rec["o_in"].reshape(-1, width)  # [B, H*dh]
    scale = cols.abs().amax(0).clamp_min(1e-30)
    v_col = []
    for s in range(width):
        diff = (cols - o_in[:, s : s + 1]).abs().amax(0) / scale
        j = int(diff.argmin())
        if float(diff[j]) > max(1e-4, _tolerance(x.dtype)):
            raise _Unmapped("a head's value is not a column of the projections reading the "
                            "residual (values through a latent, or a gated output)")
        v_col.append(j)
    vt = torch.tensor(v_col).reshape(n_heads, dh)
    if not bool((vt[:, 1:] - vt[:, :-1] == 1).all()):
        raise _Unmapped("a head's value dimensions are not consecutive columns")
    starts = sorted({int(s) for s in vt[:, 0]})
    kv_of_head = tuple(starts.index(int(s)) for s in vt[:, 0])
    n_kv = len(starts)
    v_cols = {c for s in starts for c in range(s, s + dh)}
    rest = [c for c in range(n_cols) if c not in v_cols]
    if len(rest) != (n_heads + n_kv) * dh:
        raise _Unmapped(f"{len(rest)} query and key columns for {n_heads} query and {n_kv} "
                        f"key-value heads of {dh}")
    qk_blocks = [rest[k : k + dh] for k in range(0, len(rest), dh)]
    if any(b[-1] - b[0] != dh - 1 for b in qk_blocks):
        raise _Unmapped("a query or key block is not consecutive columns")

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
    with _hooked([(leaves[p], perturb(p)) for p in readers]
                 + [(leaves[writer], keep("o_in", stop=True))]):
        _run(target, ids)
    o2 = rec["o_in"].reshape(n_rows, -1, width)[:, -1].reshape(n_rows, n_heads, dh)
    # Rows computed apart from the change agree to rounding (a batch's rows may round apart)
    tol = _tolerance(rec_dtype[0]) * (float(o2[0].abs().max()) or 1.0)
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
                raise _Unmapped("a key block's heads are not one key-value group")
            k_of.setdefault(kv.pop(), []).extend(block)
        elif not bool(first.any()) and heads:
            raise _Unmapped("a query block moves several heads: a norm over all heads' "
                            "queries or keys (OLMo 2's q_norm) mixes them, so no head has "
                            "a query map of its own")
        else:
            raise _Unmapped("a block of projection columns acts as neither a query nor a key")
    if sorted(q_of) != list(range(n_heads)) or sorted(k_of) != list(range(n_kv)) or any(
            len(v) != dh for v in (*q_of.values(), *k_of.values())):
        raise _Unmapped("queries and keys do not map one block a head")

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
        kv_of_head=kv_of_head), x


def _mlp(model: nn.Module, layer: int, path: str | None, attn_path: str | None,
         block_leaves: list[str], calls: Mapping[str, Any], every: Mapping[str, list[Any]],
         d_model: int) -> tuple[list[MlpWeights], torch.Tensor | None]:
    """The MLP's weights (one entry, or one an expert), and the input its readers read."""
    if path is not None:
        experts = _experts(model, layer, path, calls, every, d_model)
        if experts is not None:
            return experts, calls[path].input
    after = calls[attn_path].end if attn_path is not None else -1
    region = [p for p in (_leaves(model, path) if path is not None else {}) if p in calls]
    # A block whose MLP is no module of its own (OPT), or whose MLP writes through a sibling
    # (BERT's intermediate, then output.dense): the block's other projections after it.
    region += [p for p in block_leaves if calls[p].start > after and p not in region]
    region = [p for p in region if calls[p].start > after or path is not None]
    if not region:
        raise _Unmapped("no projection found in the MLP")
    first = min(region, key=lambda p: calls[p].start)
    x = calls[first].input
    readers = [p for p in region if _same(calls[p].input, x)]
    writers = [p for p in region if p not in readers and calls[p].output is not None
               and calls[p].output.shape[-1] == d_model]
    if not writers:
        raise _Unmapped("no projection writes the model width after the MLP's readers")
    writer = max(writers, key=lambda p: calls[p].start)
    if len(readers) > 2 or len(region) != len(readers) + 1:
        raise _Unmapped(f"the MLP has {len(region)} projections, not an input (and a gate) "
                        "and an output (a shared expert beside a router, or a mixer)")
    mods = {p: model.get_submodule(p) for p in region}
    w_out, b_out = affine(mods[writer], calls[writer].input, calls[writer].output)
    h = calls[writer].input.double()
    n = int(w_out.shape[1])
    mats = {p: affine(mods[p], calls[p].input, calls[p].output) for p in readers}
    outs = {p: calls[p].output.double() for p in readers}
    act = _activation(model, path, calls, every, readers, writer)
    if act is None:
        raise _Unmapped("no activation module between the MLP's projections")
    act_call, act_mod = act
    a_in = act_call.input.double()
    a_out = act_call.output.double()
    # Columns of the readers: (reader, lo, hi) of the activation's input and of the rest.
    pieces = [(p, lo, lo + n) for p in readers for lo in range(0, int(outs[p].shape[-1]), n)]
    if len(pieces) not in (1, 2) or any(hi > int(outs[p].shape[-1]) for p, _, hi in pieces):
        raise _Unmapped("the MLP's readers are not one or two blocks of its width")
    dtype = calls[writer].input.dtype
    gate = next((q for q in pieces if _close(outs[q[0]][..., q[1]:q[2]], a_in, dtype)), None)
    if gate is None:
        raise _Unmapped("the activation's input is no reader's output")
    up = next((q for q in pieces if q != gate), None)
    want = a_out if up is None else a_out * outs[up[0]][..., up[1]:up[2]]
    if not _close(want, h, dtype):
        raise _Unmapped("the output projection does not read act(gate) * up")

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


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _tolerance(dtype: torch.dtype) -> float:
    """Relative difference two computations of one value may show in `dtype`: a bfloat16
    model's activation rounds to about 2^-8."""
    return max(1e-5, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    if a.numel() != b.numel():
        return False
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    return float((a - b).abs().max()) <= _tolerance(dtype) * (float(b.abs().max()) or 1.0)


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
        raise _Unmapped(f"the experts of {where} keep {len(params)} parameters, not a fused "
                        "gate and input and an output without biases")
    n_experts = int(three[0].shape[0])
    widths = [int(q.shape[1] * q.shape[2] // d_model) for q in three]
    if widths[0] == 2 * widths[1]:
        fused, down = three
    elif widths[1] == 2 * widths[0]:
        down, fused = three
    else:
        raise _Unmapped(f"the experts of {where} are not a fused gate and input beside an "
                        "output")
    n = min(widths)
    fused, down = fused.detach(), down.detach()  # read here, never trained
    act = next((m for m in experts.children() if not any(True for _ in m.parameters())), None)
    x = calls[path].input
    if act is None or x is None:
        raise _Unmapped(f"the experts of {where} have no activation module")
    x2 = x.reshape(-1, d_model).detach()
    ones = torch.ones(len(x2), 1, dtype=x2.dtype, device=x2.device)
    out: list[MlpWeights] = []
    for e in range(n_experts):
        index = torch.full((len(x2), 1), e, dtype=torch.long, device=x2.device)
        try:
            with torch.no_grad():
                y = experts(x2, index, ones)
        except (RuntimeError, ValueError, IndexError, TypeError) as err:
            raise _Unmapped(f"the experts of {where} cannot be called with one expert a "
                            f"token ({_first(err)})") from None
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
                if _close(h @ w_out, y, x2.dtype):
                    found_map = (gate, up, w_out)
                    break
            if found_map:
                break
        if found_map is None:
            raise _Unmapped(f"expert {e} of {where} does not compute act(gate) * up, then "
                            "its output, from its parameters")
        gate, up, w_out = (t.detach() for t in found_map)
        out.append(MlpWeights(layer=layer, expert=e, module=where, w_in=up, w_gate=gate,
                              w_out=w_out, b_in=None, b_gate=None, b_out=None,
                              activation=type(act).__name__, act_fn=act))
    # Shared experts: the MLP's other children that are MLPs of their own (a router is one
    # projection, so not one).
    for name, child in root.named_children():
        child_path = f"{path}.{name}"
        leaves = [p for p in _leaves(model, child_path) if p in calls]
        if child is experts or len(leaves) < 2:
            continue
        shared, _ = _mlp(model, layer, child_path, None, [], calls, every, d_model)
        out += [replace(m, expert=n_experts + j, shared=True) for j, m in enumerate(shared)]
    return out
