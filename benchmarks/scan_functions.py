"""Workloads 12 and 13: functions that need each whole vector over a full scan, and vector
aggregates, against NumPy over the same stored vectors, paired round by round (method.py)."""

from __future__ import annotations

from typing import Any

import bench_model
import numpy as np
from method import median_time, paired
from report import Result
from scan_data import TOKEN, ScanData

import actdb

# -- 12. other functions over a full scan -----------------------------------------------------

# (label, SQL expression): functions that need the whole float32 vector (its unit, a view)
FUNCTION_SCANS = (
    ("dim_contribution", "dim_contribution(vec, 5)"),
    ("anchor_contribution", f"anchor_contribution(vec, 5, '{TOKEN}')"),
    ("rotation_angle", "rotation_angle(vec)"),
    ("dim_contribution of a view", "dim_contribution(normed(vec), 5)"),
    ("cosine_to_anchor of a view", f"cosine_to_anchor(normed(vec), '{TOKEN}')"),
    # a FLOAT[] direction (a literal here; a parameter or a subquery alike), {d} its width
    ("cosine_to", "cosine_to(vec, [cos(i) FOR i IN range({d})])"),
    ("project", "project(vec, [cos(i) FOR i IN range({d})])"),
    ("cosine_to of a view", "cosine_to(normed(vec), [cos(i) FOR i IN range({d})])"),
)


def function_scans(scan: ScanData, repeats: int) -> Result:
    """Workload 2's scan with functions that need each whole vector in float32; the ratio is
    `dim_contribution` against its NumPy float16 memmap baseline (unit(x)[:, 5]), paired."""
    db = actdb.connect(scan.store, device=bench_model.DEVICE)
    times, values = {}, {}
    scans = [(label, expr.replace("{d}", str(scan.scale.d))) for label, expr in FUNCTION_SCANS]
    runs = {}
    for label, expr in scans:
        query = f"SELECT avg({expr}) FROM acts"

        def run(query: str = query) -> float:
            db.drop_caches()
            return db.sql(query).fetchall()[0][0]

        runs[label] = run
        values[label] = run()
        if label != "dim_contribution":
            times[label] = median_time(run, repeats, warmup=False)

    def numpy_dim() -> float:
        mm = np.load(scan.npy, mmap_mode="r")
        total = 0.0
        for lo in range(0, len(mm), 65536):
            x = np.asarray(mm[lo : lo + 65536], dtype=np.float32)
            total += float((x[:, 5] / np.linalg.norm(x, axis=1)).sum())
        return total / len(mm)

    reference = numpy_dim()
    rounds = max(repeats, 5)
    ratio = paired(runs["dim_contribution"], numpy_dim, rounds)
    db.close()
    times["dim_contribution"] = ratio.seconds
    t_numpy = ratio.baseline_seconds
    r = Result(
        title="12. Other functions over a full scan",
        what=(f"`SELECT avg(f) FROM acts` over the {scan.n_vectors:,} vectors of workload 2 for "
              "functions that need each whole vector in float32 (its unit, or a view: "
              "`normed` is the site's output); each vector is converted from float16, scaled "
              "by its norm and transformed block by block in the core's cache "
              "(`Group.x_blocks`). Also the functions of a FLOAT[] direction: over raw vectors "
              "their products are the stored directions' with the direction's unit, as "
              "`cosine_to_anchor`'s (workload 2), over a view they take the path above. "
              "Baseline: NumPy over the float16 `.npy` memory map of workload 2, 65,536 rows "
              f"a block, for `dim_contribution`, paired with it in {rounds} rounds; the other "
              f"functions' times are medians of {repeats} runs."),
    )
    for label, expr in scans:
        r.figure(f"`{expr}`", f"{times[label]:.2f} s, {scan.n_vectors / times[label] / 1e6:.2f} "
                              f"M rows/s (mean {values[label]:.6g})")
    r.figure("NumPy unit(x)[:, 5]", f"{t_numpy:.2f} s, {scan.n_vectors / t_numpy / 1e6:.2f} "
                                    f"M rows/s (mean {reference:.6g})")
    ours = values["dim_contribution"]
    r.figure("mean dim_contribution (actdb, NumPy)",
             f"{ours:.6f}, {reference:.6f} (spread {abs(ours - reference):.1e})")
    speed = ratio.inverted()
    r.ratio("dim_contribution actdb / NumPy rows/s", speed, ">= 1.5", speed.median >= 1.5)
    return r


# -- 13. vector aggregates ------------------------------------------------------------------


def aggregates(scan: ScanData, repeats: int) -> Result:
    """`mean_vector` per site and `spectrum` per prompt and of one whole site, against NumPy
    over the same stored vectors (read from the Zarr arrays directly), float64, paired."""
    db = actdb.connect(scan.store, device=bench_model.DEVICE)
    site = scan.sites()[0]
    runs = db.sql("SELECT prompt_id, row_start, n_tokens FROM prompt_runs ORDER BY prompt_id"
                  ).fetchall()
    n_prompts = min(len(runs), 256)
    queries = {
        "mean": "SELECT site, mean_vector(list(vec)) FROM acts GROUP BY site ORDER BY site",
        "prompts": (f"SELECT prompt_id, spectrum(list(vec), 5) FROM acts WHERE site = '{site}' "
                    f"AND prompt_id < {n_prompts} GROUP BY prompt_id ORDER BY prompt_id"),
        "site": f"SELECT spectrum(list(vec), 5) FROM acts WHERE site = '{site}'",
    }
    group = scan._group()

    def x_of(name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        hi = scan.scale.scan_tokens if hi is None else hi
        d16 = group[f"models/0/acts/{name}/direction"]
        norm = group[f"models/0/acts/{name}/norm"]
        return np.asarray(d16[lo:hi], np.float32) * np.asarray(norm[lo:hi])[:, None]

    def eig5(x: np.ndarray) -> np.ndarray:
        return np.linalg.eigvalsh(np.cov(x.astype(np.float64).T))[::-1][:5]

    baselines = {
        "mean": lambda: [np.mean(x_of(name), axis=0, dtype=np.float64)
                         for name in sorted(scan.sites())],
        "prompts": lambda: [eig5(x_of(site, lo, lo + n)) for _, lo, n in runs[:n_prompts]],
        "site": lambda: eig5(x_of(site)),
    }
    answers: dict[str, Any] = {}
    want: dict[str, Any] = {}
    ratios = {}
    rounds = max(repeats, 3)
    for key, query in queries.items():
        def run(query: str = query) -> list[Any]:
            db.drop_caches()
            return db.sql(query).fetchall()

        answers[key] = run()
        want[key] = baselines[key]()
        ratios[key] = paired(run, baselines[key], rounds, warmup=False)
    db.close()
    spread = {
        "mean": max(float(np.max(np.abs(np.asarray(got, np.float64) - w) / np.abs(w).max()))
                    for (_, got), w in zip(answers["mean"], want["mean"], strict=True)),
        "prompts": max(float(np.max(np.abs(np.asarray(got, np.float64) - w) / w[0]))
                       for (_, got), w in zip(answers["prompts"], want["prompts"], strict=True)),
        "site": float(np.max(np.abs(np.asarray(answers["site"][0][0], np.float64)
                                    - want["site"]) / want["site"][0])),
    }
    r = Result(
        title="13. Vector aggregates",
        what=(f"`mean_vector(list(vec))` of each of {len(want['mean'])} sites "
              f"({scan.scale.scan_tokens:,} vectors each), `spectrum(list(vec), 5)` of each of "
              f"{n_prompts} prompts (fewer vectors than dimensions: an [n, n] eigenproblem) and "
              f"of one whole site (a [d, d] one, d = {scan.scale.d}), against NumPy float64 over "
              f"the same stored vectors read from the Zarr arrays, paired in {rounds} rounds; "
              "spreads relative to the largest value"),
    )
    labels = {"mean": "mean_vector per site", "prompts": "spectrum per prompt",
              "site": "spectrum of a site"}
    for key, label in labels.items():
        r.figure(f"{label} (actdb, NumPy)", f"{ratios[key].seconds:.2f} s, "
                 f"{ratios[key].baseline_seconds:.2f} s (spread {spread[key]:.1e})")
    for key, label in labels.items():
        r.ratio(f"{label}: actdb / NumPy speed", ratios[key].inverted(), "(information)", True)
    return r
