"""Chunk files of arrays stored raw on a local disk: where they lie, and reading and writing
one whole, checked (size and CRC-32C) and atomic (temporary file, fsync, rename).

A raw array has the `bytes` codec (little-endian), optionally followed by `crc32c` (format 2):
chunk `i` is the file `{array}/c/{i}/0` (key separator "/") or `{array}/c.{i}.0` (separator
"."), the chunk's values, then their CRC-32C in 4 bytes
little-endian, exactly as Zarr's own codec writes it, so zarr-python reads these files too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import crc32c as _crc32c
import numpy as np

from ..errors import StoreCorruptError
from ..lazy import lazy_module
from .durable import PARTIAL_SUFFIX
from .faults import fault

if TYPE_CHECKING:
    import zarr
else:
    zarr = lazy_module("zarr")  # imported when an array is first opened (arrays.py)

try:  # compiled run reads (actdb/_native.c), built at install when a C compiler is there
    from .. import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None  # type: ignore[assignment]
# Whether the compiled reader hands each chunk's stored CRC back (`crcs`): a module built from
# an older _native.c does not, and the digests are then checked from the bytes instead.
_NATIVE_CRCS = _native is not None and "crcs" in (_native.read_chunks.__doc__ or "")
# Whether the compiled product checks chunks' CRC-32Cs in its own pass on this CPU.
_NATIVE_DOTS_CRC = _NATIVE_CRCS and bool(getattr(_native, "DOTS_CRC", False))
_F16 = np.dtype("<f2")

CRC_BYTES = 4


def crc32c(data: np.ndarray) -> int:
    """CRC-32C of a contiguous array's bytes, as Zarr's `crc32c` codec computes it: by the
    compiled module's fastest path for this CPU (_native_crc.c), else by the crc32c package."""
    flat = data.reshape(-1).view(np.uint8)
    if _native is not None:
        return int(_native.crc32c(flat))
    return int(_crc32c.crc32c(flat.data, gil_release_mode=1))


class Expect(Protocol):
    """The digests recorded for an array's places (digests.ArrayDigests): a chunk read,
    whole and valid by its own checksum, must also be the one that belongs where it lies."""

    def check_one(self, fmt: Any, chunk: int, data: np.ndarray, stored: int | None
                  ) -> None: ...

    def check_run(self, fmt: Any, first: int, count: int, buf: np.ndarray,
                  stored: np.ndarray | None) -> None: ...


def row_dots(data: np.ndarray, v: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32: each row of float16 `data` [rows, d] dotted with float32 `v` [d] by the
    compiled product (`f16_dots`; the query layer's callers have the compiled module)."""
    if out is None:
        out = np.empty(len(data), dtype=np.float32)
    _native.f16_dots(np.ascontiguousarray(data), v, out)
    return out


@dataclass(frozen=True, kw_only=True)
class ChunkFormat:
    """What one chunk of a raw array holds: its values (`bytes` codec, little-endian), then,
    with `crc`, their CRC-32C in 4 bytes. Subclasses say where a chunk lies."""

    label: str  # the array's path in the group, for messages
    tail: str
    shape: tuple[int, ...]  # of one chunk
    dtype: np.dtype[Any]
    crc: bool

    @property
    def nbytes(self) -> int:
        # math.prod, not np.prod: this runs several times per chunk read (a scan reads
        # thousands), and np.prod's dispatch is a visible part of a full scan
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def file_bytes(self) -> int:
        return self.nbytes + (CRC_BYTES if self.crc else 0)

    def where(self, chunk: int) -> str:
        """Where chunk `chunk` lies, for messages."""
        raise NotImplementedError

    def decode(self, raw: np.ndarray, chunk: int, *, check: bool,
               expect: Expect | None = None) -> np.ndarray:
        """The values of one chunk from its `file_bytes` bytes (a view of `raw`), the
        checksum checked when `check`, and (`expect`) the digest recorded for its place."""
        data = raw[: self.nbytes]
        stored: int | None = None
        if self.crc and check:
            stored = int.from_bytes(raw[self.nbytes : self.file_bytes].tobytes(), "little")
            if crc32c(data) != stored:
                raise self.damaged(chunk, "fails its checksum")
        if expect is not None:
            expect.check_one(self, chunk, data, stored)
        return data.view(self.dtype).reshape(self.shape)

    def check_size(self, chunk: int, size: int | None) -> None:
        """A chunk found with `size` bytes (None: absent) is whole, or the store is damaged."""
        if size is None:
            raise self.damaged(chunk, "is missing")
        if size != self.file_bytes:
            raise self.damaged(chunk, f"has {size} bytes, not {self.file_bytes}")

    def damaged(self, chunk: int, what: str) -> StoreCorruptError:
        return StoreCorruptError(
            f"chunk {chunk} of array {self.label!r} {what} ({self.where(chunk)!r}): "
            "the store is damaged"
        )


@dataclass(frozen=True, kw_only=True)
class RawLayout(ChunkFormat):
    """Where the chunk files of one raw array lie on a local disk."""

    folder: str
    prefix: str = ""  # before the chunk's number: "c." where the key separator is "."

    def path(self, chunk: int) -> str:
        return f"{self.folder}/{self.prefix}{chunk}{self.tail}"

    def read(self, chunk: int, *, check: bool = True, expect: Expect | None = None
             ) -> np.ndarray:
        """Chunk `chunk` read straight from its file, its size and (`check`) checksum
        checked, and (`expect`) the digest of its place: a missing, short, long, damaged or
        misplaced chunk is a StoreCorruptError naming it."""
        path = self.path(chunk)
        # One byte more than expected: a file too long shows in the count read.
        buf = np.empty(self.file_bytes + 1, dtype=np.uint8)
        got: int | None
        try:
            # readinto releases the GIL for the read itself, so a read-ahead thread
            # reads while the query's thread computes (np.fromfile holds it).
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(buf.data)
        except FileNotFoundError:
            got = None
        self.check_size(chunk, got)
        return self.decode(buf, chunk, check=check, expect=expect)

    def read_run(self, first: int, count: int, *, check: bool = True,
                 expect: Expect | None = None) -> np.ndarray:
        """Chunks `first` .. `first + count - 1` as one array (their rows in order), each
        chunk's file checked as `read` checks it.

        Each file's values go straight into their place in one buffer and its checksum into
        a small one (one `preadv` a file, which releases the GIL), so a scan pays Python's
        per-call costs once per run of chunks for the buffer, and no copy joins them."""
        nbytes = self.nbytes
        buf = np.empty(count * nbytes, dtype=np.uint8)
        # each chunk's own CRC-32C, checked against its bytes, for the digests of the places
        stored = (np.empty(count, dtype=np.uint32)
                  if expect is not None and self.crc and check else None)
        if _native is not None:
            if not _NATIVE_CRCS:
                stored = None
            # the same reads and checks in C, the GIL released for the whole run: a scan's
            # read-ahead thread no longer competes with the query's thread for it per chunk
            paths = [os.fsencode(self.path(first + i)) for i in range(count)]
            sizes = (_native.read_chunks(paths, buf, nbytes, self.crc, check, stored)
                     if stored is not None else
                     _native.read_chunks(paths, buf, nbytes, self.crc, check))
            for i, size in enumerate(sizes):  # it stops at the first damaged chunk
                if size == -1:
                    raise self.damaged(first + i, "fails its checksum")
                self.check_size(first + i, size)
            if len(sizes) != count:
                raise RuntimeError(f"read_chunks stopped at an undamaged chunk of {self.label}")
            if expect is not None:
                expect.check_run(self, first, count, buf, stored)
            return buf.view(self.dtype).reshape(count * self.shape[0], *self.shape[1:])
        # the checksum, then one byte more than expected: a file too long shows in the count
        tail = np.empty(CRC_BYTES + 1, dtype=np.uint8)
        for i in range(count):
            chunk = first + i
            data = buf[i * nbytes : (i + 1) * nbytes]
            got: int | None
            try:
                fd = os.open(self.path(chunk), os.O_RDONLY)
            except FileNotFoundError:
                got = None
            else:
                try:
                    got = os.preadv(fd, [data.data, tail.data], 0)
                except OSError as e:  # a folder where the file should be: name it
                    raise OSError(e.errno, e.strerror, self.path(chunk)) from None
                finally:
                    os.close(fd)
            self.check_size(chunk, got)
            if self.crc and check:
                crc = int.from_bytes(tail[:CRC_BYTES].tobytes(), "little")
                if crc32c(data) != crc:
                    raise self.damaged(chunk, "fails its checksum")
                if stored is not None:
                    stored[i] = crc
        if expect is not None:
            expect.check_run(self, first, count, buf, stored)
        return buf.view(self.dtype).reshape(count * self.shape[0], *self.shape[1:])

    def read_run_dots(self, first: int, count: int, v: np.ndarray, *, check: bool = True,
                      expect: Expect | None = None) -> np.ndarray:
        """float32: the rows of chunks `first` .. `first + count - 1` (float16 [rows, d])
        dotted with `v` (float32 [d]) by the compiled product (`f16_dots`), each chunk's
        file checked as `read_run` checks it.

        Where the CPU allows (`_native.DOTS_CRC`, d a multiple of 64), each chunk's CRC-32C
        is checked in the product's own pass over its bytes (`f16_dots_crc`), where a
        separate pass cost a scan more than the product itself. A chunk missing, of the
        wrong size or failing its checksum is then read again the checked way, which names
        the first problem of the run as `read_run` does (or, a chunk whole this time, gives
        the products of bytes that passed)."""
        out = np.empty(count * self.shape[0], dtype=np.float32)
        if not (check and self._fused_crc()):
            return row_dots(self.read_run(first, count, check=check, expect=expect), v, out)
        buf = np.empty(count * self.nbytes, dtype=np.uint8)
        if self._read_dots_crc(first, count, v, buf, out, expect):
            return out
        return row_dots(self.read_run(first, count, check=True, expect=expect), v, out)

    def read_with_dots(self, chunk: int, v: np.ndarray, *, check: bool = True,
                       expect: Expect | None = None, into: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray | None]:
        """Chunk `chunk` as `read` returns it, checked as `read` checks it, and its rows
        (float16 [rows, d]) dotted with `v` (float32 [d]) by the compiled product, where the
        CPU checks the CRC-32C in the product's own pass (as `read_run_dots` does; a
        selective query reads one chunk a group and uses its rows' products alone). The
        products are None where it cannot: the caller makes them. A chunk missing, of the
        wrong size or failing its checksum is read again by `read`, which names the problem
        (or, the chunk whole this time, gives bytes that passed). `into`: a uint8 buffer of
        at least `nbytes` the chunk is read into where its products are made here (the values
        are then a view of it, valid until the buffer is used again)."""
        if not (check and self._fused_crc()):
            return self.read(chunk, check=check, expect=expect), None
        buf = np.empty(self.nbytes, dtype=np.uint8) if into is None else into[: self.nbytes]
        out = np.empty(self.shape[0], dtype=np.float32)
        if self._read_dots_crc(chunk, 1, v, buf, out, expect):
            return buf.view(self.dtype).reshape(self.shape), out
        return self.read(chunk, check=True, expect=expect), None

    def _fused_crc(self) -> bool:
        """Whether the compiled product checks this array's chunks' CRC-32Cs in its own pass
        (`_native.DOTS_CRC` on this CPU, float16 rows of a width a multiple of 64)."""
        return (_NATIVE_DOTS_CRC and self.crc and len(self.shape) == 2
                and self.shape[1] % 64 == 0 and self.dtype == _F16)

    def _read_dots_crc(self, first: int, count: int, v: np.ndarray, buf: np.ndarray,
                       out: np.ndarray, expect: Expect | None) -> bool:
        """Chunks `first` .. `first + count - 1` read into `buf` (uint8, `count * nbytes`),
        their rows dotted with `v` into `out`, each chunk's CRC-32C checked in the product's
        pass (`f16_dots_crc`), then (`expect`) the digests of their places. False where a
        chunk is missing, of the wrong size or fails its checksum: the caller reads them
        again the checked way, which names the problem."""
        stored = np.empty(count, dtype=np.uint32)
        paths = [os.fsencode(self.path(first + i)) for i in range(count)]
        # sizes checked, checksums handed back unchecked: checked below, with the product
        sizes = _native.read_chunks(paths, buf, self.nbytes, True, False, stored)
        if not (len(sizes) == count and all(size == self.file_bytes for size in sizes)
                and _native.f16_dots_crc(buf.view(self.dtype), v, out, self.shape[0],
                                         stored) < 0):
            return False
        if expect is not None and count == 1:  # a selective query's chunk: no run's arrays
            expect.check_one(self, first, buf, int(stored[0]))
        elif expect is not None:
            expect.check_run(self, first, count, buf, stored)
        return True

    def stat(self, chunk: int) -> None:
        """The structural check of one chunk: its file exists with the right size."""
        try:
            size: int | None = os.stat(self.path(chunk)).st_size
        except FileNotFoundError:
            size = None
        self.check_size(chunk, size)

    def write(self, chunk: int, data: np.ndarray, *, point: str = "chunk_write",
              direct: bool = False, sync: bool = True) -> int | None:
        """Replace chunk `chunk` whole: a temporary file beside it, fsynced, renamed over it
        (the caller fsyncs the folder). Its folder must exist. `point`: the fault point
        that tests inject at mid-write (faults.py). `direct`: past the page cache where the
        file system allows it (`write_direct`), for large chunks written once (weights).
        `sync=False`: not fsynced, for a chunk with no committed rows, which the caller makes
        durable with the whole file system (durable.FileSystemSync) before the catalog
        refers to it; a chunk holding committed rows is always fsynced before its rename,
        so that a crash never leaves it replaced by a file whose data was lost. Returns the
        chunk's CRC-32C (None: the array has none)."""
        path = self.path(chunk)
        data = np.ascontiguousarray(data, dtype=self.dtype)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{PARTIAL_SUFFIX}"
        crc = crc32c(data) if self.crc else None
        try:
            if direct and data.nbytes >= DIRECT_MIN_BYTES and write_direct(tmp, data, crc,
                                                                           point):
                os.replace(tmp, path)
                return crc
            with open(tmp, "wb") as f:
                f.write(data.data.cast("B"))
                fault(point)  # a kill here leaves a torn temporary file
                if crc is not None:
                    f.write(crc.to_bytes(CRC_BYTES, "little"))
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return crc

    def where(self, chunk: int) -> str:
        return self.path(chunk)


@dataclass(frozen=True, kw_only=True)
class ZarrChunks(ChunkFormat):
    """An array read through zarr (not laid out as actdb reads chunks straight): what its
    chunks hold, for the checks of their places' digests."""

    def where(self, chunk: int) -> str:
        return f"{self.label}, read through zarr"


# Chunks at least this large may be written past the page cache (RawLayout.write's `direct`).
DIRECT_MIN_BYTES = 4 << 20
_DIRECT_PIECE = 4 << 20  # written through a page-aligned buffer this size, one per thread
_DIRECT_ALIGN = 4096  # O_DIRECT's alignment of buffer, offset and length on Linux file systems
_direct = threading.local()
_direct_refused: set[int] = set()  # devices (st_dev) whose file system refused O_DIRECT


def write_direct(tmp: str, data: np.ndarray, crc: int | None, point: str) -> bool:
    """Write `data` (then its CRC-32C, 4 bytes little-endian) as the new file `tmp` with
    O_DIRECT, and fsync it; False, with nothing left at `tmp`, where the system or its file
    system does not take O_DIRECT (tmpfs before Linux 6.6, some FUSE and network file systems).

    A buffered write of a large weight chunk spends most of its system time filling fresh
    page-cache pages, on the commit thread beside the first forward pass; past the page cache,
    through one reused 4 MiB buffer, it is the copy into that buffer. The file's length is not
    a multiple of the alignment (the CRC's 4 bytes): the last piece is written padded, and the
    file cut to its size."""
    flag = getattr(os, "O_DIRECT", 0)
    folder = os.path.dirname(tmp) or "."
    if not flag:
        return False
    try:
        dev = os.stat(folder).st_dev
    except OSError:
        return False
    if dev in _direct_refused:
        return False
    buf = getattr(_direct, "buf", None)
    if buf is None or len(buf) != _DIRECT_PIECE:  # anonymous memory: page-aligned
        buf = _direct.buf = mmap.mmap(-1, _DIRECT_PIECE)
    payload = data.reshape(-1).view(np.uint8).data
    tail = crc.to_bytes(CRC_BYTES, "little") if crc is not None else b""
    size = len(payload) + len(tail)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            _direct_refused.add(dev)
            return False
        raise
    view = memoryview(buf)
    try:
        at = 0
        while at < size:
            n = min(_DIRECT_PIECE, size - at)
            body = max(0, min(n, len(payload) - at))
            view[:body] = payload[at : at + body]
            view[body:n] = tail[at + body - len(payload) : at + n - len(payload)]
            padded = -(-n // _DIRECT_ALIGN) * _DIRECT_ALIGN
            view[n:padded] = bytes(padded - n)
            done = 0
            while done < padded:
                done += os.write(fd, view[done:padded])
            at += n
            if at == n:
                fault(point)  # a kill here leaves a torn temporary file
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if e.errno == errno.EINVAL:  # opened, but the file system takes no aligned write
            _direct_refused.add(dev)
            return False
        raise
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        view.release()
    os.close(fd)
    return True


# Zarr v3 data types whose NumPy dtype has the same name (the types actdb writes among them).
_PLAIN_TYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                          "uint32", "uint64", "float16", "float32", "float64"})


def local_info(root: Path, label: str
               ) -> tuple[tuple[int, ...], tuple[int, ...], RawLayout] | None:
    """The shape, chunk shape and chunk files of the array `label` under the local Zarr
    group folder `root`, read from its `zarr.json` alone, where it is stored raw as
    `raw_layout` accepts it; None otherwise (no file, metadata that is not JSON or not such
    an array: zarr-python then opens it and reports what is wrong). Reading a store through
    zarr imports it and costs a round trip through its event loop an array."""
    try:
        doc = json.loads((root / label / "zarr.json").read_bytes())
        if (not isinstance(doc, dict) or doc.get("zarr_format") != 3
                or doc.get("node_type") != "array" or doc.get("storage_transformers")
                or doc.get("data_type") not in _PLAIN_TYPES):
            return None
        shape = tuple(int(n) for n in doc["shape"])
        grid, keys = doc["chunk_grid"], doc["chunk_key_encoding"]
        if grid.get("name") != "regular" or keys.get("name") != "default":
            return None
        chunks = tuple(int(n) for n in grid["configuration"]["chunk_shape"])
        sep = keys.get("configuration", {}).get("separator", "/")
        codecs = [c if isinstance(c, dict) else {"name": c} for c in doc["codecs"]]
        names = [c.get("name") for c in codecs]
        endian = (codecs[0].get("configuration") or {}).get("endian") if codecs else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if (names not in (["bytes"], ["bytes", "crc32c"]) or endian != "little"
            or not np.little_endian or sep not in ("/", ".") or not shape
            or len(chunks) != len(shape) or shape[1:] != chunks[1:]
            or min(chunks) < 1 or min(shape) < 0):
        return None
    folder = root / label
    return shape, chunks, RawLayout(
        label=label, folder=str(folder / "c" if sep == "/" else folder),
        prefix="" if sep == "/" else "c.", tail=f"{sep}0" * (len(shape) - 1),
        shape=(chunks[0], *shape[1:]), dtype=np.dtype(doc["data_type"]), crc=len(names) == 2)


def raw_layout(arr: zarr.Array, zstore: Any) -> RawLayout | None:
    """The chunk files of `arr` when it is stored raw on a local disk; None when it must be
    read through zarr."""
    meta: Any = arr.metadata
    codecs: tuple[Any, ...] = tuple(getattr(meta, "codecs", ()))
    names = [type(c).__name__ for c in codecs]
    encoding: Any = getattr(meta, "chunk_key_encoding", None)
    raw = (
        isinstance(zstore, zarr.storage.LocalStore)
        and names in (["BytesCodec"], ["BytesCodec", "Crc32cCodec"])
        and str(getattr(codecs[0], "endian", "little")).endswith("little")
        and np.little_endian
        and all(s == c for s, c in zip(arr.shape[1:], arr.chunks[1:], strict=True))
        and type(encoding).__name__ == "DefaultChunkKeyEncoding"
        and getattr(encoding, "separator", None) in ("/", ".")
    )
    if not raw:
        return None
    folder = Path(str(zstore.root)) / arr.path
    sep = encoding.separator
    return RawLayout(
        label=arr.path, folder=str(folder / "c" if sep == "/" else folder),
        prefix="" if sep == "/" else "c.", tail=f"{sep}0" * (arr.ndim - 1),
        shape=(arr.chunks[0], *arr.shape[1:]), dtype=np.dtype(arr.dtype), crc=len(codecs) == 2,
    )
