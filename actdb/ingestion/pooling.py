"""A classification head that averages its positions (Swin, SwinV2, FocalNet, I-JEPA, PVTv2,
SegFormer, a Wav2Vec2 or HuBERT sequence classifier): its logits are
`W . mean_t(y_t) + b` over an input's final-normed rows `y_t`, through any linear layers
between the norm and the mean (Wav2Vec2's `projector`) folded into `W` and `b`. Since every
map after the norm is linear, that is `mean_t(W . y_t + b)`: each row's logits are its vote,
and the model's answer is their mean, so the head's rows are anchors each row can be read
against, as a class token's are.

Found by behaviour, not by family: one pass hooked on the final norm, the head and every
linear layer that runs after the norm says what the head reads (the mean of the norm's rows,
or of a linear layer's outputs on them); a second pass, with the norm's output replaced by
random rows, proves that the model's logits are the mean of the rows' logits for any rows,
not only the sample's. A head that reads anything else (the class token beside the patches'
mean, an attention pool, a mean over some positions only) is refused in one sentence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .capture import first_tensor, output_tensor
from .layouts import as_rows
from .logits import model_logits
from .sites import FoundSite

# Worst relative error of the model's logits against the mean of the rows' logits, computed
# in float64 from the same float32 numbers in another order (about 1e-6); a model run in 16
# bits rounds its own sums to 8 or 11 bits.
_PROOF_LIMIT = {torch.float32: 1e-4, torch.float64: 1e-4}
_PROOF_LIMIT_16 = 2e-2
_MAX_LINEAR = 3  # linear layers between the norm and the mean that are followed
_MAX_SKIPPED = 8  # leading positions (a class token, registers) a refusal's diagnosis tries


@dataclass(frozen=True, kw_only=True)
class PooledHead:
    """The head as one linear map of a final-normed row: logits = mean_t(weight . y_t + bias)."""

    weight: torch.Tensor  # float64 [L, d]
    bias: torch.Tensor  # float64 [L]
    error: float  # worst relative error of the proofs


@dataclass
class _Seen:
    """What one hooked pass saw after the final norm ran."""

    final: torch.Tensor | None = None
    head_input: torch.Tensor | None = None
    linears: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] | None = None


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst relative error of rows a against rows b (both [B, k])."""
    diff = torch.linalg.vector_norm(a - b, dim=-1)
    return float((diff / torch.linalg.vector_norm(b, dim=-1).clamp_min(1e-30)).max())


def _hooked_pass(model: nn.Module, head: nn.Linear, final: FoundSite,
                 sample: Mapping[str, torch.Tensor], replace: torch.Tensor | None = None
                 ) -> tuple[_Seen, torch.Tensor]:
    """One forward pass: the final norm's output (or `replace`, sent in its place), the head's
    input and each linear layer's input and output after the norm; and the model's logits."""
    seen = _Seen(linears=[])
    handles = []

    def on_final(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if seen.final is not None:
            return None  # a norm called twice reads nothing new for the head
        y = output_tensor(output)
        if y is None:
            return None
        if replace is not None:
            sent = replace.to(dtype=y.dtype, device=y.device).reshape(y.shape)
            seen.final = sent.detach().clone()
            return sent if isinstance(output, torch.Tensor) else (sent, *output[1:])
        seen.final = y.detach().clone()
        return None

    def on_linear(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  output: Any) -> None:
        x, y = first_tensor(args, kwargs), output_tensor(output)
        if seen.final is None or x is None or y is None or seen.linears is None:
            return
        # copies: a model may change an output in place (Wav2Vec2 zeroes padded frames)
        if module is head:
            seen.head_input = x.detach().clone()
        elif isinstance(module, nn.Linear):
            seen.linears.append((module, x.detach().clone(), y.detach().clone()))

    try:
        handles.append(final.module.register_forward_hook(on_final))
        for m in model.modules():
            if isinstance(m, nn.Linear):
                handles.append(m.register_forward_hook(on_linear, with_kwargs=True))
        with torch.no_grad():
            real = model_logits(model(**sample))
    finally:
        for h in handles:
            h.remove()
    return seen, real.detach().double().cpu()


def _rows(t: torch.Tensor, batch: int) -> torch.Tensor | None:
    """A linear layer's input or output as [B, T, k] float64 (None: not batch-major)."""
    if t.dim() < 2 or t.numel() % (batch * t.shape[-1]):
        return None
    return t.reshape(batch, -1, t.shape[-1]).double().cpu()


class _Refused(Exception):
    """Why the head is not a mean of its rows' logits (a sentence)."""


def _chain(seen: _Seen, rows: torch.Tensor, limit: float) -> list[nn.Linear]:
    """The linear layers (in order) between the norm's rows and the mean the head reads.

    Raises _Refused where the head reads no such mean."""
    b = rows.shape[0]
    h = seen.head_input
    assert h is not None and seen.linears is not None
    if h.dim() != 2 or h.shape[0] != b:
        raise _Refused(f"its head reads a tensor of shape {tuple(h.shape)}, not one vector "
                       "an input")
    want = h.double().cpu()
    linears = [(m, _rows(x, b), _rows(y, b)) for m, x, y in seen.linears]

    def search(cur: torch.Tensor, used: list[nn.Linear]) -> list[nn.Linear] | None:
        if cur.shape[-1] == want.shape[-1] and _relative(cur.mean(1), want) <= limit:
            return used
        if len(used) == _MAX_LINEAR:
            return None
        # every linear layer that read these rows (an attention pool's key and value
        # projections both do): the one whose outputs' mean the head reads, if any
        for module, x, y in linears:
            if (x is not None and y is not None and x.shape == cur.shape
                    and module not in used
                    and _relative(x.reshape(-1, x.shape[-1]),
                                  cur.reshape(-1, cur.shape[-1])) <= limit):
                found = search(y, [*used, module])
                if found is not None:
                    return found
        return None

    chain = search(rows, [])
    if chain is None:
        raise _Refused(
            f"its head reads vectors of width {want.shape[-1]} that are not the mean of the "
            f"final norm's rows (width {rows.shape[-1]}), nor of a linear layer's outputs on "
            f"them ({_what_it_reads(rows, want, limit)})")
    return chain


def _what_it_reads(rows: torch.Tensor, want: torch.Tensor, limit: float) -> str:
    """What a head that reads no mean of every row reads, where the rows say it: the class
    token beside the mean of the positions from some k on (DINOv2's; past its registers), or
    that mean alone."""
    d, n = rows.shape[-1], rows.shape[1]
    for k in range(1, min(n, _MAX_SKIPPED + 1)):
        after = "the other positions" if k == 1 else f"the positions from {k} on"
        if want.shape[-1] == 2 * d and max(
                _relative(want[:, :d], rows[:, 0]),
                _relative(want[:, d:], rows[:, k:].mean(1))) <= limit:
            return f"it reads the class token beside the mean of {after}"
        if want.shape[-1] == d and _relative(want, rows[:, k:].mean(1)) <= limit:
            return f"it reads the mean of {after}"
    return ("it reads another tensor, or pools another way: an attention pool, a mean over "
            "some positions only")


def _compose(head: nn.Linear, chain: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor]:
    """W, b of head . chain[-1] . ... . chain[0], in float64 on the host."""
    w = head.weight.detach().double().cpu()
    b = (head.bias.detach().double().cpu() if head.bias is not None
         else torch.zeros(w.shape[0], dtype=torch.float64))
    for lin in reversed(chain):
        lw = lin.weight.detach().double().cpu()
        if lin.bias is not None:
            b = b + w @ lin.bias.detach().double().cpu()
        w = w @ lw
    return w, b


@torch.no_grad()
def prove_pooled(model: nn.Module, head: nn.Linear, final: FoundSite,
                 sample: Mapping[str, torch.Tensor]) -> tuple[PooledHead | None, str]:
    """The head as a mean of the final norm's rows' logits, proven on `sample` and on random
    rows sent in the norm's place; else None and the sentence that says why."""
    if final.layout not in ("btd", "bhwc", "bchw"):
        return None, f"its final norm's layout {final.layout!r} is not one row a position"
    seen, real = _hooked_pass(model, head, final, sample)
    if seen.final is None or seen.head_input is None or real.dim() != 2:
        return None, ("its logits are not one row an input read from the final norm "
                      f"{final.record.module!r}")
    batch = real.shape[0]
    if seen.final.shape[0] % batch:
        return None, "its final norm does not see the inputs batch-major"
    dtype = seen.final.dtype
    limit = _PROOF_LIMIT.get(dtype, _PROOF_LIMIT_16)
    rows = as_rows(seen.final, final.layout, batch).double().cpu()  # [B, T, d]
    try:
        chain = _chain(seen, rows, limit)
    except _Refused as e:
        return None, str(e)
    w, b = _compose(head, chain)
    if w.shape[1] != rows.shape[-1]:
        return None, "its head's linear layers do not read the final norm's width"
    err = _relative((rows @ w.T + b).mean(1), real)
    # Random rows in the norm's place, each of its own size around the sample's: the logits
    # must follow them as the mean of their logits (an attention pool, or a mean of some rows
    # only, would not).
    gen = torch.Generator().manual_seed(11)
    r = torch.randn(tuple(seen.final.shape), generator=gen, dtype=torch.float64)
    scale = float(rows.pow(2).mean().sqrt()) or 1.0
    r = r * scale * 10.0 ** torch.empty(r.shape[0], *([1] * (r.dim() - 1))).uniform_(
        -0.5, 0.5, generator=gen).double()
    seen2, real2 = _hooked_pass(model, head, final, sample, replace=r)
    if seen2.final is None or real2.shape != real.shape:
        return None, "its logits do not follow its final norm's output"
    rows2 = as_rows(seen2.final, final.layout, batch).double().cpu()
    err = max(err, _relative((rows2 @ w.T + b).mean(1), real2))
    if not err <= limit:
        return None, (f"its logits are not the mean of its rows' logits through its head "
                      f"(relative error {err:.3g}: it pools another way)")
    return PooledHead(weight=w, bias=b, error=err), ""
