"""A full scan on 1 vs 2 Dask workers, against the same scan in one process, same run.

    python benchmarks/cluster_scan.py [--tokens 65536] [--repeats 3] [--workdir bench-data]

The store is synthetic (benchmarks/generate.py, fixed seed): 4 LayerNorm sites of width 768.
Each figure is the median of `--repeats` runs after one warm-up run (which also lets every
worker open the store); cluster start-up is not counted. Prints a Markdown section for
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from generate import Shape, generate  # noqa: E402

import actdb  # noqa: E402

QUERY = "SELECT avg(cosine_to_anchor(vec, 'w123')) FROM acts"


def _median(db: actdb.Database, repeats: int) -> tuple[float, float]:
    value = db.sql(QUERY).fetchall()[0][0]  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        db.sql(QUERY).fetchall()
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(value)


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
    rows: list[tuple[str, float, float]] = []
    with actdb.connect(store, device="cpu") as db:
        rows.append(("one process (no cluster)", *_median(db, args.repeats)))
    for workers in (1, 2):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                          host="127.0.0.1", dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client, \
                actdb.connect(store, device="cpu", cluster=client) as db:
            rows.append((f"Dask, {workers} worker process{'es' if workers > 1 else ''}",
                         *_median(db, args.repeats)))
    base = rows[0][1]
    print(f"`{QUERY}` over {n:,} stored vectors of width 768 ({args.tokens:,} tokens x 4 "
          f"sites), median of {args.repeats} after a warm-up:\n")
    for name, seconds, value in rows:
        print(f"- {name}: {seconds:.2f} s, {n / seconds / 1e6:.2f} M rows/s, "
              f"{base / seconds:.2f}x one process (mean cosine {value:.6f})")


if __name__ == "__main__":
    main()
