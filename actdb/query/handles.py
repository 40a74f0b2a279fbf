"""`vec` handles: a 128-bit integer that names a stored vector and proves that this connection
made it.

A handle is a positive 128-bit integer, a DECIMAL(38, 0) in SQL (docs/FORMAT.md, "Handles"):
    high 64 bits, the fields word:
        0-37   row: the token row in the stream's arrays (store/limits.py: ROW_BITS)
        38-57  stream: an index into the connection's table of streams (store/limits.py:
               STREAM_BITS); today a (model, site, head) of `acts`, numbered in (model_id,
               site_id, head) order; a new kind of vector (weights as vectors) is new streams
        58-60  view: raw, normalized, normed, final_norm (room for four more)
        61     1, and 62-63 0: every handle lies in [2^125, 2^126), so no count, id or
               position is one by its size, a cast to BIGINT fails, and all fit in 10^38,
               the largest value DuckDB hands Python as Arrow's decimal128(38, 0)
    low 64 bits: SipHash-2-4 of the fields word (8 little-endian bytes) under a 128-bit key
        drawn from the operating system's random source when the connection opens.

The code is the guarantee: every function that takes a handle opens it (`Codec.open`), and a
value whose code does not match its fields is refused, whatever SQL made it: arithmetic (which
changes the fields or the code), a cast through DOUBLE (which drops low bits), a handle of
another connection or store (another key), a number typed in. Casts that keep the value
(VARCHAR, HUGEINT, UHUGEINT and back) give back the same handle, which names the same
row. Only two functions make handles: the view `acts`, for its stored rows (VectorSource.issue
refuses any other row), and the views `normalized`, `normed`, `final_norm`, for handles they
have opened. A cluster's workers are given the key, so the handles they return open here.

In SQL a handle is a plain number, so DuckDB joins, filters and sorts rows that carry one
without touching a vector; vectors are read only when a tensor function receives the handle.
Inside the engine, handles once opened travel as their fields word (int64), never the code.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import QueryError
from ..lazy import lazy_module
from ..store.limits import MAX_STREAMS, ROW_BITS, STREAM_BITS

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read

try:  # the compiled loops (actdb/_native.c); a build without a C compiler uses NumPy's
    from .. import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None  # type: ignore[assignment]
_COMPILED = _native is not None and hasattr(_native, "handles_open")  # an older build: NumPy

# DECIMAL(38, 0) is a 128-bit integer to DuckDB, and it crosses into Python's Arrow UDFs and
# back as decimal128(38, 0) without a conversion; a HUGEINT made by a UDF is converted from
# that decimal value by value, which dominated a scan.
SQL_TYPE = "DECIMAL(38, 0)"
KEY_BYTES = 16
STREAM_SHIFT = ROW_BITS
VIEW_SHIFT = STREAM_SHIFT + STREAM_BITS
VIEW_BITS = 3
ROW_MASK = (1 << ROW_BITS) - 1
STREAM_MASK = (1 << STREAM_BITS) - 1
VIEW_MASK = (1 << VIEW_BITS) - 1
TAG = 1 << (VIEW_SHIFT + VIEW_BITS)  # bit 61 of every fields word

VIEWS = ("raw", "normalized", "normed", "final_norm")

ADVICE = "pass the vec column of acts, or a view of it such as normed(vec)"


def arrow_type() -> pa.DataType:
    """How DuckDB hands a handle (SQL_TYPE) to Python's Arrow UDFs, and takes it back."""
    return pa.decimal128(38, 0)


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One (model, site, head) of the store (kind `acts`; head is -1 at sites without heads),
    or the rows of one stored weight array (kind `weights`: weight_rows.py; site and head -1)."""

    model_id: int
    site_id: int
    head: int
    n_rows: int  # the model's committed token rows; a weight array's rows
    kind: str = "acts"
    array: str | None = None  # kind `weights`: the array's name under models/{model_id}/


@dataclass(frozen=True)
class Decoded:
    row: np.ndarray  # int64 [n]
    head: np.ndarray  # int64 [n], -1 where the site has no heads
    site_id: np.ndarray
    model_id: np.ndarray
    view: np.ndarray


class Codec:
    """The connection's streams and key: seals fields words into handles, opens handles back
    into fields words (refusing any value it did not seal), and splits fields words."""

    def __init__(self, streams: Iterable[Stream], key: bytes | None = None) -> None:
        ordered = sorted(streams, key=lambda s: (s.model_id, s.site_id, s.head))
        if len(ordered) > MAX_STREAMS:
            raise QueryError(f"the store holds {len(ordered)} (model, site, head) streams, more "
                             f"than the {MAX_STREAMS} a vec handle can name")
        if key is None:
            key = secrets.token_bytes(KEY_BYTES)
        if len(key) != KEY_BYTES:
            raise QueryError(f"a handle key is {KEY_BYTES} bytes, not {len(key)}")
        self.key = bytes(key)
        self.streams: list[Stream] = []
        self.extend(ordered)

    def extend(self, streams: Iterable[Stream]) -> int:
        """Number `streams` after those the codec has (whose numbers stay), and return the
        first new number: the weight streams are added when a weight view is first made."""
        base = len(self.streams)
        streams = [*self.streams, *streams]
        if len(streams) > MAX_STREAMS:
            raise QueryError(f"the store holds {len(streams)} streams of vectors, more than "
                             f"the {MAX_STREAMS} a vec handle can name")
        self._model = np.array([s.model_id for s in streams], dtype=np.int64)
        self._site = np.array([s.site_id for s in streams], dtype=np.int64)
        self._head = np.array([s.head for s in streams], dtype=np.int64)
        self._weight = np.array([s.kind != "acts" for s in streams], dtype=bool)
        self._any_weight = bool(self._weight.any())
        self._models_of: dict[tuple[int, int], int | None] = {}  # model_ids' answers
        self.streams = streams
        return base

    def model_ids(self, lo: int, hi: int) -> int | None:
        """The model of streams lo .. hi - 1 when they are all of one model's acts (else
        None)."""
        found = self._models_of.get((lo, hi), -1)  # kept: a stream's numbers never change
        if found != -1:
            return found
        if not 0 <= lo < hi <= len(self._model):
            return None
        models, weights = self._model[lo:hi], self._weight[lo:hi]
        found = None if weights.any() or models.min() != models.max() else int(models[0])
        if len(self._models_of) < 4096:
            self._models_of[(lo, hi)] = found
        return found

    def weight_rows(self, fields: np.ndarray) -> np.ndarray | None:
        """bool [n]: which opened handles name weight rows (None: none can, the common case)."""
        if not self._any_weight:
            return None
        return self._weight[(np.asarray(fields, dtype=np.int64) >> STREAM_SHIFT) & STREAM_MASK]

    # -- fields words ----------------------------------------------------------------------

    @staticmethod
    def fields(rows: np.ndarray, streams: np.ndarray | int, view: int = 0) -> np.ndarray:
        """int64 fields words of rows of streams (indices into `streams`), in one view."""
        return (np.asarray(rows, dtype=np.int64) | (np.asarray(streams, dtype=np.int64)
                                                    << STREAM_SHIFT)
                | np.int64(TAG | (view << VIEW_SHIFT)))

    def heads(self, streams: np.ndarray) -> np.ndarray:
        """int64 head of each stream number (-1 where its site has no heads)."""
        return self._head[streams]

    def stream(self, bits: int) -> Stream:
        """The stream of a fields word shifted right by STREAM_SHIFT (view bits ignored)."""
        return self.streams[bits & STREAM_MASK]

    def decode(self, fields: np.ndarray) -> Decoded:
        """Fields of opened handles (`open`'s words: never a value from SQL)."""
        f = np.asarray(fields).astype(np.int64, copy=False)
        stream = (f >> STREAM_SHIFT) & STREAM_MASK
        return Decoded(row=f & ROW_MASK, head=self._head[stream], site_id=self._site[stream],
                       model_id=self._model[stream], view=(f >> VIEW_SHIFT) & VIEW_MASK)

    # -- sealing and opening ---------------------------------------------------------------

    def seal(self, fields: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
        """Handles (a decimal128 Arrow array) of int64 fields words; `valid` (bool [n]):
        NULL where False (those fields are not sealed)."""
        f = np.ascontiguousarray(fields, dtype=np.int64).view(np.uint64)
        words = np.zeros(2 * len(f), dtype=np.uint64)
        if valid is None:
            _seal(self.key, f, words)
            bitmap = None
        else:
            at = np.nonzero(valid)[0]
            part = np.empty(2 * len(at), dtype=np.uint64)
            _seal(self.key, np.ascontiguousarray(f[at]), part)
            words.reshape(-1, 2)[at] = part.reshape(-1, 2)
            bitmap = pa.array(np.asarray(valid, dtype=bool)).buffers()[1]
        return pa.Array.from_buffers(arrow_type(), len(f), [bitmap, pa.py_buffer(words)])

    def open(self, values: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """int64 fields words of handles without NULLs (decimal128, as DuckDB hands them to
        Python); a QueryError naming the first value this connection did not seal."""
        words = handle_words(values)
        fields = np.empty(len(words) // 2, dtype=np.uint64)
        bad = _open(self.key, words, fields)
        if bad >= 0:
            raise QueryError(refusal(_value(words, bad)))
        return fields.view(np.int64)

    def opens(self, values: pa.Array | pa.ChunkedArray) -> bool:
        """Whether every value is a handle this connection sealed (no NULLs, at least one)."""
        if not len(values) or values.null_count or not pa.types.is_decimal(values.type):
            return False
        words = handle_words(values)
        return _open(self.key, words, np.empty(len(words) // 2, dtype=np.uint64)) < 0


def by_stream(fields: np.ndarray) -> tuple[np.ndarray | None, list[int], list[int]]:
    """Fields words (int64 [n], n > 0) grouped by their bits above the row (stream, view and
    tag): `order`, the positions in groups, each group's positions ascending (one stable
    sort), or None where every word shares those bits (most calls: one scan's stream); the
    bits of each group, in ascending order; and the bounds of each group in `order`."""
    top = fields >> STREAM_SHIFT
    first, n = int(top[0]), len(fields)
    if first == int(top[-1]) and (n == 1 or (top == first).all()):
        return None, [first], [0, n]
    order = np.argsort(top, kind="stable")
    ordered = top[order]
    starts = (ordered[1:] != ordered[:-1]).nonzero()[0] + 1
    return order, [int(ordered[0]), *ordered[starts].tolist()], [0, *starts.tolist(), n]


def refusal(value: int) -> str:
    """The one sentence for a value that is not a handle of this connection."""
    if not 1 << 64 <= value < 1 << 127:
        return (f"{value} is not a vec handle of this connection (a plain number, not a value "
                f"of acts.vec); {ADVICE}")
    return (f"{value} is not a vec handle of this connection: its code does not match its "
            f"fields (arithmetic or a lossy cast changed it, or another connection or store "
            f"made it); {ADVICE}")


def unused_row(row: int) -> QueryError:
    """A row that no token was stored in: past the model's rows, or unused between shards."""
    return QueryError(f"row {row} holds no stored token (it is past the model's rows, or one "
                      f"of the unused rows between the shards of a sharded ingest), so it has "
                      f"no vec handle; {ADVICE}")


def handle_words(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """uint64 [2n] (code, fields) pairs of a decimal128 array of n values, without copying
    where it can (no NULLs: their places hold anything)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if not pa.types.is_decimal(values.type) or values.type.byte_width != 16:
        raise QueryError(f"a vec handle is a {SQL_TYPE}, not a value of type {values.type}; "
                         f"{ADVICE}")
    data = values.buffers()[1]
    words = np.frombuffer(data, dtype=np.uint64) if data is not None else np.zeros(0, np.uint64)
    return words[2 * values.offset : 2 * (values.offset + len(values))]


def _value(words: np.ndarray, i: int) -> int:
    low, high = int(words[2 * i]), int(words[2 * i + 1])
    value = (high << 64) | low
    return value - (1 << 128) if high >> 63 else value


def to_ints(handles: pa.Array | pa.ChunkedArray) -> list[int]:
    """Handles as Python ints (as DuckDB's fetchall gives them)."""
    words = handle_words(handles)
    return [_value(words, i) for i in range(len(words) // 2)]


def from_ints(values: Iterable[int]) -> pa.Array:
    """Python ints (below 2^127 in size) as a decimal128 array, as DuckDB hands them over."""
    words = []
    for v in values:
        v &= (1 << 128) - 1
        words += [v & ((1 << 64) - 1), v >> 64]
    return pa.Array.from_buffers(arrow_type(), len(words) // 2,
                                 [None, pa.py_buffer(np.array(words, dtype=np.uint64))])


# -- SipHash-2-4 ---------------------------------------------------------------------------
# The compiled loops do this in C (_native.c, handles_seal / handles_open); NumPy's version
# serves a build without them and is checked against them and a byte-wise reference.

_SIP = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)


def _seal(key: bytes, fields: np.ndarray, out: np.ndarray) -> None:
    if _COMPILED:
        _native.handles_seal(key, fields, out)
        return
    out[0::2] = siphash_numpy(key, fields)
    out[1::2] = fields


def _open(key: bytes, words: np.ndarray, fields: np.ndarray) -> int:
    if _COMPILED:
        return int(_native.handles_open(key, np.ascontiguousarray(words), fields))
    fields[:] = words[1::2]
    bad = np.nonzero(siphash_numpy(key, fields) != words[0::2])[0]
    return int(bad[0]) if len(bad) else -1


def siphash_numpy(key: bytes, m: np.ndarray) -> np.ndarray:
    """SipHash-2-4 of each uint64 of `m` (as 8 little-endian bytes) under a 16-byte key."""
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")
    m = np.asarray(m, dtype=np.uint64)
    v = np.empty((4, len(m)), dtype=np.uint64)  # the state v0..v3, one column a message
    for i, (k, c) in enumerate(zip((k0, k1, k0, k1), _SIP, strict=True)):
        v[i] = k ^ c
    t = np.empty(len(m), dtype=np.uint64)
    length = np.uint64(8 << 56)
    v[3] ^= m
    _sip_rounds(v, t, 2)
    v[0] ^= m
    v[3] ^= length
    _sip_rounds(v, t, 2)
    v[0] ^= length
    v[2] ^= np.uint64(0xFF)
    _sip_rounds(v, t, 4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def _sip_rounds(v: np.ndarray, t: np.ndarray, k: int) -> None:
    """k SipRounds on the state rows of `v`, in place (`t`: scratch)."""
    def rotl(x: np.ndarray, b: int) -> None:
        np.right_shift(x, np.uint64(64 - b), out=t)
        np.left_shift(x, np.uint64(b), out=x)
        x |= t

    v0, v1, v2, v3 = v
    for _ in range(k):
        v0 += v1
        rotl(v1, 13)
        v1 ^= v0
        rotl(v0, 32)
        v2 += v3
        rotl(v3, 16)
        v3 ^= v2
        v0 += v3
        rotl(v3, 21)
        v3 ^= v0
        v2 += v1
        rotl(v1, 17)
        v1 ^= v2
        rotl(v2, 32)
