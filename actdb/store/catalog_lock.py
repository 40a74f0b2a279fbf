"""The catalog's own lock, `catalog.duckdb.lock` beside the file: writers hold it exclusively
for as long as their connection is open (folds included), readers hold it shared while
they copy their snapshot.

Why not DuckDB's lock: it is a POSIX (fcntl) lock, which the kernel drops as soon as the
process closes *any* descriptor of the file (copying it for a fold does), and which stays
on the old inode once a fold renames a new file over it. Either way a second writer could
open the catalog mid-fold and lose its commit. `flock` locks belong to the open file
description, so nothing else the process does to the catalog releases this one.

Within one process the lock is counted, not taken again (flock would conflict with the
process's own description): DuckDB's own checks then refuse a second connection to a file
this process holds for writing, with their clear message.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@dataclass
class _Held:
    fd: int | None  # None: the lock file could not be created (a read-only folder)
    exclusive: bool
    count: int


_held: dict[str, _Held] = {}
_taking: set[str] = set()
_cond = threading.Condition()


def _open(key: str) -> int | None:
    try:
        return os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise
    try:  # a store a reader may not write: lock the file if a writer made it
        return os.open(key, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # nobody can have written here, so nobody is folding


def acquire(path: Path, *, exclusive: bool, timeout: float) -> bool:
    """Take the lock of catalog `path`, waiting up to `timeout` seconds; False when another
    process (or, for `exclusive`, another thread's snapshot) still holds it then."""
    key = os.path.realpath(lock_path(path))
    deadline = time.monotonic() + timeout
    with _cond:
        while True:
            held = _held.get(key)
            if held is not None and (held.exclusive or not exclusive):
                held.count += 1
                return True
            if held is None and key not in _taking:
                _taking.add(key)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _cond.wait(min(left, 0.05))
    fd: int | None = None
    got = False
    try:
        fd = _open(key)
        pause = 0.002
        while fd is not None:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        if fd is not None and exclusive:
            _record_pid(fd)
        got = True
        return True
    finally:
        with _cond:
            _taking.discard(key)
            if got:
                _held[key] = _Held(fd, exclusive, 1)
            elif fd is not None:
                os.close(fd)
            _cond.notify_all()


def release(path: Path) -> None:
    """Give back one `acquire` of the lock of catalog `path`."""
    key = os.path.realpath(lock_path(path))
    with _cond:
        held = _held[key]
        held.count -= 1
        if held.count == 0:
            del _held[key]
            if held.fd is not None:
                os.close(held.fd)  # drops the flock
            _cond.notify_all()


def holder_pid(path: Path) -> int | None:
    """The PID the last exclusive holder wrote into the lock file, for messages."""
    try:
        text = lock_path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _record_pid(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # opened read-only: the message just names no PID
