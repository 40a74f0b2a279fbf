"""From prompts to the model's inputs: token ids, the batch plan, padded batches.

The batch plan is made once per ingest, over every prompt it has to run, and it alone says
which prompts share a forward pass. Padding changes a model's hidden states slightly (the
padded length changes the shapes of its matrix products), so a prompt's stored vectors depend
on its batch: a one-process ingest, each shard of a sharded one (`shards.plan_shard` hands
out whole batches of the plan) and a resumed ingest (commits hold whole batches, so what is
left of a plan is whole batches of it) all run the same batches and store the same bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from .load import LoadedModel
from .prompts import Prompt
from .rows import Work

Batch = list[Work]


def plan_batches(work: list[Work], batch_size: int, *, by_length: bool = False
                 ) -> list[Batch]:
    """`work` in input order, cut into consecutive batches of `batch_size` prompts (the last
    may be shorter). `by_length` (a model whose activations depend on padding, padding.py):
    each batch holds prompts of one length only, in input order within a length, the lengths
    in order of their first prompt, so that no batch is padded."""
    if not by_length:
        return [work[i : i + batch_size] for i in range(0, len(work), batch_size)]
    groups: dict[int, list[Work]] = {}
    for w in work:
        groups.setdefault(w.n_rows, []).append(w)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def left_to_run(batches: list[Batch], done: set[int]) -> list[Batch]:
    """The batches of a plan with the prompts in `done` (committed) taken out; a batch wholly
    done is dropped. A run commits whole batches, so a batch of the plan is done whole or
    not at all, and the rest keep their composition and padding."""
    left = [[w for w in b if w.prompt_id not in done] for b in batches]
    return [b for b in left if b]


def length_limit(loaded: LoadedModel, max_length: int | None) -> int | None:
    """The most tokens a prompt keeps: `max_length`, else the model's own limit."""
    if max_length is not None:
        return max_length
    config = getattr(loaded.model, "config", None)
    limits = [getattr(config, "max_position_embeddings", None),
              getattr(loaded.tokenizer, "model_max_length", None)]
    sane = [int(v) for v in limits if isinstance(v, int) and 0 < v < 1_000_000]
    return min(sane) if sane else None


def tokenize(tok: Any, texts: list[str], limit: int | None, *, special: bool = True
             ) -> tuple[list[list[int]], list[bool]]:
    """Each text's token ids, cut to `limit`, and whether it was cut."""
    full = tok(texts, add_special_tokens=special, verbose=False)["input_ids"]
    truncated = [limit is not None and len(f) > limit for f in full]
    if any(truncated):
        cut = tok(texts, add_special_tokens=special, truncation=True,
                  max_length=limit)["input_ids"]
        full = [c if t else f for f, c, t in zip(full, cut, truncated, strict=True)]
    return [list(map(int, f)) for f in full], truncated


def pad(loaded: LoadedModel, ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """A batch's inputs, right-padded to its longest prompt, on the model's device."""
    width = max(len(i) for i in ids)
    pad_id = loaded.tokenizer.pad_token_id or 0
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, row in enumerate(ids):
        input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = 1
    return {"input_ids": input_ids.to(loaded.device), "attention_mask": mask.to(loaded.device)}


def cycled(prompts: list[Prompt], n: int) -> list[Prompt]:
    """n inputs for a probe batch: the first ones, repeated where there are fewer."""
    return [prompts[i % len(prompts)] for i in range(n)]


def to_device(loaded: LoadedModel, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A processor's tensors on the model's device, floating ones in its dtype."""
    return {k: v.to(loaded.device, dtype=loaded.dtype) if v.is_floating_point()
            else v.to(loaded.device) for k, v in inputs.items()}


def probe_batch(loaded: LoadedModel, ids: list[list[int]], length: int
                ) -> dict[str, torch.Tensor]:
    """3 unpadded rows of `length` real tokens (the prompts' own, cycled): sizes chosen so
    that batch, length and a head count are unlikely to collide, and two lengths tell apart
    the token axis where they do."""
    pool = [t for row in ids for t in row] or [int(loaded.tokenizer.eos_token_id or 0)]
    rows = [[pool[(r * length + j) % len(pool)] for j in range(length)] for r in range(3)]
    return pad(loaded, rows)
