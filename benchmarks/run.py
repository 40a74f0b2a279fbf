"""`make bench`: measure actdb against the tools a researcher would use instead.

Every figure is a ratio against a baseline measured in the same run, on the same data, with
fixed seeds; times are the median of `--repeats` runs after one warm-up (warm page cache).
Writes BENCHMARKS.md (or `--output`) with the machine described and the command.

    python benchmarks/run.py [--scale full|medium|tiny] [--output BENCHMARKS.md]
                             [--workdir bench-data] [--only full-scan|ingest|start-up]
                             [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import workloads  # noqa: E402
from report import machine, write_report  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Scale:
    name: str
    # ingest workload: a GPT-2-small-shaped model
    d: int
    layers: int
    heads: int
    vocab: int
    prompts: int
    prompt_tokens: int
    batch_size: int
    # scan workloads: a synthetic store
    scan_sites: int
    scan_tokens: int
    big_tokens: int
    nearest_rows: int


SCALES = {
    "full": Scale(name="full", d=768, layers=12, heads=12, vocab=50257, prompts=32,
                  prompt_tokens=128, batch_size=8, scan_sites=4, scan_tokens=262144,
                  big_tokens=720896, nearest_rows=8192),
    # A quarter of full scale for the scans; the memory workload's store is not grown past
    # the scan's (a machine shared with other work).
    "medium": Scale(name="medium", d=768, layers=12, heads=12, vocab=50257, prompts=32,
                    prompt_tokens=128, batch_size=8, scan_sites=4, scan_tokens=65536,
                    big_tokens=65536, nearest_rows=8192),
    "tiny": Scale(name="tiny", d=64, layers=2, heads=4, vocab=1000, prompts=4,
                  prompt_tokens=16, batch_size=2, scan_sites=2, scan_tokens=2048,
                  big_tokens=4096, nearest_rows=128),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    ap.add_argument("--workdir", type=Path, default=Path("bench-data"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the generated data")
    ap.add_argument("--only", choices=["full-scan", "ingest", "start-up"], default=None,
                    help="run only the full scan and its checksum cost, only the ingest, or "
                         "only the start-up")
    ap.add_argument("--device", default="cpu",
                    help="where queries, the ingest and the torch baselines run: cpu or cuda")
    args = ap.parse_args(argv)
    workloads.DEVICE = args.device
    scale = SCALES[args.scale]
    repeats = args.repeats or (3 if scale.name == "full" else 1)
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    load_at_start = os.getloadavg()  # other work on the machine changes every figure
    results = []
    try:
        if args.only in (None, "ingest"):
            results.append(workloads.ingest_overhead(scale, work, repeats))
        scan = workloads.ScanData.build(scale, work) if args.only != "ingest" else None
        if scan is not None and args.only in (None, "full-scan"):
            full_scan = workloads.full_scan(scan, repeats)
            results += [full_scan, workloads.checksum_cost(scan, repeats)]
        if args.only is None and scan is not None:
            results.append(workloads.selective(scan, repeats, full_scan))
            results.append(workloads.nearest(scan, repeats))
            results.append(workloads.contention(scan, repeats))
            results.append(workloads.function_scans(scan, repeats))
            results.append(workloads.aggregates(scan, repeats))
            results.append(workloads.start_up(scan, repeats))
            results.append(workloads.memory(scan))
            results.append(workloads.storage(scan))
        if args.only == "start-up" and scan is not None:
            results.append(workloads.start_up(scan, repeats))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(args.output, results, machine(load_at_start), command=command.strip(),
                 seconds=time.perf_counter() - started, scale=scale.name)
    print(f"wrote {args.output} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
