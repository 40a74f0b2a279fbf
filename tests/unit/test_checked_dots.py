"""The full scan's product with each chunk's CRC-32C checked in the same pass
(`_native.f16_dots_crc`, `RawLayout.read_run_dots`): the products bit for bit those of
`f16_dots`, every damaged chunk found (against the crc32c package's checksums), and every kind
of damage named as the checked run reader (`read_run`) names it; the same for one chunk read
with its products (`RawLayout.read_with_dots`, a selective query's read) against `read`."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest

from actdb.errors import StoreCorruptError
from actdb.store import chunks
from actdb.store.chunks import RawLayout
from actdb.store.digests import ChunkDigests

_native = pytest.importorskip("actdb._native")
needs_kernel = pytest.mark.skipif(not getattr(_native, "DOTS_CRC", False),
                                  reason="f16_dots_crc needs AVX2 and the AVX-512 CRC path")


def _crcs(x: np.ndarray, rows: int) -> np.ndarray:
    return np.array([crc32c.crc32c(x[c : c + rows].tobytes()) for c in range(0, len(x), rows)],
                    dtype=np.uint32)


@needs_kernel
@pytest.mark.parametrize(("d", "rows"), [(64, 1), (128, 4), (768, 7)])
def test_products_are_f16_dots_bits_and_every_damaged_chunk_is_found(d: int, rows: int) -> None:
    rng = np.random.default_rng(d)
    n_chunks = 5
    x = rng.standard_normal((rows * n_chunks, d)).astype(np.float16)
    v = rng.standard_normal(d).astype(np.float32)
    crcs = _crcs(x, rows)
    want, got = np.empty(len(x), np.float32), np.empty(len(x), np.float32)
    _native.f16_dots(x, v, want)
    assert _native.f16_dots_crc(x, v, got, rows, crcs) == -1
    assert want.tobytes() == got.tobytes()
    chunk_bytes = rows * d * 2
    for c in range(n_chunks):
        for where in (0, 1, chunk_bytes // 2 + 3, chunk_bytes - 1):  # its first and last bytes
            damaged = x.copy()
            flat = damaged.reshape(-1).view(np.uint8)
            flat[c * chunk_bytes + where] ^= 1 << (where % 8)
            assert _native.f16_dots_crc(damaged, v, got, rows, crcs) == c
            if c + 1 < n_chunks:  # a later chunk damaged too: the first is named
                flat[-1] ^= 0x80
                assert _native.f16_dots_crc(damaged, v, got, rows, crcs) == c


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_check() -> None:
    x = np.zeros((8, 96), np.float16)
    out = np.empty(8, np.float32)
    with pytest.raises(ValueError, match="d a multiple of 64"):
        _native.f16_dots_crc(x, np.zeros(96, np.float32), out, 4, np.zeros(2, np.uint32))
    x = np.zeros((8, 64), np.float16)
    with pytest.raises(ValueError, match="whole chunks"):
        _native.f16_dots_crc(x, np.zeros(64, np.float32), out, 3, np.zeros(3, np.uint32))
    with pytest.raises(ValueError, match="a CRC a chunk"):
        _native.f16_dots_crc(x, np.zeros(64, np.float32), out, 4, np.zeros(1, np.uint32))


def _layout(folder: Path, d: int) -> tuple[RawLayout, np.ndarray]:
    layout = RawLayout(label="models/0/acts/s/direction", folder=str(folder), tail="/0",
                       shape=(4, d), dtype=np.dtype(np.float16), crc=True)
    values = np.random.default_rng(d).standard_normal((20, d)).astype(np.float16)
    for i in range(5):
        os.makedirs(folder / str(i), exist_ok=True)
        layout.write(i, values[4 * i : 4 * i + 4])
    return layout, values


def _products(layout: RawLayout, v: np.ndarray, expect: ChunkDigests | None = None) -> object:
    arrays = None if expect is None else expect.for_array(layout.label)
    try:
        return layout.read_run_dots(1, 3, v, expect=arrays).tobytes()
    except StoreCorruptError as e:
        return str(e)


def _reference(layout: RawLayout, v: np.ndarray, expect: ChunkDigests | None = None) -> object:
    """The run read and checked by `read_run`, then `f16_dots`."""
    arrays = None if expect is None else expect.for_array(layout.label)
    try:
        data = layout.read_run(1, 3, expect=arrays)
    except StoreCorruptError as e:
        return str(e)
    out = np.empty(len(data), np.float32)
    _native.f16_dots(data, v, out)
    return out.tobytes()


def _one(layout: RawLayout, v: np.ndarray, expect: ChunkDigests | None = None,
         into: np.ndarray | None = None) -> object:
    """Chunk 2 read with its products: (values, products) as bytes, or the error."""
    arrays = None if expect is None else expect.for_array(layout.label)
    try:
        values, dots = layout.read_with_dots(2, v, expect=arrays, into=into)
    except StoreCorruptError as e:
        return str(e)
    if dots is None:  # where the kernel cannot check: the values alone, products made apart
        dots = np.empty(len(values), np.float32)
        _native.f16_dots(values, v, dots)
    return values.tobytes(), dots.tobytes()


def _one_reference(layout: RawLayout, v: np.ndarray,
                   expect: ChunkDigests | None = None) -> object:
    """Chunk 2 read and checked by `read`, then `f16_dots`."""
    arrays = None if expect is None else expect.for_array(layout.label)
    try:
        values = layout.read(2, expect=arrays)
    except StoreCorruptError as e:
        return str(e)
    out = np.empty(len(values), np.float32)
    _native.f16_dots(values, v, out)
    return values.tobytes(), out.tobytes()


def _damage(layout: RawLayout, damage: str) -> None:
    victim = Path(layout.path(2))
    data = victim.read_bytes()
    if damage in ("flip", "flip then delete"):
        victim.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    elif damage == "flip last":  # the last byte of the values, before the stored CRC
        victim.write_bytes(data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:])
    elif damage == "truncate":
        victim.write_bytes(data[:-1])
    elif damage == "longer":
        victim.write_bytes(data + b"\0")
    elif damage == "delete":
        victim.unlink()
    if damage == "flip then delete":  # a later chunk missing: the first problem is named
        Path(layout.path(3)).unlink()


@pytest.mark.parametrize("d", [64, 24])  # the kernel's path, and read_run's (d not a multiple)
@pytest.mark.parametrize("damage", ["none", "flip", "flip last", "truncate", "longer", "delete",
                                    "flip then delete"])
def test_a_checked_product_names_damage_as_the_run_reader_does(tmp_path: Path, d: int,
                                                               damage: str) -> None:
    layout, values = _layout(tmp_path, d)
    v = np.random.default_rng(1).standard_normal(d).astype(np.float32)
    _damage(layout, damage)
    got = _products(layout, v)
    assert got == _reference(layout, v)
    if damage == "none":
        want = np.empty(12, np.float32)
        _native.f16_dots(values[4:16], v, want)
        assert got == want.tobytes()
    else:
        assert isinstance(got, str) and "chunk 2 of array" in got
        if "flip" in damage:
            assert "fails its checksum" in got


@pytest.mark.parametrize("d", [64, 24])  # the kernel's path, and read's (d not a multiple)
@pytest.mark.parametrize("damage", ["none", "flip", "flip last", "truncate", "longer", "delete"])
def test_one_chunk_with_its_products_is_checked_as_read_checks_it(tmp_path: Path, d: int,
                                                                  damage: str) -> None:
    layout, values = _layout(tmp_path, d)
    v = np.random.default_rng(1).standard_normal(d).astype(np.float32)
    _damage(layout, damage)
    got = _one(layout, v)
    assert got == _one_reference(layout, v)
    # read into a buffer of the caller's (a byte longer: its first `nbytes` used)
    assert _one(layout, v, into=np.full(layout.nbytes + 1, 0xFF, np.uint8)) == got
    if damage == "none":
        want = np.empty(4, np.float32)
        _native.f16_dots(values[8:12], v, want)
        assert got == (values[8:12].tobytes(), want.tobytes())
    else:
        assert isinstance(got, str) and "chunk 2 of array" in got
        if "flip" in damage:
            assert "fails its checksum" in got


def test_a_valid_chunk_in_the_wrong_place_is_named_as_the_run_reader_names_it(
        tmp_path: Path) -> None:
    """Chunks 2 and 3 swapped (each whole by its own CRC): the digests recorded for their
    places (format 5) find it, in the same sentence as `read_run`'s."""
    layout, _ = _layout(tmp_path, 64)
    crcs = [crc32c.crc32c(Path(layout.path(i)).read_bytes()[:-4]) for i in range(5)]
    recorded = (np.arange(5), np.full(5, 4), np.array(crcs, np.uint64))

    def find(wanted: list[int]) -> list[tuple[str, str, int, int]]:
        return [("m", "acts/s/direction", i, 4) for i, c in enumerate(crcs) if c in wanted]

    digests = ChunkDigests(lambda model, array: recorded, find, lambda: {0: "m"})
    v = np.ones(64, np.float32)
    whole = _products(layout, v, digests)
    assert isinstance(whole, bytes) and whole == _reference(layout, v, digests)
    assert _one(layout, v, digests) == _one_reference(layout, v, digests)
    a, b = Path(layout.path(2)), Path(layout.path(3))
    tmp = a.with_name("swap")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)
    got = _products(layout, v, digests)
    assert got == _reference(layout, v, digests)
    assert isinstance(got, str) and "chunk 2 of array" in got
    assert "holds the bytes of chunk 3" in got
    one = _one(layout, v, digests)
    assert one == _one_reference(layout, v, digests) and "holds the bytes of chunk 3" in one


def test_unchecked_and_without_the_kernel_the_products_are_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, _ = _layout(tmp_path, 128)
    v = np.random.default_rng(2).standard_normal(128).astype(np.float32)
    checked = layout.read_run_dots(0, 5, v).tobytes()
    assert layout.read_run_dots(0, 5, v, check=False).tobytes() == checked
    monkeypatch.setattr(chunks, "_NATIVE_DOTS_CRC", False)
    assert layout.read_run_dots(0, 5, v).tobytes() == checked
    values, dots = layout.read_with_dots(2, v)  # without the kernel: no products, the chunk
    assert dots is None and values.tobytes() == layout.read(2).tobytes()
