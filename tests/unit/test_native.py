"""The full scan's read and compute path: the compiled kernels (actdb/_native.c) against
independent references (float64 NumPy for the row dot products, the crc32c package for the
checksums, the Python read path with its own sentences for every kind of damage for the run
reads), and the chunk cache's waiting thread helping the read-ahead."""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import numpy as np
import pytest

import actdb
from actdb.errors import StoreCorruptError
from actdb.store import chunks
from actdb.store.chunks import RawLayout

if os.environ.get("ACTDB_ALLOW_NO_NATIVE") == "1":  # a machine with no C compiler
    _native = pytest.importorskip("actdb._native")
else:
    # built by `make setup` (pyproject.toml's ext-modules); without it every scan silently
    # takes the slower torch and Python paths, so its absence is a failure here
    from actdb import _native


@pytest.mark.parametrize("d", [1, 7, 31, 32, 33, 64, 100, 768])
def test_f16_dots_match_float64_and_the_portable_path_bit_for_bit(d: int) -> None:
    rng = np.random.default_rng(d)
    n = 301
    x = (rng.standard_normal((n, d)) * rng.choice([1e-3, 1.0, 30.0], (n, 1))).astype(np.float16)
    v = rng.standard_normal(d).astype(np.float32)
    out = np.empty(n, np.float32)
    _native.f16_dots(x, v, out)
    ref = x.astype(np.float64) @ v.astype(np.float64)
    # fused multiply-adds into 32 partial sums: at most about d roundings of float32 each
    bound = d * 2.0**-24 * (np.abs(x.astype(np.float64)) @ np.abs(v.astype(np.float64)))
    assert np.all(np.abs(out - ref) <= bound + 1e-30)
    portable = np.empty(n, np.float32)
    _native.f16_dots(x, v, portable, True)
    assert out.tobytes() == portable.tobytes()


def test_a_rows_dot_does_not_depend_on_the_rows_computed_with_it() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 768)).astype(np.float16)
    v = rng.standard_normal(768).astype(np.float32)
    whole = np.empty(200, np.float32)
    _native.f16_dots(x, v, whole)
    for lo, hi in ((0, 1), (5, 8), (17, 24), (3, 200), (199, 200)):
        part = np.empty(hi - lo, np.float32)
        _native.f16_dots(x[lo:hi], v, part)
        assert part.tobytes() == whole[lo:hi].tobytes()


def test_every_float16_value_is_converted_exactly() -> None:
    """Subnormals, infinities and NaN included: a width-1 dot with 1.0 is the value itself
    (NaN stays NaN)."""
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(-1, 1)
    out = np.empty(len(x), np.float32)
    for portable in (False, True):
        _native.f16_dots(x, np.ones(1, np.float32), out, portable)
        # NumPy's conversion is exact; a sum starts from +0, so -0 comes out +0
        with np.errstate(invalid="ignore"):
            ref = x[:, 0].astype(np.float32) + np.float32(0)
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(out), nan)
        assert out[~nan].tobytes() == ref[~nan].tobytes()


def test_f16_dots_refuse_wrong_shapes() -> None:
    x = np.zeros((4, 8), np.float16)
    with pytest.raises(ValueError, match="not 5 rows of 8"):
        _native.f16_dots(x, np.zeros(8, np.float32), np.empty(5, np.float32))
    with pytest.raises(ValueError, match="items of 4 bytes, not 2"):
        _native.f16_dots(x.astype(np.float32), np.zeros(8, np.float32), np.empty(4, np.float32))
    with pytest.raises(ValueError, match="not C-contiguous"):
        _native.f16_dots(x[:, ::2], np.zeros(4, np.float32), np.empty(4, np.float32))


def _crc32c_bitwise(data: bytes) -> int:
    """CRC-32C one bit at a time, from the polynomial alone (reflected 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_paths() -> None:
    """Every path this CPU has (portable, sse4.2, avx512) against the crc32c package over
    lengths around each path's block sizes (the AVX-512 path's 64 and 256 bytes and its mixed
    blocks of 90,112, the SSE4.2 path's 3 x 256 and 3 x 8192) at unaligned starts, and against
    a bitwise reference."""
    paths = _native.CRC_PATHS
    assert paths[0] == "portable" and paths[-1] == _native.CRC_PATH
    for path in paths:
        assert _native.crc32c(b"123456789", path) == 0xE3069283  # the standard check value
    rng = np.random.default_rng(1)
    lengths = [0, 1, 7, 8, 9, 63, 64, 65, 255, 256, 257, 319, 320, 511, 512, 575, 767, 768,
               769, 1000, 4097, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 5, 90_111, 90_112, 90_113,
               2 * 90_112 + 255, 196_608, 196_611, (1 << 20) + 13]
    lengths += rng.integers(256, 4096, 12).tolist()  # odd lengths past the folding minimum
    for n in lengths:
        data = rng.integers(0, 256, n + 64, dtype=np.uint8)
        for offset in (0, 1, 3, 37):  # unaligned starts
            part = data[offset : offset + n]
            expected = crc32c.crc32c(part.tobytes())
            for path in paths:
                assert _native.crc32c(part, path) == expected, (path, n, offset)
            assert _native.crc32c(part) == expected
    for n in (5, 300, 777):
        part = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert {_native.crc32c(part, path) for path in paths} == {_crc32c_bitwise(part)}
    with pytest.raises(ValueError, match="no path 'sse9' on this CPU"):
        _native.crc32c(b"", "sse9")


def _layout(folder: Path, *, crc: bool, chunks_n: int = 5) -> tuple[RawLayout, np.ndarray]:
    layout = RawLayout(label="models/0/acts/s/direction", folder=str(folder), tail="/0",
                       shape=(4, 24), dtype=np.dtype(np.float16), crc=crc)
    values = np.random.default_rng(2).standard_normal((4 * chunks_n, 24)).astype(np.float16)
    for i in range(chunks_n):
        os.makedirs(folder / str(i), exist_ok=True)
        layout.write(i, values[4 * i : 4 * i + 4])
    return layout, values


def _outcome(layout: RawLayout, first: int, count: int) -> object:
    try:
        return layout.read_run(first, count).tobytes()
    except StoreCorruptError as e:
        return str(e)


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("damage", ["none", "flip", "truncate", "longer", "delete"])
def test_run_reads_agree_with_the_python_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                crc: bool, damage: str) -> None:
    """The same bytes when whole, and the same sentence for each kind of damage."""
    layout, values = _layout(tmp_path, crc=crc)
    victim = Path(layout.path(3))
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    elif damage == "truncate":
        victim.write_bytes(data[:-1])
    elif damage == "longer":
        victim.write_bytes(data + b"\0")
    elif damage == "delete":
        victim.unlink()
    native = _outcome(layout, 1, 4)
    monkeypatch.setattr(chunks, "_native", None)
    python = _outcome(layout, 1, 4)
    assert native == python
    if damage == "none":
        assert native == values[4:20].tobytes()
    elif damage == "flip" and not crc:  # format 1: no checksum to find it, the byte read
        assert isinstance(native, bytes) and native != values[4:20].tobytes()
    else:
        assert isinstance(native, str) and "chunk 3 of array" in native
        if damage == "flip":
            assert "fails its checksum" in native


def _outcome_any(layout: RawLayout, first: int, count: int) -> object:
    try:
        return layout.read_run(first, count).tobytes()
    except (StoreCorruptError, OSError) as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("before", ["none", "missing", "flip"])
def test_run_reads_stop_at_the_first_problem_as_the_python_reader_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str) -> None:
    """A folder where chunk 3's file should be (an error that is not damage) after a missing
    or damaged chunk 1: both readers name the first problem, the same way (review finding:
    the compiled reader read the whole run first)."""
    layout, _ = _layout(tmp_path, crc=True)
    os.replace(layout.path(3), tmp_path / "elsewhere")
    os.makedirs(layout.path(3))  # EISDIR on reading, not ENOENT
    victim = Path(layout.path(1))
    if before == "missing":
        victim.unlink()
    elif before == "flip":
        data = victim.read_bytes()
        victim.write_bytes(data[:5] + bytes([data[5] ^ 4]) + data[6:])
    native = _outcome_any(layout, 0, 5)
    monkeypatch.setattr(chunks, "_native", None)
    assert native == _outcome_any(layout, 0, 5)
    if before == "none":
        assert native.startswith("IsADirectoryError") and layout.path(3) in native
    else:
        assert native.startswith("StoreCorruptError: chunk 1 of array")


def test_read_chunks_refuses_what_would_overflow_or_truncate() -> None:
    # 3 x 2^62 bytes wraps around in 64 bits: the buffer must be measured by division
    with pytest.raises(ValueError, match="smaller than the run"):
        _native.read_chunks([b"/nonexistent"] * 3, bytearray(16), 1 << 62, True, True)
    with pytest.raises(ValueError, match="NUL"):
        _native.read_chunks([b"/etc/hostname\0/x"], bytearray(16), 8, False, False)


class _Counting:
    """actdb._native with its calls counted."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> object:
        fn = getattr(_native, name)

        def counted(*args: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)

        return counted


@pytest.mark.cpu_only  # the kernels are the CPU's; a GPU computes in torch
def test_a_scan_through_the_kernels_matches_the_torch_path(family_store, monkeypatch) -> None:
    """A full scan of `cosine_to_anchor` over runs of chunks (the kernel and the run reads)
    against the same query through torch and the Python reader: float32 rounding apart."""
    from actdb.query import runs

    monkeypatch.setattr(runs, "RUN_CHUNKS", 2)  # the tiny store's chunks make runs
    spy = _Counting()
    monkeypatch.setattr(runs, "_native", spy)
    monkeypatch.setattr(chunks, "_native", spy)
    q = ("SELECT prompt_id, position, site, cosine_to_anchor(vec, ' the') FROM acts "
         "ORDER BY ALL")
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        fast = db.sql(q).fetchall()
    # the product with each chunk's checksum in its pass where this CPU has that kernel
    # (the tiny model's d is a multiple of 64), else read and checked, then f16_dots
    product = "f16_dots_crc" if getattr(_native, "DOTS_CRC", False) else "f16_dots"
    assert spy.calls.get("read_chunks", 0) > 0 and spy.calls.get(product, 0) > 0
    monkeypatch.setattr(runs, "_native", None)
    monkeypatch.setattr(chunks, "_native", None)
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        slow = db.sql(q).fetchall()
    assert [r[:3] for r in fast] == [r[:3] for r in slow]
    a = np.array([np.nan if r[3] is None else r[3] for r in fast])
    b = np.array([np.nan if r[3] is None else r[3] for r in slow])
    assert np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert not np.array_equal(a, b)  # two different reductions: not the same code twice


def test_a_reader_waiting_for_the_read_ahead_reads_the_farthest_queued_read_itself() -> None:
    """ChunkCache.get: while the read-ahead thread is busy with the value asked for, the
    waiting thread takes the read queued farthest ahead and does it (both threads read), and
    a later get of that key is answered from it, errors included."""
    import threading

    from actdb.query.chunk_cache import ChunkCache

    cache = ChunkCache(1 << 20)
    started, release = threading.Event(), threading.Event()
    ran: dict[str, int] = {}

    def load(name: str, value: int) -> np.ndarray:
        ran[name] = threading.get_ident()
        if name == "a":
            started.set()
            release.wait(5)  # the read under way while the query's thread asks for it
        if name == "c":
            release.set()
        if name == "bad":
            raise StoreCorruptError("chunk 9 fails its checksum")
        return np.full(3, value)

    try:
        cache.prefetch(("a",), lambda: load("a", 1))
        assert started.wait(5)
        cache.prefetch(("b",), lambda: load("b", 2))
        cache.prefetch(("bad",), lambda: load("bad", 0))
        cache.prefetch(("c",), lambda: load("c", 3))
        me = threading.get_ident()
        assert cache.get(("a",), lambda: load("a", -1), keep=False).tolist() == [1, 1, 1]
        assert ran["a"] != me and ran["c"] == me  # the farthest queued read, done here
        assert cache.get(("c",), lambda: load("c", -1)).tolist() == [3, 3, 3]  # not read again
        assert cache.get(("b",), lambda: load("b", -1)).tolist() == [2, 2, 2]
        # a second wait took "bad" (or the reader did): its error comes with its value
        with pytest.raises(StoreCorruptError, match="chunk 9"):
            cache.get(("bad",), lambda: load("bad", 0))
    finally:
        release.set()
        cache.close()


def test_constant_columns_are_recognised_exactly_as_pyarrow_compares() -> None:
    """bulk._all_equal (the window path's test that an argument is one constant) against
    pyarrow.compute's equal-and-all, on columns built to fool a bytes comparison."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from actdb.query.bulk import _all_equal

    cases = [
        pa.chunked_array([pa.array(["w123"] * 2048)]), pa.array(["w123"] * 2047 + ["w124"]),
        pa.array(["ab", "", "abab"]),  # the same bytes as "ab" x 3, other values
        pa.array(["", "a"]), pa.array(["a", ""]), pa.array(["", ""]), pa.array(["é", "é"]),
        pa.array(["x", "y"]).slice(1), pa.array(["q", "x", "x"]).slice(1),
        pa.chunked_array([pa.array(["a"]), pa.array(["a"])]), pa.array([b"x", b"x"]),
        pa.array([b"x", b"y"]), pa.array([1, 1, 1]), pa.array([1.0, float("nan")]),
        pa.array([0.0, -0.0]), pa.array([True, True]), pa.array(["w1"] * 3 + ["w2"]),
    ]
    for column in cases:
        first = column[0]
        assert _all_equal(column, first) == pc.all(pc.equal(column, first)).as_py(), column


def test_a_notebooks_float64_default_dtype_changes_nothing(family_store) -> None:
    """torch.set_default_dtype(torch.float64) in the user's session: the kernels still get
    float32 buffers, and the values are the same."""
    import torch

    q = ("SELECT sum(cosine_to_anchor(vec, ' the')), sum(cosine_to_anchor(normed(vec), 5)), "
         "sum(dim_contribution(vec, 3)), sum(logit(vec, 7)), sum(logprob(vec, 7)), "
         "sum(rotation_angle(vec)), count(DISTINCT top_logits(vec, 2)) FROM acts")
    with actdb.connect(family_store("gpt2"), device="cpu") as db:
        before = db.sql(q).fetchall()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with actdb.connect(family_store("gpt2"), device="cpu") as db:
            assert db.sql(q).fetchall() == before
    finally:
        torch.set_default_dtype(old)


def test_two_threads_waiting_on_reads_never_take_the_same_queued_read() -> None:
    """DuckDB calls UDFs from several threads: a read one waiting thread took over must not be
    taken again (or read twice) by another (review finding: KeyError on the stolen key)."""
    import threading
    import time

    from actdb.query.chunk_cache import ChunkCache

    cache = ChunkCache(1 << 20)
    gates = {k: threading.Event() for k in ("k1", "k2", "k3")}
    started = {k: threading.Event() for k in gates}
    loads: list[str] = []

    def load(k: str) -> np.ndarray:
        loads.append(k)
        started[k].set()
        gates[k].wait(10)
        return np.full(2, int(k[1]))

    got: dict[str, object] = {}

    def get(k: str) -> None:
        try:
            got[k] = cache.get((k,), lambda: load(k)).tolist()
        except Exception as e:  # the failure under test
            got[k] = repr(e)

    try:
        for k in ("k1", "k2", "k3"):
            cache.prefetch((k,), lambda k=k: load(k))
        assert started["k1"].wait(10)  # the read-ahead thread reads k1; k2, k3 queued
        a = threading.Thread(target=get, args=("k1",))
        a.start()
        assert started["k3"].wait(10)  # thread a waits for k1 and reads k3 meanwhile
        gates["k1"].set()
        assert started["k2"].wait(10)  # the read-ahead thread has moved on to k2
        b = threading.Thread(target=get, args=("k2",))
        b.start()
        time.sleep(0.3)  # b waits for k2, looking for a queued read to do meanwhile
        for gate in gates.values():
            gate.set()
        a.join(10)
        b.join(10)
        assert got == {"k1": [1, 1], "k2": [2, 2]}
        assert cache.get(("k3",), lambda: load("k3")).tolist() == [3, 3]
        assert sorted(loads) == ["k1", "k2", "k3"]  # each read once
    finally:
        for gate in gates.values():
            gate.set()
        cache.close()


def _split_reference(x: np.ndarray, y: np.ndarray, gain: np.ndarray | None,
                     bias: np.ndarray | None, centered: bool, eps: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The ingest's stored fields and faithfulness figure from their definitions: norm and mean
    in float64 (stored as float32), the direction a float32 division rounded by NumPy to
    float16 (zeros where the norm is 0 or NaN), and the output rebuilt from those in float64."""
    x64 = x.astype(np.float64)
    norm = np.sqrt((x64 * x64).sum(-1)).astype(np.float32)
    mean = x64.mean(-1).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        h = np.where((norm > 0)[:, None], x / norm[:, None], np.float32(0)).astype(np.float16)
    v = (h.astype(np.float32) * norm[:, None]).astype(np.float64)
    w = v - v.mean(-1, keepdims=True) if centered else v
    yh = w / np.sqrt((w * w).mean(-1, keepdims=True) + eps)
    if gain is not None:
        yh = yh * gain.astype(np.float64)
    if bias is not None:
        yh = yh + bias.astype(np.float64)
    y64 = y.astype(np.float64)
    err = np.linalg.norm(yh - y64, axis=-1) / (np.linalg.norm(y64, axis=-1) + 1e-6)
    return h, norm, mean, float(err.max())


@pytest.mark.parametrize("d", [1, 7, 8, 64, 100, 768])
@pytest.mark.parametrize("centered,affine", [(True, "gain_bias"), (False, "gain"),
                                             (True, "none"), (False, "bias")])
@pytest.mark.parametrize("portable", [False, True])
def test_split_rows_gives_the_stored_fields_and_check_of_their_definitions(
        d: int, centered: bool, affine: str, portable: bool) -> None:
    """`split_rows`, the ingest's compiled hook, against `_split_reference` (NumPy, float64):
    the float16 directions bit for bit (rows spanning 1e-9 to 1e3 within a row, so that
    directions fall in float16's subnormal range and round to zero; a row of zeros; NaN
    handling apart), the norms and means to float32 rounding, and the worst relative error of
    the rebuilt output against an output that differs from it by a known amount."""
    rng = np.random.default_rng(d * 10 + portable)
    n = 257
    scale = 10.0 ** rng.uniform(-9, 3, (n, d))
    x = (rng.standard_normal((n, d)) * scale).astype(np.float32)
    x[5] = 0.0
    x[6] = x[6] * 1e-30  # tiny: a norm of about 1e-30 still gives unit directions
    gain = rng.uniform(0.5, 1.5, d).astype(np.float32) if "gain" in affine else None
    bias = rng.normal(0, 0.1, d).astype(np.float32) if "bias" in affine else None
    eps = 1e-5
    # the module's "real" output: the exact one, moved by a known relative amount per row
    x64 = x.astype(np.float64)
    w = x64 - x64.mean(-1, keepdims=True) if centered else x64
    exact = w / np.sqrt((w * w).mean(-1, keepdims=True) + eps)
    exact = exact * (gain if gain is not None else 1.0) + (bias if bias is not None else 0.0)
    y = (exact * (1 + rng.uniform(0, 1e-3, (n, 1)))).astype(np.float32)
    h = np.empty((n, d), np.float16)
    norm, mean = np.empty(n, np.float32), np.empty(n, np.float32)
    worst = _native.split_rows(x, y, h, norm, mean, b"" if gain is None else gain.tobytes(),
                               b"" if bias is None else bias.tobytes(), d, centered, eps,
                               portable)
    ref_h, ref_norm, ref_mean, ref_worst = _split_reference(x, y, gain, bias, centered, eps)
    assert np.array_equal(h.view(np.uint16), ref_h.view(np.uint16))
    np.testing.assert_allclose(norm, ref_norm, rtol=2**-23, atol=0)
    np.testing.assert_allclose(mean, ref_mean, rtol=2**-23, atol=1e-45)
    assert worst == pytest.approx(ref_worst, rel=1e-9, abs=1e-15)
    assert (h[5] == 0).all() and norm[5] == 0


@pytest.mark.parametrize("d", [512, 515])
def test_split_rows_paths_agree_and_a_nan_is_the_worst(d: int) -> None:
    """The AVX2 path (F16C rounding) and the portable path (rounding in C, the same sums in
    the same order) store the same bits, directions, norms and means, over a million values of
    every magnitude, ties included, and report the same figure to the bit; a row holding NaN
    makes the figure NaN (so the ingest's check fails) and stores a zero direction, as
    norms.split does."""
    rng = np.random.default_rng(d)
    n = 2048
    x = (rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-9, 3, (n, d))).astype(np.float32)
    y = rng.standard_normal((n, d)).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, d).astype(np.float32).tobytes()
    bias = rng.normal(0, 0.1, d).astype(np.float32).tobytes()
    out = []
    for portable in (False, True):
        h = np.empty((n, d), np.float16)
        norm, mean = np.empty(n, np.float32), np.empty(n, np.float32)
        worst = _native.split_rows(x, y, h, norm, mean, gain, bias, d, True, 1e-5, portable)
        out.append((h.view(np.uint16).copy(), norm, mean, worst))
    assert np.array_equal(out[0][0], out[1][0])
    assert np.array_equal(out[0][1], out[1][1]) and np.array_equal(out[0][2], out[1][2])
    assert out[0][3] == out[1][3]
    x[3, 7] = np.nan
    for portable in (False, True):
        h = np.empty((n, d), np.float16)
        norm, mean = np.empty(n, np.float32), np.empty(n, np.float32)
        assert np.isnan(_native.split_rows(x, y, h, norm, mean, b"", b"", d, True, 1e-5,
                                           portable))
        assert (h[3] == 0).all()


def _split_case(seed: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    rng = np.random.default_rng(seed)
    n, d = 2049, 100
    x = (rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-6, 3, (n, 1))).astype(np.float32)
    y = rng.standard_normal((n, d)).astype(np.float32)
    return x, y, rng.uniform(0.5, 1.5, d).astype(np.float32).tobytes()


def _split(x: np.ndarray, y: np.ndarray, gain: bytes, threads: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    n, d = x.shape
    h = np.full((n, d), 7, np.float16)  # rows left unwritten would show
    norm, mean = np.full(n, 7, np.float32), np.full(n, 7, np.float32)
    worst = _native.split_rows(x, y, h, norm, mean, gain, b"", d, True, 1e-5, False, threads)
    return h.view(np.uint16), norm, mean, worst


def _same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("threads", [2, 3, 5, 2])
def test_split_rows_on_threads_stores_the_one_thread_bits(threads: int) -> None:
    """With `threads`, split_rows shares its rows among threads (the ingest's hook): every
    row's fields are the same bits as one thread's, over a row count no thread count divides,
    and the figure is the same; a NaN in the first row or the last (the first and the last
    thread's runs) still makes it NaN. The last case asks for fewer threads than the pool
    holds after the one before."""
    if sys.platform != "win32":
        assert _native.split_pool(), "a POSIX build shares the rows among threads"
    x, y, gain = _split_case(threads)
    one, shared = _split(x, y, gain, 1), _split(x, y, gain, threads)
    assert _same(one[:3], shared[:3])
    assert one[3] == shared[3] and one[3] > 0
    for row in (0, x.shape[0] - 1):
        bad = x.copy()
        bad[row, 3] = np.nan
        assert np.isnan(_split(bad, y, gain, threads)[3])


def test_split_rows_from_several_threads_at_once_and_after_fork() -> None:
    """Callers on several Python threads at once (one holds the pool, the others run alone)
    each get their own rows' one-thread bits; a forked child, which has none of the parent's
    workers, starts its own and gets the same bits."""
    cases = [_split_case(10 + k) for k in range(4)]
    expected = [_split(*case, 1) for case in cases]
    _split(*cases[0], 3)  # the pool exists before the fork below
    with ThreadPoolExecutor(4) as workers:
        for _ in range(5):
            got = list(workers.map(lambda case: _split(*case, 3), cases))
            assert all(_same(g, e) for g, e in zip(got, expected, strict=True))
    if not hasattr(os, "fork"):
        return
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only when its threads give the same bits
        ok = all(_same(_split(*case, 3), e) for case, e in zip(cases, expected, strict=True))
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("a forked child's split_rows on threads did not finish in 60 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_split_rows_refuses_sizes_that_disagree() -> None:
    x = np.zeros((4, 8), np.float32)
    h = np.empty((4, 8), np.float16)
    norm, mean = np.empty(4, np.float32), np.empty(4, np.float32)
    for args in ((x, x[:3], h, norm, mean, b"", b"", 8),
                 (x, x, h[:3], norm, mean, b"", b"", 8),
                 (x, x, h, norm[:3], mean, b"", b"", 8),
                 (x, x, h, norm, mean, b"\0" * 12, b"", 8),
                 (x, x, h, norm, mean, b"", b"", 5)):
        with pytest.raises(ValueError, match="split_rows"):
            _native.split_rows(*args, True, 1e-5)
