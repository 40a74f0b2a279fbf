"""Reading stored fields of token rows: chunk by chunk, or for a scan by aligned runs of chunks
read ahead on the chunk cache's thread, with the run's dot products with one vector made there
too (the full scan's path)."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..lazy import lazy_module
from ..store.records import ModelRecord, SiteRecord
from ..store.store import Store
from .chunk_cache import ChunkCache

if TYPE_CHECKING:
    import torch

    from ..store.arrays import ArrayInfo
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

try:  # the compiled scan kernel (actdb/_native.c), built at install when a C compiler is there
    from .. import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None  # type: ignore[assignment]

# A scan reads whole runs of this many chunks (about 4 MiB) as one read-ahead task, and keeps
# this many runs read ahead of the one it computes on.
RUN_CHUNKS = 16
RUN_AHEAD = 2
# Runs whose products a walking scan has made ahead (FieldReader._project_runs): as many as
# the window it computes now, from RUN_AHEAD to this many. The read-ahead thread makes them
# while DuckDB and the UDFs' Python use up the window's rows, which RUN_AHEAD alone left it
# idle through; growing with the window keeps a LIMIT query, which stops in its first small
# windows, from reading far past its rows.
DOTS_AHEAD = 8
_RUNS_PENDING = 8  # about 24 MiB of runs read ahead at most, whatever the query left behind
# rows whose products with a constant vector are kept (_project_runs): 4 MiB of float32
_DOTS_ROWS = 1 << 20
# float32 values converted at a time by `project`: 1 MiB, so the block stays in the core's
# cache between its conversion and its product
SCRATCH_FLOATS = 1 << 18


class Rows(Protocol):
    """Sorted token rows of one site of one model, and their heads (vectors.Group)."""

    model: ModelRecord
    site: SiteRecord
    rows: np.ndarray
    heads: np.ndarray


def _consecutive(rows: np.ndarray) -> bool:
    """Whether sorted `rows` are consecutive integers, each once."""
    return len(rows) < 2 or (int(rows[-1]) - int(rows[0]) + 1 == len(rows)
                             and bool((rows[1:] != rows[:-1]).all()))



class _Dots:
    """One run's products with one vector: the task making them, its rows, whether a query
    has counted its reads yet."""

    __slots__ = ("counted", "rows", "task")

    def __init__(self, task: Future[np.ndarray], rows: int) -> None:
        self.task, self.rows, self.counted = task, rows, False



class RunWalk:
    """Consecutive rows of one field over many chunks, read by aligned runs of RUN_CHUNKS
    chunks: which runs, where each one's rows go, and their reads (ahead, and the run a window
    ends in, held for the next window, which starts in it)."""

    def __init__(self, reader: FieldReader, model: ModelRecord, site: SiteRecord, name: str,
                 rows: np.ndarray, heads: np.ndarray, arr: ArrayInfo, walking: bool) -> None:
        self.reader, self.site, self.heads = reader, site, heads
        self.where = (model.model_id, site.site, name)
        c = arr.chunks[0]
        self.step = RUN_CHUNKS * c
        self.chunk_bytes = math.prod(arr.chunks) * arr.dtype.itemsize
        self.lo, self.hi = int(rows[0]), int(rows[-1]) + 1
        # The chunks of this run of committed rows: no later one is read (unused rows between
        # merged shards follow it; shards start on whole runs of chunks).
        self.n_chunks = -(-reader.segment_end(model.model_id, self.hi - 1) // c)
        first, last = self.lo // self.step, (self.hi - 1) // self.step
        self.runs = range(first, last + 1)
        # past the last run read ahead while the query walks the array: RUN_AHEAD more, or
        # as many as this window holds up to DOTS_AHEAD; never past the segment's last run
        ahead = min(DOTS_AHEAD, max(RUN_AHEAD, len(self.runs))) if walking else 0
        self.stop = min(-(-self.n_chunks // RUN_CHUNKS), last + 1 + ahead)

    def count(self, r: int) -> int:
        """Chunks in run r."""
        return min(RUN_CHUNKS, self.n_chunks - r * RUN_CHUNKS)

    def nbytes(self, r: int) -> int:
        """Bytes of run r's values, as read."""
        return self.count(r) * self.chunk_bytes

    def _load(self, r: int) -> Callable[[], np.ndarray]:
        return partial(self.reader.store.arrays.read_chunks, *self.where, r * RUN_CHUNKS,
                       self.count(r))

    def prefetch_after(self, r: int) -> None:
        for ahead in range(r + 1, min(r + 1 + RUN_AHEAD, self.stop)):
            self.reader.cache.prefetch((*self.where, "run", ahead), self._load(ahead),
                                    limit=_RUNS_PENDING)

    def data(self, r: int) -> np.ndarray:
        """Run r's rows: the run held from the last window, or read (ahead or now)."""
        held = self.reader.held.get(self.where)
        if held is not None and held[0] == r:
            return held[1]
        data = self.reader.cache.get((*self.where, "run", r), self._load(r), keep=False,
                                  chunks=self.count(r))
        if r == self.runs[-1]:  # kept for the next window, which starts in it
            self.reader.held[self.where] = (r, data)
        return data

    def span(self, r: int) -> tuple[int, int]:
        """The rows of the walk that run r holds (absolute row numbers)."""
        return max(self.lo, r * self.step), min(self.hi, (r + 1) * self.step)

    def piece(self, r: int, data: np.ndarray) -> tuple[int, int, np.ndarray]:
        """(start, end, values): run r's share of the rows, as `_pieces` yields it."""
        a, b = self.span(r)
        part = data[a - r * self.step : b - r * self.step]
        lo = self.lo
        return a - lo, b - lo, (part[np.arange(b - a), self.heads[a - lo : b - lo]]
                                if self.site.n_heads else part)

    def dots(self, r: int, vv: np.ndarray) -> np.ndarray:
        """float32: every row of run r (a field of unit directions, no heads) dotted with
        `vv`, read now (the run is not kept: its products are; counted where used)."""
        return self.reader.store.arrays.read_dots(*self.where, r * RUN_CHUNKS, self.count(r),
                                                  vv)



class FieldReader:
    """Stored fields (direction, norm, mean) of sorted token rows: chunk by chunk through the
    chunk cache, or by runs of chunks for a scan, and the dot products of a scan's directions
    with one vector made on the read-ahead thread (`project`)."""

    def __init__(self, store: Store, cache: ChunkCache,
                 segment_end: Callable[[int, int], int]) -> None:
        """`segment_end(model_id, row)`: the end of the unbroken run of committed rows holding
        `row` (VectorSource.segment_end): nothing past it is read ahead."""
        self.store, self.cache, self.segment_end = store, cache, segment_end
        self._lock = threading.Lock()
        self._local = threading.local()
        self._last_chunk: dict[tuple[int, str, str], int] = {}
        # the run a window ended in, held for the next window, which starts in it (RunWalk)
        self.held: dict[tuple[int, str, str], tuple[int, np.ndarray]] = {}
        # (model, site, field, v's bytes, run) -> the run's products with v (_project_runs)
        self._dots: OrderedDict[tuple[object, ...], _Dots] = OrderedDict()
        self._dots_rows = 0

    def clear(self) -> None:
        """Forget the runs held and the products made (the chunk cache is cleared apart)."""
        self.held.clear()
        with self._lock:
            for k in list(self._dots):
                self._forget_dots(k)

    def field(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
              heads: np.ndarray) -> np.ndarray:
        """Stored `name` (direction, norm or mean) for sorted token rows, by whole chunks."""
        parts = [p for _, _, p in self.pieces(model, site, name, rows, heads)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def project(self, g: Rows, v: torch.Tensor, at: np.ndarray | None = None
                ) -> torch.Tensor:
        """float32 [n]: the group's stored unit directions dotted with `v` [d], each row
        reduced on its own in an order fixed by d (dots.py); `at` (ascending positions in
        the group): those rows alone, with the same values as in the whole group's product.

        On the CPU, each chunk's float16 piece goes through the compiled kernel
        (`actdb._native.f16_dots`): converted in registers and multiplied-added in one pass,
        with the GIL released so the read-ahead thread runs beside it (one pass over the
        stored bytes where torch makes three). Without the compiled module, torch converts
        each piece to float32 in a small scratch buffer that stays in cache, multiplies and
        sums row by row (the same values up to float32 rounding).

        On the CPU whatever the device, and returned there: one product a row is bound by
        reading the stored bytes, and copying them to a GPU is one more pass over them on the
        host (docs/ENGINE.md, "Where a function computes").
        """
        v = v.cpu()
        rows, heads = (g.rows, g.heads) if at is None else (g.rows[at], g.heads[at])
        n, d = len(rows), g.site.d
        out = torch.empty(n, dtype=torch.float32)  # whatever a notebook set as torch's default
        if _native is not None:
            vv = np.ascontiguousarray(v.numpy(), dtype=np.float32)
            res = out.numpy()
            walk = self._walk(g.model, g.site, "direction", rows, heads)
            if isinstance(walk, RunWalk):
                if not g.site.n_heads:
                    self._project_runs(walk, vv, res)
                    return out
            elif walk[1] == walk[2] and not walk[3]:
                # rows in one chunk, the array not walked (a selective query's usual group):
                # the chunk's piece alone, without `pieces`' generator and read-ahead plan
                self._project_one(g.model, g.site, rows, heads, walk[0], walk[1], vv, res)
                return out
            for a, b, part in self._read(walk, g.model, g.site, "direction", rows, heads):
                # float16 in this machine's byte order, contiguous (a per-head piece is)
                _native.f16_dots(np.ascontiguousarray(part, dtype=np.float16), vv, res[a:b])
            return out
        scratch = getattr(self._local, "scratch", None)
        step = max(1, SCRATCH_FLOATS // d)
        if scratch is None or scratch.numel() < step * d:
            scratch = self._local.scratch = torch.empty(step * d, dtype=torch.float32)
        for a, b, part in self.pieces(g.model, g.site, "direction", rows, heads):
            piece = torch.from_numpy(part)
            for i in range(0, b - a, step):
                m = min(step, b - a - i)
                block = scratch[: m * d].view(m, d)
                # row_dots in the scratch: converting, then multiplying in place, is faster
                # than one mixed float16 * float32 multiply
                block.copy_(piece[i : i + m]).mul_(v)
                torch.sum(block, -1, out=out[a + i : a + i + m])
        return out

    def pieces(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
                heads: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        """(start, end, values) for the sorted `rows` held by each chunk in turn."""
        return self._read(self._walk(model, site, name, rows, heads), model, site, name, rows,
                          heads)

    def _read(self, walk: RunWalk | tuple[int, int, int, bool], model: ModelRecord,
              site: SiteRecord, name: str, rows: np.ndarray, heads: np.ndarray
              ) -> Iterator[tuple[int, int, np.ndarray]]:
        """`pieces` the way `walk` says."""
        if isinstance(walk, RunWalk):
            return self._runs(walk)
        return self._chunks(model, site, name, rows, heads, *walk)

    def _chunks(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
                heads: np.ndarray, c: int, first: int, last: int, walking: bool
                ) -> Iterator[tuple[int, int, np.ndarray]]:
        """`pieces` chunk by chunk (each chunk kept in the cache)."""
        where = (model.model_id, site.site, name)
        # The chunks to read, in order: those holding asked-for rows (every one is read anyway,
        # so reading them ahead costs no byte more), then, when the query walks the array,
        # the chunks that follow; the read-ahead thread stays `readahead` chunks ahead.
        bounds: Sequence[int]
        if first == last:  # one chunk: a selective query's usual group
            bounds, needed = (0, len(rows)), [first]
        else:
            cut = np.searchsorted(rows, np.arange(first, last + 2) * c)
            bounds = cut.tolist()
            needed = (np.nonzero(cut[1:] > cut[:-1])[0] + first).tolist()
        upcoming = list(needed)
        if walking:
            # not past this run of committed rows: unused rows between merged shards follow
            n_chunks = -(-self.segment_end(model.model_id, int(rows[-1])) // c)
            upcoming += range(last + 1, min(last + 1 + self.cache.readahead, n_chunks))
        ahead = 1
        for i, chunk in enumerate(needed):
            for j in range(max(ahead, i + 1), min(i + 1 + self.cache.readahead, len(upcoming))):
                self.cache.prefetch((*where, upcoming[j]),
                                    partial(self.store.arrays.read_chunk, *where, upcoming[j]))
                ahead = j + 1
            lo = chunk * c
            a, b = bounds[chunk - first], bounds[chunk - first + 1]
            data = self.cache.get(
                (model.model_id, site.site, name, chunk),
                partial(self.store.arrays.read_chunk, model.model_id, site.site, name, chunk),
            )
            local = rows[a:b] - lo
            # a view where the rows are consecutive (a row can repeat: heads, self-joins)
            part = data[local[0] : local[-1] + 1] if _consecutive(local) else data[local]
            yield int(a), int(b), (part[np.arange(len(local)), heads[a:b]] if site.n_heads
                                   else part)

    def _project_one(self, model: ModelRecord, site: SiteRecord, rows: np.ndarray,
                     heads: np.ndarray, c: int, chunk: int, vv: np.ndarray, res: np.ndarray
                     ) -> None:
        """`project` of sorted rows all in chunk `chunk` (of `c` rows), nothing read ahead (a
        selective query's usual group), without `pieces`' generator and plan. A chunk read
        here has its rows' products made in the pass that checks its checksum
        (Arrays.read_chunk_dots) and this group's taken from them (a row's product does not
        depend on its neighbours: f16_dots). Its first read since the cache was cleared goes
        into this thread's buffer, counted but not kept (ChunkCache.first_read); from its
        second on, it is kept in the cache."""
        where = (model.model_id, site.site, "direction")
        key = (*where, chunk)
        dots: np.ndarray | None = None
        if not site.n_heads and self.cache.first_read(key):
            data, dots = self.store.arrays.read_chunk_dots(*where, chunk, vv,
                                                           self._chunk_buffer(c * site.d * 2))
            self.cache.count(1, data.nbytes)
        else:
            made: list[np.ndarray] = []

            def load() -> np.ndarray:
                values, products = self.store.arrays.read_chunk_dots(*where, chunk, vv)
                if products is not None:
                    made.append(products)
                return values

            data = self.cache.get(key, load)
            dots = made[0] if made and not site.n_heads else None
        lo = chunk * c
        # a slice where the rows are consecutive (a row can repeat: heads, self-joins)
        span = slice(int(rows[0]) - lo, int(rows[-1]) - lo + 1) if _consecutive(rows) else None
        if dots is not None:
            res[:] = dots[span] if span is not None else dots[rows - lo]
            return
        part = data[span] if span is not None else data[rows - lo]
        if site.n_heads:
            part = part[np.arange(len(rows)), heads]
        _native.f16_dots(np.ascontiguousarray(part, dtype=np.float16), vv, res)

    def _chunk_buffer(self, nbytes: int) -> np.ndarray:
        """This thread's buffer for a chunk read once (`_project_one`): reused, so that it
        stays in the core's cache."""
        buf: np.ndarray | None = getattr(self._local, "chunk", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.chunk = np.empty(nbytes, dtype=np.uint8)
        return buf

    def _walk(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
              heads: np.ndarray) -> RunWalk | tuple[int, int, int, bool]:
        """How `pieces` reads the sorted `rows`: by runs of chunks, or chunk by chunk (the
        chunk size, first and last chunk, and whether the query walks the array)."""
        arr = self.store.arrays.act_info(model.model_id, site.site, name)
        c = arr.chunks[0]
        first, last = int(rows[0]) // c, int(rows[-1]) // c
        where = (model.model_id, site.site, name)
        walking = self._last_chunk.get(where) in (first - 1, first)
        self._last_chunk[where] = last
        # Runs on a local disk only: object storage keeps several single-chunk requests in
        # flight (Store.readers), which a run, read request after request, would serialize.
        if (self.store.readers == 1 and last - first + 1 >= RUN_CHUNKS // 2
                and _consecutive(rows)):
            return RunWalk(self, model, site, name, rows, heads, arr, walking)
        return c, first, last, walking

    def _runs(self, walk: RunWalk) -> Iterator[tuple[int, int, np.ndarray]]:
        """`pieces` for consecutive rows over many chunks (a bulk window, a scan): read by
        runs of RUN_CHUNKS chunks (aligned, so the next window finds the run it shares with
        this one), each run one task of the read-ahead thread and one piece here, while the
        thread reads the next runs. Per-chunk Python work, on both threads, was most of a
        full scan's time; the GIL they share made a per-chunk read-ahead slower than none.
        Runs are not kept in the chunk cache (counted, not kept): the query is past them."""
        for r in walk.runs:
            walk.prefetch_after(r)
            yield walk.piece(r, walk.data(r))

    def _project_runs(self, walk: RunWalk, vv: np.ndarray, res: np.ndarray) -> None:
        """`project`'s dot products over a walk's runs, shared with the read-ahead thread.

        Each run is one task: its chunks read and checked, and its rows dotted with `vv`, by
        the compiled kernels with the GIL released (a run just read is still in the core's
        cache). This window's runs not yet made are queued last to first, so the read-ahead
        thread works from the back while this thread takes them from the front (a queued
        run is taken back and made here); this thread also runs DuckDB and the UDFs' Python,
        and left alone with a window's reads and products it was the scan's bottleneck while
        the read-ahead thread idled. When the query walks the array, the runs up to the
        walk's stop are queued too (as many as the window holds, from RUN_AHEAD up to
        DOTS_AHEAD). A row's value does not depend on the
        thread or the run (f16_dots). A run's reads are counted when a query first uses its
        products, and a run whose task failed is forgotten once the failure is reported (a
        damaged chunk is reported only to a query that needs its rows)."""
        key = (*walk.where, vv.tobytes())
        runs = walk.runs
        todo = {r: self._dots_ahead(walk, r, key, vv) for r in reversed(runs)}
        for r in runs:
            entry = todo[r]
            if entry.task.cancel():  # still queued: made here, and kept as the thread's would be
                entry = self._dots_here(walk, r, key, vv, entry)
            try:
                dots = entry.task.result()
            except BaseException:
                with self._lock:
                    if self._dots.get((*key, r)) is entry:
                        self._forget_dots((*key, r))
                raise
            with self._lock:  # counted once, whichever of DuckDB's threads uses it first
                first_use, entry.counted = not entry.counted, True
            if first_use:
                self.cache.count(walk.count(r), walk.nbytes(r))
            a, b = walk.span(r)
            res[a - walk.lo : b - walk.lo] = dots[a - r * walk.step : b - r * walk.step]
        for r in range(runs[-1] + 1, walk.stop):  # read ahead while the query walks
            self._dots_ahead(walk, r, key, vv)

    def _dots_ahead(self, walk: RunWalk, r: int, key: tuple[object, ...], vv: np.ndarray
                    ) -> _Dots:
        """Run r's products with `vv` (key: the field and vv's bytes): made or under way, or
        queued now on the read-ahead thread. Results of at most _DOTS_ROWS rows are kept,
        least recently asked for first out."""
        with self._lock:
            entry = self._dots.get((*key, r))
            if entry is not None:
                self._dots.move_to_end((*key, r))
                return entry
            return self._keep_dots((*key, r), _Dots(self.cache.submit(walk.dots, r, vv),
                                                    walk.count(r) * walk.step // RUN_CHUNKS))

    def _dots_here(self, walk: RunWalk, r: int, key: tuple[object, ...], vv: np.ndarray,
                   cancelled: _Dots) -> _Dots:
        """Make run r's products on this thread, its queued task cancelled; when another
        thread cancelled the same task first, wait for that thread's products instead."""
        with self._lock:
            entry = self._dots.get((*key, r))
            # another thread's products: waited for if under way or made; if still queued
            # (this thread's entry was dropped by `clear` or evicted), taken over here
            if entry is not None and entry is not cancelled and not entry.task.cancel():
                return entry
            self._forget_dots((*key, r))
            task: Future[np.ndarray] = Future()
            task.set_running_or_notify_cancel()
            entry = self._keep_dots((*key, r), _Dots(task, cancelled.rows))
        try:
            task.set_result(walk.dots(r, vv))
        except BaseException as e:  # raised where the result is asked for
            task.set_exception(e)
        return entry

    def _keep_dots(self, k: tuple[object, ...], entry: _Dots) -> _Dots:
        """Keep `entry` under `k` (the caller holds the lock), the oldest forgotten past
        _DOTS_ROWS rows."""
        self._dots[k] = entry
        self._dots_rows += entry.rows
        while self._dots_rows > _DOTS_ROWS and len(self._dots) > 1:
            self._forget_dots(next(iter(self._dots)))
        return entry

    def _forget_dots(self, k: tuple[object, ...]) -> None:
        entry = self._dots.pop(k, None)
        if entry is not None:
            entry.task.cancel()
            self._dots_rows -= entry.rows
