"""The catalog file is never rewritten in place (docs/FORMAT.md): a writer's commits go to
DuckDB's log, folded into a new copy of the file renamed over it; a stale log a killed fold
leaves beside the new file is read past by readers and deleted by the next writer. The
fold points killed mid-ingest are in test_faults.py."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from actdb.store import catalog_log
from actdb.store.catalog import Catalog


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prompts(first: int, n: int) -> pa.Table:
    return pa.table({"prompt_id": pa.array(range(first, first + n), pa.int64()),
                     "text": [f"prompt {i}" for i in range(first, first + n)],
                     "n_tokens": pa.array([3] * n, pa.int32())})


def _commit(cat: Catalog, first: int, n: int) -> None:
    with cat.transaction():
        cat._insert_table("prompts", _prompts(first, n))


def _column(path: Path, name: str) -> list[Any]:
    """Column `name` of the committed prompts, in prompt order, through a reader."""
    reader = Catalog(path, read_only=True)
    try:
        return [r[0] for r in reader.all(f"SELECT {name} FROM prompts ORDER BY prompt_id")]
    finally:
        reader.close()


def _texts(path: Path) -> list[str]:
    return _column(path, "text")


@pytest.fixture()
def created(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.duckdb"
    Catalog.create(path).close()
    assert not catalog_log.log_path(path).exists(), "creation should end folded"
    return path


def test_commits_leave_the_file_untouched_until_the_fold(created: Path) -> None:
    before = _digest(created)
    writer = Catalog(created, read_only=False, hold=False)
    sizes = []
    for i in range(5):
        _commit(writer, 10 * i, 10)
        sizes.append(catalog_log.log_bytes(created))
        assert _digest(created) == before, f"commit {i} rewrote the catalog file in place"
        # A reader between commits sees exactly what was committed (replaying the log).
        assert _texts(created) == [f"prompt {j}" for j in range(10 * (i + 1))]
    assert sizes == sorted(sizes) and sizes[0] > 0
    writer.close()
    assert not catalog_log.log_path(created).exists()
    assert _digest(created) != before
    assert _texts(created) == [f"prompt {j}" for j in range(50)]


def test_a_large_log_is_folded_between_commits(
    created: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(catalog_log, "FOLD_MIN_BYTES", 1)
    monkeypatch.setattr(catalog_log, "FOLD_FILE_SHARE", 10**9)
    writer = Catalog(created, read_only=False, hold=False)
    try:
        for i in range(3):
            _commit(writer, 10 * i, 10)
            assert not catalog_log.log_path(created).exists(), f"commit {i} was not folded"
            assert not list(created.parent.glob(".catalog.duckdb.folding-*"))
    finally:
        writer.close()
    assert _texts(created) == [f"prompt {j}" for j in range(30)]


def test_a_stale_log_is_read_past_then_deleted_by_the_next_writer(
    created: Path, tmp_path: Path,
) -> None:
    """What a fold killed between its rename and the log's deletion leaves."""
    writer = Catalog(created, read_only=False, hold=False)
    _commit(writer, 0, 10)
    stale = tmp_path / "stale.wal"
    shutil.copyfile(catalog_log.log_path(created), stale)
    writer.close()  # folds
    shutil.copyfile(stale, catalog_log.log_path(created))
    # The reader neither applies the old log twice nor fails, and leaves it for the writer.
    assert _texts(created) == [f"prompt {j}" for j in range(10)]
    assert catalog_log.log_path(created).exists()
    writer = Catalog(created, read_only=False, hold=False)
    _commit(writer, 10, 5)
    writer.close()
    assert not catalog_log.log_path(created).exists()
    assert _texts(created) == [f"prompt {j}" for j in range(15)]


def test_a_fold_killed_before_its_rename_leaves_a_copy_the_next_writer_removes(
    created: Path,
) -> None:
    writer = Catalog(created, read_only=False, hold=False)
    _commit(writer, 0, 4)
    leftover = created.with_name(".catalog.duckdb.folding-999999")
    shutil.copyfile(created, leftover)
    writer.close()
    writer = Catalog(created, read_only=False, hold=False)
    _commit(writer, 4, 4)
    writer.close()
    assert not leftover.exists()
    assert _texts(created) == [f"prompt {j}" for j in range(8)]


# A second writer, another process, started while a fold is at one of its points: it must
# wait for the fold (the catalog's lock), not commit into a log the fold then drops.
_SECOND_WRITER = """
import sys
import time
from pathlib import Path
from actdb.store.catalog import Catalog
import pyarrow as pa
print("ready", flush=True)
cat = Catalog(Path(sys.argv[1]), read_only=False, hold=False)
with cat.transaction():
    began = time.time()
    cat._insert_table("prompts", pa.table({"prompt_id": pa.array([100], pa.int64()),
                      "text": ["second writer"], "n_tokens": pa.array([1], pa.int32())}))
cat.close()
print("committed", began)
"""


@pytest.mark.parametrize("point", ["catalog_fold", "catalog_folded"])
def test_a_second_writer_waits_for_a_fold_in_progress(
    created: Path, point: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    holder = Catalog(created, read_only=False, hold=True)
    holder.con.execute("INSERT INTO prompts VALUES (0, 'holder', 1)")
    started: list[subprocess.Popen[str]] = []

    def at(name: str) -> None:
        if name == point and not started:
            started.append(subprocess.Popen(
                [sys.executable, "-c", _SECOND_WRITER, str(created)], text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            assert started[0].stdout is not None
            assert started[0].stdout.readline() == "ready\n"  # imported: opening now
            time.sleep(1.0)  # ample time to commit, were it let in

    monkeypatch.setattr(catalog_log, "fault", at)
    holder.close(strict=True)
    closed = time.time()
    monkeypatch.undo()
    out, err = started[0].communicate(timeout=60)
    assert started[0].returncode == 0 and "committed" in out, err
    assert float(out.split()[-1]) > closed, "the second writer wrote during the fold"
    assert _texts(created) == ["holder", "second writer"]
