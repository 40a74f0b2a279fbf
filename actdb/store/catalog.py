"""The DuckDB catalog: every piece of metadata of a store, and the batch commit."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb

from ..errors import (
    PromptsError,
    StoreBusyError,
    StoreCorruptError,
    StoreFormatError,
    StoreNotWritableError,
)
from ..lazy import lazy_module
from . import catalog_lock, catalog_log, limits
from .durable import full_disk_as_error, is_disk_full, is_file_too_large
from .faults import fault
from .records import ModelRecord, SiteRecord

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # 0.05 s to import: when Arrow data is first made or read

# The newest format this actdb reads and writes. Local stores are still created as version 2
# (their layout did not change); stores on object storage are version 3; a store becomes
# version 4 when it first holds a model that older actdb would misread (docs/FORMAT.md).
FORMAT_VERSION = 4
LOCAL_FORMAT_VERSION = 2
# A model without a token embedding, or whose head is a classifier (an image model): an actdb
# reading version 3 or less would call its missing embedding damage and its labels tokens.
IMAGE_FORMAT_VERSION = 4


def version_needed(model: ModelRecord) -> int:
    """The format version a store must have to hold `model` (0: any)."""
    if model.has_embed is False or model.head_kind == "classifier":
        return IMAGE_FORMAT_VERSION
    return 0
T = TypeVar("T")
# How long a reader waits for a commit, or a writer for another writer or a reader's
# snapshot, to let go of the catalog's lock (catalog_lock.py) before saying who holds it
# (ACTDB_LOCK_WAIT_S overrides it).
LOCK_WAIT_S = 30.0


def lock_wait_seconds() -> float:
    return float(os.environ.get("ACTDB_LOCK_WAIT_S", LOCK_WAIT_S))


def _is_lock_conflict(e: BaseException) -> bool:
    return "Could not set lock" in str(e) or "Conflicting lock" in str(e)

SCHEMA = """
CREATE TABLE meta (key VARCHAR, value VARCHAR);
CREATE TABLE models (
    model VARCHAR, model_id INTEGER, source VARCHAR, revision VARCHAR, architecture VARCHAR,
    d_model INTEGER, n_layers INTEGER, vocab_size INTEGER, n_sites INTEGER,
    has_lm_head BOOLEAN, has_lm_head_bias BOOLEAN, tied_embeddings BOOLEAN, final_site VARCHAR,
    dtype VARCHAR, max_length INTEGER, sites_glob VARCHAR, chunk_tokens INTEGER,
    n_rows BIGINT, logit_softcap DOUBLE, config JSON, created_at TIMESTAMP DEFAULT now(),
    logit_scale DOUBLE, logit_max_rel_error DOUBLE, params_digest VARCHAR, has_embed BOOLEAN,
    head_kind VARCHAR, head_position INTEGER, towers JSON
);
CREATE TABLE prompts (prompt_id BIGINT, text VARCHAR, n_tokens INTEGER);
CREATE TABLE prompt_runs (
    model VARCHAR, prompt_id BIGINT, row_start BIGINT, n_tokens INTEGER, truncated BOOLEAN
);
CREATE TABLE tokens (
    model VARCHAR, prompt_id BIGINT, position INTEGER, token_id INTEGER, token VARCHAR,
    "row" BIGINT, patch_row INTEGER, patch_col INTEGER, frame INTEGER
);
CREATE TABLE sites (
    model VARCHAR, site VARCHAR, site_id INTEGER, layer INTEGER, role VARCHAR, kind VARCHAR,
    d INTEGER, n_heads INTEGER, eps DOUBLE, module VARCHAR, has_gain BOOLEAN, has_bias BOOLEAN,
    max_rel_error DOUBLE, centered BOOLEAN, tower VARCHAR, layout VARCHAR
);
CREATE TABLE vocab (model VARCHAR, token_id INTEGER, token VARCHAR, piece VARCHAR);
"""

# Columns format version 2 added (and params_digest, later): a store without them being
# written gets them (NULL in its old rows, which then keep reading by kind, as version 1 did,
# and resume without the digest's check).
_ADDED_COLUMNS = {"models": {"logit_scale": "DOUBLE", "logit_max_rel_error": "DOUBLE",
                             "params_digest": "VARCHAR", "has_embed": "BOOLEAN",
                             "head_kind": "VARCHAR", "head_position": "INTEGER",
                             "towers": "JSON"},
                  "sites": {"centered": "BOOLEAN", "tower": "VARCHAR", "layout": "VARCHAR"},
                  "tokens": {"patch_row": "INTEGER", "patch_col": "INTEGER", "frame": "INTEGER"}}
_MODEL_COLUMNS = [f.name for f in fields(ModelRecord)]
_FIELD_TYPES = ("BIGINT", "DOUBLE", "BOOLEAN", "VARCHAR")
_TABLES = ("meta", "models", "prompts", "prompt_runs", "tokens", "sites", "vocab")
# A reader's DuckDB: no extension look-ups at start (12 ms instead of 18-32; the query layer
# locks them off anyway, query/sandbox.py)
_READER_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "threads": 1, "autoload_known_extensions": False, "autoinstall_known_extensions": False}


def quote(name: str) -> str:
    """A SQL identifier, double-quoted with inner quotes doubled: the one way a name that came
    from outside (a JSONL key) reaches SQL. Values are always bound, never formatted in."""
    return '"' + name.replace('"', '""') + '"'

_SITE_COLUMNS = [f.name for f in fields(SiteRecord)]
# The name an ingest writer's sessions attach the file under (`Catalog._attach`).
_ATTACHED = "actdb_catalog"


class Catalog:
    """The queries the store needs, over one of three kinds of DuckDB connection.

    - reader (`read_only=True`): the file is opened read-only just long enough to copy every
      table into an in-memory database, then closed; `con` is that copy, a consistent
      snapshot of what was committed, and the file stays free for the writer.
    - ingest writer (`read_only=False, hold=False`): the file is opened only for each short
      session (a few reads, or one commit transaction) and closed after it, so that
      readers can take their snapshot between commits.
    - holder (`read_only=False, hold=True`): the file stays open for writing until `close`
      (`connect(read_only=False)`, and store creation).

    Both sides wait for a while when the other holds the catalog's lock (catalog_lock.py:
    writers exclusively while their connection is open, readers shared while they copy). A
    local writer never checkpoints the file in place: its commits stay in DuckDB's log,
    folded into a new copy of the file renamed over it (catalog_log.py), so a kill cannot
    tear the file. A working copy of a catalog on object storage is checkpointed before it
    is published.
    """

    def __init__(self, path: Path, *, read_only: bool, hold: bool = True,
                 store: str | None = None, publish: Callable[[], None] | None = None) -> None:
        self.path = path
        self.read_only = read_only
        self._hold = hold
        # The store named in messages (the file may be a working copy of a remote catalog).
        self.store_label = store or str(path.parent)
        # The local folder a full disk or file-size limit is said of: the store's, or the
        # working copy's where the store is on object storage.
        self._disk = self.store_label if "://" not in self.store_label else str(path.parent)
        # Called once the file holds a committed change and is closed (checkpointed): how a
        # working copy of a catalog on object storage is published.
        self._publish = publish
        self._changed = False
        # Local writers leave commits in the log (catalog_log.py); `_logged`: some not folded.
        self._log_only = publish is None
        self._logged = False
        self._swept = False  # the leftovers of a killed fold removed
        # Set while this writer holds the catalog's lock (catalog_lock.py): gives it back
        # should the catalog be dropped without being closed.
        self._lock_release: weakref.finalize[Any, Any] | None = None
        self._lock = threading.RLock()
        self._con: duckdb.DuckDBPyConnection | None = None
        # An ingest writer's sessions attach the file to this in-memory instance (`_attach`).
        self._engine: duckdb.DuckDBPyConnection | None = None
        if read_only:
            self._con = self._snapshot()
        elif hold:
            self._con = self._open()
        else:
            with self._session():  # fail now, not at the first commit, if it cannot open
                pass

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection: the in-memory snapshot for a reader, the file otherwise
        (an ingest writer has one only inside a session)."""
        if self._con is None:
            raise RuntimeError("the ingest's catalog is open only inside a session")
        return self._con

    @classmethod
    def create(cls, path: Path, *, version: int = LOCAL_FORMAT_VERSION,
               hold: bool = True, store: str | None = None) -> Catalog:
        """A new catalog file with the schema; `hold=False`: opened for each session only,
        as an ingest writer's is (for a file created and closed at once: cheaper). `store`:
        the store it is for, as messages name it (a new store is built under another name)."""
        cat = cls(path, read_only=False, hold=hold, store=store)
        try:
            with cat.transaction():
                cat.con.execute(SCHEMA)
                cat.con.execute(
                    "INSERT INTO meta VALUES ('format_version', ?), ('created_by', 'actdb')",
                    [str(version)],
                )
        except BaseException:
            cat.close()
            raise
        return cat

    def close(self, *, strict: bool = False) -> None:
        """Close, folding the log of a local writer into the file. A fold that fails (a full
        disk) leaves the log, which every open replays, so the store stays whole: that is an
        error only when `strict` (the file is about to be moved without its log)."""
        with self._lock:
            try:
                # A holder's connection may have run a user's writes: fold any log there is.
                if self._log_only and not self.read_only and catalog_log.log_bytes(self.path):
                    try:
                        with self._session():
                            self._fold()
                    except Exception:
                        if strict:
                            raise
            finally:
                con, self._con = self._con, None
                try:
                    if con is not None:
                        con.close()
                    if self._engine is not None:
                        engine, self._engine = self._engine, None
                        engine.close()
                finally:
                    self._unlock()

    def _lock_or_busy(self, *, exclusive: bool) -> None:
        outcome = catalog_lock.acquire(self.path, exclusive=exclusive,
                                       timeout=lock_wait_seconds())
        if outcome is catalog_lock.Outcome.HELD_BY_THIS_THREAD:
            raise self._held_here()
        if outcome is catalog_lock.Outcome.BUSY:
            if catalog_lock.held_here(self.path):
                raise self._held_here()
            pid = catalog_lock.holder_pid(self.path)
            raise self._busy(f" (PID {pid})" if pid else "")

    def _lock_for_writing(self) -> None:
        self._lock_or_busy(exclusive=True)
        self._lock_release = weakref.finalize(self, catalog_lock.release, self.path)

    def _unlock(self) -> None:
        if self._lock_release is not None:
            release, self._lock_release = self._lock_release, None
            release()  # gives the lock back (once: a finalizer runs at most once)

    def _fold(self) -> None:
        catalog_log.fold(self.path, self._engine)
        self._logged = False

    def _mark_changed(self) -> None:
        self._changed = True
        self._logged = self._log_only

    # -- connections -----------------------------------------------------------------------

    def _retrying(self, step: Callable[[], T],
                  stale_log: Callable[[], None] | None = None) -> T:
        """`step`, retried while DuckDB's own file lock is held (a process of an actdb
        without the catalog's lock, or not actdb at all; up to the lock wait), then any
        failure as one of our errors. When DuckDB refuses the log beside the
        file as written for another checkpoint of it (catalog_log.py), `step` is retried too:
        after `stale_log()` when the log is older than the file, as it is when the file was
        opened across a fold."""
        deadline = time.monotonic() + lock_wait_seconds()
        pause = 0.002
        while True:
            try:
                return step()
            except duckdb.Error as e:
                stale = catalog_log.stale_log(e)
                if stale and stale_log is not None:
                    stale_log()
                if (_is_lock_conflict(e) or stale is not None) and time.monotonic() < deadline:
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
                    continue
                raise self._open_error(e) from None

    def _open(self, *, read_only: bool = False) -> duckdb.DuckDBPyConnection:
        """A connection to the file, waiting while another process holds its lock."""
        # One DuckDB thread: its idle workers otherwise steal the cores torch needs for the
        # forward pass (measured: a 20x slower forward after a catalog write).
        log_only = self._log_only and not read_only
        config = catalog_log.LOG_ONLY_CONFIG if log_only else catalog_log.CHECKPOINTING_CONFIG
        seen = catalog_log.stat_log(self.path)

        def connect() -> duckdb.DuckDBPyConnection:
            if log_only and not self._hold:
                con = self._attach()
            else:
                con = duckdb.connect(str(self.path), read_only=read_only, config=config)
            if not log_only:
                return con
            try:
                if not self._swept:
                    catalog_log.remove_leftovers(self.path)
                    self._swept = True
                return catalog_log.log_only(con)
            except BaseException:  # the file is not left open (or attached) by a failed open
                with suppress(Exception):
                    self._release(con)
                raise

        def remove_stale() -> None:
            # A log a killed fold left, older than the file and folded into it: a writer
            # deletes it (unless another writer replaced it meanwhile; then open again).
            nonlocal seen
            catalog_log.remove_stale_log(self.path, seen)
            seen = catalog_log.stat_log(self.path)

        if read_only:
            return self._retrying(connect)
        self._lock_for_writing()
        try:
            return self._retrying(connect, remove_stale)
        except BaseException:
            self._unlock()
            raise

    def _attach(self) -> duckdb.DuckDBPyConnection:
        """An ingest writer's session: the file attached to an in-memory DuckDB instance that
        the catalog keeps, and made the default database. Opening the file as a database of
        its own costs 20-30 ms of CPU apiece (DuckDB starts an instance), about ten times
        an ingest of 4k tokens; attaching it costs 1-2 ms. The instance never checkpoints
        (LOG_ONLY_CONFIG): commits stay in the log when the file is detached (`_release`)."""
        if self._engine is not None and self._engine.execute(
                "SELECT 1 FROM duckdb_databases() WHERE database_name = ?", [_ATTACHED]
        ).fetchall():
            # left attached by a session interrupted between its ATTACH and its end (a
            # Ctrl-C): the whole instance is closed, which rolls back and closes the file
            engine, self._engine = self._engine, None
            engine.close()
        if self._engine is None:
            self._engine = catalog_log.log_only(
                duckdb.connect(":memory:", config=catalog_log.LOG_ONLY_CONFIG))
        engine = self._engine
        quoted = str(self.path).replace("'", "''")
        engine.execute(f"ATTACH '{quoted}' AS {_ATTACHED}")
        try:
            engine.execute(f"USE {_ATTACHED}")
        except BaseException:
            engine.execute(f"DETACH {_ATTACHED}")
            raise
        return engine

    def _release(self, con: duckdb.DuckDBPyConnection) -> None:
        """The end of a session: an attached file detached (where that fails, the whole
        instance is closed, which closes the file too), any other connection closed."""
        if con is not self._engine:
            con.close()
            return
        try:
            con.execute("USE memory")
            con.execute(f"DETACH {_ATTACHED}")
        except BaseException:
            self._engine = None
            con.close()
            raise

    def _snapshot(self) -> duckdb.DuckDBPyConnection:
        """A reader's catalog: a private copy of the file and its log, opened read-only and
        checked whole (`_private_snapshot`); where that cannot be, every table of the file
        copied into memory inside one read-only attach (from a private copy of the file alone
        when the log beside it is stale, catalog_log.py)."""
        copied = self._private_snapshot()
        if copied is not None:
            return copied
        mem = duckdb.connect(":memory:", config=_READER_CONFIG)
        source: list[Path] = [self.path]
        private: list[Any] = []

        def attach() -> None:
            quoted = str(source[0]).replace("'", "''")
            mem.execute(f"ATTACH '{quoted}' AS _actdb_file (READ_ONLY)")

        def without_log() -> None:
            if not private:
                private.append(catalog_log.copy_without_log(self.path))
                source[0] = Path(private[0].name) / self.path.name

        try:
            self._lock_or_busy(exclusive=False)  # no writer folds while this copies
            try:
                self._retrying(attach, without_log)
                try:
                    mem.execute("COPY FROM DATABASE _actdb_file TO memory")
                except duckdb.Error as e:
                    raise self._open_error(e) from None
                finally:
                    mem.execute("DETACH _actdb_file")
            finally:
                catalog_lock.release(self.path)
        except BaseException:
            mem.close()
            raise
        finally:
            for folder in private:
                folder.cleanup()
        return mem

    def _private_snapshot(self) -> duckdb.DuckDBPyConnection | None:
        """The file and its log copied under the catalog's lock and a read lock on the file,
        opened read-only, then every column of every table hashed, so that damage is found
        now, as copying the tables into memory finds it. Opening a store of 1.4 million token
        rows: 150 ms of CPU for the in-memory copy, 64 ms this way (28 and 23 ms at 65,536 rows).
        None for anything unusual (a writer outside actdb holding the file, a log DuckDB
        refuses, damage): the attaching path then waits, retries or names it as it always
        has. The copy is unlinked once open; DuckDB keeps reading it through its descriptor."""
        self._lock_or_busy(exclusive=False)  # no writer commits or folds while this copies
        try:
            folder = catalog_log.copy_with_log(self.path)
        except OSError:  # a missing or unreadable file, a full /tmp: the attach words it
            folder = None
        finally:
            catalog_lock.release(self.path)
        if folder is None:
            return None
        con: duckdb.DuckDBPyConnection | None = None
        try:
            # not DuckDB's default beside the file, in the folder removed below; the query
            # layer's lock moves it to a folder of the process's own (sandbox.spill_directory)
            con = duckdb.connect(str(Path(folder.name) / self.path.name), read_only=True,
                                 config={**_READER_CONFIG, "temp_directory": ".tmp"})
            tables = [r[0] for r in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
            ).fetchall()]
            for t in tables:
                quoted = '"' + t.replace('"', '""') + '"'
                con.execute(f"SELECT count(*), bit_xor(hash(*COLUMNS(*))) FROM {quoted}"
                            ).fetchall()
            return con
        except duckdb.Error:
            if con is not None:
                con.close()
            return None
        finally:
            folder.cleanup()

    def _open_error(self, e: duckdb.Error) -> Exception:
        text = str(e)
        if _is_lock_conflict(e):
            pid = re.search(r"\(PID (\d+)\)", text)
            return self._busy(f" (PID {pid.group(1)})" if pid else "")
        if "Unique file handle conflict" in text or "different configuration" in text:
            return self._held_here()
        if "Permission denied" in text or "Read-only" in text:
            return StoreNotWritableError(f"cannot open catalog {str(self.path)!r} for writing")
        if is_file_too_large(e) or is_disk_full(e):  # said by full_disk_as_error
            return e
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        return StoreCorruptError(
            f"the catalog {str(self.path)!r} cannot be read ({first}): the store is damaged"
        )

    def _held_here(self) -> StoreBusyError:
        return StoreBusyError(
            f"the catalog of store {self.store_label!r} is held open for writing by this same "
            "process (a connection opened with read_only=False, or a running ingest); close it "
            "first"
        )

    def _busy(self, who: str) -> StoreBusyError:
        return StoreBusyError(
            f"the catalog of store {self.store_label!r} is held open by another process{who} "
            f"for more than {lock_wait_seconds():g} s (an ingest holds it only while it "
            "commits; a session opened with read_only=False holds it until closed); "
            "try again when it has closed it"
        )

    @contextmanager
    def _session(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The connection, opened for this session only when it is not open already."""
        with self._lock, full_disk_as_error(self._disk, "the catalog"):
            if self._con is not None:
                yield self._con
                return
            self._con = self._open()
            try:
                yield self._con
                if self._logged and catalog_log.should_fold(self.path):
                    self._fold()
            finally:
                con, self._con = self._con, None
                try:
                    # a local writer's commits stay in the log; others checkpoint
                    self._release(con)
                finally:
                    self._unlock()
            if self._changed and self._publish is not None:
                self._changed = False
                self._publish()

    @contextmanager
    def session(self) -> Iterator[None]:
        """Several reads and writes on one connection to the file. An ingest writer otherwise
        opens the file for each (20-80 ms of CPU apiece: DuckDB opens a database and replays
        the log). The catalog's lock is held throughout and readers in other processes wait
        for it: hold it for the catalog's own work only, nothing that reads weights or
        tokenizes."""
        with self._session():
            yield

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._session() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield
                fault("catalog_commit")
            except BaseException:
                with suppress(duckdb.Error):  # a failed write may have ended it already
                    con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
            self._mark_changed()
            fault("committed")

    # -- reading ---------------------------------------------------------------------------

    def one(self, sql: str, params: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
        """The first row of a query, fetched to the end: an unfinished result would block
        the connection for every later statement."""
        with self._session() as con:
            rows = con.execute(sql, list(params or [])).fetchall()
        return rows[0] if rows else None

    def all(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Every row of a query."""
        with self._session() as con:
            return con.execute(sql, list(params or [])).fetchall()

    def meta(self) -> dict[str, str]:
        """The `meta` table as a dict (format version, shard plans)."""
        with self._session() as con:
            return dict(con.execute("SELECT key, value FROM meta").fetchall())

    def format_version(self) -> int:
        row = self.one("SELECT value FROM meta WHERE key = 'format_version'")
        if row is None:
            raise StoreFormatError(f"catalog {str(self.path)!r} has no format version")
        return int(row[0])

    def _columns(self, table: str, wanted: list[str]) -> list[str]:
        """The wanted columns the table has: a version-1 store lacks the later ones, which
        then keep their record defaults. Cached: information_schema is slow to query, and the
        columns of models and sites never change after creation."""
        cache = self.__dict__.setdefault("_column_cache", {})
        if table not in cache:
            with self._session() as con:
                res = con.execute(f"SELECT * FROM {table} LIMIT 0")  # table is one of ours
                cache[table] = {r[0] for r in res.description or []}
                res.fetchall()  # an unfinished result would block the connection
        return [c for c in wanted if c in cache[table]]

    def _add_missing_columns(self) -> None:
        for table, cols in _ADDED_COLUMNS.items():
            have = self._columns(table, list(cols))
            for name, sqltype in cols.items():
                if name not in have:
                    with self._session() as con:
                        con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sqltype}")
                        self._mark_changed()
                    self.__dict__.pop("_column_cache", None)

    def models(self) -> list[ModelRecord]:
        names = self._columns("models", _MODEL_COLUMNS)
        cols = ", ".join(quote(c) for c in names)
        with self._session() as con:
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
        names = self._columns("sites", _SITE_COLUMNS)
        cols = ", ".join(names)
        with self._session() as con:
            rows = con.execute(
                f"SELECT {cols} FROM sites WHERE model = ? ORDER BY site_id", [model]
            ).fetchall()
        return [SiteRecord(**dict(zip(names, r, strict=True))) for r in rows]

    def prompt_ids(self, texts: Sequence[str]) -> dict[str, int]:
        """The ids of those texts that already are prompts of the store."""
        if not texts:
            return {}
        wanted = pa.table({"text": pa.array(list(set(texts)), pa.string())})
        with self._session() as con:
            con.register("_wanted", wanted)
            try:
                rows = con.execute(
                    "SELECT p.text, p.prompt_id FROM prompts p JOIN _wanted w USING (text)"
                ).fetchall()
            finally:
                con.unregister("_wanted")
        return {t: int(i) for t, i in rows}

    def media_prompt_ids(self) -> dict[str, int]:
        """The ids of the prompts with an image, video or audio, by their key (ingest's
        `Prompt.key`: a NUL, then the JSON list [text, image, video, audio])."""
        have = {c.lower() for c in self.prompt_columns()}  # prompts gains columns: not cached
        media = [c for c in ("image", "video", "audio") if c in have]
        if not media:
            return {}
        cols = ", ".join(f"p.{c}" if c in media else "NULL" for c in ("image", "video", "audio"))
        with self._session() as con:
            rows = con.execute(f"SELECT p.prompt_id, coalesce(p.text, ''), {cols} FROM prompts p "
                               f"WHERE coalesce({', '.join(media)}) IS NOT NULL").fetchall()
        return {"\0" + json.dumps(list(r[1:])): int(r[0]) for r in rows}

    def next_prompt_id(self) -> int:
        row = self.one("SELECT coalesce(max(prompt_id) + 1, 0) FROM prompts")
        return int(row[0]) if row else 0

    def ingested_prompt_ids(self, model: str) -> set[int]:
        with self._session() as con:
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
        with self._session() as con:
            rows = con.execute(f"SELECT {select} FROM prompts WHERE prompt_id IN "
                               "(SELECT unnest($ids))", {"ids": list(prompt_ids)}).fetchall()
        return {int(r[0]): dict(zip(cols, r[1:], strict=True)) for r in rows}

    def prompt_columns(self) -> dict[str, str]:
        with self._session() as con:
            rows = con.execute(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = 'prompts' AND table_catalog = current_database() "
                "ORDER BY ordinal_position"
            ).fetchall()
        return {name: dtype for name, dtype in rows}

    def token_strings(self, model: str) -> list[str | None]:
        """Each token id of the model's vocabulary decoded alone, in id order."""
        with self._session() as con:
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
        with self._session() as con:
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
                self._mark_changed()

    def insert_model(
        self, model: ModelRecord, sites: Sequence[SiteRecord], vocab: pa.Table
    ) -> None:
        """Register a model, its sites and its vocabulary in one transaction (one open of
        the file for the checks and the transaction)."""
        opened_here = self._con is None
        with self._session():
            self._insert_model(model, sites, vocab)
            if opened_here and self._logged:
                # The vocabulary is most of what an ingest logs (50k rows and more): folded
                # now, beside the first forward passes, each later session of the ingest
                # attaches the file without replaying it (20-40 ms apiece). Only at the end
                # of a session opened here: a holder's connection, or an outer session's,
                # would go on writing to the file folded away. A fold that fails (a full
                # disk) leaves the log, which every open replays: the close folds it.
                with suppress(Exception):
                    self._fold()

    def _insert_model(
        self, model: ModelRecord, sites: Sequence[SiteRecord], vocab: pa.Table
    ) -> None:
        self._add_missing_columns()
        have = self.one("SELECT coalesce(sum(coalesce(n_heads, 1)), 0) FROM sites")
        limits.check_streams(int(have[0]) if have else 0, sum(s.n_heads or 1 for s in sites),
                             model.model)
        with self.transaction():
            # Older stores are migrated in the same transaction: their new columns were added
            # above (NULL in older rows, read as before); the version is raised where the
            # model needs it, so that an older actdb refuses the store instead of misreading.
            needed = version_needed(model)
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
    ) -> None:
        """Make one ingested batch visible: everything in one transaction."""
        self._add_missing_columns()
        limits.check_rows(n_rows, model)
        with self.transaction():
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
        assert table in _TABLES, table
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
