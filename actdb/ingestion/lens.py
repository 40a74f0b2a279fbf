"""The materialized lens: at ingest, the logit lens of every row of every lens site, computed
from the stored fields on the ingest's device and stored beside them (store/lens_layout.py).

Each row is read as the query's lens reads it: x = norm * direction (the stored float16
direction), through the final site's norm with its measured gain and bias, the LM head and
the model's recorded logit transform. So the stored values are what the lens functions would
compute from the store, up to float32 rounding of the product (docs/FORMAT.md, "Materialized
lens"). Of each row's logits over the whole vocabulary it keeps the top K (logit descending,
ties lower id first), the log-sum-exp, the entropy, and the logit and rank of the model's own
prediction at that row (the final site's top token).

On a checked batch, the final site's lens is proven against the model's own logits.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from .. import norms
from ..errors import IngestError
from ..store.lens_layout import ENTROPY, LSE, N_STATS, PRED_RANK
from ..store.records import ModelRecord, SiteRecord
from ..store.store import ActBatch
from .logits import LOGIT_LIMIT, LogitTransform
from .sites import FoundSite

DEFAULT_LENS_K = 10  # on a GPU; on a CPU the lens costs more than the forward pass: off
MAX_LENS_K = 1000
_BLOCK_VALUES = 1 << 24  # logits of a block of rows held at once: 64 MiB of float32

LensRows = dict[str, np.ndarray]  # array name (lens_layout.LENS_FIELDS) -> rows


def lens_default(device: torch.device) -> int:
    """K when the ingest is not told: the lens on a GPU, none on a CPU, where its products
    with the vocabulary cost more than the forward pass that stores the vectors."""
    return DEFAULT_LENS_K if device.type == "cuda" else 0


def check_lens_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LENS_K:
        raise IngestError(f"lens must be a whole number of tokens from 0 (none) to "
                          f"{MAX_LENS_K}, got {k!r}")
    return k


class LensMaker:
    """Computes the lens rows of a batch's lens sites from their stored fields."""

    def __init__(self, record: ModelRecord, final: FoundSite, head: nn.Module,
                 sites: list[SiteRecord], device: torch.device) -> None:
        self.k = int(record.lens_k or 0)
        self.final = final.record
        w = head.weight
        assert isinstance(w, torch.Tensor)
        self.device = w.device  # with a device map, the head's own device
        self.w = w.detach().float()  # [V, d]: no copy for a float32 model
        b = getattr(head, "bias", None)
        self.b = b.detach().float() if isinstance(b, torch.Tensor) else None
        self.gain = final.gain.float().to(self.device) if final.gain is not None else None
        self.bias = final.bias.float().to(self.device) if final.bias is not None else None
        self.transform = LogitTransform(scale=record.logit_scale, softcap=record.logit_softcap,
                                        error=0.0)
        self.vocab = min(int(record.vocab_size), self.w.shape[0]) if record.vocab_size else (
            self.w.shape[0])
        if self.k > self.vocab:
            raise IngestError(f"lens {self.k} is more tokens than model {record.model!r} has "
                              f"({self.vocab})")
        # The final site first: its top token is every other site's prediction.
        self.sites = sorted(sites, key=lambda s: s.site != self.final.site)
        if not self.sites or self.sites[0].site != self.final.site:
            raise IngestError(f"model {record.model!r}: the materialized lens reads the final "
                              f"site {self.final.site!r}, which --sites leaves out")
        self.block = max(1, min(1024, _BLOCK_VALUES // self.vocab))

    def logits(self, site: SiteRecord, acts: ActBatch, lo: int, hi: int) -> torch.Tensor:
        """The lens logits [hi - lo, V] of rows lo..hi of a site's stored fields. As the
        query's final_norm view reads them: the stored mean at the final site itself, else
        the mean of x (query/vectors.py, apply_view)."""
        dev = self.device
        x = (torch.from_numpy(acts.direction[lo:hi]).to(dev).float()
             * torch.from_numpy(acts.norm[lo:hi]).to(dev).unsqueeze(-1))  # [n, d]
        f = self.final
        mean = (torch.from_numpy(acts.mean[lo:hi]).to(dev) if site.site == f.site else None)
        hn = norms.apply(bool(f.centered), x, gain=self.gain, bias=self.bias, eps=f.eps,
                         mean=mean)  # [n, d]
        pre = hn @ self.w[: self.vocab].T  # [n, V]
        if self.b is not None:
            pre = pre + self.b[: self.vocab]
        return self.transform.apply(pre)

    @torch.no_grad()
    def batch(self, out: Mapping[str, ActBatch]) -> dict[str, LensRows]:
        """Each lens site's lens rows of the batch whose stored rows are `out`."""
        n = out[self.final.site].direction.shape[0]
        pred = torch.zeros(n, dtype=torch.int64, device=self.device)
        made: dict[str, LensRows] = {}
        for s in self.sites:
            ids = np.empty((n, self.k + 1), dtype=np.int32)
            vals = np.empty((n, self.k + 1), dtype=np.float32)
            stats = np.empty((n, N_STATS), dtype=np.float32)
            for lo in range(0, n, self.block):
                hi = min(lo + self.block, n)
                lg = self.logits(s, out[s.site], lo, hi)  # [m, V]
                top_v, top_i = top_k(lg, self.k)
                if s.site == self.final.site:
                    pred[lo:hi] = top_i[:, 0]
                mine = lg.gather(1, pred[lo:hi].unsqueeze(1))  # [m, 1]
                lse = torch.logsumexp(lg, dim=-1)  # [m]
                lp = lg - lse.unsqueeze(1)
                st = torch.stack([
                    lse,
                    -(lp.exp() * lp).sum(-1),
                    # 1 + the tokens with a strictly larger logit: ties share the better rank
                    1 + (lg > mine).sum(-1).float(),
                ], dim=-1)
                ids[lo:hi, : self.k] = top_i[:, : self.k].cpu().numpy()
                ids[lo:hi, self.k] = pred[lo:hi].cpu().numpy()
                vals[lo:hi, : self.k] = top_v[:, : self.k].cpu().numpy()
                vals[lo:hi, self.k] = mine[:, 0].cpu().numpy()
                stats[lo:hi] = st.cpu().numpy()
            made[s.site] = {"lens_ids": ids, "lens_logits": vals, "lens_stats": stats}
        return made

    @torch.no_grad()
    def error(self, real: torch.Tensor, made: LensRows, mask: torch.Tensor,
              positions: torch.Tensor) -> float:
        """The worst error of the final site's stored lens against the model's own logits
        `real` [B, P, V] at `positions`: top-K logits (the K largest of the model's, and the
        model's logits of the stored ids), log-sum-exp and prediction's logit relative to the
        row's largest logit magnitude, entropy relative to max(1, entropy)."""
        rows = (torch.cumsum(mask.reshape(-1).long(), 0) - 1).reshape(mask.shape)  # [B, T]
        m = mask[:, positions].cpu()  # [B, P]
        idx = rows[:, positions].cpu()[m].numpy()
        if len(idx) == 0:
            return 0.0
        theirs = real.to(self.device).float()[m.to(real.device)][:, : self.vocab]  # [n, V]
        ids = torch.from_numpy(made["lens_ids"][idx].astype(np.int64)).to(self.device)
        vals = torch.from_numpy(made["lens_logits"][idx]).to(self.device)
        stats = torch.from_numpy(made["lens_stats"][idx]).to(self.device)
        scale = theirs.abs().amax(-1).clamp_min(1e-30)  # [n]
        k = self.k
        top_v = torch.topk(theirs, k, dim=-1).values  # [n, K]
        lse = torch.logsumexp(theirs, dim=-1)
        lp = theirs - lse.unsqueeze(1)
        entropy = -(lp.exp() * lp).sum(-1)
        diffs = torch.stack([
            (vals[:, :k] - top_v).abs().amax(-1) / scale,
            (vals - theirs.gather(1, ids)).abs().amax(-1) / scale,
            (stats[:, LSE] - lse).abs() / scale,
            (stats[:, ENTROPY] - entropy).abs() / entropy.clamp_min(1.0),
            (stats[:, PRED_RANK] - 1).abs(),  # the final site's prediction is its own top
        ], dim=-1)
        return float(diffs.max())

    def check(self, error: float, model: str) -> None:
        if not error <= LOGIT_LIMIT:
            raise IngestError(
                f"model {model!r}: the materialized lens at the final site differs from the "
                f"model's own logits by {error:.3g} (relative), more than {LOGIT_LIMIT}; "
                "nothing of this batch was committed")


def top_k(lg: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of lg [m, V], logit descending, ties lower id first (also
    where the k-th place falls among tied tokens: torch.topk leaves their order open)."""
    v, i = torch.topk(lg, k, dim=-1)  # [m, k]
    tied = (lg >= v[:, -1:]).sum(-1) > k  # rows whose k-th value is shared beyond the k
    # lower id first, then a stable sort by value: ties keep that order
    i = torch.sort(i, dim=-1).values
    v = lg.gather(1, i)
    order = torch.sort(v, dim=-1, descending=True, stable=True).indices
    v, i = v.gather(1, order), i.gather(1, order)
    if bool(tied.any()):
        rows = torch.nonzero(tied)[:, 0]
        ids = torch.arange(lg.shape[1], device=lg.device)
        for r in rows.tolist():  # rare: a full stable sort of the row alone
            o = torch.sort(lg[r], descending=True, stable=True).indices[:k]
            i[r], v[r] = ids[o], lg[r, o]
    return v, i


__all__ = ["DEFAULT_LENS_K", "MAX_LENS_K", "LensMaker", "check_lens_k", "lens_default",
           "top_k"]
