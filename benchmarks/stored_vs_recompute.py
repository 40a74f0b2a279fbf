"""Workload 17, stored against recomputed: a question answered from a store against the same
question answered by running the model again with hooks, as a researcher without a store
would. The model is workload 1's GPT-2-small-shaped one, ingested once; every ratio is paired
round by round (method.py).

`Ingested` is the shared fixture: the model, its batches and the store made from them, with
each hooked module's layer read from the catalog, for further questions of this kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_model
import torch
from bench_model import Gpt2, gpt2_small, norm_input_hooks
from method import paired
from report import Result

import actdb


@dataclass(frozen=True, kw_only=True)
class Ingested:
    g: Gpt2
    store: Path
    layer_of: dict[str, int]  # hooked module path (under model.transformer) -> layer
    n_vectors: int

    @classmethod
    def build(cls, scale: Any, work: Path) -> Ingested:
        g = gpt2_small(scale)
        store = work / "recompute.actdb"
        actdb.ingest(store, model=g.model, tokenizer=g.tokenizer, prompts=g.prompts,
                     batch_size=g.batch_size, device=bench_model.DEVICE, name="gpt2")
        with actdb.connect(store) as db:
            sites = db.sql("SELECT module, layer FROM sites WHERE model = 'gpt2'").fetchall()
            n = db.sql("SELECT count(*) FROM acts").fetchall()[0][0]
        prefix = "transformer."
        layer_of = {m.removeprefix(prefix): int(layer) for m, layer in sites}
        return cls(g=g, store=store, layer_of=layer_of, n_vectors=int(n))


def _recompute_angles(data: Ingested) -> dict[int, float]:
    """Mean uniform_angle per layer, recomputed: the model without its LM head run over the
    same batches, a hook on every norm module taking the angle of its input to the all-ones
    vector, padding dropped."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    seen: list[tuple[str, torch.Tensor]] = []  # this batch's norm inputs, in call order
    g = data.g
    with torch.no_grad(), norm_input_hooks(g.model.transformer,
                                           lambda name, x: seen.append((name, x))):
        for b in g.batches:
            seen.clear()
            g.model.transformer(**b, use_cache=False)
            real = b["attention_mask"].bool()  # [batch, T]
            for name, x in seen:
                x = x[real]  # [tokens, d]
                cos = x.sum(-1) / (torch.linalg.vector_norm(x, dim=-1) * math.sqrt(x.shape[-1]))
                angle = torch.rad2deg(torch.arccos(cos.clamp(-1, 1)))  # [tokens]
                layer = data.layer_of[name]
                sums[layer] = sums.get(layer, 0.0) + float(angle.double().sum())
                counts[layer] = counts.get(layer, 0) + len(angle)
    return {k: sums[k] / counts[k] for k in sorted(sums)}


ANGLE_QUERY = ("SELECT layer, avg(uniform_angle(vec)) FROM acts WHERE model = 'gpt2' "
               "GROUP BY layer ORDER BY layer")


def angle_query(data: Ingested, repeats: int) -> Result:
    db = actdb.connect(data.store, device=bench_model.DEVICE)

    def stored() -> dict[int, float]:
        db.drop_caches()
        return {int(k): float(v) for k, v in db.sql(ANGLE_QUERY).fetchall()}

    got, want = stored(), _recompute_angles(data)
    if sorted(got) != sorted(want):
        raise RuntimeError(f"layers differ: stored {sorted(got)}, recomputed {sorted(want)}")
    spread = max(abs(got[k] - want[k]) for k in got)
    rounds = max(repeats, 5)
    timed = paired(stored, lambda: _recompute_angles(data), rounds)
    db.close()
    g = data.g
    r = Result(
        title="17. Stored vs recompute: an angle query",
        what=(f"`{ANGLE_QUERY}` over the {data.n_vectors:,} vectors of workload 1's model "
              f"ingested once ({g.n_tokens} tokens, every norm site), against recomputing the "
              "same means: the model without its LM head run over the same batches with a "
              "forward pre-hook on every norm module taking its input's angle to the all-ones "
              "vector (float32, padding dropped), summed per layer; paired in "
              f"{rounds} rounds, each query on a connection with no chunk cached."),
    )
    r.figure("stored (actdb query)", f"{timed.seconds:.3f} s")
    r.figure("recomputed with hooks", f"{timed.baseline_seconds:.3f} s")
    r.figure("mean angle per layer (stored)", ", ".join(f"{got[k]:.3f}" for k in sorted(got)))
    r.figure("largest difference from the recomputed means, degrees",
             f"{spread:.1e} (spread {spread:.1e})")
    r.ratio("recompute time / stored query time", timed.inverted(), "(information)", True)
    return r
