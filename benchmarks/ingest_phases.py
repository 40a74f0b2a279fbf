"""Where an ingest's time goes: each step of `actdb.ingest` timed inside one run.

    python benchmarks/ingest_phases.py [--prompts 1] [--repeats 3] [--device cpu]
                                       [--timeline] [--workdir /tmp/phases]

The model is the ingest benchmark's (bench_model.py: GPT-2-small shape, random weights, fixed
seed, 128-token prompts), ingested into a new store each run, batch size 8, on `--device`.
Steps on the commit thread (registering the model, sizing the arrays, committing batches)
overlap the forward passes, so the steps do not add up to the wall time. Prints the median of
each step over the runs after one warm-up run; with `--timeline`, also the last run's steps in
the order they started, with their thread, start and end (seconds from the ingest's start), the
model's forward passes among them (on a GPU, each step ends when its host code returns).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_model import gpt2_small  # noqa: E402
from run import SCALES  # noqa: E402

import actdb  # noqa: E402
from actdb.ingestion import logits, process, run  # noqa: E402
from actdb.store.store import Store  # noqa: E402

STEPS = {
    process: ["find_sites", "register", "plan_work"],
    run.BatchRunner: ["run"],
    Store: ["open_or_create", "register_model", "reserve_rows", "commit_batch", "close"],
    logits.LogitFit: ["transform"],
    logits.LogitCheck: ["error"],
}
seconds: dict[str, float] = defaultdict(float)
events: list[tuple[str, str, float, float]] = []  # (thread, step, start, end)


def _timed(owner: Any, name: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            end = time.perf_counter()
            seconds[name] += end - t
            events.append((threading.current_thread().name, name, t, end))

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/actdb-ingest-phases"))
    args = ap.parse_args()
    for owner, names in STEPS.items():
        for name in names:
            _timed(owner, name)
    g = gpt2_small(SCALES["medium"])
    model, tokenizer, prompts = g.model, g.tokenizer, g.prompts
    _timed(model.transformer, "forward")  # the model's forward passes (the ingest's base model)
    prompts = prompts[: args.prompts]
    runs: dict[str, list[float]] = defaultdict(list)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    for i in range(args.repeats + 1):
        seconds.clear()
        events.clear()
        t = time.perf_counter()
        actdb.ingest(args.workdir / f"run-{i}.actdb", model=model, tokenizer=tokenizer,
                     prompts=prompts, batch_size=8, device=args.device, name="gpt2")
        seconds["wall"] = time.perf_counter() - t
        start = t
        shutil.rmtree(args.workdir / f"run-{i}.actdb")
        if i > 0:  # the first run warms up
            for k, v in seconds.items():
                runs[k].append(v)
    print(f"ingest of {len(prompts)} prompt(s) on {args.device}, {torch.get_num_threads()} "
          f"torch threads, median of {args.repeats}:")
    for k, v in sorted(runs.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {k:16s} {statistics.median(v):6.3f} s")
    if args.timeline:
        print("the last run, step by step (thread, start, end, seconds):")
        for thread, name, a, b in sorted(events, key=lambda e: e[2]):
            print(f"  {thread[:14]:14s} {a - start:7.3f} {b - start:7.3f} {b - a:7.3f}  {name}")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
