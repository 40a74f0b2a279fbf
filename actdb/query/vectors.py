"""Reading stored vectors for handles: chunk cache, views, weights, anchors, token lookup."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import norms
from ..errors import QueryError, TokenError
from ..lazy import lazy_module
from ..store.records import ModelRecord, SiteRecord
from ..store.store import Store
from . import handles as H
from .dots import tree_sum, unit_rows
from .threads import READAHEAD_CHUNKS

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from ..store.arrays import ArrayInfo
else:
    pa = lazy_module("pyarrow")  # 0.05 s to import: when Arrow data is first made or read
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

try:  # the compiled scan kernel (actdb/_native.c), built at install when a C compiler is there
    from .. import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None  # type: ignore[assignment]

INT_TYPES = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT",
             "UINTEGER", "UBIGINT", "UHUGEINT"}
ANCHOR_SETS = ("unembed", "embed", "unembed_folded")
# The names an anchor set may be given by: a classifier's head rows are its 'unembed' set.
ANCHOR_NAMES = (*ANCHOR_SETS, "classifier")
# Sites off the residual stream: their vectors never meet the LM head, so anchor and logit
# functions (and final_norm) are NULL there.
OFF_STREAM_ROLES = frozenset({"inner", "q_norm", "k_norm"})


# A scan reads whole runs of this many chunks (about 4 MiB) as one read-ahead task, and keeps
# this many runs read ahead of the one it computes on.
RUN_CHUNKS = 16
RUN_AHEAD = 2
# Runs whose products a walking scan has made ahead (VectorSource._project_runs): as many as
# the window it computes now, from RUN_AHEAD to this many. The read-ahead thread makes them
# while DuckDB and the UDFs' Python use up the window's rows; RUN_AHEAD alone left it idle
# through most of that: a 262,144-row scan made 54 of its 128 runs on the query's thread, 47
# with this (0.1235 -> 0.1152 s and 0.1225 -> 0.1165 s, alternating in one process). Growing
# with the window keeps a LIMIT query, which stops in its first small windows, from reading
# far past its rows.
DOTS_AHEAD = 8
_RUNS_PENDING = 8  # about 24 MiB of runs read ahead at most, whatever the query left behind
# rows whose products with a constant vector are kept (_project_runs): 4 MiB of float32
_DOTS_ROWS = 1 << 20
# float32 values converted at a time by `project`: 1 MiB, so the block stays in the core's
# cache between its conversion and its product
_SCRATCH_FLOATS = 1 << 18


def _consecutive(rows: np.ndarray) -> bool:
    """Whether sorted `rows` are consecutive integers, each once."""
    return len(rows) < 2 or (int(rows[-1]) - int(rows[0]) + 1 == len(rows)
                             and bool((rows[1:] != rows[:-1]).all()))


_ANCHOR_BLOCK = 8192  # rows of the vocabulary normalized at a time (float64 scratch)
# Rows of a weight a connection reads alone (a chunk each) before it reads the whole weight.
_ROWS_ALONE = 4
# Token strings a connection finds by a scan of the vocabulary before it builds a dict of it.
_STRINGS_ALONE = 16


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
        far faster than one thread reads (measured: the query's thread waited 40 of a full
        scan's 120 ms for the read-ahead thread). The read taken is replaced, under the
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

    def clear(self) -> None:
        """Forget every cached chunk and every read ahead (the counters stay)."""
        with self._lock:
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


class Group:
    """Handles of one (model, site, view): their positions in the batch, and their stored
    fields read on first use (a function that needs only the norm reads no direction)."""

    def __init__(self, src: VectorSource, index: np.ndarray, model: ModelRecord,
                 site: SiteRecord, view: str, rows: np.ndarray, heads: np.ndarray) -> None:
        self.src, self.index, self.model, self.site, self.view = src, index, model, site, view
        self.rows, self.heads = rows, heads
        self._cache: dict[str, torch.Tensor] = {}

    def _field(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            data = self.src.field(self.model, self.site, name, self.rows, self.heads)
            self._cache[name] = torch.from_numpy(data).to(self.src.device)
        return self._cache[name]

    @property
    def norm(self) -> torch.Tensor:
        """float32 [n]: ||x|| of the stored input (before any view)."""
        return self._field("norm")

    @property
    def mean(self) -> torch.Tensor:
        """float32 [n]: mean(x) of the stored input."""
        return self._field("mean")

    @property
    def direction(self) -> torch.Tensor:
        """float16 [n, d]: the stored unit direction of x."""
        return self._field("direction")

    def x_blocks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """`x` by blocks of consecutive rows: (start, end, float32 [end - start, d]). On the
        CPU each block is converted from the stored float16 in a scratch buffer that stays in
        the core's cache (VectorSource.x_blocks), so the float32 copy of a whole window never
        exists; a block is valid until the next one is asked for. Elsewhere, or when `x` is
        held already, one block of every row."""
        if "x" in self._cache or self.src.device.type != "cpu":
            yield 0, len(self.rows), self.x
            return
        yield from self.src.x_blocks(self)

    @property
    def x(self) -> torch.Tensor:
        """float32 [n, d]: the vector with the group's view applied."""
        if "x" not in self._cache:
            x = self.direction.float() * self.norm.unsqueeze(-1)
            if self.view != "raw":
                x = self.src.apply_view(self.model, self.site, self.view, x, self.mean,
                                        self.heads)
            self._cache["x"] = x
        return self._cache["x"]


class _Dots:
    """One run's products with one vector: the task making them, its rows, whether a query
    has counted its reads yet."""

    __slots__ = ("counted", "rows", "task")

    def __init__(self, task: Future[np.ndarray], rows: int) -> None:
        self.task, self.rows, self.counted = task, rows, False


class _RunWalk:
    """Consecutive rows of one field over many chunks, read by aligned runs of RUN_CHUNKS
    chunks: which runs, where each one's rows go, and their reads (ahead, and the run a window
    ends in, held for the next window, which starts in it)."""

    def __init__(self, src: VectorSource, model: ModelRecord, site: SiteRecord, name: str,
                 rows: np.ndarray, heads: np.ndarray, arr: ArrayInfo, walking: bool) -> None:
        self.src, self.site, self.heads = src, site, heads
        self.where = (model.model_id, site.site, name)
        c = arr.chunks[0]
        self.step = RUN_CHUNKS * c
        self.chunk_bytes = math.prod(arr.chunks) * arr.dtype.itemsize
        self.lo, self.hi = int(rows[0]), int(rows[-1]) + 1
        # The chunks of this run of committed rows: no later one is read (unused rows between
        # merged shards follow it; shards start on whole runs of chunks).
        self.n_chunks = -(-src.segment_end(model.model_id, self.hi - 1) // c)
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
        return partial(self.src.store.arrays.read_chunks, *self.where, r * RUN_CHUNKS,
                       self.count(r))

    def prefetch_after(self, r: int) -> None:
        for ahead in range(r + 1, min(r + 1 + RUN_AHEAD, self.stop)):
            self.src.cache.prefetch((*self.where, "run", ahead), self._load(ahead),
                                    limit=_RUNS_PENDING)

    def data(self, r: int) -> np.ndarray:
        """Run r's rows: the run held from the last window, or read (ahead or now)."""
        held = self.src._held.get(self.where)
        if held is not None and held[0] == r:
            return held[1]
        data = self.src.cache.get((*self.where, "run", r), self._load(r), keep=False,
                                  chunks=self.count(r))
        if r == self.runs[-1]:  # kept for the next window, which starts in it
            self.src._held[self.where] = (r, data)
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
        data = self._load(r)()
        out = np.empty(len(data), dtype=np.float32)
        _native.f16_dots(data, vv, out)
        return out


class VectorSource:
    """Everything tensor functions read from a store, cached, on one device."""

    def __init__(self, store: Store, device: torch.device | str, *,
                 cache_bytes: int = 256 << 20, key: bytes | None = None):
        """`key`: the handles' key (handles.py); None draws a new one."""
        self.store = store
        self._device = device
        # Object storage reads with several readers, each keeping its share of read-ahead.
        self.cache = ChunkCache(cache_bytes, readahead=READAHEAD_CHUNKS * store.readers,
                                readers=store.readers)
        self.models = {m.model_id: m for m in store.catalog.models()}
        self.sites: dict[tuple[int, int], SiteRecord] = {}
        for m in self.models.values():
            for s in store.catalog.sites(m.model):
                self.sites[(m.model_id, s.site_id)] = s
        self.codec = H.Codec((
            H.Stream(model_id=mid, site_id=sid, head=head, n_rows=self.models[mid].n_rows)
            for (mid, sid), s in self.sites.items()
            for head in (range(s.n_heads) if s.n_heads else (-1,))
        ), key=key)
        self._weights: dict[tuple[object, ...], torch.Tensor | None] = {}
        self._rows_alone: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # _rows_of
        self._shapes: dict[tuple[int, str], tuple[int, ...]] = {}  # weights' shapes
        self._vocab: dict[int, dict[str, list[int]]] = {}  # string -> ids, once many are asked
        self._strings_alone: dict[int, int] = {}
        self._vocab_column: dict[int, Any] = {}  # each model's tokens (read_vocabularies)
        self._lock = threading.RLock()  # anchors() builds on cached weights under the lock
        self._local = threading.local()
        self._last_chunk: dict[tuple[int, str, str], int] = {}
        self._held: dict[tuple[int, str, str], tuple[int, np.ndarray]] = {}
        # (model, site, field, v's bytes, run) -> the run's products with v (_project_runs)
        self._dots: OrderedDict[tuple[object, ...], _Dots] = OrderedDict()
        self._dots_rows = 0
        self._token_ids: dict[tuple[int, str, str], int] = {}
        self._tokenizers: dict[int, Any] = {}  # _tokenizer
        # Where each model's committed rows run without a break: a merged sharded ingest
        # leaves unused rows (maybe without chunks) between shards, never to be read ahead.
        self._segments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Read up front: UDFs run inside a query on the catalog connection and may not use it.
        for m in self.models.values():
            runs = store.catalog.con.execute(
                "SELECT row_start, row_start + n_tokens FROM prompt_runs WHERE model = ? "
                "AND n_tokens > 0 ORDER BY row_start", [m.model]).fetchall()
            self._segments[m.model_id] = _segments(runs)
        self._vocabularies_read = False

    def read_vocabularies(self) -> None:
        """Read each model's token strings as Arrow (a few ms for 50,257 strings; Python
        strings are made on first use). Called before the first query that calls a tensor
        function is bound (execute.Functions.register): UDFs run inside a query on the catalog
        connection and may not use it, and a query that calls none (`SELECT 1`) should import
        neither pyarrow nor read the vocabulary."""
        with self._lock:
            if self._vocabularies_read:
                return
            for m in self.models.values():
                self._vocab_column[m.model_id] = self.store.catalog.con.sql(
                    "SELECT token FROM vocab WHERE model = $1 ORDER BY token_id",
                    params=[m.model]).to_arrow_table().column(0)
            self._vocabularies_read = True

    def clear(self) -> None:
        """Forget every chunk read (the next query reads from the store again)."""
        self.cache.clear()
        self._held.clear()
        with self._lock:
            for k in list(self._dots):
                self._forget_dots(k)

    @property
    def device(self) -> torch.device:
        """The device, resolved on first use: the first tensor function imports torch."""
        if isinstance(self._device, str):
            from ..devices import resolve_device
            from ..lazy import load

            load(torch)
            self._device = resolve_device(self._device)
        return self._device

    def segment_end(self, model_id: int, row: int) -> int:
        """The end of the unbroken run of committed rows holding `row` (rows past it up to
        the next run's start are unused)."""
        starts, ends = self._segments.get(int(model_id), (np.zeros(0), np.zeros(0)))
        i = int(np.searchsorted(starts, row, side="right")) - 1
        return int(ends[i]) if i >= 0 and row < ends[i] else row + 1

    # -- identity --------------------------------------------------------------------------

    def model(self, model_id: int) -> ModelRecord:
        return self.models[int(model_id)]

    def site(self, model_id: int, site_id: int) -> SiteRecord:
        return self.sites[(int(model_id), int(site_id))]

    def final_site(self, model: ModelRecord) -> SiteRecord:
        final = next((s for (mid, _), s in self.sites.items()
                      if mid == model.model_id and s.site == model.final_site), None)
        if final is None:
            raise QueryError(f"model {model.model!r} has no final norm site, so no final_norm")
        return final

    # -- raw fields ------------------------------------------------------------------------

    def field(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
              heads: np.ndarray) -> np.ndarray:
        """Stored `name` (direction, norm or mean) for sorted token rows, by whole chunks."""
        parts = [p for _, _, p in self._pieces(model, site, name, rows, heads)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def project(self, g: Group, v: torch.Tensor, at: np.ndarray | None = None
                ) -> torch.Tensor:
        """float32 [n]: the group's stored unit directions dotted with `v` [d], each row
        reduced on its own in an order fixed by d (dots.py); `at` (ascending positions in
        the group): those rows alone, with the same values as in the whole group's product.

        On the CPU, each chunk's float16 piece goes through the compiled kernel
        (`actdb._native.f16_dots`): converted in registers and multiplied-added in one pass,
        with the GIL released so the read-ahead thread runs beside it (a full scan's product
        3x faster than torch's three passes). Without the compiled module, torch converts
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
            if isinstance(walk, _RunWalk) and not g.site.n_heads:
                self._project_runs(walk, vv, res)
                return out
            for a, b, part in self._read(walk, g.model, g.site, "direction", rows, heads):
                # float16 in this machine's byte order, contiguous (a per-head piece is)
                _native.f16_dots(np.ascontiguousarray(part, dtype=np.float16), vv, res[a:b])
            return out
        scratch = getattr(self._local, "scratch", None)
        step = max(1, _SCRATCH_FLOATS // d)
        if scratch is None or scratch.numel() < step * d:
            scratch = self._local.scratch = torch.empty(step * d, dtype=torch.float32)
        for a, b, part in self._pieces(g.model, g.site, "direction", rows, heads):
            piece = torch.from_numpy(part)
            for i in range(0, b - a, step):
                m = min(step, b - a - i)
                block = scratch[: m * d].view(m, d)
                # row_dots in the scratch: converting, then multiplying in place, takes 25%
                # less time than one mixed float16 * float32 multiply (measured)
                block.copy_(piece[i : i + m]).mul_(v)
                torch.sum(block, -1, out=out[a + i : a + i + m])
        return out

    def x_blocks(self, g: Group) -> Iterator[tuple[int, int, torch.Tensor]]:
        """`Group.x_blocks` on the CPU: each block of stored directions converted to float32
        in this thread's scratch buffer, times its norms, then the group's view applied. The
        same float32 operations as `Group.x`, row by row, in blocks of 1 MiB: a scan of
        `dim_contribution` converted and scaled 200 MB arrays a window before."""
        d = g.site.d
        step = max(1, _SCRATCH_FLOATS // d)
        scratch = getattr(self._local, "x_scratch", None)
        if scratch is None or scratch.numel() < step * d:
            scratch = self._local.x_scratch = torch.empty(step * d, dtype=torch.float32)
        norm = g.norm
        mean = g.mean if g.view != "raw" else None
        for a, b, part in self._pieces(g.model, g.site, "direction", g.rows, g.heads):
            piece = torch.from_numpy(part)
            for i in range(0, b - a, step):
                lo, m = a + i, min(step, b - a - i)
                x = scratch[: m * d].view(m, d)
                x.copy_(piece[i : i + m])
                x.mul_(norm[lo : lo + m].unsqueeze(-1))
                if mean is not None:
                    x = self.apply_view(g.model, g.site, g.view, x, mean[lo : lo + m],
                                        g.heads[lo : lo + m])
                yield lo, lo + m, x

    def _pieces(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
                heads: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        """(start, end, values) for the sorted `rows` held by each chunk in turn."""
        return self._read(self._walk(model, site, name, rows, heads), model, site, name, rows,
                          heads)

    def _read(self, walk: _RunWalk | tuple[int, int, int, bool], model: ModelRecord,
              site: SiteRecord, name: str, rows: np.ndarray, heads: np.ndarray
              ) -> Iterator[tuple[int, int, np.ndarray]]:
        """`_pieces` the way `walk` says."""
        if isinstance(walk, _RunWalk):
            return self._runs(walk)
        return self._chunks(model, site, name, rows, heads, *walk)

    def _chunks(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
                heads: np.ndarray, c: int, first: int, last: int, walking: bool
                ) -> Iterator[tuple[int, int, np.ndarray]]:
        """`_pieces` chunk by chunk (each chunk kept in the cache)."""
        where = (model.model_id, site.site, name)
        bounds = np.searchsorted(rows, np.arange(first, last + 2) * c)
        # The chunks to read, in order: those holding asked-for rows (every one is read anyway,
        # so reading them ahead costs no byte more), then, when the query walks the array,
        # the chunks that follow; the read-ahead thread stays `readahead` chunks ahead.
        needed = (np.nonzero(bounds[1:] > bounds[:-1])[0] + first).tolist()
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

    def _walk(self, model: ModelRecord, site: SiteRecord, name: str, rows: np.ndarray,
              heads: np.ndarray) -> _RunWalk | tuple[int, int, int, bool]:
        """How `_pieces` reads the sorted `rows`: by runs of chunks, or chunk by chunk (the
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
            return _RunWalk(self, model, site, name, rows, heads, arr, walking)
        return c, first, last, walking

    def _runs(self, walk: _RunWalk) -> Iterator[tuple[int, int, np.ndarray]]:
        """`_pieces` for consecutive rows over many chunks (a bulk window, a scan): read by
        runs of RUN_CHUNKS chunks (aligned, so the next window finds the run it shares with
        this one), each run one task of the read-ahead thread and one piece here, while the
        thread reads the next runs. Per-chunk Python work, on both threads, was most of a
        full scan's time; the GIL they share made a per-chunk read-ahead slower than none.
        Runs are not kept in the chunk cache (counted, not kept): the query is past them."""
        for r in walk.runs:
            walk.prefetch_after(r)
            yield walk.piece(r, walk.data(r))

    def _project_runs(self, walk: _RunWalk, vv: np.ndarray, res: np.ndarray) -> None:
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

    def _dots_ahead(self, walk: _RunWalk, r: int, key: tuple[object, ...], vv: np.ndarray
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

    def _dots_here(self, walk: _RunWalk, r: int, key: tuple[object, ...], vv: np.ndarray,
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

    def gather(self, handles: np.ndarray, device: torch.device | str, what: str
               ) -> torch.Tensor:
        """float32 [n, d] on `device`: the vectors of `handles` (no NULLs), views applied, in
        their order; [0, 0] for none. `what` names the rows in errors. A QueryError when they
        have different widths, or when a row's vector is NULL (`final_norm` of a vector off
        the residual stream): never a row left unfilled."""
        out: torch.Tensor | None = None
        filled = 0
        for g in self.groups(handles):
            if out is None:
                out = torch.empty((len(handles), g.x.shape[-1]), dtype=g.x.dtype, device=device)
            if g.x.shape[-1] != out.shape[-1]:
                raise QueryError(f"{what} have different widths ({out.shape[-1]} and "
                                 f"{g.x.shape[-1]}); select one site width at a time")
            out[torch.from_numpy(g.index).to(out.device)] = g.x.to(out.device)
            filled += len(g.index)
        if filled != len(handles):
            raise QueryError(
                f"{what} include final_norm(vec) of {len(handles) - filled} rows at q_norm, "
                "k_norm or inner sites, which is NULL (those vectors never meet the final "
                "norm); filter them out, e.g. WHERE role NOT IN ('q_norm', 'k_norm', 'inner')")
        return out if out is not None else torch.empty((0, 0), device=device)

    def groups(self, handles: np.ndarray) -> Iterator[Group]:
        """Split a batch of opened handles (their fields words: handles.Codec.open) by
        (model, site, view); fields are read when first used."""
        dec = self.codec.decode(handles)
        if dec.one:  # one (model, site, view): most calls, every bulk window
            key = dec.model_id[:1]
            keys = key
        else:
            key = (dec.model_id << 24) | (dec.site_id << H.VIEW_BITS) | dec.view
            keys = key[:1] if len(key) and key.min() == key.max() else np.unique(key)
        for k in keys:
            index = np.nonzero(key == k)[0] if len(keys) > 1 else np.arange(len(dec.row))
            model = self.model(int(dec.model_id[index[0]]))
            site = self.site(model.model_id, int(dec.site_id[index[0]]))
            view = H.VIEWS[int(dec.view[index[0]])]
            if view == "final_norm" and site.role in OFF_STREAM_ROLES:
                continue  # final_norm(v) is NULL where v never meets the final norm
            whole = len(keys) == 1  # index is every position: no copies
            rows = dec.row if whole else dec.row[index]
            heads = dec.head if whole else dec.head[index]
            if np.any(rows[1:] < rows[:-1]):  # chunk-friendly reading order
                order = np.argsort(rows, kind="stable")
                index, rows, heads = index[order], rows[order], heads[order]
            yield Group(self, index, model, site, view, rows, heads)

    def issue(self, fields: np.ndarray) -> pa.Array:
        """Raw handles of the view `acts`' rows (their fields words, handles.py), each of a
        stored row (`check_stored`): the one function making raw handles makes none the
        store would not."""
        self.check_stored(fields)
        return self.codec.seal(fields)

    def check_stored(self, fields: np.ndarray) -> None:
        """Refuse fields words (int64) that do not name a raw vector of a stored row: the
        view `acts` passes them to `issue` and to its norm and mean columns, which read no
        handle. Per call, not per row, where one stream's rows lie within one unbroken run of
        committed rows (every call of an unsharded store)."""
        if not len(fields):
            return
        top = fields >> H.STREAM_SHIFT  # stream, view and tag
        first = int(top[0])
        streams = [first] if (top == first).all() else np.unique(top).tolist()
        for bits in streams:
            stream = bits & H.STREAM_MASK
            if bits != (H.TAG >> H.STREAM_SHIFT) | stream or stream >= len(self.codec.streams):
                raise QueryError(f"{bits << H.STREAM_SHIFT} names no raw vector of a stream "
                                 "of the store")
            rows = (fields if len(streams) == 1 else fields[top == bits]) & H.ROW_MASK
            self._check_stored(self.codec.streams[stream].model_id, rows)

    def _check_stored(self, model_id: int, rows: np.ndarray) -> None:
        """Refuse a row that holds no stored token. Per call, not per row, where the rows lie
        within one unbroken run of committed rows (every call of an unsharded store)."""
        starts, ends = self._segments[model_id]
        lo, hi = int(rows.min()), int(rows.max())
        i = int(np.searchsorted(starts, lo, side="right")) - 1
        if lo >= 0 and i >= 0 and hi < ends[i]:
            return
        seg = np.searchsorted(starts, rows, side="right") - 1
        stored = (rows >= 0) & (seg >= 0) & (rows < ends[np.maximum(seg, 0)]) if len(
            starts) else np.zeros(len(rows), dtype=bool)
        if not stored.all():
            raise H.unused_row(int(rows[int(np.argmin(stored))]))

    def apply_view(self, model: ModelRecord, site: SiteRecord, view: str, x: torch.Tensor,
                   mean: torch.Tensor | None, heads: np.ndarray | None = None) -> torch.Tensor:
        """A view of raw vectors x; `mean` is their stored mean (None: computed from x)."""
        if view == "normalized":
            return norms.normalize(self.centered(site), x, site.eps, mean)
        if view == "normed":
            return self.site_output(model, site, x, mean, heads)
        final = self.final_site(model)
        if final.d != x.shape[-1]:
            raise QueryError(
                f"final_norm needs width {final.d}, but site {site.site!r} has width {x.shape[-1]}"
            )
        return self.site_output(model, final, x, mean if final.site_id == site.site_id else None)

    def site_output(self, model: ModelRecord, site: SiteRecord, x: torch.Tensor,
                    mean: torch.Tensor | None, heads: np.ndarray | None = None) -> torch.Tensor:
        """y = gain * z + bias with the site's effective gain and bias; a per-head site whose
        heads are separate modules has one gain row per head, picked by `heads`."""
        gain = self.gain(model, site)
        bias = self.param(model, site, "bias")
        if heads is not None:
            at = torch.from_numpy(np.array(heads, dtype=np.int64)).to(self.device)  # writable
            gain = gain[at] if gain is not None and gain.dim() == 2 else gain
            bias = bias[at] if bias is not None and bias.dim() == 2 else bias
        return norms.apply(self.centered(site), x, gain=gain, bias=bias, eps=site.eps,
                           mean=mean)

    @staticmethod
    def centered(site: SiteRecord) -> bool:
        """Whether the site centres; version-1 stores say it by kind."""
        return site.centered if site.centered is not None else norms.legacy_centered(site.kind)

    def gain(self, model: ModelRecord, site: SiteRecord) -> torch.Tensor | None:
        """The effective gain (version-1 stores kept Gemma's raw weight: add its 1 back)."""
        g = self.param(model, site, "gain")
        return g if site.centered is not None else norms.legacy_gain(site.kind, g)

    # -- weights and anchors ---------------------------------------------------------------

    def _cached(self, key: tuple[object, ...], make: Callable[[], torch.Tensor | None]
                ) -> torch.Tensor | None:
        with self._lock:
            if key not in self._weights:
                self._weights[key] = make()
            return self._weights[key]

    def _weight(self, model_id: int, name: str, *, required: bool = True
                ) -> torch.Tensor | None:
        """A weight; absent only where the catalog says the model has none (`required`
        False), since a weight deleted from a store must be an error, not a default."""
        def make() -> torch.Tensor | None:
            w = self.store.arrays.weight(model_id, name, required=required)
            return None if w is None else torch.from_numpy(w).to(self.device)
        return self._cached(("w", model_id, name), make)

    def param(self, model: ModelRecord, site: SiteRecord, name: str) -> torch.Tensor | None:
        has = site.has_gain if name == "gain" else site.has_bias
        return self._weight(model.model_id, f"sites/{site.site}/{name}", required=has)

    def _head(self, model: ModelRecord) -> str:
        """The name of the weight that is the model's LM head (W_U), which it must have."""
        if not model.has_lm_head:
            raise QueryError(f"model {model.model!r} has no LM head, so no logits")
        return "embed" if model.tied_embeddings else "lm_head"

    def unembed(self, model: ModelRecord) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_U [V, d] and b_U [V] (or None)."""
        w = self._weight(model.model_id, self._head(model))
        assert w is not None
        return w, self._weight(model.model_id, "lm_head_bias", required=model.has_lm_head_bias)

    def unembed_width(self, model: ModelRecord) -> int:
        """The LM head's width, from its array's metadata (no weights read)."""
        return int(self._weight_shape(model.model_id, self._head(model))[1])

    def unembed_row(self, model: ModelRecord, tid: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row `tid` of W_U [d] and of b_U (a 0-d tensor, or None): the rows of `unembed`,
        read alone while few have been (one chunk of the weights each), else from it."""
        w = self._rows_of(model, self._head(model), tid)
        b = self._rows_of(model, "lm_head_bias", tid) if model.has_lm_head_bias else None
        return w, b

    def _weight_shape(self, model_id: int, name: str) -> tuple[int, ...]:
        """A weight's shape, from its array's metadata, read once (opening the array costs
        1.5 ms, and a scan asks once per call)."""
        with self._lock:
            if (model_id, name) not in self._shapes:
                info = self.store.arrays.info(f"models/{model_id}/{name}", required=True)
                assert info is not None
                self._shapes[(model_id, name)] = info.shape
            return self._shapes[(model_id, name)]

    def _rows_of(self, model: ModelRecord, name: str, tid: int) -> torch.Tensor:
        """Row `tid` of weight `name`: from the cached whole; else, for the first
        `_ROWS_ALONE` rows a query asks of it, read alone (and kept); past that, the whole
        weight is read once (a column of many tokens must not read a chunk per token)."""
        mid = model.model_id
        rows = self._weight_shape(mid, name)[0]
        if not 0 <= tid < rows:
            raise QueryError(f"token id {tid} has no row in the {name} weights of model "
                             f"{model.model!r} ({rows} rows)")
        with self._lock:
            whole = self._weights.get(("w", mid, name))
            kept = self._rows_alone.setdefault((mid, name), {})
            if whole is None and tid not in kept and len(kept) >= _ROWS_ALONE:
                whole = self._weight(mid, name)
            if whole is not None:
                return whole[tid]
            if tid not in kept:
                got = self.store.arrays.weight_rows(mid, name, [tid])
                kept[tid] = torch.from_numpy(got).to(self.device)[0]
            return kept[tid]

    def anchor_set(self, model: ModelRecord, anchor_set: str | None) -> str:
        """The anchor set's name (None: the model's default), checked: a known set, and
        an LM head where the set is made of it."""
        name = anchor_set or ("unembed" if model.has_lm_head else "embed")
        if name not in ANCHOR_NAMES:
            raise QueryError(f"unknown anchor set {name!r}; anchor sets are {list(ANCHOR_NAMES)}")
        # A classification head is stored where an LM head is, its labels as the vocabulary:
        # 'classifier' names its rows, and only a classifier's store has them.
        classifier = model.head_kind == "classifier"
        if name == "classifier" and not classifier:
            raise QueryError(f"model {model.model!r} has no classification head: anchor set "
                             "'classifier' is for image classifiers")
        if name == "classifier":
            name = "unembed"
        if name == "embed" and model.has_embed is False:
            raise QueryError(f"model {model.model!r} has no token embedding (it reads images): "
                             "anchor set 'embed' does not exist for it")
        if name != "embed":
            self._head(model)  # the set is made of the LM head: the model must have one
        if name == "unembed_folded":
            self.final_site(model)  # the fold needs it: its absence is said here
        return name

    def anchor_width(self, model: ModelRecord, anchor_set: str | None) -> int:
        """The width of an anchor set's vectors, from its weight's metadata (no weights read):
        the embedding's for 'embed', the LM head's otherwise. Models with factorized
        embeddings (ALBERT) have anchors narrower than d_model."""
        name = self.anchor_set(model, anchor_set)
        weight = "embed" if name == "embed" else self._head(model)
        return int(self._weight_shape(model.model_id, weight)[1])

    def _unit_anchors(self, model: ModelRecord, name: str, w: torch.Tensor) -> torch.Tensor:
        """Rows of `name`'s weight (`w`, [n, d]) -> their unit anchors, each row computed on
        its own (unit_rows): a row made alone equals its row of the whole set bit for bit."""
        if name == "unembed_folded":
            final = self.final_site(model)
            g = self.gain(model, final)
            w64 = w.double() * g.double() if g is not None else w.double()
            if self.centered(final):
                w64 = w64 - (tree_sum(w64) / w64.shape[-1]).unsqueeze(-1)
            return unit_rows(w64)
        return unit_rows(w)

    def anchors(self, model: ModelRecord, anchor_set: str | None) -> torch.Tensor:
        """Unit anchor directions [V, d] (zero rows stay zero)."""
        name = self.anchor_set(model, anchor_set)

        def make() -> torch.Tensor:
            if name == "embed":
                w = self._weight(model.model_id, "embed")
                assert w is not None
            else:
                w, _ = self.unembed(model)
            out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
            for lo in range(0, w.shape[0], _ANCHOR_BLOCK):  # float64 scratch a block at a time
                out[lo : lo + _ANCHOR_BLOCK] = self._unit_anchors(
                    model, name, w[lo : lo + _ANCHOR_BLOCK])
            return out

        out = self._cached(("anchors", model.model_id, name), make)
        assert out is not None
        return out

    def anchor(self, model: ModelRecord, anchor_set: str | None, tid: int) -> torch.Tensor:
        """Unit anchor `tid` [d]: row `tid` of `anchors`, bit for bit, made alone from one
        row of the weights while the whole set is not made and few rows have been read alone
        (a fresh process's `cosine_to_anchor(vec, ' Paris')` reads one chunk of the
        vocabulary, not all of it); else from the whole set, made once."""
        name = self.anchor_set(model, anchor_set)
        weight = "embed" if name == "embed" else self._head(model)
        with self._lock:
            whole = self._weights.get(("anchors", model.model_id, name))
            alone = (whole is None and len(self._rows_alone.get((model.model_id, weight), {}))
                     < _ROWS_ALONE)
        if not alone:
            return (whole if whole is not None else self.anchors(model, name))[tid]
        key = ("anchor", model.model_id, name, tid)
        with self._lock:
            made = self._weights.get(key)
        if made is None:  # made once: a scan asks for the same anchor in every call
            w = self._rows_of(model, weight, tid)
            made = self._cached(key, lambda: self._unit_anchors(model, name, w.unsqueeze(0))[0])
        assert made is not None
        return made

    # -- tokens ----------------------------------------------------------------------------

    def token_column(self, model: ModelRecord) -> pa.Array:
        """Each token id's string as one Arrow array (NULL where the vocabulary has none)."""
        if not self._vocabularies_read:  # a caller outside any query (a query reads them first)
            self.read_vocabularies()
        column = self._vocab_column[model.model_id]
        if not isinstance(column, pa.Array):
            with self._lock:
                column = self._vocab_column[model.model_id]
                if not isinstance(column, pa.Array):
                    column = column.combine_chunks()
                    if not len(column):
                        column = pa.array([], pa.string())
                    self._vocab_column[model.model_id] = column
        return column

    def resolve_token(self, model: ModelRecord, value: str, sqltype: str) -> int:
        """A token argument (a string that is one token, or a token id) -> token id."""
        key = (model.model_id, value, sqltype)
        if key not in self._token_ids:
            self._token_ids[key] = self._resolve_token(model, value, sqltype)
        return self._token_ids[key]

    def _resolve_token(self, model: ModelRecord, value: str, sqltype: str) -> int:
        column = self.token_column(model)
        size = len(column)
        if sqltype.upper() in INT_TYPES:
            tid = int(value)
            if not 0 <= tid < size:
                raise QueryError(
                    f"token id {tid} is out of range for model {model.model!r} "
                    f"(vocabulary of {size})"
                )
            return tid
        if sqltype.upper() != "VARCHAR":  # a list, a boolean, a struct: no token, said so
            raise TokenError(f"a token is a string or a token id, not a value of type "
                             f"{sqltype} ({value!r})")
        ids = self._ids_of_string(model, column, value)
        encoded = self._encode(model, value) if len(ids) != 1 else None
        if len(ids) > 1 and encoded and len(encoded) == 1 and encoded[0] in ids:
            return encoded[0]
        if len(ids) == 1:
            return ids[0]
        if ids:  # several tokens decode to this text and the tokenizer picks none of them
            shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
            raise TokenError(
                f"{value!r} is the text of {len(ids)} tokens of model {model.model!r} (ids "
                f"{shown}): pass the token id instead")
        how = ": the empty string is no token" if value == "" else ""
        unknown = getattr(self._tokenizer(model), "unk_token_id", None) if encoded else None
        if encoded and len(encoded) == 1 and encoded[0] == unknown:
            how = ": its tokenizer does not know it (it reads it as its unknown token)"
        elif encoded and len(encoded) == 1:  # a tokenizer that normalizes (BERT's lowercasing)
            piece = column[encoded[0]].as_py() if encoded[0] < size else None
            how = (f": no token's text is {value!r}; the tokenizer reads it as the one token "
                   f"{piece!r} (id {encoded[0]}): pass {piece!r} or {encoded[0]}")
        elif encoded:
            pieces = [column[i].as_py() if i < size else str(i) for i in encoded]
            how = f": it tokenizes as {pieces} ({len(encoded)} tokens)"
        from .display import shown_whitespace, unshown

        if shown_whitespace(value):  # copied from the table output, where a space shows as ␣
            how += (f" (in the table output {', '.join(shown_whitespace(value))}; write "
                    f"{unshown(value)!r})")
        raise TokenError(f"{value!r} is not one token of model {model.model!r}{how}")

    def _ids_of_string(self, model: ModelRecord, column: pa.Array, value: str) -> list[int]:
        """The ids whose string is `value`, in id order. The first few strings a connection
        resolves take one Arrow comparison each (a dict of all 50,257 strings of GPT-2 cost
        0.2 s of a fresh process's first query); past `_STRINGS_ALONE`, as for a column of
        many token strings, the dict is built once and used."""
        with self._lock:
            index = self._vocab.get(model.model_id)
            if index is None and self._strings_alone.get(model.model_id, 0) >= _STRINGS_ALONE:
                index = {}
                for i, text in enumerate(column.to_pylist()):
                    if text is not None:
                        index.setdefault(text, []).append(i)
                self._vocab[model.model_id] = index
            if index is not None:
                return index.get(value, [])
            self._strings_alone[model.model_id] = self._strings_alone.get(model.model_id, 0) + 1
        import pyarrow.compute as pc

        same = pc.fill_null(pc.equal(column, pa.scalar(value, pa.string())), False)
        return [int(i) for i in pc.indices_nonzero(same).to_pylist()]

    def _tokenizer(self, model: ModelRecord) -> Any:
        """The model's stored tokenizer (None when the store has none), loaded once."""
        if model.model_id not in self._tokenizers:
            folder = self.store.tokenizer_dir(model.model_id)
            tok = None
            if folder.is_dir():
                from transformers import AutoTokenizer

                try:  # a store's folder may come from anyone: its code never runs
                    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
                except ValueError as e:
                    if "trust_remote_code" not in str(e):
                        raise
                    # one that only its own code loads: tokens resolve by the vocab table
                    # alone, as in a store without a tokenizer
            self._tokenizers[model.model_id] = tok
        return self._tokenizers[model.model_id]

    def _encode(self, model: ModelRecord, text: str) -> list[int] | None:
        tok = self._tokenizer(model)
        return None if tok is None else list(tok(text, add_special_tokens=False)["input_ids"])


def _segments(runs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (start, end) runs of rows joined where one ends as the next starts."""
    starts: list[int] = []
    ends: list[int] = []
    for a, b in runs:
        if ends and a == ends[-1]:
            ends[-1] = b
        else:
            starts.append(a)
            ends.append(b)
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
