"""Chunks of arrays on object storage, read and written straight as objects, checked.

Two layouts, both exactly Zarr v3's own encodings (a plain `zarr.open_group` reads them):

- `ObjectChunks`: an unsharded raw array (`bytes` then `crc32c`): chunk `i` is the object
  `{array}/c/{i}{tail}` (or `{array}/c.{i}.0`, a local store's vectors copied up), its values
  then their CRC-32C. Weights on object storage.
- `ShardedChunks`: the `sharding_indexed` codec, index at the end, inner codecs and index
  codecs both `bytes` then `crc32c`: the vectors on object storage. A shard holds up to
  `per_shard` inner chunks of `chunk_rows` rows; actdb writes the inner chunks from the first
  up to the last holding a row written, each full size, in order, and marks the rest absent
  in the index (offset and size 2^64 - 1, as the Zarr spec says; zarr reads them as the fill
  value). So a shard is as long as what is written (a store on object storage takes the
  bytes a local one does), inner chunk `j` always lies at byte `j * (chunk bytes + 4)`, and
  the index says only how many chunks are present. A cached index stays right for every
  chunk it names however often an ingest rewrites the shard; a chunk it does not name is
  looked up afresh once (an ingest may have added it since) before it is called missing.

An object is replaced whole by one PUT (atomic on S3): a reader sees the old or the new
shard, and both carry every committed row with its checksum.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .chunks import CRC_BYTES, ChunkFormat, Expect, crc32c
from .faults import fault

if TYPE_CHECKING:
    import zarr

    from .objects import Objects  # obstore: imported by a remote store alone

_EMPTY = 2**64 - 1


@dataclass(frozen=True, kw_only=True)
class ObjectChunks(ChunkFormat):
    """Where the chunk objects of one raw unsharded array lie."""

    objects: Objects  # the tensors group's prefix
    sep: str = "/"  # the chunk key separator: "." in a local store's vectors, copied up

    def key(self, chunk: int) -> str:
        return f"{self.label}/c{self.sep}{chunk}{self.tail}"

    def read(self, chunk: int, *, check: bool = True, expect: Expect | None = None
             ) -> np.ndarray:
        try:
            data: bytes | None = self.objects.get(self.key(chunk))[0]
        except FileNotFoundError:
            data = None
        self.check_size(chunk, None if data is None else len(data))
        assert data is not None
        # The object's bytes are immutable: the values are copied out, writable.
        return self.decode(np.frombuffer(data, np.uint8), chunk, check=check,
                           expect=expect).copy()

    def stat(self, chunk: int) -> None:
        self.check_size(chunk, self.objects.size(self.key(chunk)))

    def where(self, chunk: int) -> str:
        return self.objects.where(self.key(chunk))


@dataclass(frozen=True, kw_only=True)
class ShardedChunks(ChunkFormat):
    """One sharded array on object storage: inner chunks read by range, shards written whole.
    `shape` is that of one inner chunk; every inner chunk carries its CRC-32C."""

    objects: Objects
    per_shard: int  # inner chunks per shard
    crc: bool = True
    _present: dict[int, int] = field(default_factory=dict)  # shard -> inner chunks it holds
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def index_bytes(self) -> int:
        return 16 * self.per_shard + CRC_BYTES

    def shard_bytes(self, present: int) -> int:
        """The size of a shard holding inner chunks 0 .. present - 1."""
        return present * self.file_bytes + self.index_bytes

    def key(self, shard: int) -> str:
        return f"{self.label}/c/{shard}{self.tail}"

    def expected_index(self, present: int) -> bytes:
        """The index of a shard actdb writes with `present` inner chunks: chunk j < present at
        j * file_bytes, the others absent."""
        index = np.full((self.per_shard, 2), _EMPTY, dtype="<u8")
        index[:present, 0] = np.arange(present, dtype=np.uint64) * self.file_bytes
        index[:present, 1] = self.file_bytes
        raw = index.tobytes()
        return raw + crc32c(np.frombuffer(raw, np.uint8)).to_bytes(CRC_BYTES, "little")

    def _load_index(self, shard: int, chunk: int) -> int:
        """Fetch and check a shard's index (its CRC-32C, that it is actdb's layout, and that
        the object is as long as the index says); the number of inner chunks it holds."""
        try:
            got, size = self.objects.get_suffix(self.key(shard), self.index_bytes)
        except FileNotFoundError:
            raise self.damaged(chunk, "is missing (its shard is absent)") from None
        if len(got) != self.index_bytes:
            raise self.damaged(chunk, f"lies in a shard of the wrong size ({size} bytes, "
                                       f"shorter than its index of {self.index_bytes})")
        raw = bytes(got)
        body, stored = raw[:-CRC_BYTES], int.from_bytes(raw[-CRC_BYTES:], "little")
        if crc32c(np.frombuffer(body, np.uint8)) != stored:
            raise self.damaged(chunk, "lies in a shard whose index fails its checksum")
        index = np.frombuffer(body, "<u8").reshape(self.per_shard, 2)
        present = int(np.count_nonzero(index[:, 0] != _EMPTY))
        if raw != self.expected_index(present):
            raise self.damaged(chunk, "lies in a shard not laid out as actdb writes it")
        if size != self.shard_bytes(present):
            raise self.damaged(chunk, f"lies in a shard of the wrong size ({size} bytes, not "
                                       f"{self.shard_bytes(present)} for its {present} "
                                       "chunks)")
        with self._lock:
            self._present[shard] = present
        return present

    def _check_index(self, shard: int, chunk: int) -> None:
        """That the shard holds inner chunk `chunk`: from the cached index, or, where that
        does not name it, from the index fetched afresh."""
        j = chunk % self.per_shard
        cached = self._present.get(shard)
        if cached is not None and j < cached:
            return
        if self._load_index(shard, chunk) <= j:
            raise self.damaged(chunk, "is missing from its shard")

    def read(self, chunk: int, *, check: bool = True, expect: Expect | None = None
             ) -> np.ndarray:
        shard, j = divmod(chunk, self.per_shard)
        self._check_index(shard, chunk)
        lo = j * self.file_bytes
        try:
            got = self.objects.get_range(self.key(shard), lo, lo + self.file_bytes)
        except FileNotFoundError:
            raise self.damaged(chunk, "is missing (its shard is absent)") from None
        self.check_size(chunk, len(got))
        return self.decode(np.frombuffer(got, np.uint8), chunk, check=check,
                           expect=expect).copy()

    def stat(self, chunk: int) -> None:
        shard = chunk // self.per_shard
        with self._lock:
            self._present.pop(shard, None)  # verify looks afresh
        self._check_index(shard, chunk)

    def write_rows(self, start: int, value: np.ndarray, *, expect: Expect | None = None
                   ) -> list[tuple[int, int, int, np.ndarray, int]]:
        """Rows [start, start + n): every shard they touch is rebuilt and PUT whole. Inner
        chunks below `start` hold committed rows: copied as stored (a chunk partly below
        is read, checked (`expect`: against its place's digest too), and patched); the shard
        ends with the last inner chunk holding a row written (its rows past those written
        zeros), the rest marked absent. Returns each inner chunk holding rows written, as
        (chunk, its first row, the row past those written, its values, its CRC-32C)."""
        written: list[tuple[int, int, int, np.ndarray, int]] = []
        c, stop = self.shape[0], start + value.shape[0]
        rows_per_shard = c * self.per_shard
        value = np.ascontiguousarray(value, dtype=self.dtype)
        for shard in range(start // rows_per_shard, (stop - 1) // rows_per_shard + 1):
            lo = shard * rows_per_shard
            first = max(start - lo, 0) // c  # first inner chunk this write changes
            partial = (start - lo) % c if start > lo else 0
            present = -(-(min(stop, lo + rows_per_shard) - lo) // c)  # through the last row
            buf = np.empty(self.shard_bytes(present), dtype=np.uint8)
            if first > 0:
                keep = first * self.file_bytes
                buf[:keep] = self._old_shard(shard, lo // c, first)[:keep]
            for j in range(first, present):
                a = max(start, lo + j * c)
                b = min(stop, lo + (j + 1) * c)
                if j == first and partial:
                    data = self.read(lo // c + j, expect=expect).copy()
                else:
                    data = np.zeros(self.shape, self.dtype)
                data[a - lo - j * c : b - lo - j * c] = value[a - start : b - start]
                crc = self._encode_into(buf, j, data)
                written.append((lo // c + j, lo + j * c, b, data, crc))
            buf[present * self.file_bytes:] = np.frombuffer(self.expected_index(present),
                                                            np.uint8)
            fault("chunk_write")  # a kill here: the shard object is untouched
            self.objects.put(self.key(shard), buf.data)
            with self._lock:
                self._present[shard] = present
        return written

    def _old_shard(self, shard: int, first_chunk: int, needed: int) -> np.ndarray:
        """The stored shard, which must hold its first `needed` inner chunks (committed
        rows)."""
        try:
            data, _ = self.objects.get(self.key(shard))
        except FileNotFoundError:
            raise self.damaged(first_chunk, "is missing (its shard is absent)") from None
        present = (len(data) - self.index_bytes) // self.file_bytes
        if len(data) != self.shard_bytes(max(present, 0)) or present < needed:
            raise self.damaged(first_chunk, f"lies in a shard of {len(data)} bytes, short of "
                                             f"the {self.shard_bytes(needed)} of its "
                                             f"{needed} committed chunks")
        return np.frombuffer(data, np.uint8)

    def _encode_into(self, buf: np.ndarray, j: int, data: np.ndarray) -> int:
        """Inner chunk `j` of a shard into `buf`: its values, then their CRC-32C (returned)."""
        lo = j * self.file_bytes
        raw = np.ascontiguousarray(data, dtype=self.dtype).reshape(-1).view(np.uint8)
        buf[lo : lo + self.nbytes] = raw
        crc = crc32c(raw)
        buf[lo + self.nbytes : lo + self.file_bytes] = np.frombuffer(
            crc.to_bytes(CRC_BYTES, "little"), np.uint8)
        return crc

    def where(self, chunk: int) -> str:
        return self.objects.where(self.key(chunk // self.per_shard))


def object_layout(arr: zarr.Array, objects: Objects) -> ObjectChunks | ShardedChunks | None:
    """How to read `arr` straight from object storage; None when only zarr can."""
    meta: Any = arr.metadata
    codecs: tuple[Any, ...] = tuple(getattr(meta, "codecs", ()))
    encoding: Any = getattr(meta, "chunk_key_encoding", None)
    sep = getattr(encoding, "separator", None)
    if not (type(encoding).__name__ == "DefaultChunkKeyEncoding" and sep in ("/", ".")
            and np.little_endian):
        return None
    tail = f"{sep}0" * (arr.ndim - 1)
    if len(codecs) == 1 and type(codecs[0]).__name__ == "ShardingCodec":
        if sep != "/":  # actdb shards only with zarr's default keys
            return None
        sh = codecs[0]
        inner = [type(c).__name__ for c in sh.codecs]
        index = [type(c).__name__ for c in sh.index_codecs]
        outer = tuple(meta.chunk_grid.chunk_shape)
        ok = (inner == index == ["BytesCodec", "Crc32cCodec"]
              and str(sh.index_location.value) == "end"
              and _little(sh.codecs[0]) and _little(sh.index_codecs[0])
              and tuple(sh.chunk_shape[1:]) == tuple(arr.shape[1:]) == outer[1:]
              and outer[0] % sh.chunk_shape[0] == 0)
        if not ok:
            return None
        return ShardedChunks(label=arr.path, objects=objects, tail=tail,
                             shape=(sh.chunk_shape[0], *arr.shape[1:]),
                             dtype=np.dtype(arr.dtype),
                             per_shard=outer[0] // sh.chunk_shape[0])
    names = [type(c).__name__ for c in codecs]
    if (names not in (["BytesCodec"], ["BytesCodec", "Crc32cCodec"]) or not _little(codecs[0])
            or any(s != c for s, c in zip(arr.shape[1:], arr.chunks[1:], strict=True))):
        return None
    return ObjectChunks(label=arr.path, objects=objects, tail=tail, sep=sep,
                        shape=(arr.chunks[0], *arr.shape[1:]), dtype=np.dtype(arr.dtype),
                        crc=len(codecs) == 2)


def _little(codec: Any) -> bool:
    return str(getattr(codec, "endian", "little")).endswith("little")
