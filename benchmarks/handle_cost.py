"""What `vec` handles cost on scans: this tree against another checkout of actdb.

    python benchmarks/handle_cost.py --baseline DIR [--tokens 32768] [--rounds 5]

Both trees query one synthetic store (generate.py, fixed seed; made under --workdir if
missing). Each round runs every query in a fresh process of each tree, the two back to back
in alternating order, and times the query's median over `--repeats` runs after a warm-up; the
ratio printed is the median of the per-round ratios (this tree / baseline), with their spread.
Every query makes a handle for each row it reads (`vec`), and the tensor functions check each
one they receive.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

QUERIES = {
    "handles only": "SELECT count(*) FROM (SELECT DISTINCT vec FROM acts)",
    "norm column": "SELECT avg(norm) FROM acts",
    "vec_norm scan": "SELECT avg(vec_norm(vec)) FROM acts",
    "full scan": "SELECT avg(cosine_to_anchor(vec, 'w123')) FROM acts",
    "normed view": "SELECT avg(vec_norm(normed(vec))) FROM acts",
}

_CHILD = r"""
import json, statistics, sys, time
import actdb
store, repeats, queries = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
out = {}
with actdb.connect(store, device="cpu") as db:
    for name, q in queries.items():
        db.sql(q).fetchall()
        times = []
        for _ in range(repeats):
            db.drop_caches()
            t = time.perf_counter()
            db.sql(q).fetchall()
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
print(json.dumps(out))
"""


def _run(tree: Path, store: Path, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(store), str(repeats),
                           json.dumps(QUERIES)], env=env, check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout of actdb")
    ap.add_argument("--tokens", type=int, default=32768, help="token rows (4 sites each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("bench-data"))
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(here / "benchmarks"))
    from generate import Shape, generate

    store = args.workdir / f"handles-{args.tokens}.actdb"
    if not store.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        generate(store, tokens=args.tokens, shape=Shape())
    ratios: dict[str, list[float]] = {k: [] for k in QUERIES}
    times: dict[str, list[float]] = {k: [] for k in QUERIES}
    for r in range(args.rounds):
        order = [(here, "this"), (args.baseline, "base")]
        got = {}
        for tree, side in order if r % 2 == 0 else order[::-1]:
            got[side] = _run(tree, store, args.repeats)
        for k in QUERIES:
            ratios[k].append(got["this"][k] / got["base"][k])
            times[k].append(got["this"][k])
    print(f"{args.tokens * 4:,} vectors of width 768; median of {args.rounds} rounds")
    print(f"{'query':<16} {'this tree (s)':>14} {'ratio to baseline':>18} {'spread':>16}")
    for k in QUERIES:
        lo, hi = min(ratios[k]), max(ratios[k])
        print(f"{k:<16} {statistics.median(times[k]):>14.4f} "
              f"{statistics.median(ratios[k]):>18.3f} {f'{lo:.3f}..{hi:.3f}':>16}")


if __name__ == "__main__":
    main()
