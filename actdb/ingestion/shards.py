"""A sharded ingest's plan: which batches shard i of N runs, and into which rows.

Every shard computes the same plan from the same main catalog and the same prompts: the
prompts to ingest (with their ids and token ids) cut into the batches a one-process ingest
runs (`batches.plan_batches`), and those batches cut into N contiguous runs of about equal
numbers of batches. A shard runs whole batches of the plan, so its prompts share forward
passes, and padding, exactly as they do in one process. Shard 0's rows start where the
model's committed rows end; each later shard's start is the previous shard's end rounded up
to the write alignment (a whole chunk file of every field, or a whole shard object on object
storage), so no two shards ever write the same chunk or shard object.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..errors import IngestError, ShardSpecError
from ..store.arrays import write_alignment
from ..store.records import SiteRecord
from ..store.shard_catalogs import (
    MergeSummary,
    ShardPlan,
    create_shard_catalog,
    merge_shards,
    other_plans,
)
from ..store.store import Store
from .batches import Batch, left_to_run
from .register import Registration

# ASCII digits only: str.isdigit() also passes '²', which int() refuses (and '٣', which it
# reads as 3), so a typo would not be one clear error.
_SHARD_SPEC = re.compile(r"([0-9]+)/([0-9]+)", re.ASCII)
# Far more shards than any cluster runs; the plan walks every shard's range, so a typo with
# twenty digits would otherwise hang before it said anything.
MAX_SHARDS = 100_000


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
        # NumPy's integers too (a shard index from an array), never a bool
        if len(parts) != 2 or not all(isinstance(v, numbers.Integral)
                                      and not isinstance(v, bool) for v in parts):
            raise ShardSpecError(f"shard {spec!r} is not I/N: give a string such as '0/2' "
                                 "or a tuple of two ints such as (0, 2)")
        i, n = (int(v) for v in parts)
    if n < 1 or not 0 <= i < n:
        raise ShardSpecError(f"shard {spec!r}: I must be from 0 to N - 1 and N at least 1 "
                             f"(got I = {i}, N = {n})")
    if n > MAX_SHARDS:
        raise ShardSpecError(f"shard {spec!r}: N must be at most {MAX_SHARDS} (got N = {n})")
    return i, n


def check_shard_count(shards: object) -> int | None:
    """A cluster ingest's shard count: None (one per worker) or an int of at least 1."""
    if shards is None:
        return None
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
        raise ShardSpecError(f"shards={shards!r}: a cluster ingest needs a whole number of "
                             f"shards of at least 1 and at most {MAX_SHARDS} (or None: one "
                             "per worker)")
    return shards


def nothing_to_do(location: str, model: str, shard: tuple[int, int]) -> str:
    """What a shard says when the main catalog already holds every prompt of its ingest
    (its plan's shards were merged, or an ingest stored them): it writes nothing then."""
    return (f"shard {shard[0]}/{shard[1]}: every prompt is already stored for model {model!r} "
            f"in {location!r} (merged from its shards, or by an earlier ingest); nothing to do")


def fingerprint(model: str, n_shards: int, base: int, align: int, batches: list[Batch]
                ) -> str:
    """The same for every shard of one plan; different for another model name, another
    number of shards, other prompts (text, fields or token ids), another batching of them
    or other committed rows."""
    h = hashlib.sha256()
    h.update(json.dumps([model, n_shards, base, align]).encode())
    for b in batches:
        h.update(b"batch\n")
        for w in b:
            h.update(json.dumps([w.prompt_id, w.prompt.key, w.ids, w.truncated, w.new_prompt,
                                 sorted(w.prompt.extra.items(), key=lambda kv: kv[0])]
                                + ([w.decoder] if w.decoder is not None else []),
                                default=str).encode())
    return h.hexdigest()


def plan_shard(batches: list[Batch], *, model: str, shard: int, n_shards: int, base: int,
               align: int) -> tuple[ShardPlan, list[Batch]]:
    """Shard `shard`'s plan and its batches, in the order they are ingested.

    Args:
        batches: the batch plan of every prompt the whole ingest runs, in input order (the
            same in every shard, and the one a one-process ingest runs).
        model: the model's name in the store.
        shard, n_shards: which shard of how many.
        base: the model's committed rows before the plan (main catalog).
        align: rows each later shard's start is rounded up to.
    """
    cuts = [round(k * len(batches) / n_shards) for k in range(n_shards + 1)]
    start, end = base, base
    ranges = []
    for k in range(n_shards):
        tokens = sum(w.n_rows for b in batches[cuts[k] : cuts[k + 1]] for w in b)
        if k:
            start = -(-end // align) * align
        end = start + tokens
        ranges.append((start, end))
    mine = ranges[shard]
    plan = ShardPlan(model=model, shard=shard, n_shards=n_shards,
                     fingerprint=fingerprint(model, n_shards, base, align, batches), base=base,
                     start=mine[0], end=mine[1], total_end=ranges[-1][1])
    return plan, batches[cuts[shard] : cuts[shard + 1]]


def enter_shard(st: Store, reg: Registration, records: list[SiteRecord],
                batches: list[Batch], shard_of: tuple[int, int]
                ) -> tuple[Registration, list[Batch]]:
    """Under the shards' registration lock: plan, refuse beside shards of another plan,
    register a new model now, size the arrays to the plan's end, open (or create) this
    shard's catalog; then this shard's registration (its own committed rows) and the
    batches it has still to run."""
    record = reg.record
    align = write_alignment(record.chunk_tokens, sharded=st.arrays.sharded)
    plan, mine = plan_shard(batches, model=record.model, shard=shard_of[0],
                            n_shards=shard_of[1], base=record.n_rows, align=align)
    # Before anything is written: shards of another plan (another N, batch size, prompts
    # file or store state) own rows this plan would overwrite.
    others = other_plans(st, plan.fingerprint)
    if others:
        raise IngestError(
            f"store {st.location!r} has shard ingests of another plan ({', '.join(others)}: "
            "another shard count, batch size, prompts file or model); finish them and run "
            "`actdb merge`, or rerun this shard with their arguments"
        )
    if reg.write is not None:
        reg.write()
    st.reserve_rows(record, records, plan.total_end)  # only ever grows: racing shards agree
    # Its own catalog, if it exists, was among those checked: it follows this plan.
    cat = st.open_shard(lambda path: create_shard_catalog(path, st.catalog, record, plan))
    mine_record = cat.model(record.model)
    assert mine_record is not None
    done = cat.ingested_prompt_ids(record.model)
    return replace(reg, record=mine_record, write=None), left_to_run(mine, done)


def merge(store: str | os.PathLike[str], *,
          storage_options: Mapping[str, Any] | None = None) -> MergeSummary:
    """Merge the catalogs of every finished shard ingest into the store's main catalog, in
    one transaction, then remove them (takes the store's exclusive ingest lock).

    Args:
        store: a local store folder or `s3://bucket/prefix`.
        storage_options: object storage settings beyond the AWS environment variables.

    Returns:
        What was merged: the model, how many shards, prompt runs and token rows; with
        `already_merged`, no shard was left and an earlier merge had finished (nothing done).

    Raises:
        ShardError: no shards and none ever merged, a shard missing or unfinished, or shards
            that disagree on their plan; nothing is changed then.
    """
    with Store(store, ingest=True, storage_options=storage_options) as st:
        return merge_shards(st)
