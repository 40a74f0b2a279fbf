"""A sharded ingest's plan: which prompts shard i of N runs, and into which rows.

Every shard computes the same plan from the same main catalog and the same prompts: the
prompts to ingest (with their ids and token ids), cut into N contiguous runs of about equal
numbers of prompts. Shard 0's rows start where the model's committed rows end; each later
shard's start is the previous shard's end rounded up to the write alignment (a whole chunk
file of every field, or a whole shard object on object storage), so no two shards ever write
the same chunk or shard object.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from ..errors import ShardSpecError
from ..store.sharding import MergeSummary, ShardPlan, merge_shards
from ..store.store import Store
from .rows import Work

# ASCII digits only: str.isdigit() also passes '²', which int() refuses (and '٣', which it
# reads as 3), so a typo would not be one clear error.
_SHARD_SPEC = re.compile(r"([0-9]+)/([0-9]+)", re.ASCII)


def parse_shard(spec: str | tuple[int, int]) -> tuple[int, int]:
    """`i/N` (or a tuple) as (i, N), checked: 0 <= i < N.

    Raises:
        ShardSpecError: anything else, in one sentence naming the value.
    """
    if isinstance(spec, str):
        match = _SHARD_SPEC.fullmatch(spec)
        if match is None:
            raise ShardSpecError(f"shard {spec!r} is not I/N (two whole numbers, e.g. 0/2 for "
                                 "the first of 2 shards)")
        i, n = int(match[1]), int(match[2])
    else:
        parts = tuple(spec) if isinstance(spec, tuple | list) else ()
        if len(parts) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                      for v in parts):
            raise ShardSpecError(f"shard {spec!r} is not I/N: give a string such as '0/2' "
                                 "or a tuple of two ints such as (0, 2)")
        i, n = parts
    if n < 1 or not 0 <= i < n:
        raise ShardSpecError(f"shard {spec!r}: I must be from 0 to N - 1 and N at least 1 "
                             f"(got I = {i}, N = {n})")
    return i, n


def check_shard_count(shards: object) -> int | None:
    """A cluster ingest's shard count: None (one per worker) or an int of at least 1."""
    if shards is None:
        return None
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ShardSpecError(f"shards={shards!r}: a cluster ingest needs a whole number of "
                             "shards of at least 1 (or None: one per worker)")
    return shards


def nothing_to_do(location: str, model: str, shard: tuple[int, int]) -> str:
    """What a shard says when the main catalog already holds every prompt of its ingest
    (its plan's shards were merged, or an ingest stored them): it writes nothing then."""
    return (f"shard {shard[0]}/{shard[1]}: every prompt is already stored for model {model!r} "
            f"in {location!r} (merged from its shards, or by an earlier ingest); nothing to do")


def fingerprint(model: str, n_shards: int, base: int, align: int, work: list[Work]) -> str:
    """The same for every shard of one plan; different for another model name, another
    number of shards, other prompts (text, fields or token ids) or other committed rows."""
    h = hashlib.sha256()
    h.update(json.dumps([model, n_shards, base, align]).encode())
    for w in work:
        h.update(json.dumps([w.prompt_id, w.prompt.text, w.ids, w.truncated, w.new_prompt,
                             sorted(w.prompt.extra.items(), key=lambda kv: kv[0])],
                            default=str).encode())
    return h.hexdigest()


def plan_shard(work: list[Work], *, model: str, shard: int, n_shards: int, base: int,
               align: int) -> tuple[ShardPlan, list[Work]]:
    """Shard `shard`'s plan and its prompts, in the order they are ingested.

    Args:
        work: every prompt the whole ingest runs, in input order (the same in every shard).
        model: the model's name in the store.
        shard, n_shards: which shard of how many.
        base: the model's committed rows before the plan (main catalog).
        align: rows each later shard's start is rounded up to.
    """
    cuts = [round(k * len(work) / n_shards) for k in range(n_shards + 1)]
    start, end = base, base
    ranges = []
    for k in range(n_shards):
        tokens = sum(len(w.ids) for w in work[cuts[k] : cuts[k + 1]])
        if k:
            start = -(-end // align) * align
        end = start + tokens
        ranges.append((start, end))
    mine = ranges[shard]
    plan = ShardPlan(model=model, shard=shard, n_shards=n_shards,
                     fingerprint=fingerprint(model, n_shards, base, align, work), base=base,
                     start=mine[0], end=mine[1], total_end=ranges[-1][1])
    return plan, work[cuts[shard] : cuts[shard + 1]]


def merge(store: str | os.PathLike[str], *,
          storage_options: Mapping[str, Any] | None = None) -> MergeSummary:
    """Merge the catalogs of every finished shard ingest into the store's main catalog, in
    one transaction, then remove them (takes the store's exclusive ingest lock).

    Args:
        store: a local store folder or `s3://bucket/prefix`.
        storage_options: object storage settings beyond the AWS environment variables.

    Returns:
        What was merged: the model, how many shards, prompt runs and token rows.

    Raises:
        ShardError: a shard is missing or unfinished, or the shards disagree on their plan;
            nothing is changed then.
    """
    with Store(store, ingest=True, storage_options=storage_options) as st:
        return merge_shards(st)
