"""Bulk evaluation: a tensor function computed over whole windows of a stream's rows at once.

DuckDB hands a Python UDF at most 2,048 rows a call. When a query walks a stream (one model,
site, head and view) in row order, as a scan does, the rows it will ask for next are the rows
that follow: this evaluator then computes the function over a window of the rows ahead in one
kernel call (one read of whole chunks, one matrix product, read-ahead overlapping the compute),
keeps the results, and answers the next calls from them. The window doubles while the walk goes
on (up to `max_rows`), so speculation never costs more than the work the query has already
asked for, and a LIMIT stops it early. Rows asked for out of order, sparsely, or with arguments
that vary from row to row are computed exactly as asked (the selective-query path), and so are
all rows of a function whose every row is a product with a whole vocabulary (`ahead=False`):
see docs/ENGINE.md.

A function's value depends only on the stored vector and its arguments, and stored rows never
change, so a result computed ahead is the result the query would have got.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..lazy import lazy_module
from . import handles as H
from .lists import ListResults
from .timeout import check
from .vectors import VectorSource

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    pc = lazy_module("pyarrow.compute")  # imported when a tensor function first runs

Kernel = Callable[..., None]
# the argument columns other than the vectors -> the kernel's arguments (kernels.Arg)
Convert = Callable[[list["pa.Array"]], list[Any]]
# (those columns, one row each, m) -> the kernel's arguments for m rows of those values
Broadcast = Callable[[list["pa.Array"], int], list[Any]]


# The kernel arguments of constants kept (BulkEvaluator._constants): a few sizes of call.
_CONSTANTS_KEPT = 8


@dataclass(kw_only=True)
class _Window:
    lo: int  # first row
    values: Any  # float64 [n] (NaN = NULL) or an Arrow array of n list results

    def __len__(self) -> int:
        return len(self.values)


@dataclass(kw_only=True)
class _Walk:
    """Where the last rows a query asked of one stream ended, and the last window's size."""

    end: int
    size: int


class BulkEvaluator:
    """One tensor function with exactly one vec argument, evaluated for a DuckDB session."""

    def __init__(self, src: VectorSource, kernel: Kernel, *, scalar: bool, vec_at: int,
                 convert: Convert, broadcast: Broadcast, list_type: pa.DataType | None,
                 max_rows: int, cache_rows: int, ahead: bool = True) -> None:
        """`ahead`: whether rows may be computed ahead of the calls that ask for them (False
        for a function whose every row is a product with a whole vocabulary: a window's rows
        past the query's last, up to as many as the query asked for, would cost as much)."""
        self.src, self.kernel, self.scalar, self.list_type = src, kernel, scalar, list_type
        self.vec_at, self.convert, self.broadcast = vec_at, convert, broadcast
        self.max_rows, self.cache_rows, self.ahead = max_rows, cache_rows, ahead
        self._windows: OrderedDict[tuple[Any, ...], _Window] = OrderedDict()
        self._walks: dict[tuple[Any, ...], _Walk] = {}
        self._cached = 0
        self._args: OrderedDict[tuple[Any, ...], list[Any]] = OrderedDict()  # _constants
        self._lock = threading.Lock()  # DuckDB may call a UDF from several threads
        self.rows_bulk = 0  # rows answered from windows
        self.rows_exact = 0  # rows computed as asked

    def evaluate(self, arrays: tuple[Any, ...]) -> Any:
        """Results for one call's rows (no NULLs among them): float64 [n] or ListResults.
        The vec argument comes opened (handles.Codec.open: int64 fields words), the others
        as Arrow arrays."""
        handles = arrays[self.vec_at]
        rest = [a for i, a in enumerate(arrays) if i != self.vec_at]
        n = len(handles)
        key = _constant_key(rest) if self.ahead else None
        if key is None or n == 0:
            return self._exact(handles, rest)
        with self._lock:
            return self._evaluate(handles, rest, key)

    def _evaluate(self, handles: np.ndarray, rest: list[pa.Array], key: tuple[Any, ...]) -> Any:
        n = len(handles)
        # the stream and view bits (one walk each) of each handle: most calls have one stream
        # (a scan's), and then the handles' rows run between the smallest and largest
        order, bits, bounds = H.by_stream(handles)  # order None: one stream
        if order is None:
            parts: list[tuple[int, np.ndarray | None, tuple[int, int], int]] = [
                (bits[0], None, (int(handles.min()), int(handles.max())), n)]
        else:
            # the smallest and largest handle of each stream from one reduction over the
            # handles in stream order
            by_stream = handles[order]
            lows = np.minimum.reduceat(by_stream, bounds[:-1]).tolist()
            highs = np.maximum.reduceat(by_stream, bounds[:-1]).tolist()
            parts = [(top, order[a:b], (lo, hi), b - a) for top, lo, hi, a, b in zip(
                bits, lows, highs, bounds[:-1], bounds[1:], strict=True)]
        windows = [self._window(stream, count, lo_hi, key, rest)
                   for stream, _, lo_hi, count in parts]
        # the arguments are constants (`key`): rows computed as asked get them broadcast from
        # one row, as a window's are, not taken row by row and dictionary-encoded back to
        # their one value
        if all(w is None for w in windows):  # a selective query: every row as asked
            if order is None:
                return self._exact(handles, rest, key)
            # by stream, each stream's rows in the call's order: the kernel's split by
            # (model, site, view) then sorts sorted words
            sub = self._exact(by_stream, rest, key)
            out: Any = np.empty(n) if self.scalar else ListResults(n)  # every row set
            if self.scalar:
                out[order] = sub
            else:
                out.put(order, sub.arrow(self.list_type))
            return out
        out = None if order is None and self.scalar else (
            np.full(n, np.nan) if self.scalar else ListResults(n))
        exact: list[np.ndarray] = []
        for (_, at, lo_hi, count), window in zip(parts, windows, strict=True):
            if window is None:
                exact.append(np.arange(n) if at is None else at)
                continue
            h = handles if at is None else handles[at]
            # each row less the stream bits and the window's first row (one subtraction)
            local = h - ((lo_hi[0] - (lo_hi[0] & H.ROW_MASK)) + window.lo)
            if self.scalar:
                if at is None:
                    out = window.values[local]
                else:
                    out[at] = window.values[local]
            else:
                out.put(np.arange(n) if at is None else at, window.values.take(pa.array(local)))
            self.rows_bulk += count
        if exact:
            at = np.concatenate(exact) if len(exact) > 1 else exact[0]
            sub = self._exact(handles[at], rest, key)
            if self.scalar:
                out[at] = sub
            else:
                out.put(at, sub.arrow(self.list_type))
        return out

    def _window(self, stream: int, count: int, ends: tuple[int, int], key: tuple[Any, ...],
                rest: list[pa.Array]) -> _Window | None:
        """The cached window holding a call's `count` handles of one stream (`ends`: the
        smallest and largest), computing the next one when the query walks the stream; None:
        compute these rows exactly."""
        lo, hi = ends[0] & H.ROW_MASK, (ends[1] & H.ROW_MASK) + 1
        wkey = (key, stream)
        window = self._windows.get(wkey)
        walk = self._walks.get(wkey)
        if window is not None and window.lo <= lo and hi <= window.lo + len(window):
            self._windows.move_to_end(wkey)
            if walk is not None:
                walk.end = hi
            return window
        dense = hi - lo <= 2 * count
        # A walk goes on where the last call of this stream ended (a gap of at most this call's
        # span: a filter that keeps most rows); anything else starts a walk afresh.
        walking = walk is not None and walk.end <= lo <= walk.end + (hi - lo)
        if not (dense and walking):
            self._walks[wkey] = _Walk(end=hi, size=hi - lo)
            return None
        assert walk is not None
        size = min(max(2 * walk.size, hi - lo), self.max_rows)
        # Never past the committed rows' unbroken run (a merged sharded ingest leaves unused
        # rows between shards, whose chunks may not exist); a call whose rows straddle such
        # a gap is computed as asked.
        segment_end = self.src.stream_end(stream, lo)
        if hi > segment_end:
            self._walks[wkey] = _Walk(end=hi, size=hi - lo)
            return None
        end = min(segment_end, max(hi, lo + size))
        window = self._compute(stream, lo, end, rest, key)
        self._walks[wkey] = _Walk(end=hi, size=end - lo)
        self._remember(wkey, window)
        return window

    def _compute(self, stream: int, lo: int, hi: int, rest: list[pa.Array],
                 key: tuple[Any, ...]) -> _Window:
        check()  # a window is the longest step of one call: a query past its limit stops here
        m = hi - lo
        handles = (np.int64(stream) << H.STREAM_SHIFT) | np.arange(lo, hi, dtype=np.int64)
        out: Any = np.full(m, np.nan) if self.scalar else ListResults(m)
        self.kernel(self.src, handles, out, *self._constants(rest, key, m))
        return _Window(lo=lo, values=out if self.scalar else out.arrow(self.list_type))

    def _remember(self, wkey: tuple[Any, ...], window: _Window) -> None:
        old = self._windows.pop(wkey, None)
        self._cached -= len(old) if old is not None else 0
        self._windows[wkey] = window
        self._cached += len(window)
        while self._cached > self.cache_rows and len(self._windows) > 1:
            _, gone = self._windows.popitem(last=False)
            self._cached -= len(gone)

    def _exact(self, handles: np.ndarray, rest: list[pa.Array],
               key: tuple[Any, ...] | None = None) -> Any:
        """The kernel over exactly these rows (`key`: each column of `rest` holds one value,
        for all of them: _constant_key's)."""
        self.rows_exact += len(handles)
        out: Any = np.full(len(handles), np.nan) if self.scalar else ListResults(len(handles))
        args = self.convert(rest) if key is None else self._constants(rest, key, len(handles))
        vecs: list[Any] = [handles]
        self.kernel(self.src, *vecs, out, *args)
        return out

    def _constants(self, rest: list[pa.Array], key: tuple[Any, ...], m: int) -> list[Any]:
        """The kernel's arguments for `m` rows of the constants in the columns of `rest`
        (`key`: their values), broadcast from one row, made once for each (key, m) among the
        last few asked for (a selective query's calls are mostly of one size). Kernels only
        read their arguments."""
        args = self._args.get((key, m))
        if args is None:
            args = self.broadcast([a.slice(0, 1) for a in rest], m)
            if len(self._args) >= _CONSTANTS_KEPT:
                self._args.popitem(last=False)
            self._args[(key, m)] = args
        return args


def _constant_key(arrays: list[pa.Array]) -> tuple[Any, ...] | None:
    """The one value of each argument column (with its type), or None if any column varies
    (or holds a type whose values cannot be compared here: then the rows go the exact way)."""
    key: list[Any] = []
    for a in arrays:
        if len(a) == 0:
            return None
        first = a[0]
        try:
            if len(a) > 1 and not _all_equal(a, first):
                return None
            key.append((str(a.type), repr(first.as_py())))
        except (pa.ArrowException, TypeError, ValueError):
            return None
    return tuple(key)


_OFFSETS: dict[tuple[int, int], bytes] = {}  # (rows, width) -> offsets of equal-width values


def _all_equal(a: pa.Array | pa.ChunkedArray, first: pa.Scalar) -> bool:
    """Whether every value of `a` equals `first` (its first value), as `pc.equal` compares.
    A string column with no NULLs (the constants a macro passes: 2 to 3 columns a UDF call)
    is compared as bytes, its offsets against those of equal widths, cheaper than `pc.equal`
    and `pc.all`. Anything else goes through pyarrow.compute."""
    arr = a.chunk(0) if isinstance(a, pa.ChunkedArray) and a.num_chunks == 1 else a
    if (isinstance(arr, pa.Array) and arr.null_count == 0 and arr.offset == 0
            and (pa.types.is_string(arr.type) or pa.types.is_binary(arr.type))):
        # int32 offsets, then the values' bytes
        n = len(arr)
        offsets, data = arr.buffers()[1:3]
        got = offsets.to_pybytes()[: 4 * (n + 1)]
        width = int.from_bytes(got[4:8], "little", signed=True)
        expected = _OFFSETS.get((n, width))
        if expected is None:
            if len(_OFFSETS) > 256:
                _OFFSETS.clear()
            expected = _OFFSETS[(n, width)] = (np.arange(n + 1, dtype="<i4") * width).tobytes()
        if got != expected:
            return False
        if data is None:
            return width == 0
        raw = data.to_pybytes()
        return raw[: n * width] == raw[:width] * n
    return bool(pc.all(pc.equal(a, first)).as_py())
