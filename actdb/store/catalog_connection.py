"""The catalog's DuckDB connection and its locks: a reader's snapshot, an ingest writer's
short sessions, or a holder's open file; the catalog's lock (catalog_lock.py) taken around
each, DuckDB's own lock waited for, the log folded (catalog_log.py), and every failure to open
said in one sentence."""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from ..errors import StoreBusyError, StoreCorruptError, StoreNotWritableError
from . import catalog_lock, catalog_log
from .durable import full_disk_as_error, is_disk_full, is_file_too_large
from .faults import fault
from .retry import retry

T = TypeVar("T")
# How long a reader waits for a commit, or a writer for another writer or a reader's
# snapshot, to let go of the catalog's lock (catalog_lock.py) before saying who holds it
# (ACTDB_LOCK_WAIT_S overrides it).
LOCK_WAIT_S = 30.0


def lock_wait_seconds() -> float:
    return float(os.environ.get("ACTDB_LOCK_WAIT_S", LOCK_WAIT_S))


def _is_lock_conflict(e: BaseException) -> bool:
    return "Could not set lock" in str(e) or "Conflicting lock" in str(e)

# A reader's DuckDB: no extension look-ups at start (they slow every open; the query layer
# locks them off anyway, query/sandbox.py)
_READER_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "threads": 1, "autoload_known_extensions": False, "autoinstall_known_extensions": False}
# The name an ingest writer's sessions attach the file under (`CatalogConnection._attach`).
_ATTACHED = "actdb_catalog"


class CatalogConnection:
    """One catalog file's DuckDB connection, of one of three kinds.

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
            with self.session():  # fail now, not at the first commit, if it cannot open
                pass

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection: the in-memory snapshot for a reader, the file otherwise
        (an ingest writer has one only inside a session)."""
        if self._con is None:
            raise RuntimeError("the ingest's catalog is open only inside a session")
        return self._con

    @property
    def held(self) -> duckdb.DuckDBPyConnection | None:
        """The connection when it stays open between sessions (a reader's, a holder's)."""
        return self._con

    @property
    def logged(self) -> bool:
        """Some commits of this local writer are in the log, not yet folded."""
        return self._logged

    def close(self, *, strict: bool = False) -> None:
        """Close, folding the log of a local writer into the file. A fold that fails (a full
        disk) leaves the log, which every open replays, so the store stays whole: that is an
        error only when `strict` (the file is about to be moved without its log)."""
        with self._lock:
            try:
                # A holder's connection may have run a user's writes: fold any log there is.
                if self._log_only and not self.read_only and catalog_log.log_bytes(self.path):
                    try:
                        with self.session():
                            self.fold()
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

    def fold(self) -> None:
        catalog_log.fold(self.path, self._engine)
        self._logged = False

    def mark_changed(self) -> None:
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
        def again(e: Exception) -> bool:
            if not isinstance(e, duckdb.Error):
                return False
            stale = catalog_log.stale_log(e)
            if stale and stale_log is not None:
                stale_log()
            return _is_lock_conflict(e) or stale is not None

        try:
            return retry(step, again=again, deadline=time.monotonic() + lock_wait_seconds())
        except duckdb.Error as e:
            raise self._open_error(e) from None

    def _open(self, *, read_only: bool = False) -> duckdb.DuckDBPyConnection:
        """A connection to the file, waiting while another process holds its lock."""
        # One DuckDB thread: its idle workers otherwise steal the cores torch needs for the
        # forward pass.
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
        its own starts a DuckDB instance each time, which costs far more CPU than attaching
        a file to one kept. The instance never checkpoints
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
        now, as copying the tables into memory finds it, for less CPU than that copy.
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
    def session(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The connection, opened for this session only when it is not open already."""
        with self._lock, full_disk_as_error(self._disk, "the catalog"):
            if self._con is not None:
                yield self._con
                return
            self._con = self._open()
            try:
                yield self._con
                if self._logged and catalog_log.should_fold(self.path):
                    self.fold()
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
    def transaction(self) -> Iterator[None]:
        with self.session() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield
                fault("catalog_commit")
            except BaseException:
                with suppress(duckdb.Error):  # a failed write may have ended it already
                    con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
            self.mark_changed()
            fault("committed")


__all__ = ["LOCK_WAIT_S", "CatalogConnection", "lock_wait_seconds"]
