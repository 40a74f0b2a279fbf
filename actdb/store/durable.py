"""Durable writes on a local file system: fsync of files and directories, a full disk
turned into one sentence, and the clean-up of temporary files a killed writer left."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import StoreFullError

PARTIAL_SUFFIX = ".partial"  # every temporary file (ours and zarr's) ends so
_FULL = (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names in a directory (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
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
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
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


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in _FULL:
        return True
    # DuckDB reports a full disk as an error (an IOException, or a TransactionException for
    # a commit that could not write its log) whose text carries strerror; its classes live
    # in the module `_duckdb`.
    return (type(e).__module__.lstrip("_").startswith("duckdb")
            and "No space left on device" in str(e))


@contextmanager
def full_disk_as_error(store: Path, what: str) -> Iterator[None]:
    """A full disk while writing `what` becomes one sentence saying what filled up."""
    try:
        yield
    except StoreFullError:
        raise
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise StoreFullError(
            f"the file system holding store {str(store)!r} is full (while writing {what}); "
            "nothing committed is lost: free some space and run the same command again "
            "to resume"
        ) from None
