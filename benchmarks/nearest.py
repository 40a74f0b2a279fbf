"""Workload 4, nearest anchors: `nearest_anchors(vec, 10)` over a block of rows against the
same-shaped matrix products in bfloat16 and float32 on the same device, paired round by round
(method.py); and every row's answer against the exact float64 top-k."""

from __future__ import annotations

from typing import Any

import bench_model
import torch
from bench_model import sync
from method import paired_many
from report import Result
from scan_data import ScanData

import actdb


def nearest(scan: ScanData, repeats: int) -> Result:
    from actdb.query.topk import lowp_dtype

    device = bench_model.DEVICE
    d, v = scan.scale.d, scan.scale.vocab
    rows = scan.scale.nearest_rows
    prompt_tokens = min(128, scan.scale.scan_tokens // 16)
    n_prompts = rows // prompt_tokens
    site = scan.sites()[0]
    query = (f"SELECT nearest_anchors(vec, 10) AS n FROM acts WHERE prompt_id < {n_prompts} "
             f"AND site = '{site}' ORDER BY prompt_id, position")

    db = actdb.connect(scan.store, device=device)
    got: list[Any] = []

    def ours() -> None:
        db.drop_caches()
        got[:] = [r[0] for r in db.sql(query).fetchall()]
        assert len(got) == rows

    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    # The matmul baselines: the same [rows, d] @ [d, v] product, made over slices of rows so
    # that its [part, v] output stays in memory as the engine's blocks do.
    part = min(rows, 1024)
    a = torch.randn(part, d, generator=g).to(dev)
    w = torch.randn(d, v, generator=g).to(dev)
    ab, wb = a.bfloat16(), w.bfloat16()

    def product(x: torch.Tensor, y: torch.Tensor) -> None:
        for _ in range(rows // part):
            out = x @ y
        sync(out)

    rounds = max(repeats, 3)
    ratios = paired_many(ours, {"bf16": lambda: product(ab, wb),
                                "fp32": lambda: product(a, w)}, rounds)
    ours()
    same, ties = _exact_agreement(db, got, n_prompts, site, d, rows)
    lowp = lowp_dtype(dev)
    db.close()
    flops = 2.0 * rows * d * v
    t_ours = ratios["bf16"].seconds
    t_bf16, t_fp32 = ratios["bf16"].baseline_seconds, ratios["fp32"].baseline_seconds
    r = Result(
        title="4. Nearest anchors",
        what=(f"`{query}`: {rows:,} vectors against all {v:,} anchors (k = 10). Baselines: "
              f"the same-shaped torch matrix products [{rows}, {d}] @ [{d}, {v}] in bfloat16 and "
              f"float32 on the same device (in slices of {part} rows), each paired with actdb "
              f"in {rounds} rounds. The engine's candidate dtype here: "
              f"{lowp or 'float32 (no fast bfloat16 on this device)'}."),
    )
    r.figure("actdb", f"{t_ours:.3f} s, {flops / t_ours / 1e9:.1f} GFLOP/s")
    r.figure("torch matmul bfloat16", f"{t_bf16:.3f} s, {flops / t_bf16 / 1e9:.1f} GFLOP/s")
    r.figure("torch matmul float32", f"{t_fp32:.3f} s, {flops / t_fp32 / 1e9:.1f} GFLOP/s")
    r.figure("rows whose top-10 equals the exact (float64) top-10", f"{same} of {rows}")
    r.figure("rows that differ from it only by a float32 tie (tokens swapped whose exact "
             "cosines differ by less than float32 can resolve)", f"{ties} of {rows}")
    bf16 = ratios["bf16"].inverted()
    fastest = ratios["bf16" if t_bf16 <= t_fp32 else "fp32"].inverted()
    r.ratio("actdb FLOP rate / bf16 matmul FLOP rate", bf16, ">= 0.5", bf16.median >= 0.5)
    r.ratio("actdb FLOP rate / fastest matmul FLOP rate", fastest, "(information)", True)
    r.ratio("rows with the float32 top-k", (same + ties) / rows, "1 (ties aside)",
            same + ties == rows)
    if t_bf16 > t_fp32:
        r.notes.append("This CPU has no AVX-512 BF16 or AMX instructions: its bfloat16 matrix "
                       "product is slower than float32, so the engine ranks in float32 here "
                       "(query/topk.py) and the fair baseline is the faster of the two.")
    return r


def _exact_agreement(db: Any, got: list[Any], n_prompts: int, site: str, d: int, rows: int
                     ) -> tuple[int, int]:
    """(rows equal to the exact top-10, rows that differ only by a float32 tie): the exact
    answer for the same vectors computed in float64 with torch alone. A row may differ only
    where float32 cannot tell two tokens apart: tokens swapped whose float64 cosines differ by
    less than twice float32's bound on a dot product's error (d * 2^-24 for unit vectors)."""
    x = db.vectors(f"SELECT vec FROM acts WHERE prompt_id < {n_prompts} AND site = '{site}' "
                   "ORDER BY prompt_id, position").double()
    anchors = db.source.weights.anchors(db.source.models[0], None).double()
    u = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    tie = 2 * d * 2.0**-24
    same = ties = 0
    for lo in range(0, rows, 512):
        scores = u[lo : lo + 512] @ anchors.T
        want = torch.topk(scores, 10, dim=-1)
        for j, (w_ids, w_vals) in enumerate(zip(want.indices.tolist(), want.values.tolist(),
                                                strict=True)):
            ids = [e["token_id"] for e in got[lo + j]]
            if ids == w_ids:
                same += 1
            elif all(abs(float(scores[j, t]) - v) <= tie for t, v in zip(ids, w_vals,
                                                                        strict=True)):
                ties += 1
    return same, ties
