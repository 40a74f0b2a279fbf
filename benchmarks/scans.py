"""Workloads 2, 3, 7 and 8: the full scan against DuckDB, NumPy and the I/O floor; a selective
query against the full scan; what checksums cost; the scan under contention. Every ratio is
paired round by round (method.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import duckdb
import numpy as np
from method import Ratio, paired, paired_many
from report import Result
from scan_data import TOKEN, ActdbScan, ScanData, numpy_cosines

from actdb.store.store import Store

# -- 2. full scan --------------------------------------------------------------------------


def full_scan(scan: ScanData, repeats: int) -> Result:
    n, d = scan.n_vectors, scan.scale.d
    ours = ActdbScan(scan.store)
    con = duckdb.connect(str(scan.baseline_db), read_only=True)
    anchor_list = scan.anchor.tolist()

    def duck() -> float:
        return con.execute(f"SELECT avg(array_cosine_similarity(v, $a::FLOAT[{d}])) FROM vecs",
                           {"a": anchor_list}).fetchall()[0][0]

    sites = scan.sites()
    group = scan._group()

    def zarr_read() -> None:
        for s in sites:
            arr = group[f"models/0/acts/{s}/direction"]
            for lo in range(0, scan.scale.scan_tokens, 65536):
                np.asarray(arr[lo : lo + 65536])

    # chunk keys with the separator "." (a local store's vectors) or "/"
    acts = scan.store / "tensors.zarr" / "models" / "0" / "acts"
    chunk_files = sorted([*acts.glob("*/direction/c.*"), *acts.glob("*/direction/c/*/0")])
    n_chunks = sum(-(-group[f"models/0/acts/{s}/direction"].shape[0]
                     // group[f"models/0/acts/{s}/direction"].chunks[0]) for s in sites)
    if len(chunk_files) != n_chunks:  # a floor that reads less than the scan is no floor
        raise RuntimeError(f"found {len(chunk_files)} direction chunk files, not {n_chunks}")

    def raw_read() -> None:
        for f in chunk_files:
            np.fromfile(f, dtype=np.float16)

    values = {"actdb": ours(), "duckdb": duck(), "numpy": numpy_cosines(scan)}
    spread = max(values.values()) - min(values.values())
    rounds = max(repeats, 7)  # each side a second or less
    times = paired_many(ours, {"duckdb": duck, "numpy": lambda: numpy_cosines(scan),
                               "raw": raw_read, "zarr": zarr_read}, rounds)
    con.close()
    r = Result(
        title="2. Full scan",
        what=(f"`SELECT avg(cosine_to_anchor(vec, '{TOKEN}')) FROM acts` over {n:,} stored "
              f"vectors of width {d} ({scan.scale.scan_sites} sites x "
              f"{scan.scale.scan_tokens:,} tokens; synthetic store written through the store's "
              f"own API in {scan.generate_seconds:.0f} s). Baselines on the same vectors: "
              f"(a) DuckDB `array_cosine_similarity` over a `FLOAT[{d}]` table; (b) NumPy over a "
              "float16 `.npy` memory map, 65,536 rows a block; (c) reading the same Zarr "
              "direction bytes with no computation, through zarr-python and as raw chunk files "
              f"(the I/O floor is the faster of the two). Each of {rounds} rounds times actdb "
              "beside each baseline, back to back in alternating order."),
    )
    for k, label in (("duckdb", "(a) DuckDB array_cosine_similarity"),
                     ("numpy", "(b) NumPy float16 memmap"), ("zarr", "(c) zarr-python read"),
                     ("raw", "(c) raw chunk-file read")):
        t = times[k].baseline_seconds
        r.figure(label, f"{t:.2f} s, {n / t / 1e6:.2f} M rows/s")
    t_ours = times["duckdb"].seconds
    r.figure("actdb", f"{t_ours:.2f} s, {n / t_ours / 1e6:.2f} M rows/s")
    r.figure("mean cosine (actdb, DuckDB, NumPy)",
             ", ".join(f"{v:.6f}" for v in values.values()) + f" (spread {spread:.1e})")
    floor_key = min(("raw", "zarr"), key=lambda k: times[k].baseline_seconds)
    speed = {k: v.inverted() for k, v in times.items()}
    r.ratio("actdb / DuckDB rows/s", speed["duckdb"], ">= 1.5", speed["duckdb"].median >= 1.5)
    r.ratio("actdb / NumPy rows/s", speed["numpy"], ">= 1.5", speed["numpy"].median >= 1.5)
    r.ratio(f"actdb / I/O floor rows/s ({floor_key} read)", speed[floor_key], ">= 0.5",
            speed[floor_key].median >= 0.5)
    if speed["duckdb"].median < 1.5 or speed[floor_key].median < 0.5:
        r.notes += _scan_profile(ours, t_ours, speed["duckdb"].median,
                                 times[floor_key].baseline_seconds)
    ours.close()
    return r


def _scan_profile(ours: ActdbScan, t_ours: float, vs_duckdb: float, t_floor: float
                  ) -> list[str]:
    """Where a full scan's time goes, from one run under cProfile (shares of its total)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    ours()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def cum(pred: Callable[[str, str], bool], tot: bool = False) -> float:
        return sum((st[2] if tot else st[3]) for (f, _, name), st in stats.items()
                   if pred(f, name))

    total = cum(lambda f, n: n == "submit" and "duckdb" in f)
    # Runs read and multiplied on the query's thread (runs.RunWalk.dots), chunk reads
    # (ChunkCache.get), and waits for the read-ahead thread's runs (Future.result)
    runs = cum(lambda f, n: f.endswith("runs.py") and n == "dots")
    reads = runs + cum(lambda f, n: f.endswith("chunk_cache.py") and n == "get") + cum(
        lambda f, n: f.endswith("_base.py") and n == "result")

    def kernel(n: str) -> bool:  # the compiled kernel, or torch's conversion and product
        return "f16_dots" in n or "copy_" in n or "mul_" in n or "built-in method sum" in n

    # the products made outside a run's task (those inside are counted with the runs)
    compute = sum(tt for (f, _, n), st in stats.items() if kernel(n)
                  for (_, _, caller), (_, _, tt, _) in st[4].items() if caller != "dots")
    in_runs = sum(tt for (f, _, n), st in stats.items() if kernel(n)
                  for (_, _, caller), (_, _, tt, _) in st[4].items() if caller == "dots")
    udf = cum(lambda f, n: f.endswith("execute.py") and n == "udf")
    calls = sum(st[1] for (f, _, n), st in stats.items() if f.endswith("execute.py") and n == "udf")
    glue = max(udf - reads - compute, 0.0)
    outside = max(total - udf, 0.0)
    total = max(total, 1e-9)
    return [
        f"Targets missed in this run. Where the time goes (one scan under cProfile, "
        f"{total:.2f} s with profiling): reading chunk files and their products on the "
        f"query's thread, or waiting for the read-ahead thread's, {reads / total:.0%} (of "
        f"which the products {in_runs / total:.0%}), float16 conversion and dot products "
        f"elsewhere {compute / total:.0%}, per-batch Python work in the UDF (argument "
        f"decoding, grouping, chunk bookkeeping) {glue / total:.0%}, DuckDB itself (the "
        f"join that makes `acts`, calling {calls} UDF batches of at most 2,048 rows, the "
        f"aggregate) {outside / total:.0%}.",
        f"The DuckDB target means the whole query in {t_ours * vs_duckdb / 1.5:.2f} s; reading "
        f"the direction bytes alone from the page cache takes {t_floor:.2f} s here.",
    ]


# -- 3. selective query ----------------------------------------------------------------------


def selective(scan: ScanData, repeats: int) -> Result:
    """1% of the prompts against the full scan, paired round by round."""
    with Store(scan.store) as st:
        n_prompts = int((st.catalog.one("SELECT count(*) FROM prompts") or (0,))[0])
    rng = np.random.default_rng(1)
    ids = sorted(rng.choice(n_prompts, max(1, n_prompts // 100), replace=False).tolist())
    some = ActdbScan(scan.store, "WHERE prompt_id IN (SELECT unnest($ids))", {"ids": ids})
    full = ActdbScan(scan.store)
    ratio = paired(some, full, max(repeats, 7))
    # The same rounds on the CPU clock: a query of a few milliseconds on one thread loses a
    # scheduler slice to the machine's other work far more often, in proportion, than a
    # scan that keeps two threads busy, so its wall-time ratio moves with the load.
    cpu = paired(some, full, max(repeats, 7), clock=time.process_time)
    stats = some.stats
    some.close()
    full.close()
    d = scan.scale.d
    total = scan.n_vectors * (2 * d + 8)
    r = Result(
        title="3. Selective query",
        what=(f"The same function over {len(ids)} of {n_prompts} prompts (1%, chosen at random "
              "with a fixed seed): `... FROM acts WHERE prompt_id IN (SELECT unnest($ids))`, "
              "each on its own connection, against workload 2's full scan, paired round by "
              "round. Bytes read are counted by the query layer's chunk reader (direction, "
              "norm and mean chunks), against all bytes of those arrays."),
    )
    r.figure("time", f"{ratio.seconds * 1000:.1f} ms (full scan "
                     f"{ratio.baseline_seconds * 1000:.0f} ms)")
    r.figure("bytes read", f"{stats['bytes_read']:,} of {total:,} "
                           f"({stats['chunks_read']} chunks)")
    r.ratio("bytes read / array bytes", stats["bytes_read"] / total, "<= 0.03",
            stats["bytes_read"] <= 0.03 * total)
    r.ratio("time / full-scan time", ratio, "<= 0.05", ratio.median <= 0.05)
    r.figure("CPU time (all threads)", f"{cpu.seconds * 1000:.1f} ms (full scan "
                                       f"{cpu.baseline_seconds * 1000:.0f} ms)")
    r.ratio("CPU time / full-scan CPU time", cpu, "(information)", True)
    return r


# -- 7. checksum cost ------------------------------------------------------------------------


def checksum_cost(scan: ScanData, repeats: int) -> Result:
    """Workload 2's query with every chunk's CRC-32C checked (as always for users) and, in
    runs alternating with those, not checked: what integrity costs a full scan."""
    from actdb.store.arrays import crc32c
    from actdb.store.chunks import _native

    crc_path = (f"actdb's, the {_native.CRC_PATH} path" if _native is not None
                else "the crc32c package")

    ours = ActdbScan(scan.store)
    arrays = ours.db.store.arrays

    def check(on: bool) -> Callable[[], None]:
        def setup() -> None:
            arrays.check_checksums = on
        return setup

    # On a shared machine a round's two sides differ by more than the check costs: enough
    # rounds that the median, not one busy moment, says what it costs.
    rounds = max(repeats, 21)
    ratio = paired(ours, ours, rounds, actdb_setup=check(True), baseline_setup=check(False))
    arrays.check_checksums = True
    read = ours.stats.get("bytes_read", 0)
    info = arrays.act_info(0, scan.sites()[0], "direction")
    chunk_bytes = int(np.prod(info.chunks)) * info.dtype.itemsize
    ours.close()
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    t = time.perf_counter()
    crc32c(block)
    crc_rate = block.nbytes / (time.perf_counter() - t)
    # one chunk's bytes, in the core's cache as just read: what the scan's check meets
    chunk = block[:chunk_bytes]
    t = time.perf_counter()
    for _ in range(64):
        crc32c(chunk)
    chunk_rate = 64 * chunk.nbytes / (time.perf_counter() - t)
    r = Result(
        title="7. Checksum cost",
        what=(f"Workload 2's query over the same {scan.n_vectors:,} vectors "
              f"({read / 1e6:,.0f} MB of chunks read a scan), with the CRC-32C of every chunk "
              "checked (always, for users; in the product's own pass over each chunk where "
              "the CPU allows, docs/ENGINE.md) and unchecked "
              "(`Arrays.check_checksums = False`, a benchmark-only switch), paired in "
              f"{rounds} rounds on one connection."),
    )
    r.figure("checked", f"{ratio.seconds:.3f} s (fastest {min(ratio.actdb):.3f} s)")
    r.figure("unchecked", f"{ratio.baseline_seconds:.3f} s (fastest {min(ratio.baseline):.3f} s)")
    r.figure(f"CRC-32C alone ({crc_path}; one 64 MiB buffer, and one {chunk.nbytes:,}-byte "
             "chunk 64 times)", f"{crc_rate / 1e9:.1f} GB/s, {chunk_rate / 1e9:.1f} GB/s")
    r.ratio("checked time / unchecked time", ratio, "<= 1.05", ratio.median <= 1.05)
    return r


# -- 8. contention ---------------------------------------------------------------------------

_SPIN = "import time\nend = time.time() + 900\nwhile time.time() < end:\n    pass\n"


def contention(scan: ScanData, repeats: int) -> Result:
    """Workload 2's scan, quiet and while two CPU-bound processes run; NumPy likewise. The
    busy processes run throughout, stopped (SIGSTOP) for the quiet side of each round and
    resumed (SIGCONT) for the contended one, so each round pairs the two sides back to
    back."""
    ours = ActdbScan(scan.store)
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(2)]

    def signalled(sig: int) -> Callable[[], None]:
        def setup() -> None:
            for p in spinners:
                os.kill(p.pid, sig)
            time.sleep(0.05)  # the scheduler sees the change before the clock starts
        return setup

    rounds = max(repeats, 5)
    ratios: dict[str, Ratio] = {}
    try:
        time.sleep(0.5)
        for key, fn in (("actdb", ours), ("numpy", lambda: numpy_cosines(scan))):
            ratios[key] = paired(fn, fn, rounds, actdb_setup=signalled(signal.SIGCONT),
                                 baseline_setup=signalled(signal.SIGSTOP))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    ours.close()
    r = Result(
        title="8. Full scan under contention",
        what=(f"Workload 2's query over {scan.n_vectors:,} vectors, quiet and while two "
              "CPU-bound Python processes (busy loops) run beside it (stopped with SIGSTOP for "
              f"the quiet runs), paired in {rounds} rounds; the NumPy float16 memmap baseline "
              "of workload 2 measured the same way for comparison."),
    )
    for k, v in ratios.items():
        r.figure(k, f"quiet {v.baseline_seconds:.2f} s, contended {v.seconds:.2f} s")
    r.ratio("actdb contended / quiet time", ratios["actdb"], "<= 2.5",
            ratios["actdb"].median <= 2.5)
    r.ratio("NumPy contended / quiet time", ratios["numpy"], "(information)", True)
    return r
