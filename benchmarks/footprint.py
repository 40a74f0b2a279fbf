"""Workloads 5, 6 and 9: bytes on disk per stored vector, the peak memory of a full scan, and
the CPU time of a query in a fresh process (figures no paired timing makes, except the
start-up's commands, which alternate round by round)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from generate import Shape, generate
from report import Result
from scan_data import ScanData

from actdb.store.store import Store

# -- 5. storage and 6. memory ----------------------------------------------------------------


def storage(scan: ScanData) -> Result:
    d = scan.scale.d
    with Store(scan.store) as st:
        sizes = st.disk_bytes()
        n = int((st.catalog.one("SELECT n_rows FROM models") or (0,))[0]) * scan.scale.scan_sites
    per = sizes["total"] / n
    weights = scan.scale.vocab * d * 4
    r = Result(
        title="5. Storage",
        what=("Bytes on disk per stored (token, site) vector, every file of the store counted "
              f"(catalog, tensors, tokenizers), for the store of workload 6 ({n:,} vectors)."),
    )
    r.figure("store", f"{sizes['total']:,} bytes: catalog {sizes['catalog']:,}, tensors "
                      f"{sizes['tensors']:,} (of which the {weights:,}-byte float32 embedding)")
    r.figure("per vector", f"{per:.1f} bytes; 2d + 16 = {2 * d + 16}")
    grown = n - scan.n_vectors
    r.figure("per vector without the per-model weights",
             f"{(sizes['total'] - weights) / n:.1f} bytes")
    r.ratio("bytes per vector / (2d + 16)", per / (2 * d + 16), "<= 1", per <= 2 * d + 16)
    if grown > 0:  # the memory workload grew the store (not at every scale)
        marginal = (sizes["total"] - scan.scan_bytes) / grown
        r.figure("marginal bytes per vector", f"{marginal:.1f} (growing the store from "
                 f"{scan.n_vectors:,} to {n:,} vectors); the vectors themselves take 2d + 8 "
                 f"= {2 * d + 8}")
        r.ratio("marginal bytes per vector / (2d + 16)", marginal / (2 * d + 16), "<= 1",
                marginal <= 2 * d + 16)
    fixed = sizes["total"] - (2 * d + 8) * n
    if per > 2 * d + 16:
        r.notes.append(
            f"Each vector takes 2d + 8 bytes (float16 direction, float32 norm and mean); the "
            f"rest, {fixed:,} bytes here, is per model and per token: the {weights:,}-byte "
            f"float32 embedding matrix (the anchors and the LM head, kept exact so that "
            f"`logit` reproduces the model's logits) and the catalog. The target leaves 8 "
            f"bytes a vector for all of it, so it is met from about "
            f"{fixed / 8 / 1e6:.0f} M vectors on (a GPT-2-small ingest of 25 sites reaches "
            f"that at about {fixed / 8 / 25 / 1e6:.1f} M tokens); below that the per-model "
            "weights dominate. Storing them as float16 would halve them at the cost of "
            "exact logits.")
    return r


_MEMORY_SCRIPT = """
import json, sys, time
import actdb
t = time.perf_counter()
with actdb.connect(sys.argv[1], device="cpu") as db:
    value = db.sql("SELECT avg(cosine_to_anchor(vec, 'w123')) FROM acts").fetchall()[0][0]
# VmHWM, not ru_maxrss: Linux carries a parent's ru_maxrss across fork and exec.
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": time.perf_counter() - t, "value": value, "max_rss_kb": hwm}))
"""


def memory(scan: ScanData) -> Result:
    shape = Shape(d=scan.scale.d, vocab=scan.scale.vocab, n_sites=scan.scale.scan_sites,
                  prompt_tokens=min(128, scan.scale.scan_tokens // 16))
    generate(scan.store, tokens=scan.scale.big_tokens, shape=shape)
    with Store(scan.store) as st:
        size = st.disk_bytes()["total"]
    n = scan.scale.big_tokens * scan.scale.scan_sites
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(scan.store)],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError("the memory workload's scan failed: "
                           + " | ".join(out.stderr.strip().splitlines()[-4:]))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    rss = got["max_rss_kb"] * 1024
    r = Result(
        title="6. Memory",
        what=(f"Peak resident memory of a full scan (workload 2's query) in a fresh process, "
              f"over the same store grown to {n:,} vectors, {size / 1e9:.2f} GB on disk."),
    )
    r.figure("peak RSS", f"{rss / 2**30:.2f} GiB")
    r.figure("scan", f"{got['seconds']:.1f} s, {n / got['seconds'] / 1e6:.2f} M rows/s")
    r.ratio("peak RSS / 1.5 GB", rss / 1.5e9, "<= 1", rss <= 1.5e9)
    if size < 4e9:
        r.notes.append(f"At this scale the store is {size / 1e9:.2f} GB, under the 4 GB the "
                       "target names: run `--scale full` for the real figure.")
    return r

# -- 9. start-up -----------------------------------------------------------------------------

_START = """
import resource, subprocess, sys
subprocess.run([sys.executable, *sys.argv[1:]], check=True, capture_output=True)
u = resource.getrusage(resource.RUSAGE_CHILDREN)
print(u.ru_utime + u.ru_stime)
"""
# A query that calls a function: sqlglot then reads it too (query/plan.py).
_COUNT = "SELECT count(*) FROM prompts"


def start_up(scan: ScanData, repeats: int) -> Result:
    """CPU time of `actdb query STORE "SELECT 1"`, a fresh process each time."""
    # As installed: the first run writes the package's bytecode, later runs load it (a
    # PYTHONDONTWRITEBYTECODE=1 environment would recompile ~40 modules every run, 0.09 s).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    commands = {
        "select 1": ["-m", "actdb", "query", str(scan.store), "SELECT 1"],
        "count": ["-m", "actdb", "query", str(scan.store), _COUNT],
        "imports": ["-c", "import numpy, duckdb, pyarrow, click"],
        "python": ["-c", "pass"],
    }

    def one(args: list[str]) -> float:
        out = subprocess.run([sys.executable, "-c", _START, *args],
                             capture_output=True, text=True, check=True, env=env)
        return float(out.stdout.strip())

    times: dict[str, list[float]] = {k: [] for k in commands}
    for args in commands.values():
        one(args)
    order = list(commands)
    for k in range(max(repeats, 5)):  # alternating, so a slower minute hits them all
        for key in order if k % 2 == 0 else order[::-1]:
            times[key].append(one(commands[key]))
    cpu = {k: statistics.median(v) for k, v in times.items()}
    r = Result(
        title="9. Start-up",
        what=("CPU time (user + system) of `actdb query STORE \"SELECT 1\"` in a fresh "
              "process (the CLI's table output included), median of runs alternating with "
              "the other commands below, after one that writes the package's bytecode, as "
              "an installed package has it; for comparison a query that calls a function "
              f"(`{_COUNT}`: sqlglot reads it too), importing the four libraries every "
              "query needs (NumPy's BLAS threads left at their default), and the Python "
              "interpreter alone."),
    )
    r.figure("actdb query STORE \"SELECT 1\"", f"{cpu['select 1']:.2f} s CPU")
    r.figure(f"actdb query STORE \"{_COUNT}\"", f"{cpu['count']:.2f} s CPU")
    r.figure("python -c \"import numpy, duckdb, pyarrow, click\"", f"{cpu['imports']:.2f} s CPU")
    r.figure("python -c pass", f"{cpu['python']:.2f} s CPU")
    r.ratio("CPU seconds", cpu["select 1"], "<= 0.5", cpu["select 1"] <= 0.5)
    r.ratio("CPU seconds of a query calling a function", cpu["count"], "(information)", True)
    return r
