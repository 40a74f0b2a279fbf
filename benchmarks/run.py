"""`make bench`: measure actdb against the tools a researcher would use instead.

Every figure is a ratio against a baseline measured in the same run, on the same data, with
fixed seeds; a timed ratio is the median of per-round ratios, each round timing the two sides
back to back in alternating order, with the spread printed (method.py). Writes BENCHMARKS.md
(or `--output`) with the machine described, its load, and the command.

    python benchmarks/run.py [--scale full|medium|tiny] [--output BENCHMARKS.md]
                             [--workdir bench-data] [--only full-scan,selective,...]
                             [--device cpu|cuda] [--keep-going]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_model  # noqa: E402
import footprint  # noqa: E402
import ingest_cost  # noqa: E402
import nearest  # noqa: E402
import scan_functions  # noqa: E402
import scans  # noqa: E402
from report import Result, machine, write_report  # noqa: E402
from scan_data import ScanData  # noqa: E402


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


# The workloads on the synthetic scan store, and those that ingest a model of their own.
SCAN_WORKLOADS = ("full-scan", "selective", "nearest", "contention", "functions", "aggregates",
                  "start-up", "memory", "storage")
WORKLOADS = ("ingest", "recompute", "lens", "lens-computed", "images", *SCAN_WORKLOADS)


def _workloads(text: str) -> set[str]:
    names = {w.strip() for w in text.split(",") if w.strip()}
    unknown = sorted(names - set(WORKLOADS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {unknown}; they are "
                                         f"{', '.join(WORKLOADS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"))
    ap.add_argument("--workdir", type=Path, default=Path("bench-data"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the generated data")
    ap.add_argument("--only", default=None, type=_workloads,
                    help="a comma-separated list of the workloads to run, of "
                         f"{', '.join(WORKLOADS)} (full-scan: the full scan and its checksum "
                         "cost; recompute runs the lens looked up and the lens computed "
                         "too); all by default")
    ap.add_argument("--device", default="cpu",
                    help="where queries, the ingest and the torch baselines run: cpu or cuda")
    ap.add_argument("--keep-going", action="store_true",
                    help="record a workload that fails (its error in the report) and go on")
    args = ap.parse_args(argv)
    bench_model.DEVICE = args.device
    scale = SCALES[args.scale]
    repeats = args.repeats or (3 if scale.name == "full" else 1)
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    load_at_start = os.getloadavg()  # other work on the machine changes every figure
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results: list[Result] = []

    def report() -> None:  # after every workload: a run stopped part-way keeps what it measured
        write_report(args.output, results, machine(load_at_start), command=command.strip(),
                     seconds=time.perf_counter() - started, scale=scale.name)

    def step(name: str, run: Callable[[], Result | list[Result]]) -> None:
        load = os.getloadavg()[0]  # other work on the machine moves every figure: say it
        try:
            got = run()
        except Exception as e:  # noqa: BLE001 - with --keep-going, a failure is a figure too
            if not args.keep_going:
                raise
            traceback.print_exc()
            got = Result(title=f"{name} (failed)", what=f"Failed: {type(e).__name__}: {e}",
                         notes=["```", *traceback.format_exc().splitlines()[-12:], "```"])
        for r in got if isinstance(got, list) else [got]:
            r.figure("load average (1 min) when it started and ended",
                     f"{load:.2f}, {os.getloadavg()[0]:.2f}")
            results.append(r)
        report()

    only: set[str] = args.only or set(WORKLOADS)
    try:
        if "ingest" in only:
            step("1. Ingest overhead",
                 lambda: ingest_cost.ingest_overhead(scale, work, repeats))
        if only & {"recompute", "lens-computed"}:
            import lens_computed
            import stored_vs_recompute as svr

            ingested = svr.Ingested.build(scale, work)
            if "recompute" in only:
                step("17. Stored vs recompute", lambda: svr.angle_query(ingested, repeats))
            step("22. The lens computed",
                 lambda: lens_computed.lens_computed(ingested, repeats))
        if only & {"recompute", "lens"}:
            import lens_lookup

            lensed = lens_lookup.LensStore.build(scale, work)
            step("19. The lens looked up", lambda: lens_lookup.lens_lookup(lensed, repeats))
        if "images" in only:
            import images

            step("15. Image ingest", lambda: images.image_ingest(work, repeats, scale.name))
        if only & set(SCAN_WORKLOADS):
            scan = ScanData.build(scale, work)
            if "full-scan" in only:
                step("2. Full scan", lambda: scans.full_scan(scan, repeats))
                step("7. Checksum cost", lambda: scans.checksum_cost(scan, repeats))
            if "selective" in only:
                step("3. Selective query", lambda: scans.selective(scan, repeats))
            if "nearest" in only:
                step("4. Nearest anchors", lambda: nearest.nearest(scan, repeats))
            if "contention" in only:
                step("8. Full scan under contention", lambda: scans.contention(scan, repeats))
            if "functions" in only:
                step("12. Other functions",
                     lambda: scan_functions.function_scans(scan, repeats))
            if "aggregates" in only:
                step("13. Vector aggregates", lambda: scan_functions.aggregates(scan, repeats))
            if "start-up" in only:
                step("9. Start-up", lambda: footprint.start_up(scan, repeats))
            if "memory" in only:
                step("6. Memory", lambda: footprint.memory(scan))
            if "storage" in only:
                step("5. Storage", lambda: footprint.storage(scan))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report()
    print(f"wrote {args.output} in {time.perf_counter() - started:.0f} s", file=sys.stderr)

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
