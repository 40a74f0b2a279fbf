"""The top-k lists of a batch's rows over a whole vocabulary or anchor set (`top_logits`,
`nearest_anchors`): the rows scored a block at a time, candidates from the bfloat16 kernels
where they run (vocab_scan, topk.py: the same float32 top k, proven row by row), every block's
answers copied to the host once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..lazy import lazy_module
from . import topk, vocab_scan
from .lists import ListResults, struct_lists
from .threads import threads_for, torch_threads
from .timeout import check

if TYPE_CHECKING:
    import pyarrow as pa
    import torch
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

_BLOCK = 512  # rows per matrix product against a whole vocabulary
_GPU_SCORES_BYTES = 1 << 30  # a GPU's float32 [block, V] scores at most


def _to_logits(model: Any, pre: torch.Tensor) -> torch.Tensor:
    """The model's own transform after its LM head (measured at ingest): a scale, then a
    soft-cap. `pre` is W_U . final_norm(v) + b_U."""
    scale, cap = model.logit_scale, model.logit_softcap
    out = pre * scale if scale is not None else pre
    return cap * torch.tanh(out / cap) if cap else out


def topk_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int,
              index: np.ndarray, ok: torch.Tensor, out: ListResults, tokens: pa.Array,
              label: str, model: Any = None) -> None:
    lowp = topk.lowp_dtype(x.device)
    # The logit transform keeps ranks (so ranks are taken before it) unless its scale is not
    # positive; then the transformed logits are ranked whole.
    reversing = model is not None and model.logit_scale is not None and model.logit_scale <= 0
    step = _vocab_block_rows(x.device, w.shape[0])
    got_v, got_i = [], []
    for lo in range(0, x.shape[0], step):
        check()  # each block is a vocabulary-wide product: a query past its limit stops
        block = x[lo : lo + step]
        if reversing:
            with torch_threads(threads_for(2.0 * block.shape[0] * w.numel(), block.device)):
                scores = block @ w.T  # [block, V]
            scores = _to_logits(model, scores + b if b is not None else scores)
            pre, ids = topk.rescored(block, w, b, torch.topk(scores, k, dim=-1).indices)
            vals, order = torch.sort(_to_logits(model, pre), dim=-1, descending=True, stable=True)
            ids = torch.gather(ids, 1, order)
        else:
            vals, ids = topk_block(block, w, b, k, lowp, model)
        got_v.append(vals)
        got_i.append(ids)
    if not got_v:
        return
    # One copy to the host for all blocks: on a GPU each copy waits for the device.
    flat = torch.cat(got_i).cpu().numpy().astype(np.int64).reshape(-1)
    vals = torch.cat(got_v)
    # an LM head may have more rows than the vocabulary has strings: those are NULL
    strings = tokens.take(pa.array(flat, mask=flat >= len(tokens)))
    if label == "cosine":  # float32 rounding can pass 1
        vals = vals.clamp(-1.0, 1.0)
    out.put(index, struct_lists(k, {
        "token_id": pa.array(flat), "token": strings,
        label: pa.array(vals.double().cpu().numpy().reshape(-1)),
    }, ok.cpu().numpy()))


def _vocab_block_rows(device: torch.device, vocab: int) -> int:
    """Rows per vocabulary-wide product: _BLOCK on the CPU (the [block, V] scores stay
    small); on a GPU as many as scores of _GPU_SCORES_BYTES hold, where the work around each
    product (its candidates checked, its results copied) would cost more than the product."""
    if device.type == "cpu":
        return _BLOCK
    return max(_BLOCK, _GPU_SCORES_BYTES // (4 * max(1, vocab)))


def topk_block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, k: int,
               lowp: torch.dtype | None, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """topk.topk of a block of rows, the LM head's candidates from the bfloat16 kernel where
    it runs (vocab_scan.top_k: the same float32 top k), rows it cannot take by topk.py."""
    transform = None if model is None else (lambda v: _to_logits(model, v))
    if model is None or k > vocab_scan.TOP_MAX_K or not vocab_scan.top_usable(x.device):
        return topk.topk(x, w, b, k, lowp=lowp, transform=transform)
    head = vocab_scan.pack(w, b)
    ok = vocab_scan.takes(x, head)
    vals = torch.empty((x.shape[0], k), dtype=x.dtype)
    ids = torch.empty((x.shape[0], k), dtype=torch.long)
    at = torch.nonzero(ok).flatten()
    if len(at):
        v, i, done = vocab_scan.top_k(x[at], w, b, k, head)
        vals[at], ids[at] = v, i
        ok[at[~done]] = False
    rest = torch.nonzero(~ok).flatten()
    if len(rest):
        v, i = topk.topk(x[rest], w, b, k, lowp=lowp, transform=None)
        vals[rest], ids[rest] = v, i
    return (transform(vals) if transform is not None else vals), ids
