"""Where an ingest's CPU goes, thread by thread: the CPU time of each of the process's threads
over one ingest, read from /proc/self/task (Linux) every 20 ms while it runs.

    python benchmarks/ingest_threads.py [--prompts 32] [--workdir /tmp/actdb-ingest-threads]

The model and prompts are the ingest benchmark's (bench_model.py: GPT-2-small shape, random
weights, fixed seed, 128-token prompts), batch size 8, on the CPU, into a new store after one
warm-up ingest. Threads that already ran before the ingest (the main thread, torch's OpenMP
workers) are told apart from the ones the ingest starts (its commit and writer threads).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import gpt2_small  # noqa: E402
from run import SCALES  # noqa: E402

import actdb  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_by_thread() -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of this process."""
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/actdb-ingest-threads"))
    args = ap.parse_args()
    g = gpt2_small(SCALES["medium"])
    model, tokenizer, prompts = g.model, g.tokenizer, g.prompts
    prompts = prompts[: args.prompts]
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    actdb.ingest(args.workdir / "warm.actdb", model=model, tokenizer=tokenizer,
                 prompts=prompts[:8], batch_size=8, device="cpu", name="gpt2")

    last: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:  # a thread's last reading before it ends is what it used
        while not done.is_set():
            last.update(_cpu_by_thread())
            time.sleep(0.02)

    before = _cpu_by_thread()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    actdb.ingest(args.workdir / "run.actdb", model=model, tokenizer=tokenizer,
                 prompts=prompts, batch_size=8, device="cpu", name="gpt2")
    wall = time.perf_counter() - t
    done.set()
    sampler.join()
    last.update(_cpu_by_thread())
    share: Counter[str] = Counter()
    for tid, cpu in last.items():
        if tid == sampler.native_id:
            continue
        if tid == os.getpid():
            label = "main thread"
        elif tid in before:
            label = "threads there before the ingest (torch's OpenMP workers, zarr's I/O)"
        else:
            label = "threads the ingest started (commit, writers)"
        share[label] += cpu - before.get(tid, 0.0)
    print(f"ingest of {len(prompts)} prompts: {wall:.2f} s wall, "
          f"{sum(share.values()):.2f} s CPU")
    for label, cpu in share.most_common():
        print(f"  {cpu:6.2f} s  {label}")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
