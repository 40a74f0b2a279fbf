"""Reading one chunk checked: its size, its own CRC-32C, and (format 5) the digest recorded for
its place; straight from storage where the array's layout allows (chunks.py, object_chunks.py), else
through zarr."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StoreCorruptError
from .array_group import ArrayGroup, ArrayInfo, Layout, first_line
from .chunks import ZarrChunks

if TYPE_CHECKING:
    import zarr

    from .digests import ArrayDigests, ChunkDigests


class ChunkReader:
    """Checked reads of chunks of the arrays in `group`."""

    def __init__(self, group: ArrayGroup) -> None:
        self.group = group
        # Off only to measure what checking costs (benchmarks/); never off for users.
        self.check_checksums = True
        # The digests recorded for each chunk's place (format 5; None: an older store, whose
        # chunks are checked by their own checksums alone), set by the Store.
        self.expected: ChunkDigests | None = None

    def expect(self, label: str) -> ArrayDigests | None:
        """The digests recorded for the array `label`'s chunks, where they are checked."""
        if self.expected is None or not self.check_checksums:
            return None
        return self.expected.for_array(label)

    def read_raw(self, raw: Layout, chunk: int) -> np.ndarray:
        """One chunk read straight from storage, its size and checksum checked, and the
        digest of its place."""
        return raw.read(chunk, check=self.check_checksums, expect=self.expect(raw.label))

    def read_through_zarr(self, arr: zarr.Array, label: str, chunk: int) -> np.ndarray:
        """Chunk `chunk` of an array that only zarr reads (its rows within the array), its
        place's digest checked; damage zarr reports is a StoreCorruptError naming it."""
        c = arr.chunks[0] if arr.ndim else 1
        try:
            values = np.asarray(arr[chunk * c : min(chunk * c + c, arr.shape[0])])
        except Exception as e:
            raise StoreCorruptError(
                f"chunk {chunk} of array {arr.path!r} cannot be read ({first_line(e)}): "
                "the store is damaged"
            ) from None
        expect = self.expect(label)
        if expect is not None:
            fmt = ZarrChunks(label=label, tail="", shape=(c, *arr.shape[1:]),
                             dtype=np.dtype(arr.dtype), crc=False)
            whole = np.zeros(fmt.shape, dtype=fmt.dtype)
            whole[: values.shape[0]] = values
            expect.check_one(fmt, chunk, whole.reshape(-1).view(np.uint8), None)
        return values

    def chunk(self, label: str, info: ArrayInfo, i: int) -> np.ndarray:
        """Chunk `i` of the array at `label` (its rows within the array), checked."""
        c = info.chunks[0]
        lo, hi = i * c, min(info.shape[0], i * c + c)
        if info.raw is not None:
            return self.read_raw(info.raw, i)[: hi - lo]
        # opened once for all its chunks
        return self.read_through_zarr(self.group.zarr_array(label), label, i)

    def blocks(self, label: str, info: ArrayInfo) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, rows) of each chunk of the array at `label`, checked, in order."""
        c = info.chunks[0]
        for i in range(n_chunks(info)):
            yield i * c, self.chunk(label, info, i)

    def whole(self, label: str, info: ArrayInfo) -> np.ndarray:
        """All of the array at `label`, chunk by chunk, so that a damaged or missing one is
        named (zarr itself would read a missing chunk as its fill value)."""
        out = np.empty(info.shape, dtype=info.dtype)
        for lo, block in self.blocks(label, info):
            out[lo:lo + len(block)] = block
        return out


def n_chunks(arr: Any) -> int:
    """Chunks along the first axis of an array or ArrayInfo (a 0-d array has one)."""
    return -(-arr.shape[0] // arr.chunks[0]) if len(arr.shape) else 1


__all__ = ["ChunkReader", "n_chunks"]
