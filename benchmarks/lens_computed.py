"""Workload 22, the lens computed against the lens recomputed: the same two questions as
workload 19 (lens_lookup.py), asked of a store ingested without `--lens` (workload 17's store:
the model's 4,096 tokens, every norm site), so that actdb multiplies the stored vectors by the
vocabulary (the CPU's vocabulary kernel, query/vocab_scan.py, where it has one) while the
baseline runs the model again with hooks and multiplies its float32 states by the LM head, as
a researcher without a store would. Every ratio is paired round by round (method.py).
"""

from __future__ import annotations

from typing import Any

import bench_model
import numpy as np
from lens_lookup import RANK_QUERY, recompute_picture, recompute_ranks
from method import paired
from report import Result
from stored_vs_recompute import Ingested

import actdb
from actdb.plot.lensmap import lens_spec


def lens_computed(data: Ingested, repeats: int) -> list[Result]:
    db = actdb.connect(data.store, device=bench_model.DEVICE)
    n_layers = data.g.model.config.n_layer

    def ranks() -> np.ndarray:
        db.drop_caches()
        got = db.sql(RANK_QUERY).fetchall()
        return np.array([r[3] for r in got]).reshape(-1, n_layers)

    def picture() -> Any:
        db.drop_caches()
        spec = lens_spec(db, 0)
        return db.sql(spec.sql, params=spec.params).df()

    got, want = ranks(), recompute_ranks(data.g)
    if got.shape != want.shape:
        raise RuntimeError(f"ranks of shape {got.shape} computed, {want.shape} recomputed")
    agree = float((got == want).mean())
    near = float((np.abs(got - want) <= 0.01 * want).mean())
    df = picture()
    top, _ = recompute_picture(data.g, 0)
    stored_top = df.pivot(index="layer", columns="position", values="top_id").to_numpy()
    pic_agree = float((stored_top == top).mean())
    # Each round of the rank question runs the model over every batch: 3 rounds at least.
    # The answers just compared were each side's warm-up.
    rounds = max(repeats, 3)
    timed = paired(ranks, lambda: recompute_ranks(data.g), rounds, warmup=False)
    timed_pic = paired(picture, lambda: recompute_picture(data.g, 0), max(repeats, 5),
                       warmup=False)
    db.close()
    g = data.g
    rank = Result(
        title="22. The lens computed: the prediction's rank at every layer",
        what=(f"`{' '.join(RANK_QUERY.split())}` over workload 17's store (the model ingested "
              f"without `--lens`: {g.n_tokens} tokens x {n_layers} pre-attention sites), so "
              "that each rank is computed against the whole vocabulary, against recomputing "
              "the same ranks as workload 19 does (the model without its LM head run over the "
              "same batches with a forward pre-hook on every norm module, each block's ln_1 "
              "input and the final norm's input passed through ln_f and multiplied by the LM "
              "head, float32, padding dropped); paired in "
              f"{rounds} rounds, each query on a connection with no chunk cached."),
    )
    rank.figure("computed (actdb query)", f"{timed.seconds:.2f} s")
    rank.figure("recomputed with hooks", f"{timed.baseline_seconds:.2f} s")
    rank.figure("ranks equal to the recomputed ones",
                f"{agree:.4f} of {got.size}, within 1% of them {near:.4f} (actdb's ranks are "
                "exact for the stored float16 directions; the recomputation's are float32 "
                "products of the unrounded states)")
    rank.ratio("recompute time / computed query time", timed.inverted(), ">= 2",
               timed.inverted().median >= 2)
    pic = Result(
        title="22b. The lens computed: the lens picture",
        what=("The data of `actdb plot lens STORE 0` (lens_spec's query: each pre-attention "
              "and the final site's top token at each position of prompt 0, with its "
              "probability) from the store without `--lens`, against recomputing it as "
              "workload 19b does; drawing the picture costs both sides the same and is left "
              f"out; paired in {max(repeats, 5)} rounds."),
    )
    pic.figure("computed (actdb query)", f"{timed_pic.seconds:.3f} s")
    pic.figure("recomputed with hooks", f"{timed_pic.baseline_seconds:.3f} s")
    pic.figure("top tokens equal to the recomputed ones", f"{pic_agree:.4f}")
    pic.ratio("recompute time / computed query time", timed_pic.inverted(), ">= 2",
              timed_pic.inverted().median >= 2)
    return [rank, pic]
