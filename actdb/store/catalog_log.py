"""The catalog file is never rewritten in place: commits go to DuckDB's log, and the log is
folded into a new copy of the file that is renamed over the old one.

Why: a DuckDB checkpoint rewrites metadata blocks that the file's current header still
points at, and a SIGKILL can interrupt a large write between pages (Linux checks for a fatal
signal between them), so a kill during a checkpoint left a block whose checksum no longer
matched: a store that would not open. Appends to the log are safe (DuckDB replays only
whole, committed transactions), and a rename is atomic.

The protocol, with the catalog's lock held exclusively throughout (catalog_lock.py: no
other actdb writer opens the file meanwhile, and no actdb reader copies it into its
snapshot; other programs are not kept out):
1. copy the file and its log to `.catalog.duckdb.folding-PID` (+ `.wal`), open the copy
   (DuckDB replays the log), checkpoint it, close it, fsync it;
2. rename the copy over the file (fault point `catalog_fold` just before);
3. delete the log (fault point `catalog_folded` just before).
Killed after 2, the old log is left beside the new file. DuckDB refuses such a log by its
checkpoint iteration (older than the file's); everything in it is in the file already, so a
writer deletes it, and a reader takes its snapshot from the file alone (`stale_log`).
"""

from __future__ import annotations

import fcntl
import os
import platform
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import duckdb

from .durable import fsync_dir
from .faults import fault

# A connection that never checkpoints: commits stay in the log until it is folded.
Config = dict[str, str | bool | int | float | list[str]]
LOG_ONLY_CONFIG: Config = {"threads": 1, "checkpoint_threshold": "1TB"}
# A working copy of a catalog on object storage: checkpointed at close, then uploaded.
CHECKPOINTING_CONFIG: Config = {"threads": 1}
# The log is folded when a writer closes, and in between once it is larger than
# FOLD_MIN_BYTES and than 1/FOLD_FILE_SHARE of the file (so folding, which copies the file,
# costs at most a few times what was written, and every open replays at most that much).
FOLD_MIN_BYTES = 4 << 20
FOLD_FILE_SHARE = 4

_ITERATIONS = re.compile(r"File checkpoint iteration: (\d+), WAL checkpoint iteration: (\d+)")


def log_path(path: Path) -> Path:
    return path.with_name(path.name + ".wal")


def log_only(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """`con` (opened with LOG_ONLY_CONFIG) made to leave its commits in the log at close."""
    con.execute("PRAGMA disable_checkpoint_on_shutdown")
    return con


def stale_log(e: BaseException) -> bool | None:
    """For DuckDB's refusal of a log written for another checkpoint of the file: True when
    the log is older than the file (folded into it already), False when newer (the file was
    opened just before a fold renamed a new one into place: open again); None for any
    other error."""
    m = _ITERATIONS.search(str(e))
    if not m:
        return None
    return int(m.group(2)) < int(m.group(1))


def log_bytes(path: Path) -> int:
    try:
        return log_path(path).stat().st_size
    except FileNotFoundError:
        return 0


def should_fold(path: Path) -> bool:
    size = log_bytes(path)
    if size < FOLD_MIN_BYTES:
        return False
    try:
        return size * FOLD_FILE_SHARE >= path.stat().st_size
    except FileNotFoundError:
        return False


def fold(path: Path, engine: duckdb.DuckDBPyConnection | None = None) -> None:
    """Fold the log of `path` into a new file renamed over it. The caller holds the
    catalog's lock exclusively (catalog_lock.py) and has no transaction in flight. With
    `engine` (a DuckDB instance of the caller's), the copy is attached to it rather than
    opened as a database of its own, which would start a DuckDB instance."""
    log = log_path(path)
    try:
        copied_log = log.stat()
    except FileNotFoundError:
        return
    tmp = path.with_name(f".{path.name}.folding-{os.getpid()}")
    tmp_log = log_path(tmp)
    for p in (tmp, tmp_log):
        p.unlink(missing_ok=True)
    try:
        shutil.copyfile(path, tmp)
        shutil.copymode(path, tmp)  # the folded file is as readable as the one it replaces
        shutil.copyfile(log, tmp_log)
        made = tmp.stat()
        _checkpoint(tmp, engine)
        if tmp_log.exists():
            raise OSError(f"DuckDB left a log after checkpointing {str(tmp)!r}")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            if os.fstat(fd).st_ino != made.st_ino:
                raise OSError(f"{str(tmp)!r} was replaced while the catalog was folded")
            os.fsync(fd)
        finally:
            os.close(fd)
        fault("catalog_fold")
        os.replace(tmp, path)
    except BaseException:
        for p in (tmp, tmp_log):
            p.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    fault("catalog_folded")
    if _same_file(stat_log(path), copied_log):  # the log folded, not one written since
        log.unlink(missing_ok=True)
        fsync_dir(path.parent)


def _checkpoint(path: Path, engine: duckdb.DuckDBPyConnection | None) -> None:
    """Checkpoint the database file `path` (its log replayed into it, the log removed),
    checking that it holds the catalog's tables: what is renamed over the catalog must be
    this copy, whole, as a file that lost its tables (or was replaced) would pass for an
    empty store. The file is attached to `engine`, or to an instance of its own."""
    own = engine is None
    con = duckdb.connect(":memory:", config={"threads": 1}) if engine is None else engine
    try:
        quoted = str(path).replace("'", "''")
        con.execute("DETACH DATABASE IF EXISTS actdb_fold")  # an interrupted fold's
        con.execute(f"ATTACH '{quoted}' AS actdb_fold")
        try:
            con.execute("CHECKPOINT actdb_fold")
            con.execute("SELECT count(*) FROM actdb_fold.meta").fetchall()
        finally:
            con.execute("DETACH actdb_fold")
    finally:
        if own:
            con.close()


def _same_file(now: os.stat_result | None, seen: os.stat_result | None) -> bool:
    return now is not None and seen is not None and (
        now.st_ino, now.st_size, now.st_mtime_ns) == (seen.st_ino, seen.st_size, seen.st_mtime_ns)


def remove_leftovers(path: Path) -> None:
    """The copies a killed fold left (the caller holds the catalog's lock exclusively:
    nobody is folding)."""
    for p in path.parent.glob(f".{path.name}.folding-*"):
        p.unlink(missing_ok=True)


def remove_stale_log(path: Path, seen: os.stat_result | None) -> None:
    """Delete a log DuckDB refused as older than the file, if it is still the one it refused
    (same inode, size and time: no writer has replaced it since)."""
    if _same_file(stat_log(path), seen):
        log_path(path).unlink(missing_ok=True)
        fsync_dir(path.parent)


def stat_log(path: Path) -> os.stat_result | None:
    try:
        return log_path(path).stat()
    except FileNotFoundError:
        return None


def copy_without_log(path: Path) -> tempfile.TemporaryDirectory[str]:
    """A private copy of the file alone (its stale log left behind), in a temporary folder
    the caller removes: what a reader opens when the log beside the file is stale."""
    folder = tempfile.TemporaryDirectory(prefix="actdb-catalog-")
    shutil.copyfile(path, Path(folder.name) / path.name)
    return folder


# struct flock on Linux x86-64 and aarch64: type, whence, (padding), start, len, pid, (padding)
_FLOCK = struct.Struct("hhxxxxqqixxxx")


def copy_with_log(path: Path) -> tempfile.TemporaryDirectory[str] | None:
    """A private copy of the file and its log, in a temporary folder the caller removes, taken
    under a read lock on the file that conflicts with DuckDB's write lock (so a program outside
    actdb writing the catalog is never copied mid-write); None when that lock is not free or
    cannot be taken here (the caller then attaches the file, which waits or says who holds it).

    The lock is an open-file-description lock (`F_OFD_SETLK`): unlike a POSIX record lock it
    is not the process's, so it does not merge with one DuckDB holds here. Closing the
    descriptor still drops this process's POSIX locks on the file, as every copy of the file
    does (`copy_without_log`, `fold`): under the catalog's shared lock no actdb writer of
    this process has the file open, and another reader thread attaching it meanwhile loses
    only its wait for a writer outside actdb.
    """
    if not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
            and hasattr(fcntl, "F_OFD_SETLK")):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
        except OSError:  # held by a writer (EAGAIN), or refused here
            return None
        folder = tempfile.TemporaryDirectory(prefix="actdb-catalog-")
        try:
            _copy_fd(fd, Path(folder.name) / path.name)
            try:
                log = os.open(log_path(path), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                pass
            else:
                try:
                    _copy_fd(log, log_path(Path(folder.name) / path.name))
                finally:
                    os.close(log)
        except BaseException:
            folder.cleanup()
            raise
        return folder
    finally:
        os.close(fd)  # releases the lock


def _copy_fd(src: int, dst: Path) -> None:
    size = os.fstat(src).st_size
    with open(dst, "wb") as out:
        done = 0
        while done < size:
            sent = os.sendfile(out.fileno(), src, done, size - done)
            if sent == 0:
                raise OSError(f"{str(dst)!r}: the catalog shrank while it was copied")
            done += sent
