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


def test_a_writer_starts_one_duckdb_instance_for_all_its_sessions_and_folds(
    created: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ingest writer's sessions attach the file to one in-memory instance of its own, and
    its fold attaches the copy there too: starting an instance costs 20-30 ms of CPU, once,
    not at every session."""
    import duckdb

    started: list[str] = []
    real_connect = duckdb.connect

    def connect(database: Any = ":memory:", *a: Any, **kw: Any) -> Any:
        started.append(str(database))
        return real_connect(database, *a, **kw)

    monkeypatch.setattr(duckdb, "connect", connect)
    monkeypatch.setattr(catalog_log, "FOLD_MIN_BYTES", 1)
    monkeypatch.setattr(catalog_log, "FOLD_FILE_SHARE", 10**9)
    writer = Catalog(created, read_only=False, hold=False)
    for i in range(4):
        _commit(writer, 10 * i, 10)  # each folded as well
    writer.close()
    assert started == [":memory:"], started
    assert _texts(created) == [f"prompt {j}" for j in range(40)]


def test_a_new_models_registration_is_folded_at_once_but_not_under_a_holder(
    created: Path,
) -> None:
    """An ingest writer folds the log right after registering a model (its vocabulary is
    most of what an ingest logs, which every later session would replay); a holder, whose
    connection stays on the file, leaves it in the log until it closes."""
    from actdb.store.records import ModelRecord, SiteRecord

    sites = [SiteRecord(site="s0", site_id=0, layer=0, role="pre_attn", kind="rmsnorm", d=4,
                        n_heads=None, eps=1e-5, module="m0", has_gain=False, has_bias=False)]
    vocab = pa.table({"token_id": pa.array(range(5000), pa.int32()),
                      "token": [f"t{i}" for i in range(5000)],
                      "piece": [f"p{i}" for i in range(5000)]})

    def model(name: str, model_id: int) -> ModelRecord:
        return ModelRecord(model=name, model_id=model_id, source="test", revision=None,
                           architecture="X", d_model=4, n_layers=1, vocab_size=5000, n_sites=1,
                           has_lm_head=False, has_lm_head_bias=False, tied_embeddings=False,
                           final_site=None, dtype="float32", max_length=None, sites_glob=None,
                           chunk_tokens=8)

    writer = Catalog(created, read_only=False, hold=False)
    writer.insert_model(model("a", 0), sites, vocab)
    assert not catalog_log.log_path(created).exists()
    writer.close()
    holder = Catalog(created, read_only=False)
    try:
        holder.insert_model(model("b", 1), sites, vocab)
        assert catalog_log.log_bytes(created) > 0
        holder.con.execute("INSERT INTO meta VALUES ('after', 'b')")  # still on the file
    finally:
        holder.close()
    reader = Catalog(created, read_only=True)
    try:
        assert reader.all("SELECT model, count(*) FROM vocab GROUP BY model ORDER BY model") == [
            ("a", 5000), ("b", 5000)]
        assert reader.meta()["after"] == "b"
    finally:
        reader.close()


def test_a_registration_inside_an_outer_session_waits_for_its_end_to_fold(
    created: Path,
) -> None:
    """Folding renames a new file over the one attached: inside a session opened by the
    caller, whose later writes go to the attached file, the fold waits for the session's end
    (else those writes would be lost without an error)."""
    from actdb.store.records import ModelRecord, SiteRecord

    sites = [SiteRecord(site="s0", site_id=0, layer=0, role="pre_attn", kind="rmsnorm", d=4,
                        n_heads=None, eps=1e-5, module="m0", has_gain=False, has_bias=False)]
    record = ModelRecord(model="a", model_id=0, source="test", revision=None, architecture="X",
                         d_model=4, n_layers=1, vocab_size=1, n_sites=1, has_lm_head=False,
                         has_lm_head_bias=False, tied_embeddings=False, final_site=None,
                         dtype="float32", max_length=None, sites_glob=None, chunk_tokens=8)
    vocab = pa.table({"token_id": pa.array([0], pa.int32()), "token": ["t"], "piece": ["p"]})
    writer = Catalog(created, read_only=False, hold=False)
    with writer.session():
        writer.insert_model(record, sites, vocab)
        _commit(writer, 0, 3)  # after the registration, in the same session
    writer.close()
    assert _texts(created) == ["prompt 0", "prompt 1", "prompt 2"]


def test_an_interrupted_session_leaves_the_file_neither_attached_nor_locked(
    created: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session that fails between attaching the file and its end (here a Ctrl-C while it
    is being set up) detaches it: the next session works and nothing keeps DuckDB's lock;
    one left attached anyway is found and its instance closed at the next session."""
    import duckdb

    writer = Catalog(created, read_only=False, hold=False)
    real = catalog_log.log_only

    def interrupted(con: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog_log, "log_only", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _commit(writer, 0, 2)
    monkeypatch.setattr(catalog_log, "log_only", real)
    assert writer.connection._engine is not None and writer.connection._engine.execute(
        "SELECT database_name FROM duckdb_databases() WHERE NOT internal").fetchall() == [
        ("memory",)]
    other = duckdb.connect(str(created))  # DuckDB's own lock is free
    other.close()
    _commit(writer, 0, 2)
    # attached and never detached (an interrupt just after the ATTACH returned)
    quoted = str(created).replace("'", "''")
    writer.connection._engine.execute(f"ATTACH '{quoted}' AS actdb_catalog")
    _commit(writer, 2, 2)
    writer.close()
    assert _texts(created) == [f"prompt {j}" for j in range(4)]


def test_a_commit_that_cannot_write_the_log_is_a_full_disk() -> None:
    """DuckDB reports a log it cannot write at COMMIT as a TransactionException (class of
    the module `_duckdb`): it is a full disk, said in one sentence, like its IOException."""
    import duckdb

    from actdb.store.durable import is_disk_full

    text = 'Failed to commit: Could not write file "c.duckdb.wal": No space left on device'
    assert is_disk_full(duckdb.TransactionException(text))
    assert is_disk_full(duckdb.IOException(text))
    assert not is_disk_full(duckdb.TransactionException("Failed to commit: a conflict"))


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


def _tables(reader: Catalog) -> dict[str, list[Any]]:
    names = [r[0] for r in reader.all("SELECT table_name FROM duckdb_tables() WHERE "
                                      "database_name = current_database() ORDER BY ALL")]
    return {t: reader.all(f'SELECT * FROM "{t}" ORDER BY ALL') for t in names}


def test_a_reader_opens_a_private_copy_with_the_log_and_leaves_nothing_behind(
    created: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader's fast path (a copy of the file and its log, opened read-only) holds what
    the in-memory copy of every table holds, commits still in the log included, and its
    temporary folder is gone once the catalog is open."""
    import tempfile

    writer = Catalog(created, read_only=False, hold=False)
    _commit(writer, 0, 7)
    _commit(writer, 7, 5)
    assert catalog_log.log_bytes(created) > 0  # the commits are in the log only
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    copies: list[object] = []
    real = catalog_log.copy_with_log
    monkeypatch.setattr(catalog_log, "copy_with_log", lambda p: copies.append(real(p))
                        or copies[-1])
    fast = Catalog(created, read_only=True)
    try:
        assert copies and copies[0] is not None
        assert fast.all("SELECT current_database()") != [("memory",)]
        assert list(scratch.iterdir()) == []
        fast_tables = _tables(fast)
    finally:
        fast.close()
    monkeypatch.setattr(catalog_log, "copy_with_log", lambda p: None)
    slow = Catalog(created, read_only=True)
    try:
        assert slow.all("SELECT current_database()") == [("memory",)]
        assert _tables(slow) == fast_tables
    finally:
        slow.close()
    assert [r[0] for r in fast_tables["prompts"]] == list(range(12))
    writer.close()


def test_no_private_copy_while_a_program_outside_actdb_writes_the_catalog(
    created: Path,
) -> None:
    """DuckDB's write lock held by another process: no copy (the reader attaches instead,
    which waits and then names the holder: test_store.py)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
         "print('held', flush=True); time.sleep(60)", str(created)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert catalog_log.copy_with_log(created) is None
    finally:
        holder.kill()
        holder.wait()
    folder = catalog_log.copy_with_log(created)
    assert folder is not None
    folder.cleanup()
