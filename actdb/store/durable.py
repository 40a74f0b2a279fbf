"""Durable writes on a local file system: fsync of files and directories, one syncfs(2) for
a commit's new files, a full disk (or a file-size limit) turned into one sentence, and the
clean-up of temporary files a killed writer left."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ActdbError, StoreFullError

PARTIAL_SUFFIX = ".partial"  # every temporary file (ours and zarr's) ends so
_FULL = (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names in a directory (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# syncfs(2) reports the file system's writeback errors since the descriptor was opened from
# Linux 5.8 on, and the errors of the file system's own sync step (a journal commit, a cache
# flush) from 5.17 on; before, an fsync a file stays the rule.
_SYNCFS_LINUX = (5, 17)
# File systems whose syncfs writes and flushes what a file's fsync would (local disks, memory):
# on FUSE, overlayfs, network and cluster file systems an fsync a file stays the rule.
_SYNCFS_TYPES = {"ext4", "ext3", "xfs", "btrfs", "f2fs", "tmpfs"}


def _kernel_at_least(version: tuple[int, int]) -> bool:
    parts = os.uname().release.split("-")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= version
    except (IndexError, ValueError):
        return False


@functools.cache
def _syncfs() -> ctypes.CDLL | None:
    if not (sys.platform.startswith("linux") and _kernel_at_least(_SYNCFS_LINUX)):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syncfs.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


def file_system_type(path: str | os.PathLike[str], *, mounts: str = "/proc/self/mounts"
                     ) -> str | None:
    """The type of the file system `path` is on (Linux: the longest mount point above it in
    `mounts`), or None where that cannot be told."""
    try:
        real = os.path.realpath(path)
        best, kind = "", None
        with open(mounts, encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                # mount points escape blanks and the like as octal (\040)
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, parts[2]
        return kind
    except OSError:
        return None


def batch_sync_available(path: str | os.PathLike[str]) -> bool:
    """Whether new files under `path` may be made durable together (FileSystemSync) rather
    than one fsync each: Linux 5.17 or later, on a local file system whose syncfs does what
    fsync does (_SYNCFS_TYPES), unless ACTDB_SYNC=files asks for an fsync a file (a file
    system shared with writers of much other data, which one syncfs would wait for too)."""
    mode = os.environ.get("ACTDB_SYNC", "").strip().lower()
    if mode not in ("", "auto", "files"):
        raise ActdbError(f"ACTDB_SYNC={mode!r} is not a sync mode: set 'files' (an fsync a "
                         "file) or 'auto' (one syncfs a commit where the file system allows)")
    return (mode != "files" and _syncfs() is not None
            and file_system_type(path) in _SYNCFS_TYPES)


class FileSystemSync:
    """Everything written on one file system made durable at once, by syncfs(2).

    An fsync a file costs each file a flush of the disk's write cache and its own round
    trips: a commit of 2,048 tokens of a 25-site model writes about 400 new chunk files. New
    files that nothing refers to yet are written without one, and a single syncfs of the
    file system (their data, their inodes, every folder's entries, one cache flush) runs
    before the catalog commit that makes them visible. A crash before it loses only rows
    past the committed count, which the next ingest writes again.

    The descriptor stays open from before the first write to `close`: each syncfs reports
    the file system's write errors since the previous one (Linux 5.17), a background
    writeback of these files that failed before the call among them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        self._fd = fd
        self.device = os.fstat(fd).st_dev  # files elsewhere (another mount) are not covered
        self._close = weakref.finalize(self, os.close, fd)
        self._failed: OSError | None = None

    def sync(self) -> None:
        """syncfs; raises OSError where a write since the last call failed, and from then on:
        the kernel reports an error once, and what it lost is not written again."""
        if self._failed is not None:
            raise self._failed
        if not self._close.alive:
            raise OSError(errno.EBADF, "syncfs after close", self.path)
        lib = _syncfs()
        if lib is None:
            raise OSError(errno.ENOSYS, "syncfs is not available", self.path)
        if lib.syncfs(self._fd) != 0:
            code = ctypes.get_errno()
            self._failed = OSError(
                code, f"syncfs of the file system holding {self.path!r} failed "
                f"({os.strerror(code)}): a write to some file on it was lost, perhaps not "
                "one of this store's; nothing was committed (ACTDB_SYNC=files makes each "
                "file's fsync report its own errors)", self.path)
            raise self._failed

    def close(self) -> None:
        self._close()


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path, *, skip: str | None = None) -> None:
    """fsync every file and directory under `root` (a folder named `skip` is left out):
    for what zarr-python wrote, which it does not fsync itself."""
    for folder, dirs, files in os.walk(root):
        if skip in dirs:
            dirs.remove(skip)
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)


def remove_partials(root: Path) -> int:
    """Delete the temporary files of writes that never finished; returns how many.

    Only called by the one writer holding the ingest lock: no write of anyone's is in
    flight, so every such file is dead."""
    removed = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(PARTIAL_SUFFIX):
                os.unlink(os.path.join(folder, name))
                removed += 1
    return removed


def _library_says(e: BaseException, code: int) -> bool:
    """Whether a library's own error reports a failed write with `code`: DuckDB's (an
    IOException, or a TransactionException for a commit that could not write its log; its
    classes live in the module `_duckdb`) carry strerror in their text, and the Rust
    `tokenizers` library's plain Exception ends "(os error N)"."""
    text = str(e)
    if type(e).__module__.lstrip("_").startswith("duckdb"):
        return os.strerror(code) in text
    return type(e) is Exception and text.endswith(f"(os error {code})")


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in _FULL:
        return True
    return any(_library_says(e, code) for code in _FULL)


def is_file_too_large(e: BaseException) -> bool:
    """A write past the process's file-size limit (`ulimit -f`, RLIMIT_FSIZE): EFBIG where
    SIGXFSZ is ignored (it kills the process otherwise)."""
    if isinstance(e, OSError) and e.errno == errno.EFBIG:
        return True
    return _library_says(e, errno.EFBIG)


@contextmanager
def full_disk_as_error(store: str | Path, what: str) -> Iterator[None]:
    """A full disk, or a file grown to the file-size limit, while writing `what` becomes one
    sentence saying what filled up."""
    try:
        yield
    except StoreFullError:
        raise
    except Exception as e:
        if is_file_too_large(e):
            raise StoreFullError(
                f"a file of store {str(store)!r} reached this process's file-size limit "
                f"(ulimit -f) while writing {what}; nothing committed is lost: raise the "
                "limit and run the same command again to resume"
            ) from None
        if not is_disk_full(e):
            raise
        raise StoreFullError(
            f"the file system holding store {str(store)!r} is full (while writing {what}); "
            "nothing committed is lost: free some space and run the same command again "
            "to resume"
        ) from None
