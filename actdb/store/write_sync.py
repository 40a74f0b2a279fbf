"""Making a batch's chunk writes durable before the catalog commit that refers to them: the
folders whose entries changed, fsynced (concurrently), or, where the file system allows it,
one syncfs for every new file at once (durable.FileSystemSync)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Executor
from pathlib import Path

from . import durable


class WriteSync:
    """What the writes to a local group's folder since the last `sync` left to make durable."""

    def __init__(self, path: Path | None, *, read_only: bool) -> None:
        self.path = path
        self._made: set[str] = set()  # chunk folders known to exist
        self._dirty: set[str] = set()  # folders with renames not yet fsynced
        self._lock = threading.Lock()
        # New chunk files are written without an fsync each and made durable by one syncfs
        # in `sync`; `_unsynced`: some were written since.
        self._batch_sync = (path is not None and not read_only
                            and durable.batch_sync_available(path))
        self._fs_sync: durable.FileSystemSync | None = None  # opened before the first such file
        self._on_device: dict[str, bool] = {}  # chunk folder -> on the descriptor's file system
        self._unsynced = False

    def file_system_sync(self) -> durable.FileSystemSync | None:
        """The descriptor `sync`'s syncfs runs on, where new files may wait for it: opened
        before the first such file is written (syncfs reports the errors since then)."""
        if not self._batch_sync:
            return None
        if self._fs_sync is None:
            with self._lock:
                if self._fs_sync is None:
                    assert self.path is not None
                    self._fs_sync = durable.FileSystemSync(self.path)
        return self._fs_sync

    def syncs_with(self, folder: str) -> bool:
        """Whether a new file in `folder` may wait for `sync`'s syncfs: batch sync is on and
        the folder is on the same file system (not another disk mounted inside the store)."""
        fs = self.file_system_sync()
        if fs is None:
            return False
        same = self._on_device.get(folder)
        if same is None:
            same = self._on_device[folder] = os.stat(folder).st_dev == fs.device
        return same

    def make_folder(self, folder: str, *parents: str) -> None:
        """`folder` exists (made once); made here, its entry in `parents` awaits `sync`."""
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
            self._made.add(folder)
            self.mark_dirty(*parents)

    def wrote(self, folder: str, *, deferred: bool) -> None:
        """A file was renamed into `folder`; `deferred`: not fsynced, left to the syncfs."""
        with self._lock:
            self._dirty.add(folder)
            # Set once the file is in place: a `sync` that read the flag before then leaves
            # it to the next one (a write ahead may finish beside a commit's sync).
            self._unsynced = self._unsynced or deferred

    def mark_unsynced(self) -> None:
        """New files were written that the next `sync`'s syncfs makes durable."""
        with self._lock:
            self._unsynced = True

    def mark_dirty(self, *folders: str) -> None:
        with self._lock:
            self._dirty.update(folders)

    def sync(self, pool: Executor | None = None) -> None:
        """fsync the folders whose entries changed since the last call: the renames of
        the chunks written become durable (before the catalog commit refers to them).

        With `pool`, the folders are synced concurrently on its threads: a batch touches a
        folder per array, and nothing else overlaps the last commit's wait for them. Their
        order does not matter: nothing refers to the chunks until all have returned.

        Where new chunk files were written without an fsync each, one syncfs of the file
        system makes them, and every folder's entries, durable instead."""
        with self._lock:
            folders, self._dirty = sorted(self._dirty, key=len, reverse=True), set()
            whole, self._unsynced = self._unsynced, False
        if whole:
            # A failure fails the commit; the next one starts at the same rows again.
            assert self._fs_sync is not None
            self._fs_sync.sync()
            return
        list((pool.map if pool else map)(durable.fsync_dir, folders))

    def close(self) -> None:
        """Let go of the file system's descriptor (`sync`'s)."""
        with self._lock:
            fs, self._fs_sync = self._fs_sync, None
        if fs is not None:
            fs.close()


__all__ = ["WriteSync"]
