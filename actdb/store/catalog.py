"""The DuckDB catalog: every piece of metadata of a store, read and written; the batch commit.

`Catalog` holds its connection (catalog_connection.py: snapshots, sessions, locks, folds) and
its schema (catalog_schema.py: tables, columns added since, the format version)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from ..errors import PromptsError, StoreFormatError
from ..lazy import lazy_module
from . import digests, limits
from .catalog_connection import CatalogConnection
from .catalog_schema import (
    FORMAT_VERSION,
    IMAGE_FORMAT_VERSION,
    LOCAL_FORMAT_VERSION,
    TABLES,
    CatalogSchema,
    version_needed,
)
from .records import ModelRecord, SiteRecord, prompt_key

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # when Arrow data is first made or read

_MODEL_COLUMNS = [f.name for f in fields(ModelRecord)]
_SITE_COLUMNS = [f.name for f in fields(SiteRecord)]
_FIELD_TYPES = ("BIGINT", "DOUBLE", "BOOLEAN", "VARCHAR")
_DIGESTS = digests.TABLE


def quote(name: str) -> str:
    """A SQL identifier, double-quoted with inner quotes doubled: the one way a name that came
    from outside (a JSONL key) reaches SQL. Values are always bound, never formatted in."""
    return '"' + name.replace('"', '""') + '"'


class Catalog:
    """The queries the store needs, over a reader's snapshot, an ingest writer's sessions or a
    holder's open file (`CatalogConnection` says which and how)."""

    def __init__(self, path: Path, *, read_only: bool, hold: bool = True,
                 store: str | None = None, publish: Callable[[], None] | None = None) -> None:
        self.path = path
        self.read_only = read_only
        self.connection = CatalogConnection(path, read_only=read_only, hold=hold, store=store,
                                            publish=publish)
        self.schema = CatalogSchema(self.connection)

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection: the in-memory snapshot for a reader, the file otherwise
        (an ingest writer has one only inside a session)."""
        return self.connection.con

    @property
    def store_label(self) -> str:
        return self.connection.store_label

    @classmethod
    def create(cls, path: Path, *, version: int = LOCAL_FORMAT_VERSION,
               hold: bool = True, store: str | None = None) -> Catalog:
        """A new catalog file with the schema; `hold=False`: opened for each session only,
        as an ingest writer's is (for a file created and closed at once: cheaper). `store`:
        the store named in messages."""
        cat = cls(path, read_only=False, hold=hold, store=store)
        try:
            with cat.transaction():
                cat.schema.create(version)
        except BaseException:
            cat.close()
            raise
        return cat

    def close(self, *, strict: bool = False) -> None:
        """Close, folding the log of a local writer into the file (catalog_connection.py)."""
        self.connection.close(strict=strict)

    @contextmanager
    def session(self) -> Iterator[None]:
        """Several reads and writes on one connection to the file. An ingest writer otherwise
        opens the file for each. The catalog's lock is held throughout and readers in other
        processes wait for it: hold it for the catalog's own work only, nothing that reads
        weights or tokenizes."""
        with self.connection.session():
            yield

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self.connection.transaction():
            yield

    # -- reading ---------------------------------------------------------------------------

    def one(self, sql: str, params: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
        """The first row of a query, fetched to the end: an unfinished result would block
        the connection for every later statement."""
        with self.connection.session() as con:
            rows = con.execute(sql, list(params or [])).fetchall()
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Every row of a query."""
        with self.connection.session() as con:
            return con.execute(sql, list(params or [])).fetchall()

    def meta(self) -> dict[str, str]:
        """The `meta` table as a dict (format version, shard plans)."""
        with self.connection.session() as con:
            return dict(con.execute("SELECT key, value FROM meta").fetchall())

    def format_version(self) -> int:
        row = self.one("SELECT value FROM meta WHERE key = 'format_version'")
        if row is None:
            raise StoreFormatError(f"catalog {str(self.path)!r} has no format version")
        return int(row[0])

    def models(self) -> list[ModelRecord]:
        names = self.schema.columns("models", _MODEL_COLUMNS)
        cols = ", ".join(quote(c) for c in names)
        with self.connection.session() as con:
            rows = con.execute(f"SELECT {cols} FROM models ORDER BY model_id").fetchall()
        out = []
        for row in rows:
            kw = dict(zip(names, row, strict=True))
            kw["config"] = json.loads(kw["config"]) if kw["config"] else {}
            if "towers" in kw:
                kw["towers"] = json.loads(kw["towers"]) if kw["towers"] else {}
            out.append(ModelRecord(**kw))
        return out

    def model(self, name: str) -> ModelRecord | None:
        return next((m for m in self.models() if m.model == name), None)

    def sites(self, model: str) -> list[SiteRecord]:
        names = self.schema.columns("sites", _SITE_COLUMNS)
        cols = ", ".join(names)
        with self.connection.session() as con:
            rows = con.execute(
                f"SELECT {cols} FROM sites WHERE model = ? ORDER BY site_id", [model]
            ).fetchall()
        return [SiteRecord(**dict(zip(names, r, strict=True))) for r in rows]

    def prompt_ids(self, texts: Sequence[str]) -> dict[str, int]:
        """The ids of those texts that already are prompts of the store (of text alone: no
        media, no decoder target)."""
        if not texts:
            return {}
        have = self._keyed_columns()
        alone = " AND ".join(f"p.{c} IS NULL" for c in ("image", "video", "audio", "target")
                             if c in have) or "true"
        wanted = pa.table({"text": pa.array(list(set(texts)), pa.string())})
        with self.connection.session() as con:
            con.register("_wanted", wanted)
            try:
                rows = con.execute(
                    "SELECT p.text, p.prompt_id FROM prompts p JOIN _wanted w USING (text) "
                    f"WHERE {alone}"
                ).fetchall()
            finally:
                con.unregister("_wanted")
        return {t: int(i) for t, i in rows}

    def media_prompt_ids(self) -> dict[str, int]:
        """The ids of the prompts with an image, video, audio or decoder target, by their key
        (records.prompt_key, as the ingest's `Prompt.key`)."""
        have = self._keyed_columns()
        media = [c for c in ("image", "video", "audio", "target") if c in have]
        if not media:
            return {}
        cols = ", ".join(f"p.{c}" if c in media else "NULL"
                         for c in ("image", "video", "audio", "target"))
        # a target that is no string (a JSON value in a VARCHAR column) is no decoder's
        with self.connection.session() as con:
            rows = con.execute(f"SELECT p.prompt_id, coalesce(p.text, ''), {cols} FROM prompts p "
                               f"WHERE coalesce({', '.join(media)}) IS NOT NULL").fetchall()
        return {prompt_key(*r[1:]): int(r[0]) for r in rows}

    def _keyed_columns(self) -> set[str]:
        """The prompts' columns that are part of a prompt's key: its media paths, and a
        `target` column of text (a column of numbers a user named so is a plain field, as in
        `Prompt.target`). Not cached: prompts gains columns."""
        return {c.lower() for c, t in self.prompt_columns().items()
                if c.lower() in ("image", "video", "audio")
                or (c.lower() == "target" and t == "VARCHAR")}

    def next_prompt_id(self) -> int:
        row = self.one("SELECT coalesce(max(prompt_id) + 1, 0) FROM prompts")
        return int(row[0]) if row else 0

    def ingested_prompt_ids(self, model: str) -> set[int]:
        with self.connection.session() as con:
            rows = con.execute("SELECT prompt_id FROM prompt_runs WHERE model = ?", [model])
            return {int(r[0]) for r in rows.fetchall()}

    def prompt_fields(self, prompt_ids: Sequence[int], names: Sequence[str]
                      ) -> dict[int, dict[str, Any]]:
        """The stored values of prompt columns `names` (those the store has) for these
        prompts: {prompt_id: {column: value}}."""
        have = {n.lower(): n for n in self.prompt_columns()}
        cols = [have[n.lower()] for n in names if n.lower() in have]
        if not prompt_ids:
            return {}
        select = ", ".join(['prompt_id', *('"' + c.replace('"', '""') + '"' for c in cols)])
        with self.connection.session() as con:
            rows = con.execute(f"SELECT {select} FROM prompts WHERE prompt_id IN "
                               "(SELECT unnest($ids))", {"ids": list(prompt_ids)}).fetchall()
        return {int(r[0]): dict(zip(cols, r[1:], strict=True)) for r in rows}

    def prompt_columns(self) -> dict[str, str]:
        with self.connection.session() as con:
            rows = con.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = 'prompts' AND table_catalog = current_database() "
                "ORDER BY ordinal_position"
            ).fetchall()
        return {name: dtype for name, dtype in rows}

    def token_strings(self, model: str) -> list[str | None]:
        """Each token id of the model's vocabulary decoded alone, in id order."""
        with self.connection.session() as con:
            rows = con.execute(
                "SELECT token FROM vocab WHERE model = ? ORDER BY token_id", [model]
            ).fetchall()
        return [r[0] for r in rows]

    def next_model_id(self) -> int:
        row = self.one("SELECT coalesce(max(model_id) + 1, 0) FROM models")
        return int(row[0]) if row else 0

    # -- writing ---------------------------------------------------------------------------

    def add_prompt_columns(self, columns: dict[str, str]) -> None:
        """Add the extra prompt fields (JSONL keys) that `prompts` does not have yet, after
        checking every field against the columns already there (same name, same case, a type
        its values fit): a field that changed type between runs is a PromptsError."""
        with self.connection.session() as con:
            self._add_prompt_columns(con, columns)

    def _add_prompt_columns(self, con: duckdb.DuckDBPyConnection, columns: dict[str, str]
                            ) -> None:
        have = self.prompt_columns()
        by_lower = {name.lower(): name for name in have}
        for name, sqltype in columns.items():
            existing = by_lower.get(name.lower())
            if existing is None:
                continue
            if existing != name:
                raise PromptsError(f"field {name!r} differs only in case from the store's "
                                   f"prompts column {existing!r}; column names ignore case")
            fits = sqltype in (have[existing], "NULL") or (have[existing], sqltype) == (
                "DOUBLE", "BIGINT")
            if not fits:
                raise PromptsError(
                    f"field {name!r} holds {sqltype} values in these prompts but the store's "
                    f"prompts.{existing} column is {have[existing]} from an earlier ingest; "
                    "give the field the same type, or another name"
                )
        for name, sqltype in columns.items():
            if name.lower() not in by_lower:
                column_type = "VARCHAR" if sqltype == "NULL" else sqltype  # null so far
                if column_type not in _FIELD_TYPES:  # never pasted: only our own type names
                    raise ValueError(f"unexpected prompt column type {sqltype!r}")
                con.execute(f"ALTER TABLE prompts ADD COLUMN {quote(name)} {column_type}")
                self.connection.mark_changed()

    def insert_model(
        self, model: ModelRecord, sites: Sequence[SiteRecord], vocab: pa.Table,
        digests: pa.Table | None = None,
    ) -> None:
        """Register a model, its sites, its vocabulary and (`digests`) its weights' chunk
        digests in one transaction (one open of the file for the checks and the
        transaction)."""
        opened_here = self.connection.held is None
        with self.connection.session():
            self._insert_model(model, sites, vocab, digests)
            if opened_here and self.connection.logged:
                # The vocabulary is most of what an ingest logs (50k rows and more): folded
                # now, beside the first forward passes, each later session of the ingest
                # attaches the file without replaying it. Only at the end
                # of a session opened here: a holder's connection, or an outer session's,
                # would go on writing to the file folded away. A fold that fails (a full
                # disk) leaves the log, which every open replays: the close folds it.
                with suppress(Exception):
                    self.connection.fold()

    def _insert_model(
        self, model: ModelRecord, sites: Sequence[SiteRecord], vocab: pa.Table,
        digests: pa.Table | None,
    ) -> None:
        self.schema.add_missing()
        have = self.one("SELECT coalesce(sum(coalesce(n_heads, 1)), 0) FROM sites")
        limits.check_streams(int(have[0]) if have else 0, sum(s.n_heads or 1 for s in sites),
                             model.model)
        with self.transaction():
            # Older stores are migrated in the same transaction: their new columns were added
            # above (NULL in older rows, read as before); the version is raised where the
            # model needs it, so that an older actdb refuses the store instead of misreading.
            needed = version_needed(model, sites)
            if needed:
                self.con.execute(
                    "UPDATE meta SET value = ? WHERE key = 'format_version' "
                    "AND CAST(value AS INTEGER) < ?", [str(needed), needed])
            row = asdict(model)
            row["config"] = json.dumps(row["config"], default=str)
            row["towers"] = json.dumps(row["towers"])
            cols = ", ".join(quote(c) for c in _MODEL_COLUMNS)
            marks = ", ".join("?" for _ in _MODEL_COLUMNS)
            self.con.execute(
                f"INSERT INTO models ({cols}) VALUES ({marks})", [row[c] for c in _MODEL_COLUMNS]
            )
            site_cols = ", ".join(_SITE_COLUMNS)
            site_marks = ", ".join("?" for _ in _SITE_COLUMNS)
            self.con.executemany(
                f"INSERT INTO sites (model, {site_cols}) VALUES (?, {site_marks})",
                [[model.model, *[getattr(s, c) for c in _SITE_COLUMNS]] for s in sites],
            )
            self.con.register("_vocab", vocab)
            try:
                self.con.execute(
                    "INSERT INTO vocab SELECT ?, token_id, token, piece FROM _vocab", [model.model]
                )
            finally:
                self.con.unregister("_vocab")
            if digests is not None:
                # the weights of an interrupted registration under this name are replaced
                self.con.execute(f"DELETE FROM {_DIGESTS} WHERE model = ?", [model.model])
                self.put_digests(digests)

    def put_digests(self, table: pa.Table) -> None:
        """Record chunk digests (inside a transaction), each replacing any recorded for the
        same place (a partly filled chunk's, whose committed rows grew)."""
        if table.num_rows == 0:
            return
        self.con.register("_digests", table)
        try:
            self.con.execute(
                f"DELETE FROM {_DIGESTS} d USING _digests n WHERE d.model = n.model "
                "AND d.path = n.path AND d.chunk = n.chunk")
            self.con.execute(f'INSERT INTO {_DIGESTS} (model, path, chunk, "rows", crc) '
                             'SELECT model, path, chunk, "rows", crc FROM _digests')
        finally:
            self.con.unregister("_digests")

    def digest_query(self) -> Callable[[str, list[Any]], list[tuple[Any, ...]]]:
        """A function running one query on this catalog, safe to call while a query runs on
        `con` (inside a UDF, on another thread): a reader's or holder's own cursor, opened
        now; an ingest writer's sessions otherwise."""
        held = self.connection.held
        if held is None:
            return lambda sql, params: self.all(sql, params)
        cursor = held.cursor()
        lock = threading.Lock()

        def run(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
            with lock:
                return cursor.execute(sql, params).fetchall()
        return run

    def commit_batch(
        self,
        *,
        model: str,
        new_prompts: pa.Table,
        prompt_runs: pa.Table,
        tokens: pa.Table,
        site_errors: dict[str, float],
        n_rows: int,
        logit_error: float | None = None,
        digests: pa.Table | None = None,
    ) -> None:
        """Make one ingested batch visible: everything in one transaction, with the digests
        of the chunks holding its rows."""
        self.schema.add_missing()
        limits.check_rows(n_rows, model)
        with self.transaction():
            if digests is not None:
                self.put_digests(digests)
            self._insert_table("prompts", new_prompts)
            self._insert_table("prompt_runs", prompt_runs, model=model)
            self._insert_table("tokens", tokens, model=model)
            for site, err in site_errors.items():
                self.con.execute(
                    "UPDATE sites SET max_rel_error = greatest(coalesce(max_rel_error, 0), ?) "
                    "WHERE model = ? AND site = ?",
                    [err, model, site],
                )
            if logit_error is not None:
                self.con.execute(
                    "UPDATE models SET logit_max_rel_error = "
                    "greatest(coalesce(logit_max_rel_error, 0), ?) WHERE model = ?",
                    [logit_error, model],
                )
            self.con.execute("UPDATE models SET n_rows = ? WHERE model = ?", [n_rows, model])

    def _insert_table(self, table: str, data: pa.Table, **constants: Any) -> None:
        if data.num_rows == 0:
            return
        assert table in TABLES, table
        self.con.register("_batch", data)
        try:
            const_cols = [quote(k) for k in constants]
            data_cols = [quote(c) for c in data.column_names]
            target = ", ".join(const_cols + data_cols)
            select = ", ".join(["?"] * len(constants) + data_cols)
            self.con.execute(
                f"INSERT INTO {table} ({target}) SELECT {select} FROM _batch",
                list(constants.values()),
            )
        finally:
            self.con.unregister("_batch")


__all__ = ["FORMAT_VERSION", "IMAGE_FORMAT_VERSION", "LOCAL_FORMAT_VERSION", "Catalog", "quote",
           "version_needed"]
