"""Turn a norm module's hooked input and output into the stored fields, checking faithfulness:
the output recomputed from what is stored must match what the module really produced."""

from __future__ import annotations

import torch

from .. import norms
from ..errors import IngestError
from ..store.store import ActBatch
from .sites import FoundSite

FAITHFULNESS_LIMIT = 1e-2


def _heads_last(x: torch.Tensor, layout: str) -> torch.Tensor:
    """One per-head module's tensor as [B, T, h, d]."""
    if layout == "bhtd":
        return x.transpose(1, 2)
    return x if layout == "bthd" else x.unsqueeze(-2)


class SiteSink:
    """Turns each hooked (input, output) into stored fields and a faithfulness figure."""

    def __init__(self, found: list[FoundSite], device: torch.device) -> None:
        self.by_module = {path: (f, i) for f in found for i, (path, _) in enumerate(f.hooks)}
        self.params = {
            f.record.site: (
                f.gain.float().to(device) if f.gain is not None else None,
                f.bias.float().to(device) if f.bias is not None else None,
            )
            for f in found
        }
        self.mask = torch.zeros(0, dtype=torch.bool)
        self._no_padding = False
        self.out: dict[str, ActBatch] = {}
        self.errors: dict[str, float] = {}
        self._heads: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def start(self, mask: torch.Tensor) -> None:
        """A new forward pass over a batch whose real tokens are `mask` [B, T]."""
        self.mask = mask
        self._no_padding = bool(mask.all())
        self.out, self.errors, self._heads = {}, {}, {}

    @torch.no_grad()
    def __call__(self, module_path: str, x: torch.Tensor, y: torch.Tensor) -> None:
        f, head = self.by_module[module_path]
        s = f.record
        if s.site in self.out:
            return  # a module called twice in one pass: keep its first call
        if f.layout == "list":  # one module per head: stack the heads when all have run
            parts = self._heads.setdefault(s.site, {})
            parts.setdefault(head, (x, y))
            if len(parts) < len(f.hooks):
                return
            x = torch.cat([_heads_last(parts[i][0], f.member_layout)
                           for i in range(len(f.hooks))], dim=-2)  # [B, T, H, d]
            y = torch.cat([_heads_last(parts[i][1], f.member_layout)
                           for i in range(len(f.hooks))], dim=-2)
        elif f.layout == "bhtd":
            x, y = x.transpose(1, 2), y.transpose(1, 2)  # [B, T, H, d]
        b, t = self.mask.shape
        # Under a device_map the module may live on another device than the batch's mask.
        x, y = x.to(self.mask.device), y.to(self.mask.device)
        shape = (b * t, *x.shape[-(2 if s.n_heads else 1):])
        if self._no_padding:  # every position is a real token: views, not gathered copies
            x, y = x.reshape(shape).float(), y.reshape(shape).float()
        else:
            x = x.reshape(b, t, *shape[1:])[self.mask].float()
            y = y.reshape(b, t, *shape[1:])[self.mask].float()
        direction, norm, mean = norms.split(x)  # [n, (h,) d], [n, (h)], [n, (h)]
        direction16 = direction.half()
        gain, bias = self.params[s.site]
        # the vector rebuilt from what is stored, in the direction's buffer (a pass fewer)
        rebuilt = direction.copy_(direction16).mul_(norm.unsqueeze(-1))
        y_hat = norms.apply(bool(s.centered), rebuilt, gain=gain, bias=bias, eps=s.eps)
        err = torch.linalg.vector_norm(y_hat.sub_(y), dim=-1).div_(  # y_hat is a new tensor
            torch.linalg.vector_norm(y, dim=-1).add_(1e-6))
        worst = float(err.max()) if err.numel() else 0.0
        if not worst <= FAITHFULNESS_LIMIT:
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
