"""Turn a norm module's hooked input and output into the stored fields, checking faithfulness:
the output recomputed from what is stored must match what the module really produced."""

from __future__ import annotations

import torch

from .. import norms
from ..errors import IngestError
from ..store.store import ActBatch
from .sites import FoundSite

FAITHFULNESS_LIMIT = 1e-2


class SiteSink:
    """Turns each hooked (input, output) into stored fields and a faithfulness figure."""

    def __init__(self, found: list[FoundSite], device: torch.device) -> None:
        self.by_module = {f.record.module: f for f in found}
        self.params = {
            f.record.module: (
                f.gain.float().to(device) if f.gain is not None else None,
                f.bias.float().to(device) if f.bias is not None else None,
            )
            for f in found
        }
        self.mask = torch.zeros(0, dtype=torch.bool)
        self.out: dict[str, ActBatch] = {}
        self.errors: dict[str, float] = {}

    @torch.no_grad()
    def __call__(self, module_path: str, x: torch.Tensor, y: torch.Tensor) -> None:
        f = self.by_module[module_path]
        s = f.record
        if s.site in self.out:
            return  # a module called twice in one pass: keep its first call
        b, t = self.mask.shape
        # Under a device_map the module may live on another device than the batch's mask.
        x, y = x.to(self.mask.device), y.to(self.mask.device)
        x = x.reshape(b, t, *x.shape[-(2 if s.n_heads else 1):])[self.mask].float()
        y = y.reshape(b, t, *y.shape[-(2 if s.n_heads else 1):])[self.mask].float()
        direction, norm, mean = norms.split(x)  # [n, (h,) d], [n, (h)], [n, (h)]
        direction16 = direction.half()
        gain, bias = self.params[module_path]
        rebuilt = direction16.float() * norm.unsqueeze(-1)
        y_hat = norms.apply(s.kind, rebuilt, gain=gain, bias=bias, eps=s.eps)
        err = torch.linalg.vector_norm(y_hat - y, dim=-1) / (
            torch.linalg.vector_norm(y, dim=-1) + 1e-6)
        worst = float(err.max()) if err.numel() else 0.0
        if worst > FAITHFULNESS_LIMIT:
            raise IngestError(
                f"site {s.site!r} ({s.module}, kind {s.kind}): the output recomputed from the "
                f"stored fields differs from the module's output by {worst:.3g} (relative), "
                f"more than {FAITHFULNESS_LIMIT}; actdb's maths for this norm is wrong"
            )
        self.errors[s.site] = worst
        self.out[s.site] = ActBatch(
            direction=direction16.cpu().numpy(), norm=norm.cpu().numpy(),
            mean=mean.cpu().numpy(),
        )
