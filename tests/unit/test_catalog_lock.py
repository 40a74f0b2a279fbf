"""The catalog's lock (catalog_lock.py) inside one process: a second writer, in another
thread, waits for the first to close rather than sharing its DuckDB database (a fold by one
would lose the other's commits); the same thread asking again is refused at once; a reader
thread waits for a writer thread; a writer dropped unclosed, or a forked child, does not
keep the lock; the lock file and a folded catalog are as readable as the catalog was."""

from __future__ import annotations

import gc
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from test_catalog_log import _column, _commit

from actdb.errors import StoreBusyError
from actdb.store import catalog_lock, catalog_log
from actdb.store.catalog import Catalog


def _ids(path: Path) -> list[int]:
    return _column(path, "prompt_id")


@pytest.fixture()
def created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ACTDB_LOCK_WAIT_S", "20")
    path = tmp_path / "catalog.duckdb"
    Catalog.create(path).close()
    return path


def test_a_writer_thread_waits_for_another_threads_writer_and_both_commits_stay(
    created: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(catalog_log, "FOLD_MIN_BYTES", 0)  # fold whenever a session ends
    holder = Catalog(created, read_only=False)
    _commit(holder, 0, 5)
    committed: list[float] = []
    errors: list[BaseException] = []

    def second_writer() -> None:
        try:
            writer = Catalog(created, read_only=False, hold=False)
            for i in range(3):
                _commit(writer, 100 + 10 * i, 5)
                committed.append(time.monotonic())
            writer.close()
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=second_writer)
    thread.start()
    time.sleep(0.5)  # ample time to commit, were it let in
    _commit(holder, 5, 5)
    closed = time.monotonic()
    holder.close()
    thread.join(60)
    assert not errors, errors
    assert committed and committed[0] > closed, "the second writer wrote while the first held"
    assert _ids(created) == list(range(10)) + [
        100 + 10 * i + k for i in range(3) for k in range(5)]


def test_the_thread_holding_a_writer_is_refused_a_second_one_at_once(created: Path) -> None:
    holder = Catalog(created, read_only=False)
    try:
        for read_only in (False, True):
            began = time.monotonic()
            with pytest.raises(StoreBusyError, match="by this same process"):
                Catalog(created, read_only=read_only, hold=False)
            assert time.monotonic() - began < 10, "waited on its own lock"
    finally:
        holder.close()
    assert catalog_lock.holder_pid(created) is None, "the lock file still names a holder"


def test_a_reader_thread_waits_for_a_writer_thread(created: Path) -> None:
    opened = threading.Event()

    def write() -> None:
        writer = Catalog(created, read_only=False)
        _commit(writer, 0, 3)
        opened.set()
        time.sleep(0.5)
        writer.close()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        assert opened.wait(60)
        assert _ids(created) == [0, 1, 2]
    finally:
        thread.join(60)


def test_a_writer_dropped_without_closing_gives_the_lock_back(created: Path) -> None:
    writer = Catalog(created, read_only=False)
    _commit(writer, 0, 2)
    del writer
    gc.collect()
    again = Catalog(created, read_only=False)  # the same thread: refused were it still held
    _commit(again, 2, 2)
    again.close()
    assert _ids(created) == [0, 1, 2, 3]


def test_a_forked_child_does_not_keep_or_share_the_parents_lock(created: Path) -> None:
    holder = Catalog(created, read_only=False)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no DuckDB here, only the lock
        code = 3
        try:
            outcome = catalog_lock.acquire(created, exclusive=False, timeout=0.2)
            code = 0 if outcome is catalog_lock.Outcome.BUSY else 1
            os.write(ready_w, b"x")
            time.sleep(3)  # alive while the parent closes and locks again
        finally:
            os._exit(code)
    try:
        assert os.read(ready_r, 1) == b"x"
        holder.close()
        began = time.monotonic()
        again = Catalog(created, read_only=False)  # the child's copy must not hold it
        assert time.monotonic() - began < 2, "the forked child kept the lock"
        again.close()
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)
    assert os.waitstatus_to_exitcode(status) == 0, (
        "the child took the parent's held lock as its own")


def test_the_lock_file_and_a_folded_catalog_keep_the_catalogs_mode(created: Path) -> None:
    os.chmod(created, 0o644)
    catalog_lock.lock_path(created).unlink()
    old = os.umask(0o077)  # what would make the new files private
    try:
        writer = Catalog(created, read_only=False)
        _commit(writer, 0, 2)
        writer.close()  # folds: a new file renamed over the catalog
    finally:
        os.umask(old)
    assert stat.S_IMODE(created.stat().st_mode) == 0o644
    assert stat.S_IMODE(catalog_lock.lock_path(created).stat().st_mode) == 0o644
