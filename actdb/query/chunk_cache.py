"""Whole chunks kept in memory between queries, and the read-ahead thread that fills them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .threads import READAHEAD_CHUNKS

# keys `first_read` remembers at most (forgotten all at once past it: a chunk then read once
# more without being kept)
_SEEN_MAX = 1 << 16


class ChunkCache:
    """Whole chunks kept in memory, least recently used first out, at most `max_bytes`.

    A scan that walks an array chunk after chunk gets the next `readahead` chunks read by a
    background thread while it computes on this one (file reads release the GIL), so reading
    and computing overlap on two cores.
    """

    def __init__(self, max_bytes: int, *, readahead: int = READAHEAD_CHUNKS,
                 readers: int = 1) -> None:
        self.max_bytes = max_bytes
        self.readahead = readahead
        self._items: OrderedDict[tuple[object, ...], np.ndarray] = OrderedDict()
        self._pending: dict[tuple[object, ...], Future[np.ndarray]] = {}
        self._loads: dict[tuple[object, ...], Callable[[], np.ndarray]] = {}  # of _pending
        self._bytes = 0
        self._lock = threading.Lock()
        # One reader overlaps a local disk with compute; object storage answers each range
        # request after a round trip, so several are kept in flight (Store.readers).
        self._reader = ThreadPoolExecutor(max_workers=readers,
                                          thread_name_prefix="actdb-readahead")
        self.chunks_read = 0
        self.bytes_read = 0
        # keys asked for once, through `first_read`, since the last `clear`
        self._seen: set[tuple[object, ...]] = set()

    def get(self, key: tuple[object, ...], load: Callable[[], np.ndarray], *,
            keep: bool = True, chunks: int = 1) -> np.ndarray:
        """The value of `key`, from memory, from a read under way, or read now. `keep`
        False: counted but not kept (a scan's runs of chunks: holding hundreds of megabytes
        it will not read again would make every read land in fresh, page-faulted memory).
        `chunks`: how many chunks the value holds, for the counters."""
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
            pending = self._pending.pop(key, None)
            self._loads.pop(key, None)
        if pending is None or pending.cancel():  # not read ahead, or still queued: read here
            value = load()
        else:
            if not pending.done():
                self._help()
            value = pending.result()
        self._insert(key, value, keep=keep, chunks=chunks)
        return value

    def _help(self) -> None:
        """While this thread waits for a read under way, do the read queued farthest ahead
        itself (file reads release the GIL, so both threads read). A scan's windows compute
        faster than one thread reads, so the query's thread would otherwise wait on the
        read-ahead thread. The read taken is replaced, under the
        lock, by a future already running, so that another thread asking for it (DuckDB
        calls UDFs from several threads) waits for it, and no other helper takes it again."""
        with self._lock:
            for key in reversed(self._pending):
                future = self._pending[key]
                if not future.cancelled() and future.cancel():
                    load = self._loads.pop(key)
                    done: Future[np.ndarray] = Future()
                    done.set_running_or_notify_cancel()
                    self._pending[key] = done
                    break
            else:
                return
        try:
            done.set_result(load())
        except BaseException as e:  # raised, like a read-ahead's, when the value is asked for
            done.set_exception(e)
            if not isinstance(e, Exception):
                raise

    def prefetch(self, key: tuple[object, ...], load: Callable[[], np.ndarray], *,
                 limit: int = 64) -> None:
        """Start reading `key` in the background unless it is cached or on its way, or
        `limit` reads are on their way already (reads a query stopped before using stay there
        until the next `clear`: the limit bounds their memory)."""
        with self._lock:
            if key in self._items or key in self._pending or len(self._pending) >= limit:
                return
            self._pending[key] = self._reader.submit(load)
            self._loads[key] = load

    def submit(self, fn: Callable[..., np.ndarray], *args: Any) -> Future[np.ndarray]:
        """Run `fn(*args)` on the read-ahead thread, after the reads queued before it."""
        return self._reader.submit(fn, *args)

    def _insert(self, key: tuple[object, ...], value: np.ndarray, *, keep: bool = True,
                chunks: int = 1) -> None:
        with self._lock:
            self.chunks_read += chunks
            self.bytes_read += value.nbytes
            if not keep:
                return
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes

    def first_read(self, key: tuple[object, ...]) -> bool:
        """Whether `key` is neither held nor on its way, nor asked for here since the last
        `clear`; remembered now as asked for. A caller that gets True reads the value without
        keeping it (and counts the read): a selective query's chunk is kept from its second
        read on. Keeping a chunk means reading it into fresh memory, whose first writes miss
        the core's caches; a chunk read once, into a buffer reused for each read, does not."""
        with self._lock:
            if key in self._items or key in self._pending or key in self._seen:
                return False
            if len(self._seen) >= _SEEN_MAX:
                self._seen.clear()
            self._seen.add(key)
            return True

    def clear(self) -> None:
        """Forget every cached chunk, every read ahead and every key asked for (the counters
        stay)."""
        with self._lock:
            self._seen.clear()
            self._items.clear()
            self._bytes = 0
            for f in self._pending.values():
                f.cancel()
            self._pending.clear()
            self._loads.clear()

    def count(self, chunks: int, nbytes: int) -> None:
        """Count a read whose value is not kept here."""
        with self._lock:
            self.chunks_read += chunks
            self.bytes_read += nbytes

    def close(self) -> None:
        for f in list(self._pending.values()):
            f.cancel()
        self._reader.shutdown(wait=True, cancel_futures=True)
