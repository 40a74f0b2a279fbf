"""Whether a model's activations depend on the batch's padding, measured once per ingest.

A batch of text prompts is right-padded to its longest one (batches.pad), with an attention
mask that hides the padding. For most models a prompt's rows are then what it gives alone, up
to rounding. Some models run another computation when a mask is given at all: PaliGemma's text
decoder attends bidirectionally over an unpadded input (its config asks for bidirectional
attention, and transformers skips the mask when nothing is padded), but causally as soon as
a padding mask is materialized, so every row of a padded batch, the unpadded prompt's
included, differs from the prompt run alone. Such a model's prompts are batched only with
prompts of their own length (batches.plan_batches), which need no padding, so each stored row
is the one the prompt gives alone.

The measure: the shortest and the longest prompt (token ids, their first 32) run alone and
together in one padded batch, each site's inputs at their real tokens compared row by row,
through the base model alone where every site is inside it (sites.forward_module: no LM head's
product over the vocabulary in the three passes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batches import pad
from .capture import record_calls
from .load import LoadedModel
from .run import forward_kwargs
from .sites import FoundSite, forward_module

# Relative difference of a row's norm input, padded against alone, that counts as a change of
# computation rather than rounding (different matrix shapes), by the dtype the model runs in.
_PROBE = 32
_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 5e-2,
              torch.bfloat16: 1e-1}


def padding_change(loaded: LoadedModel, found: Sequence[FoundSite], ids: Sequence[list[int]]
                   ) -> float:
    """Worst relative difference, over sites and real tokens, between a row's norm input in a
    padded batch of the shortest and the longest prompt and the same row with its prompt run
    alone; 0.0 where every prompt has one length (no batch is ever padded)."""
    lengths = [len(i) for i in ids]
    if not lengths or min(lengths) == max(lengths):
        return 0.0
    # At most _PROBE tokens: the copies of every site's inputs stay small on a large model.
    long = ids[lengths.index(max(lengths))][:_PROBE]
    short = ids[lengths.index(min(lengths))][: len(long) - 1]
    modules = {f.record.site: f.module for f in found if f.layout == "btd"}
    target = forward_module(loaded.model, [path for f in found for path, _ in f.hooks])
    extra = forward_kwargs(target)
    runs = []
    with torch.no_grad():
        for batch in ([short], [long], [short, long]):
            with record_calls(modules, copies=True) as log:
                target(**pad(loaded, batch), **extra)
            runs.append({s: calls[0].input for s, calls in log.calls.items()
                         if calls and calls[0].input is not None})
    alone, together = runs[:2], runs[2]
    worst = 0.0
    for site, x in together.items():
        for b, row in enumerate((short, long)):
            a = alone[b].get(site)
            if a is None or x.dim() < 3 or a.dim() < 3:
                continue  # a flattened [B*T, d] input: no token axis to line up
            n = len(row)
            got, want = x[b, :n].double(), a[0, :n].double()  # [T, d]
            gap = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
            worst = max(worst, float(gap.max()))
    return worst


def depends_on_padding(loaded: LoadedModel, change: float) -> bool:
    """Whether `change` (padding_change) is more than the model's dtype rounds to."""
    return change > _TOLERANCE.get(loaded.dtype, 1e-3)
