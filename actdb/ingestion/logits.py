"""What a model does between its final norm and its logits, measured; and the ingest's proof
that logits recomputed from the store equal the model's own.

The recorded transform is `logit = cap * tanh(scale * pre / cap)` (no cap: `scale * pre`) with
`pre = W_U . final_norm(x) + b_U`. It covers an LM-head bias, a multiplication or division by a
constant (Cohere's `logit_scale`, Granite's `logits_scaling`, MiniCPM's width division) and
soft-capping (Gemma 2). It is found by replacing the final norm's output with vectors we choose,
at magnitudes from tiny to saturating, and fitting the model's real logits; config values only
serve to snap a measured number to the checkpoint's exact one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import norms
from ..errors import IngestError
from ..store.store import ActBatch
from .capture import output_tensor
from .sites import FoundSite

LOGIT_LIMIT = 1e-2  # worst relative error (per token, over the vocabulary) an ingest accepts
_FIT_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4, torch.float16: 1e-2,
                  torch.bfloat16: 3e-2}
_VOCAB_BLOCK = 16384  # vocabulary rows converted at a time: memory stays bounded


@dataclass(frozen=True, kw_only=True)
class LogitTransform:
    scale: float | None  # None: 1
    softcap: float | None
    error: float  # worst relative error of the fit against the model's logits

    def apply(self, pre: torch.Tensor) -> torch.Tensor:
        out = pre * self.scale if self.scale is not None else pre
        return self.softcap * torch.tanh(out / self.softcap) if self.softcap else out


def model_logits(out: Any) -> torch.Tensor:
    got = getattr(out, "logits", None)
    got = got if isinstance(got, torch.Tensor) else output_tensor(out)
    if got is None:
        raise IngestError("the model's forward pass returned no logits")
    return got


def _pre(h: torch.Tensor, head: nn.Module, *, bias: bool = True) -> torch.Tensor:
    """W_U . h + b_U for rows h [n, d] as float64 on the CPU, from the live LM head a block
    of the vocabulary at a time (no converted copy of the whole head), on the head's device
    (on a GPU, the head is not copied to the host: only the [n, V] products are). The product
    runs in float32 (float64 for a float64 model): its relative error, about 1e-7, is far
    below the fit's tolerance (1e-4), and a float64 product of a large vocabulary is slow."""
    w = head.weight
    assert isinstance(w, torch.Tensor)
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    b = getattr(head, "bias", None) if bias else None
    hh = h.to(device=w.device, dtype=dtype)
    parts = []
    for lo in range(0, w.shape[0], _VOCAB_BLOCK):
        part = hh @ w[lo : lo + _VOCAB_BLOCK].detach().to(dtype=dtype).T
        if isinstance(b, torch.Tensor):
            part = part + b[lo : lo + _VOCAB_BLOCK].detach().to(device=w.device, dtype=dtype)
        parts.append(part.to(device="cpu", dtype=torch.float64))
    return torch.cat(parts, dim=-1)  # [n, V]


def _snap(value: float, candidates: list[float]) -> float:
    for c in candidates:
        if c != 0 and abs(value - c) <= 1e-4 * abs(value):
            return c
    return value


def _config_numbers(config: Any) -> list[float]:
    """Numbers in the config, and their inverses: hints to snap a measured number to."""
    items = config.to_dict().values() if hasattr(config, "to_dict") else []
    nums = [float(v) for v in items if isinstance(v, int | float) and not isinstance(v, bool)
            and v != 0]
    return [1.0] + nums + [1.0 / v for v in nums]


class LogitFit:
    """The logit fit, in two halves around one forward pass of the whole model: as the final
    norm's forward hook, it replaces the norm's output with vectors we choose (every position
    its own magnitude); `run` makes that pass and keeps its output; `transform` fits its
    logits.

    find_sites runs its second pass this way (sites.FinalProbe), so the fit costs no forward
    pass of its own; `measure_logits` runs one where that pass could not carry it. The sample
    is that pass's (3 rows of 7 tokens: 21 magnitudes from 1e-2 to saturation, each position
    compared over the whole vocabulary)."""

    def __init__(self, head: nn.Module, sample: Mapping[str, torch.Tensor],
                 kwargs: Mapping[str, Any], config: Any = None) -> None:
        self.head = head
        self.kwargs = kwargs
        self.hints = _config_numbers(config)
        # the LM head reads the decoder's tokens in an encoder-decoder
        ids = sample.get("decoder_input_ids", sample.get("input_ids"))
        assert ids is not None, "a logit fit needs token ids"
        self.bsz, self.t = (int(n) for n in ids.shape)
        d = int(head.weight.shape[1])  # type: ignore[index]
        gen = torch.Generator().manual_seed(7)
        r = torch.randn(self.bsz * self.t, d, generator=gen, dtype=torch.float64)
        self.r = r / torch.linalg.vector_norm(r, dim=-1, keepdim=True) * math.sqrt(d)
        self.product = self.base = self.target = torch.empty(0, dtype=torch.float64)
        self.dtype = torch.float32
        self.sent: torch.Tensor | None = None
        self.path: str | None = None
        self.output: Any = None

    @property
    def ready(self) -> bool:
        """Whether the hook replaced the output of the module the pass handed over."""
        return self.sent is not None and self.output is not None

    @torch.no_grad()
    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        out = output_tensor(output)
        if out is None or out.numel() != self.r.numel():
            return None  # not a norm of the LM head's width over the sample: left alone
        p = next(module.parameters(), None)
        self.dtype = p.dtype if p is not None else torch.float32
        top = 4.0 if self.dtype == torch.float16 else 8.0  # float16 logits overflow past 65504
        # Each token gets its own magnitude: max |W_U . h| from 1e-2 (linear) to saturating.
        self.target = 10.0 ** torch.linspace(-2.0, top, self.bsz * self.t, dtype=torch.float64)
        if not self.product.numel():  # computed once, and only where the hook runs
            self.product = _pre(self.r, self.head, bias=False)  # [n, V]
            self.base = self.product.abs().amax(-1).clamp_min(1e-30)  # [n]
        h = self.r * (self.target / self.base).unsqueeze(-1)
        sent = h.to(dtype=out.dtype, device=out.device).reshape(out.shape)
        self.sent = sent
        return sent if isinstance(output, torch.Tensor) else (sent, *output[1:])

    def run(self, model: nn.Module, module: nn.Module, path: str,
            sample: Mapping[str, torch.Tensor]) -> None:
        """One forward pass of the whole model over `sample`, hooked on the final norm
        `module` (at `path`); its output is kept for `transform`."""
        handle = module.register_forward_hook(self)
        try:
            output = model(**sample, **self.kwargs)
        finally:
            handle.remove()
        self.path, self.output = path, output

    @torch.no_grad()
    def transform(self, final: FoundSite, name: str) -> LogitTransform:
        """Fit the model's logits as a scale and soft-cap of `W_U . final_norm + b_U`.

        Raises IngestError when no such transform reproduces them."""
        bsz, t, head = self.bsz, self.t, self.head
        real = model_logits(self.output).double().cpu() if self.output is not None else None
        width = int(head.weight.shape[1])  # type: ignore[index]
        if self.sent is None and final.record.d * (final.record.n_heads or 1) != width:
            raise IngestError(
                f"model {name!r}: its LM head reads vectors of width {width}, and its final "
                f"norm {final.record.module!r} gives width {final.record.d}: a layer between "
                "them (a projection, as OPT's project_out) makes the logits, which actdb "
                "computes as W_U . final_norm(x) + b_U")
        if self.sent is None or real is None or real.shape[:2] != (bsz, t):
            raise IngestError(f"model {name!r}: its logits do not come from its final norm "
                              f"{final.record.module!r}")
        if self.sent.dtype in (torch.float32, torch.float64):
            # h is r scaled row by row (rounded to float32 at most, 1e-7 relative): its
            # product is r's, scaled, within the product's own rounding (so no second pass
            # over the LM head)
            pre = self.product * (self.target / self.base).unsqueeze(-1)
            b = getattr(head, "bias", None)
            if isinstance(b, torch.Tensor):
                pre = pre + b.detach().to(device="cpu", dtype=torch.float64)
        else:  # rounded to the model's 8 or 11 bits: the product of what was sent
            pre = _pre(self.sent.double().cpu().reshape(bsz * t, -1), head)
        real = real.reshape(bsz * t, -1)[:, : pre.shape[1]]
        tol = _FIT_TOLERANCE.get(self.dtype, 3e-2)
        hints = self.hints

        def error(tr: LogitTransform) -> float:
            diff = torch.linalg.vector_norm(tr.apply(pre) - real, dim=-1)
            return float((diff / torch.linalg.vector_norm(real, dim=-1).clamp_min(1e-30)).max())

        scale = float((pre * real).sum() / (pre * pre).sum())
        fit = LogitTransform(scale=_snap(scale, hints), softcap=None, error=0.0)
        if error(fit) > tol:
            cap = _snap(float(real.abs().max()), hints)
            ok = real.abs() < 0.9 * cap  # far from saturation: atanh is well conditioned
            y = cap * torch.atanh((real / cap).clamp(-1 + 1e-12, 1 - 1e-12))
            scale = float((pre[ok] * y[ok]).sum() / (pre[ok] * pre[ok]).sum())
            fit = LogitTransform(scale=_snap(scale, hints), softcap=cap, error=0.0)
        err = error(fit)
        if not err <= tol:
            masked = _masked_tokens(real)
            if masked:
                raise IngestError(
                    f"model {name!r}: its logits of {masked} tokens are the lowest value "
                    "there is at every position (tokens it never predicts, as Chameleon's "
                    "image tokens), a mask on W_U . final_norm(x) + b_U that actdb does not "
                    "record")
            raise IngestError(
                f"model {name!r}: its logits are not a scale and soft-cap of W_U . final_norm(x) "
                f"+ b_U (the best fit leaves a relative error of {err:.3g}); actdb cannot "
                "reproduce them"
            )
        return LogitTransform(scale=None if fit.scale == 1.0 else fit.scale, softcap=fit.softcap,
                              error=err)


def _masked_tokens(real: torch.Tensor) -> int:
    """How many of the vocabulary's columns of the model's logits `real` [n, V] (float64)
    are at every row the lowest value of a floating-point type, or -inf: tokens masked out
    after the LM head."""
    lows = [-math.inf] + [float(torch.finfo(t).min) for t in
                          (torch.float16, torch.bfloat16, torch.float32, torch.float64)]
    low = torch.zeros(real.shape[-1], dtype=torch.bool)
    for v in lows:
        low |= (real == v).all(0)
    return int(low.sum())


@torch.no_grad()
def measure_logits(model: nn.Module, sample: Mapping[str, torch.Tensor], final: FoundSite,
                   head: nn.Module, extra: Mapping[str, Any], name: str) -> LogitTransform:
    """The logit fit (LogitFit) with a forward pass of its own over `sample`.

    Raises IngestError when no scale and soft-cap reproduce the model's logits.
    """
    fit = LogitFit(head, sample, extra, getattr(model, "config", None))
    fit.run(model, final.module, final.record.module, sample)
    return fit.transform(final, name)


class LogitCheck:
    """Recompute a sample of logits from the stored final-site fields and compare them with
    the model's: the store proves its logits, as it proves each site's output."""

    def __init__(self, final: FoundSite, head: nn.Module, transform: LogitTransform,
                 device: torch.device, *, position: int | None = None,
                 projection: torch.Tensor | None = None,
                 inputs: Mapping[str, torch.Tensor] | None = None,
                 read: Callable[[Any], torch.Tensor] | None = None,
                 pooled: bool = False) -> None:
        """`position`: a classifier's, the one position its logits read (else every one
        may be checked); `pooled`: a classifier whose logits are the mean of the logits of
        an input's rows (pooling.py), all of them read. A contrastive model's labels
        (labels.py): `projection` P [p, d],
        the head's products are divided by ||P y||; `inputs`, what its forward pass takes
        beside the images (the labels' token ids); `read`, its logits from its output."""
        self.final = final
        self.projection = None if projection is None else projection.float().to(device)
        self.inputs = dict(inputs or {})
        self.read = read or model_logits
        self.position = position
        self.pooled = pooled
        self.head = head
        self.transform = transform
        # The head's own device: with a device map it may not be the model's first device.
        self.device = head.weight.device if isinstance(head.weight, torch.Tensor) else device
        self.gain = final.gain.float().to(device) if final.gain is not None else None
        self.bias = final.bias.float().to(device) if final.bias is not None else None

    def positions(self, t: int) -> torch.Tensor:
        """Up to 4 positions spread over the batch's length (the first and the last among
        them): logits only for these. Each costs a product with the whole LM head for every
        row of the batch, twice (the model's, and ours from the store). A classifier's: the
        position it reads (a pooled one's logits are one row an input: 0)."""
        if self.pooled:
            return torch.tensor([0])
        if self.position is not None:
            return torch.tensor([self.position])
        return torch.unique(torch.linspace(0, t - 1, min(t, 4)).round().long())

    @torch.no_grad()
    def error(self, real: torch.Tensor, acts: ActBatch, mask: torch.Tensor,
              positions: torch.Tensor) -> float:
        """Worst relative error over the real tokens at `positions`; real [B, P, V] (a
        pooled classifier's [B, 1, V], compared with the mean of each input's rows)."""
        rows = (torch.cumsum(mask.reshape(-1).long(), 0) - 1).reshape(mask.shape)  # [B, T]
        if self.pooled:  # every row of an input, averaged below
            m = mask.any(dim=1, keepdim=True).cpu()  # [B, 1]: inputs with rows
            idx = rows.cpu()[mask.cpu()].numpy()
        else:
            m = mask[:, positions].cpu()  # [B, P]
            idx = rows[:, positions].cpu()[m].numpy()
        if len(idx) == 0:
            return 0.0
        s = self.final.record
        direction = torch.from_numpy(acts.direction[idx]).to(self.device).float()
        x = direction * torch.from_numpy(acts.norm[idx]).to(self.device).unsqueeze(-1)
        mean = torch.from_numpy(acts.mean[idx]).to(self.device)
        y = norms.apply(bool(s.centered), x, gain=self.gain, bias=self.bias, eps=s.eps, mean=mean)
        w = self.head.weight
        assert isinstance(w, torch.Tensor)
        hb = getattr(self.head, "bias", None)
        # a contrastive model's image embedding is unit: y scaled by 1 / ||P y||
        length = (torch.linalg.vector_norm(y @ self.projection.T, dim=-1, keepdim=True)
                  if self.projection is not None else None)
        parts = []
        for lo in range(0, w.shape[0], _VOCAB_BLOCK):
            part = y @ w[lo : lo + _VOCAB_BLOCK].float().T
            if length is not None:
                part = part / length
            if isinstance(hb, torch.Tensor):
                part = part + hb[lo : lo + _VOCAB_BLOCK].float()
            parts.append(part)
        mine = self.transform.apply(torch.cat(parts, dim=-1))  # [n, V]
        if self.pooled:  # each input's rows are consecutive: their mean, an input a row
            counts = mask.sum(dim=1).cpu()
            owner = torch.repeat_interleave(torch.arange(len(counts)), counts).to(mine.device)
            sums = torch.zeros(len(counts), mine.shape[1], device=mine.device).index_add_(
                0, owner, mine)
            mine = (sums / counts.clamp_min(1).to(mine.device).unsqueeze(-1))[
                (counts > 0).to(mine.device)]
        theirs = real.to(self.device).float()[m.to(real.device)][:, : mine.shape[1]]
        diff = torch.linalg.vector_norm(mine - theirs, dim=-1)
        return float((diff / torch.linalg.vector_norm(theirs, dim=-1).clamp_min(1e-30)).max())
