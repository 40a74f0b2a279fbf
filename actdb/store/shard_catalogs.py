"""Shard ingests' own catalogs, and their merge into the main catalog in one transaction.

A shard ingest (`--shard i/N`) writes its vectors into rows of the store's arrays that no
other shard touches, and commits its catalog rows to `shards/{i}-of-{N}/catalog.duckdb`, a
catalog of the same schema holding the model's row (its `n_rows`: where the shard resumes),
its sites (their worst errors so far), the shard's new prompts, prompt runs and tokens, and
in `meta` the plan it follows and, once done, that it finished. `merge` checks that every
shard of one plan has finished and moves all their rows into the main catalog at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ShardError
from ..lazy import lazy_module
from .catalog import Catalog, quote
from .digests import TABLE as DIGESTS
from .digests import digests_table
from .records import ModelRecord
from .store import Store
from .upgrade import act_digests

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read

_PLAN_KEY = "shard_plan"
_FINISHED_KEY = "shard_finished"
_MERGED_KEY = "merged_shards"  # main catalog: the fingerprint of the last plan merged
_MERGED_MODEL_KEY = "merged_shards_model"  # main catalog: the model of the last plan merged
_ROW_TABLES = ("prompts", "prompt_runs", "tokens")


@dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """What one shard of a sharded ingest does; every shard of one plan computes the same
    `fingerprint` (of the model, the prompts to ingest with their token ids, N and the
    store's rows before the plan)."""

    model: str
    shard: int
    n_shards: int
    fingerprint: str
    base: int  # the model's committed rows in the main catalog when planned
    start: int  # this shard's first row (aligned)
    end: int  # past this shard's last row
    total_end: int  # past the last row of every shard: the arrays' size

    @property
    def name(self) -> str:
        return shard_name(self.shard, self.n_shards)


@dataclass(frozen=True, kw_only=True)
class MergeSummary:
    store: str
    model: str | None  # None: a store merged before merges recorded the model
    shards: int
    prompts: int  # prompt runs merged
    tokens: int
    # the shards had been merged by an earlier merge that was killed while removing their
    # catalogs: this one only removed what was left
    finished_removal: bool = False
    # no shards left, and the store records a merge: an earlier merge finished (a rerun of
    # a merge that may have been killed tells done from failed); nothing was changed
    already_merged: bool = False


def shard_name(shard: int, n_shards: int) -> str:
    return f"{shard}-of-{n_shards}"


def create_shard_catalog(path: Path, main: Catalog, model: ModelRecord, plan: ShardPlan) -> None:
    """A new shard catalog at `path`: the model and its sites as the main catalog has them
    (rows from the shard's start), the prompt columns of the main catalog, and the plan."""
    cat = Catalog.create(path, version=main.format_version(), store=main.store_label)
    try:
        vocab = pa.table({"token_id": pa.array([], pa.int32()), "token": pa.array([], pa.string()),
                          "piece": pa.array([], pa.string())})
        record = ModelRecord(**{**asdict(model), "n_rows": plan.start,
                                "logit_max_rel_error": None})
        sites = main.sites(model.model)
        cat.insert_model(record, sites, vocab)
        with cat.transaction():
            cat.con.execute("UPDATE sites SET max_rel_error = NULL")
            extra = {k: v for k, v in main.prompt_columns().items()
                     if k not in ("prompt_id", "text", "n_tokens")}
            for name, sqltype in extra.items():
                cat.con.execute(f"ALTER TABLE prompts ADD COLUMN {quote(name)} {sqltype}")
            cat.con.execute("INSERT INTO meta VALUES (?, ?)",
                            [_PLAN_KEY, json.dumps(asdict(plan), sort_keys=True)])
    finally:
        cat.close(strict=True)  # renamed into place without its log


def read_plan(cat: Catalog) -> tuple[ShardPlan, bool]:
    """A shard catalog's plan, and whether the shard has finished."""
    rows = cat.meta()
    return ShardPlan(**json.loads(rows[_PLAN_KEY])), rows.get(_FINISHED_KEY) == "true"


def other_plans(store: Store, fingerprint: str) -> list[str]:
    """The shard catalogs in `store` that follow another plan than `fingerprint`: shards of
    two plans compute overlapping rows, so a shard must not write beside any of them."""
    others = []
    for name in store.backend.shard_names():
        cat = store.backend.open_shard_catalog(name, read_only=True)
        try:
            plan, _ = read_plan(cat)
        finally:
            cat.close()
        if plan.fingerprint != fingerprint:
            others.append(name)
    return others


def mark_finished(cat: Catalog) -> None:
    with cat.transaction():
        cat.con.execute("DELETE FROM meta WHERE key = ?", [_FINISHED_KEY])
        cat.con.execute("INSERT INTO meta VALUES (?, 'true')", [_FINISHED_KEY])


def pending_shards(store: Store) -> list[str]:
    """The shard catalogs not yet merged (an unsharded ingest must not run beside them)."""
    return store.backend.shard_names()


@dataclass(frozen=True, kw_only=True)
class _Shard:
    name: str
    plan: ShardPlan
    finished: bool
    model: ModelRecord
    tables: dict[str, pa.Table]
    errors: dict[str, float]
    digests: pa.Table | None  # its chunks' digests (None: a shard of an older actdb)


def _digests_of_old_shards(store: Store, model: ModelRecord, shards: list[_Shard]
                           ) -> pa.Table:
    """The digests of the chunks that shards written by an actdb older than format 5 hold
    (their catalogs record none), read from the chunks as they are (upgrade.py)."""
    sites = store.catalog.sites(model.model)
    found = []
    for s in shards:  # a shard's last chunk holds its rows up to its end, then unused rows
        found += act_digests(store.arrays, model, sites, s.plan.start, s.model.n_rows, [])
    return digests_table(found, {model.model_id: model.model})


def _read_shard(store: Store, name: str) -> _Shard:
    cat = store.backend.open_shard_catalog(name, read_only=True)
    try:
        plan, finished = read_plan(cat)
        model = cat.models()[0]
        tables = {t: cat.con.sql(f"SELECT * FROM {t}").to_arrow_table()
                  for t in _ROW_TABLES}
        digests = (cat.con.sql(f"SELECT * FROM {DIGESTS}").to_arrow_table()
                   if cat.con.execute("SELECT 1 FROM duckdb_tables() WHERE table_name = ?",
                                      [DIGESTS]).fetchall() else None)
        errors = {s: e for s, e in cat.con.execute(
            "SELECT site, max_rel_error FROM sites WHERE max_rel_error IS NOT NULL").fetchall()}
    finally:
        cat.close()
    return _Shard(name=name, plan=plan, finished=finished, model=model, tables=tables,
                  errors=errors, digests=digests)


def merge_shards(store: Store) -> MergeSummary:
    """Move every finished shard's catalog rows into the main catalog in one transaction,
    then remove the shard catalogs. `store` is open for an ingest (the exclusive lock).

    Raises:
        ShardError: no shards, a shard missing or unfinished, or shards of different plans;
            nothing is changed then.
    """
    where = store.location
    names = store.backend.shard_names()
    if not names:
        meta = store.catalog.meta()
        if _MERGED_KEY in meta:
            return MergeSummary(store=where, model=meta.get(_MERGED_MODEL_KEY), shards=0,
                                prompts=0, tokens=0, already_merged=True)
        raise ShardError(f"store {where!r} has no shard ingests to merge (and none was ever "
                         "merged into it)")
    shards = [_read_shard(store, n) for n in names]
    # A merge killed after its transaction committed, while it removed the shard catalogs,
    # left some of them: their plan is the one the main catalog records as merged (a later
    # plan starts from the merged rows, so its fingerprint differs). Only finish removing.
    row = store.catalog.one("SELECT value FROM meta WHERE key = ?", [_MERGED_KEY])
    merged = row[0] if row else None
    done = [s for s in shards if s.plan.fingerprint == merged]
    if done:
        store.backend.remove_shards([s.name for s in done])
        shards = [s for s in shards if s.plan.fingerprint != merged]
        if not shards:
            return MergeSummary(store=where, model=done[0].plan.model, shards=0, prompts=0,
                                tokens=0, finished_removal=True)
        names = [s.name for s in shards]
    fingerprints = {s.plan.fingerprint for s in shards}
    if len(fingerprints) > 1 or any(s.name != s.plan.name for s in shards):
        detail = ", ".join(f"{s.name} (model {s.plan.model!r}, plan {s.plan.fingerprint[:8]})"
                           for s in shards)
        raise ShardError(
            f"the shard ingests of store {where!r} disagree on their plan (another prompts "
            f"file, model or number of shards): {detail}; rerun them all with the same "
            "arguments, or remove the stray shards/ folder"
        )
    plan = shards[0].plan
    have = {s.plan.shard for s in shards}
    missing = [shard_name(i, plan.n_shards) for i in range(plan.n_shards) if i not in have]
    unfinished = [s.name for s in shards if not s.finished]
    if missing or unfinished:
        what = "missing" if missing else "not finished"
        raise ShardError(
            f"cannot merge store {where!r}: shard {', '.join(missing or unfinished)} of "
            f"model {plan.model!r} is {what}; run it (`actdb ingest ... --shard i/N` with the "
            "same arguments resumes it), then merge"
        )
    main = store.catalog
    model = main.model(plan.model)
    if model is None or model.n_rows != plan.base:
        raise ShardError(
            f"cannot merge store {where!r}: model {plan.model!r} changed in the main catalog "
            f"since its shards planned (rows {model.n_rows if model else None}, planned from "
            f"{plan.base})"
        )
    n_rows = max([plan.base] + [s.model.n_rows for s in shards])
    errors: dict[str, float] = {}
    for s in shards:
        for site, err in s.errors.items():
            errors[site] = max(errors.get(site, 0.0), err)
    logit = [s.model.logit_max_rel_error for s in shards if s.model.logit_max_rel_error]
    digests = [s.digests for s in shards if s.digests is not None]
    if store.has_digests and len(digests) < len(shards):  # shards of an older actdb
        digests.append(_digests_of_old_shards(store, model, [s for s in shards
                                                             if s.digests is None]))
    with store.backend.writing("the catalog"), main.transaction():
        con = main.con
        for s in shards:
            for table in _ROW_TABLES:
                data = s.tables[table]
                if data.num_rows == 0:
                    continue
                con.register("_shard", data)
                try:
                    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _shard")
                finally:
                    con.unregister("_shard")
        for site, err in errors.items():
            con.execute("UPDATE sites SET max_rel_error = greatest(coalesce(max_rel_error, 0), "
                        "?) WHERE model = ? AND site = ?", [err, plan.model, site])
        if logit:
            con.execute("UPDATE models SET logit_max_rel_error = greatest(coalesce("
                        "logit_max_rel_error, 0), ?) WHERE model = ?", [max(logit), plan.model])
        if store.has_digests:
            for table in digests:
                main.put_digests(table)
        con.execute("UPDATE models SET n_rows = ? WHERE model = ?", [n_rows, plan.model])
        con.execute("DELETE FROM meta WHERE key IN (?, ?)", [_MERGED_KEY, _MERGED_MODEL_KEY])
        con.execute("INSERT INTO meta VALUES (?, ?), (?, ?)",
                    [_MERGED_KEY, plan.fingerprint, _MERGED_MODEL_KEY, plan.model])
    store.backend.remove_shards(names)
    return MergeSummary(
        store=where, model=plan.model, shards=len(shards),
        prompts=sum(s.tables["prompt_runs"].num_rows for s in shards),
        tokens=sum(s.tables["tokens"].num_rows for s in shards),
    )
