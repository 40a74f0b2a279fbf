"""A full scan on 1 vs 2 Dask workers, against the same scan in one process, same run.

    python benchmarks/cluster_scan.py [--tokens 65536] [--repeats 3] [--workdir bench-data]

The store is synthetic (benchmarks/generate.py, fixed seed): 4 LayerNorm sites of width 768.
Each figure is the median of `--repeats` interleaved runs after one warm-up run (which also
lets every worker open the store); cluster start-up is not counted. Prints a Markdown section for
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from generate import Shape, generate  # noqa: E402

import actdb  # noqa: E402

QUERY = "SELECT avg(cosine_to_anchor(vec, 'w123')) FROM acts"


def _timed(db: actdb.Database, threads: int | None) -> tuple[float, float]:
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        value = db.sql(QUERY).fetchall()[0][0]
        return time.perf_counter() - start, float(value)
    finally:
        torch.set_num_threads(before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("bench-data"))
    args = ap.parse_args()
    from distributed import Client, LocalCluster

    store = args.workdir / f"cluster-scan-{args.tokens}.actdb"
    if not store.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        generate(store, tokens=args.tokens, shape=Shape())
    n = args.tokens * Shape().n_sites
    with ExitStack() as stack:
        local = stack.enter_context(actdb.connect(store, device="cpu"))
        runs: list[tuple[str, actdb.Database, int | None]] = [
            ("one process, torch's default threads", local, None),
            ("one process, 1 torch thread", local, 1)]
        for workers in (1, 2):
            cluster = stack.enter_context(LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address=None, silence_logs=logging.ERROR))
            client = stack.enter_context(Client(cluster))
            db = stack.enter_context(actdb.connect(store, device="cpu", cluster=client))
            runs.append((f"Dask, {workers} single-thread worker process"
                         f"{'es' if workers > 1 else ''}", db, None))
        # One warm-up each (workers open the store), then the repeats interleaved, so that a
        # change in the machine's load falls on every configuration alike.
        values = [_timed(db, threads)[1] for _, db, threads in runs]
        times: list[list[float]] = [[] for _ in runs]
        for _ in range(args.repeats):
            for i, (_, db, threads) in enumerate(runs):
                times[i].append(_timed(db, threads)[0])
    medians = [statistics.median(t) for t in times]
    base = medians[1]
    print(f"`{QUERY}` over {n:,} stored vectors of width 768 ({args.tokens:,} tokens x 4 "
          f"sites), median of {args.repeats} interleaved runs after a warm-up; ratios against "
          "one process with 1 torch thread:\n")
    for (name, _, _), seconds, value in zip(runs, medians, values, strict=True):
        print(f"- {name}: {seconds:.2f} s, {n / seconds / 1e6:.2f} M rows/s, "
              f"{base / seconds:.2f}x (mean cosine {value:.6f})")


if __name__ == "__main__":
    main()
