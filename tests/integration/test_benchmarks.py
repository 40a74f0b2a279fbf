"""The benchmark suite at its tiny scale, so the scripts cannot rot (no timing assertions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_tiny_benchmark_writes_every_workload(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--scale", "tiny", "--output",
         str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for title in ("1. Ingest overhead", "2. Full scan", "3. Selective query",
                  "4. Nearest anchors", "5. Storage", "6. Memory", "7. Checksum cost",
                  "12. Other functions over a full scan", "13. Vector aggregates",
                  "15. Image ingest", "17. Stored vs recompute",
                  "## Machine"):
        assert title in text
    # Every baseline and ratio is reported, and actdb's answer agrees with the baselines'.
    for label in ("DuckDB array_cosine_similarity", "NumPy float16 memmap", "raw chunk-file read",
                  "torch matmul", "output_hidden_states", "hand-written hook cache", "peak RSS"):
        assert label in text
    # Every timed ratio is the median of its rounds, printed with their spread (lo..hi).
    table = text.split("\n\n## ")[0]  # today's table, before the machine and the workloads
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")][1:]
    timed = [(float(r[2]), r[3], r[4]) for r in rows if r[3] != "-"]
    assert len(timed) >= 15
    for median, spread, rounds in timed:
        lo, hi = (float(x) for x in spread.split(".."))
        assert lo <= median <= hi and int(rounds) >= 3, (median, spread, rounds)
    ours = text.split("# Measured apart from the suite")[0]  # not the figures kept from before
    spreads = [float(part.split(")")[0]) for part in ours.split("(spread ")[1:]]
    assert len(spreads) >= 6 and max(spreads) < 1e-2, spreads
    assert not (tmp_path / "work").exists()
