"""A store in a local directory: created aside and renamed into place, one ingest at a time
by an flock, the catalog file opened directly, chunks as files."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from ..errors import (
    StoreBusyError,
    StoreFormatError,
    StoreNotFoundError,
    StoreNotWritableError,
)
from . import durable
from .arrays import Arrays
from .backend import CATALOG_NAME, SHARDS_NAME, TENSORS_NAME, TOKENIZERS_NAME
from .catalog import LOCAL_FORMAT_VERSION, Catalog
from .faults import fault
from .pids import alive
from .retry import retry

LOCK_NAME = "ingest.lock"  # flock: exclusive for an ingest or merge, shared by shard ingests
REGISTER_LOCK_NAME = "shards.lock"  # flock: shard ingests registering a model and planning
_BUILDING = ".creating-"  # a store being created: `.{name}.creating-{pid}-{random}`


def _refuse_linked_files(folder: Path) -> None:
    """A writer writes files of fixed names in the store's folder (the catalog, its log and
    write-ahead log, the lock files): a store copied from elsewhere holding a symbolic link of
    such a name would have DuckDB or the ingest overwrite the file it points to. A link to a
    folder (the tensors kept on another disk) is the user's own choice, and stays allowed."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink() and not entry.is_dir():
                raise StoreFormatError(
                    f"{os.path.join(folder, entry.name)!r} is a symbolic link to a file; a "
                    "store's own files are never links (one could make a write land in the "
                    "file it points to): put the file it points to in its place if it is the "
                    "store's, else remove the link")


def _open_lock_file(path: Path) -> int:
    """A lock file, opened read-write and made if missing, never through a symbolic link: the
    ingest writes its process id into it, and a store copied from elsewhere with a link named
    like a lock file would have that write truncate the file it points to."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise StoreFormatError(f"{str(path)!r} is a symbolic link, where the store keeps a "
                               "lock file of its own: remove the link, then run again") from None


class LocalBackend:
    remote = False
    readers = 1

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = str(path)
        self.storage_options: dict[str, Any] = {}
        self._lock_fd: int | None = None
        self._shard_fd: int | None = None

    def needs_create(self) -> bool:
        p = self.path
        if p.exists() and not p.is_dir():
            raise StoreFormatError(f"store path {str(p)!r} is a regular file, not a directory")
        return not p.exists() or (p.is_dir() and not any(p.iterdir()))

    def create(self) -> None:
        """Build the store in a sibling folder and rename it into place: a kill at any
        moment leaves either no store or a whole one. Of two processes creating the same
        store at once, the first rename wins and the other opens what it made."""
        p = self.path
        parent = p.absolute().parent
        if not parent.is_dir():
            raise StoreNotFoundError(
                f"cannot create store {str(p)!r}: its parent folder {str(parent)!r} "
                "does not exist"
            )
        _check_writable(parent)
        _remove_dead_builds(p)
        tmp = parent / f".{p.name}{_BUILDING}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with durable.full_disk_as_error(p, "a new store"):
                tmp.mkdir()
                Arrays.create(tmp / TENSORS_NAME, version=LOCAL_FORMAT_VERSION)
                fault("create_before_catalog")
                Catalog.create(tmp / CATALOG_NAME, version=LOCAL_FORMAT_VERSION,
                               hold=False, store=str(p)).close(strict=True)
                fault("create_after_catalog")
                durable.sync_tree(tmp)
                try:
                    os.rename(tmp, p)  # onto nothing, or onto an empty folder
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    return  # another process created it first: use theirs
                durable.fsync_dir(parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def check_is_store(self) -> None:
        p = self.path
        if not p.exists():
            raise StoreNotFoundError(f"no store at {str(p)!r}")
        if not p.is_dir():
            raise StoreFormatError(f"store path {str(p)!r} is a regular file, not a directory")
        if not (p / CATALOG_NAME).is_file() or not (p / TENSORS_NAME).is_dir():
            raise StoreFormatError(
                f"{str(p)!r} is not an actdb store (no {CATALOG_NAME} and {TENSORS_NAME} in it)"
            )

    def check_writable(self) -> None:
        _check_writable(self.path)

    def lock(self, shard: str | None = None) -> None:
        """An flock on `ingest.lock`, released by the kernel however the process ends, so a
        killed ingest never leaves the store locked: exclusive for an ingest or a merge,
        shared by the shard ingests (`shard`: the shard's name) that may run side by side."""
        _refuse_linked_files(self.path)
        with durable.full_disk_as_error(self.path, "the store's lock file"):
            fd = _open_lock_file(self.path / LOCK_NAME)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shard else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._busy(fd, shard) from None
            if not shard:  # the one holder says who it is; shards share the lock
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            else:
                self._shard_fd = self._lock_one_shard(fd, shard)
        self._lock_fd = fd

    def _lock_one_shard(self, store_fd: int, shard: str) -> int:
        """One process per shard: a second one would write the same rows and commit them
        twice. An exclusive flock on `shards/{shard}/shard.lock`, beside the shared store lock
        (merge, which holds the store alone, removes it with the shard's folder)."""
        folder = self.path / SHARDS_NAME / shard
        folder.mkdir(parents=True, exist_ok=True)
        try:
            _refuse_linked_files(folder)
            fd = _open_lock_file(folder / "shard.lock")
        except StoreFormatError:
            os.close(store_fd)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            os.close(store_fd)
            raise StoreBusyError(
                f"store {self.location!r}: shard {shard} is being ingested by another process; "
                "run it again when that one has finished (it will skip what is stored)"
            ) from None
        return fd

    def _busy(self, fd: int, shard: str | None) -> StoreBusyError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        # Held shared (by shards) when a shared lock can still be had.
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            by_shards = True
        except BlockingIOError:
            by_shards = False
        os.close(fd)
        if by_shards:
            return StoreBusyError(
                f"store {self.location!r} is being written by shard ingests (--shard); run "
                "this one when they have finished and `actdb merge` has run"
            )
        who = f" (PID {holder})" if holder.isdigit() else ""
        what = "shard ingest" if shard else "one"
        return StoreBusyError(
            f"store {self.location!r} is being written by another ingest{who} (an ingest or a "
            f"merge writes it alone); run this {what} again when it has finished (it will skip "
            "what is stored)"
        )

    @contextmanager
    def registering(self) -> Iterator[None]:
        """Among shard ingests, one at a time: an flock on `shards.lock`, waited for as long
        as another shard holds it. No time limit: the kernel releases the flock when its
        holder dies, so a holder is alive while it holds it, and a first registration may
        take long (a large model's weights written and fsynced)."""
        fd = _open_lock_file(self.path / REGISTER_LOCK_NAME)
        try:
            # Polled rather than a blocking flock: Ctrl-C (or a worker's cancellation) ends
            # the wait at once.
            retry(lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB),
                  again=lambda e: isinstance(e, BlockingIOError), pause=0.05, grow=1.0)
            yield
        finally:
            os.close(fd)

    def shard_names(self) -> list[str]:
        folder = self.path / SHARDS_NAME
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if (p / CATALOG_NAME).is_file())

    def open_shard_catalog(self, name: str, *, create: Callable[[Path], None] | None = None,
                           read_only: bool = False) -> Catalog:
        """A shard's catalog: an ingest writer (made by `create(file)` first when absent, in
        a temporary file renamed into place) or a reader's snapshot."""
        path = self.path / SHARDS_NAME / name / CATALOG_NAME
        if not path.is_file() and create is not None:
            with durable.full_disk_as_error(self.path, "a shard catalog"):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{CATALOG_NAME}.{os.getpid()}")
                tmp.unlink(missing_ok=True)
                create(tmp)
                durable.fsync_file(tmp)
                os.rename(tmp, path)
                durable.fsync_dir(path.parent)
                durable.fsync_dir(path.parent.parent)
        return Catalog(path, read_only=read_only, hold=False, store=self.location)

    def remove_shards(self, names: list[str]) -> None:
        """Remove merged shards' folders, each one's catalog file last: a merge killed
        meanwhile leaves a shard that the next merge still recognises as merged. Then the
        folders a killed removal left without a catalog (nothing else makes them while a
        merge holds the store alone: a shard takes the shared lock before its folder)."""
        folder = self.path / SHARDS_NAME
        for name in names:
            if not (folder / name).is_dir():
                continue
            for p in sorted((folder / name).iterdir()):
                if p.name not in (CATALOG_NAME, CATALOG_NAME + ".wal"):  # with its log
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            fault("shard_removal")
            shutil.rmtree(folder / name, ignore_errors=True)
        if folder.is_dir():
            for p in folder.iterdir():
                if p.is_dir() and not (p / CATALOG_NAME).is_file():
                    shutil.rmtree(p, ignore_errors=True)
        with suppress(OSError):
            folder.rmdir()  # only when empty

    def unlock(self) -> None:
        if self._shard_fd is not None:
            os.close(self._shard_fd)
            self._shard_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def open_catalog(self, *, read_only: bool, ingest: bool) -> Catalog:
        return Catalog(self.path / CATALOG_NAME, read_only=read_only, hold=not ingest)

    def open_arrays(self, *, read_only: bool) -> Arrays:
        return Arrays(self.path / TENSORS_NAME, read_only=read_only)

    def clean_partials(self) -> None:
        durable.remove_partials(self.path / TENSORS_NAME)

    def tokenizer_dir(self, model_id: int) -> Path:
        return self.path / TOKENIZERS_NAME / str(model_id)

    def save_tokenizer(self, model_id: int, save: Callable[[str], object]) -> None:
        folder = self.tokenizer_dir(model_id)
        save(str(folder))
        # durable before the model's catalog row names it (a handful of files)
        durable.sync_tree(folder)
        durable.fsync_dir(folder.parent)
        durable.fsync_dir(self.path)

    def writing(self, what: str) -> AbstractContextManager[None]:
        return durable.full_disk_as_error(self.path, what)

    def disk_bytes(self) -> dict[str, int]:
        def size(p: Path) -> int:
            # A running ingest renames and removes files (chunk temporaries, the catalog's
            # log) while this walks: one that vanished between listing and stat counts 0.
            if not p.is_dir():
                with suppress(FileNotFoundError):
                    return p.stat().st_size
                return 0
            total = 0
            for folder, _, files in os.walk(p):  # os.walk skips folders it cannot list
                for name in files:
                    with suppress(FileNotFoundError):
                        total += os.stat(os.path.join(folder, name)).st_size
            return total

        cat = sum(size(f) for f in self.path.glob(CATALOG_NAME + "*"))
        ten = size(self.path / TENSORS_NAME)
        tok = size(self.path / TOKENIZERS_NAME) if (self.path / TOKENIZERS_NAME).exists() else 0
        return {"catalog": cat, "tensors": ten, "tokenizers": tok, "total": cat + ten + tok}

    def close(self) -> None:
        self.unlock()


def _check_writable(path: Path) -> None:
    """The one place that decides whether we may write into a store directory."""
    targets = [path]
    if (path / TENSORS_NAME).exists():
        targets.append(path / TENSORS_NAME)
    for t in targets:
        # The mode bits count too: root passes os.access on a directory made read-only.
        if not os.access(t, os.W_OK | os.X_OK) or not t.stat().st_mode & 0o222:
            raise StoreNotWritableError(f"store directory {str(t)!r} is not writable")


def _remove_dead_builds(p: Path) -> None:
    """Remove the half-built copies of this store left by creators that were killed."""
    for build in p.absolute().parent.glob(f".{p.name}{_BUILDING}*"):
        pid = build.name.rsplit(_BUILDING, 1)[-1].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(build, ignore_errors=True)

