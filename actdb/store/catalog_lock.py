"""The catalog's own lock, `catalog.duckdb.lock` beside the file: writers hold it exclusively
for as long as their connection is open (folds included), readers hold it shared while
they copy their snapshot.

Why not DuckDB's lock: it is a POSIX (fcntl) lock, which the kernel drops as soon as the
process closes *any* descriptor of the file (copying it for a fold does), and which stays
on the old inode once a fold renames a new file over it. Either way a second writer could
open the catalog mid-fold and lose its commit. `flock` locks belong to the open file
description, so nothing else the process does to the catalog releases this one.

Within one process the lock is kept in a table here (flock would conflict with the
process's own description, and DuckDB would hand a second connection the same database
rather than refuse it): shared requests share a shared hold; any other request waits for
the hold to go, like one from another process, except that a thread asking again for the
catalog it holds exclusively is refused at once (waiting on itself would never end).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .retry import retry


class Outcome(Enum):
    TAKEN = "taken"
    BUSY = "busy"  # another holder kept it for the whole wait
    HELD_BY_THIS_THREAD = "held by this thread"  # exclusively, so waiting would never end


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@dataclass
class _Held:
    fd: int | None  # None: there is no lock file and it cannot be made (a read-only folder)
    exclusive: bool
    count: int
    owner: int  # the thread that took an exclusive hold


_held: dict[str, _Held] = {}
_taking: set[str] = set()
_cond = threading.Condition()


def _forget() -> None:
    """In a forked child: the parent's holds are the parent's, not the child's."""
    global _cond
    for held in _held.values():
        if held.fd is not None:
            try:
                os.close(held.fd)  # the child's copy only: the parent keeps its flock
            except OSError:
                pass
    _held.clear()
    _taking.clear()
    _cond = threading.Condition()


os.register_at_fork(after_in_child=_forget)


def _open(key: str, catalog: Path) -> int | None:
    try:
        fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise
    else:
        try:  # whoever may open the catalog may take its lock
            os.fchmod(fd, stat.S_IMODE(catalog.stat().st_mode) & 0o666 | 0o600)
        except OSError:
            pass
        return fd
    try:
        return os.open(key, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return _open(key, catalog)  # removed meanwhile (a store being deleted): make it
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise
    try:  # a store this user may not write: lock the file if a writer made it
        return os.open(key, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, PermissionError):
        # Nobody could write the store and make the file, or this user cannot take the
        # lock anyone takes: either way there is nothing to wait on.
        return None


def acquire(path: Path, *, exclusive: bool, timeout: float) -> Outcome:
    """Take the lock of catalog `path`, waiting up to `timeout` seconds while another
    process or thread holds it."""
    key = os.path.realpath(lock_path(path))
    deadline = time.monotonic() + timeout
    me = threading.get_ident()
    with _cond:
        while True:
            held = _held.get(key)
            if held is not None and not held.exclusive and not exclusive:
                held.count += 1
                return Outcome.TAKEN
            if held is not None and held.exclusive and held.owner == me:
                return Outcome.HELD_BY_THIS_THREAD
            if held is None and key not in _taking:
                _taking.add(key)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return Outcome.BUSY
            _cond.wait(min(left, 0.05))
    fd: int | None = None
    got = False
    try:
        fd = _open(key, path)
        if fd is not None:
            held_fd = fd
            mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
            try:
                retry(lambda: fcntl.flock(held_fd, mode),
                      again=lambda e: isinstance(e, BlockingIOError), deadline=deadline)
            except BlockingIOError:
                return Outcome.BUSY
        if fd is not None and exclusive:
            _record_pid(fd, f"{os.getpid()}\n")
        got = True
        return Outcome.TAKEN
    finally:
        with _cond:
            _taking.discard(key)
            if got:
                _held[key] = _Held(fd, exclusive, 1, me)
            elif fd is not None:
                os.close(fd)
            _cond.notify_all()


def release(path: Path) -> None:
    """Give back one `acquire` of the lock of catalog `path`."""
    key = os.path.realpath(lock_path(path))
    with _cond:
        held = _held.get(key)
        if held is None:
            return  # forgotten in a forked child
        held.count -= 1
        if held.count == 0:
            del _held[key]
            if held.fd is not None:
                if held.exclusive:
                    _record_pid(held.fd, "")  # no stale PID for the next message
                os.close(held.fd)  # drops the flock
            _cond.notify_all()


def holder_pid(path: Path) -> int | None:
    """The PID the current exclusive holder wrote into the lock file, for messages."""
    try:
        text = lock_path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def held_here(path: Path) -> bool:
    """Whether this process holds the lock of catalog `path` exclusively, for messages."""
    held = _held.get(os.path.realpath(lock_path(path)))
    return held is not None and held.exclusive


def _record_pid(fd: int, text: str) -> None:
    try:
        os.ftruncate(fd, 0)
        if text:
            os.pwrite(fd, text.encode(), 0)
    except OSError:
        pass  # opened read-only: the message just names no PID
