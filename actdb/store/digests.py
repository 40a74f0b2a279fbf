"""Chunk digests bound to their place (format 5): the catalog's `chunk_digests` table records,
for every chunk of committed data, the CRC-32C of its committed rows under its place
(model, array path, chunk index). A chunk's own trailing CRC-32C says its bytes are whole; the
digest recorded for its place says they are the bytes that belong there, so a valid chunk
moved, copied over another, swapped or duplicated is damage naming both places.

A digest covers the chunk's first `rows` rows (its committed rows: every row of a full chunk,
whose digest then equals the chunk's own CRC-32C, so checking it costs one comparison; the
committed head of the last, partly filled chunk, checked with one more CRC-32C of those rows).
Rows past them belong to no commit and may change under a resumed ingest. Digests reach the
catalog in the transaction that makes the rows (or the model's weights) visible.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .chunks import crc32c

if TYPE_CHECKING:
    import pyarrow as pa

    from ..errors import StoreCorruptError

# The first format whose catalog records chunk digests; 2 to 4 are upgraded to it by the
# first writer that opens them (upgrade.py), 1 is read as it is (no checksums at all).
DIGESTS_VERSION = 5
TABLE = "chunk_digests"
SCHEMA = (f"CREATE TABLE IF NOT EXISTS {TABLE} "
          "(model VARCHAR, path VARCHAR, chunk BIGINT, \"rows\" BIGINT, crc UBIGINT)")


@dataclass(frozen=True)
class Digest:
    """The digest of one chunk written: its place and its committed rows' CRC-32C."""

    label: str  # the array's path in the group: models/{model_id}/{array}
    chunk: int
    end: int  # the array row past the rows it covers (chunk start + rows)
    rows: int
    crc: int


class Chunks(Protocol):
    """What a check needs of a chunk layout (chunks.ChunkFormat)."""

    @property
    def label(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    def damaged(self, chunk: int, what: str) -> StoreCorruptError: ...


def split_label(label: str) -> tuple[int, str]:
    """`models/{model_id}/{array}` -> (model_id, array)."""
    _, model_id, array = label.split("/", 2)
    return int(model_id), array


def head_crc(data: np.ndarray, rows: int, row_bytes: int) -> int:
    """The CRC-32C of the first `rows` rows of a chunk's bytes (`data`, uint8)."""
    return crc32c(data[: rows * row_bytes])


def chunk_digest(label: str, chunk: int, lo: int, end: int, data: np.ndarray,
                 whole: int | None) -> Digest:
    """The digest of chunk `chunk` (rows from `lo`) written with `data` (its values, whole
    chunk), committed up to row `end`; `whole`: the chunk's own CRC-32C, when known."""
    rows = end - lo
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if rows == data.shape[0] and whole is not None:
        return Digest(label, chunk, end, rows, whole)
    return Digest(label, chunk, end, rows, head_crc(raw, rows, raw.size // data.shape[0]))


def weight_digests(label: str, value: np.ndarray, chunk_rows: int) -> list[Digest]:
    """The digests of a weight array written whole, chunked `chunk_rows` rows a chunk (every
    row committed: the last chunk's digest covers its real rows, not its padding)."""
    value = np.ascontiguousarray(value, dtype=np.float32)
    if value.ndim == 0:
        value = value.reshape(1)
    out = []
    for i, lo in enumerate(range(0, max(value.shape[0], 1), chunk_rows)):
        part = value[lo : lo + chunk_rows]
        out.append(Digest(label, i, lo + part.shape[0], part.shape[0],
                          crc32c(part.reshape(-1).view(np.uint8))))
    return out


class WrittenDigests:
    """The digests of chunks this process wrote, until the commit that makes their rows
    visible takes them (`take`): a chunk written ahead of its commit waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], Digest] = {}

    def add(self, digest: Digest) -> None:
        with self._lock:
            self._pending[(digest.label, digest.chunk)] = digest

    def take(self, model_id: int, n_rows: int) -> list[Digest]:
        """The digests of the model's chunks whose rows are all below `n_rows` (committed
        now), removed from those waiting."""
        prefix = f"models/{model_id}/"
        with self._lock:
            keys = [k for k, d in self._pending.items()
                    if d.label.startswith(prefix) and d.end <= n_rows]
            return [self._pending.pop(k) for k in keys]

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()


def digests_table(digests: Sequence[Digest], names: dict[int, str]) -> pa.Table:
    """Digests as rows of `chunk_digests` (model by name)."""
    import pyarrow as pa

    places = [split_label(d.label) for d in digests]
    return pa.table({
        "model": pa.array([names[m] for m, _ in places], pa.string()),
        "path": pa.array([a for _, a in places], pa.string()),
        "chunk": pa.array([d.chunk for d in digests], pa.int64()),
        "rows": pa.array([d.rows for d in digests], pa.int64()),
        "crc": pa.array([d.crc for d in digests], pa.uint64()),
    })


# (model, array) -> (chunk, rows, crc) arrays of the recorded digests
Load = Callable[[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]
# crcs -> (model, array, chunk, rows) of every recorded digest with one of them
Find = Callable[[list[int]], list[tuple[str, str, int, int]]]


class ArrayDigests:
    """The recorded digests of one array's chunks, checked against chunks as they are read:
    chunk i's first `rows[i]` rows have CRC-32C `crc[i]` (rows 0: none recorded)."""

    def __init__(self, owner: ChunkDigests, label: str, rows: np.ndarray,
                 crc: np.ndarray) -> None:
        self.owner = owner
        self.label = label
        self.rows = rows
        self.crc = crc.astype(np.uint32)  # as a run reader hands the chunks' own CRCs back
        # chunk rows -> whether each chunk's digest covers fewer rows than that (or none)
        self._short: dict[int, np.ndarray] = {}

    def update(self, chunk: int, rows: int, crc: int) -> None:
        if chunk >= len(self.rows):
            grow = max(chunk + 1, 2 * len(self.rows))
            self.rows = np.concatenate([self.rows, np.zeros(grow - len(self.rows), np.int64)])
            self.crc = np.concatenate([self.crc, np.zeros(grow - len(self.crc), np.uint32)])
        self.rows[chunk] = rows
        self.crc[chunk] = crc
        self._short.clear()

    def _short_of(self, c: int) -> np.ndarray:
        short = self._short.get(c)
        if short is None:
            short = self._short[c] = self.rows != c
        return short

    def _expected(self, fmt: Chunks, chunk: int) -> tuple[int, int]:
        rows = int(self.rows[chunk]) if chunk < len(self.rows) else 0
        if not 0 < rows <= fmt.shape[0]:
            raise fmt.damaged(chunk, f"has no digest recorded in the catalog's {TABLE} "
                                     "(a chunk of committed rows always has one)")
        return rows, int(self.crc[chunk])

    def check_one(self, fmt: Chunks, chunk: int, data: np.ndarray, stored: int | None) -> None:
        """Chunk `chunk`, whose bytes are `data` (uint8, whole chunk) and whose own CRC-32C,
        checked against them, is `stored` (None: not known), is the one recorded here."""
        rows, crc = self._expected(fmt, chunk)
        row_bytes = fmt.nbytes // fmt.shape[0]
        got = stored if rows == fmt.shape[0] and stored is not None else head_crc(
            data, rows, row_bytes)
        if got != crc:
            raise self.misplaced(fmt, chunk, data)

    def check_run(self, fmt: Chunks, first: int, count: int, buf: np.ndarray,
                  stored: np.ndarray | None) -> None:
        """Chunks `first` .. `first + count - 1`, their bytes one after another in `buf`
        (uint8) and their own checked CRC-32Cs in `stored` (None: not known)."""
        nbytes, c = fmt.nbytes, fmt.shape[0]
        crc = self.crc[first : first + count]
        if (stored is not None and len(crc) == count
                and not self._short_of(c)[first : first + count].any()):
            # the common case, a run of full chunks: their own CRCs are their digests
            if not np.array_equal(stored, crc):
                i = int(np.flatnonzero(stored != crc)[0])
                raise self.misplaced(fmt, first + i, buf[i * nbytes : (i + 1) * nbytes])
            return
        for i in range(count):
            self.check_one(fmt, first + i, buf[i * nbytes : (i + 1) * nbytes],
                           None if stored is None else int(stored[i]))

    def misplaced(self, fmt: Chunks, chunk: int, data: np.ndarray) -> StoreCorruptError:
        """The error for chunk `chunk`, whose bytes are not those recorded for its place:
        naming the place they belong to when a recorded digest matches them."""
        row_bytes = fmt.nbytes // fmt.shape[0]
        rows = int(self.rows[chunk])
        candidates = [crc32c(data[: fmt.nbytes]), head_crc(data, rows, row_bytes)]
        here = split_label(self.label)
        source = self.owner.source(candidates, exclude=(here[0], here[1], chunk))
        if source is None:
            what = ("does not hold the bytes recorded for its place, nor those of any other "
                    "chunk of the store")
        else:
            what = (f"holds the bytes of chunk {source[1]} of array {source[0]!r} (a valid "
                    "chunk moved, copied or swapped into this place)")
        return fmt.damaged(chunk, what)


class ChunkDigests:
    """The digests recorded in a store's catalog, read per array when it is first read and
    kept up to date with this process's own commits (`committed`)."""

    def __init__(self, load: Load, find: Find, names: Callable[[], dict[int, str]]) -> None:
        self._load = load
        self._find = find
        self._names = names
        self._lock = threading.Lock()
        self._arrays: dict[str, ArrayDigests] = {}

    def names(self) -> dict[int, str]:
        """model_id -> model name."""
        return self._names()

    def for_array(self, label: str) -> ArrayDigests | None:
        """The digests of the array `label`; None for a model the catalog does not name (it
        has no committed rows, and no query or verify reads its arrays)."""
        found = self._arrays.get(label)
        if found is not None:
            return found
        model_id, array = split_label(label)
        name = self._names().get(model_id)
        if name is None:
            return None
        with self._lock:
            found = self._arrays.get(label)
            if found is None:
                chunks, rows, crc = self._load(name, array)
                n = int(chunks.max()) + 1 if len(chunks) else 0
                all_rows = np.zeros(n, np.int64)
                all_crc = np.zeros(n, np.uint64)
                all_rows[chunks] = rows
                all_crc[chunks] = crc
                found = self._arrays[label] = ArrayDigests(self, label, all_rows, all_crc)
        return found

    def committed(self, digests: Sequence[Digest]) -> None:
        """This process committed `digests`: arrays already read take them in."""
        with self._lock:
            for d in digests:
                arr = self._arrays.get(d.label)
                if arr is not None:
                    arr.update(d.chunk, d.rows, d.crc)

    def forget(self) -> None:
        with self._lock:
            self._arrays.clear()

    def source(self, crcs: list[int], *, exclude: tuple[int, str, int]
               ) -> tuple[str, int] | None:
        """The place (array label, chunk) whose recorded digest one of `crcs` is, other than
        `exclude` (model_id, array, chunk); None when none is."""
        ids = {name: model_id for model_id, name in self._names().items()}
        for model, array, chunk, _ in self._find(sorted(set(crcs))):
            model_id = ids.get(model)
            if model_id is None or (model_id, array, chunk) == exclude:
                continue
            return f"models/{model_id}/{array}", chunk
        return None


def load_with(query: Callable[[str, list[Any]], list[tuple[Any, ...]]]) -> Load:
    """A Load over a function running one SQL query with parameters."""
    def load(model: str, array: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = query(f'SELECT chunk, "rows", crc FROM {TABLE} WHERE model = ? AND path = ?',
                     [model, array])
        if not rows:
            empty = np.zeros(0, np.int64)
            return empty, empty, np.zeros(0, np.uint64)
        cols = list(zip(*rows, strict=True))
        return (np.asarray(cols[0], np.int64), np.asarray(cols[1], np.int64),
                np.asarray(cols[2], np.uint64))
    return load


def find_with(query: Callable[[str, list[Any]], list[tuple[Any, ...]]]) -> Find:
    def find(crcs: list[int]) -> list[tuple[str, str, int, int]]:
        return [(str(m), str(a), int(c), int(r)) for m, a, c, r in query(
            f'SELECT model, path, chunk, "rows" FROM {TABLE} WHERE crc IN '
            "(SELECT unnest($1::UBIGINT[])) ORDER BY model, path, chunk", [crcs])]
    return find


__all__ = ["DIGESTS_VERSION", "ArrayDigests", "ChunkDigests", "Digest", "WrittenDigests",
           "chunk_digest", "digests_table", "weight_digests"]
