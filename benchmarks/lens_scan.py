"""Workload 21, the logit lens without a materialized lens: the rank of the model's final
prediction at every pre-attention site (`token_rank` against `top_logits` of the final site)
and the lens picture (`actdb.plot.lens_data`: `top_logits` and `prob`), on a store ingested
from the GPT-2-small-shaped model (random weights, seed 0, vocabulary 50257 x 768). actdb's
bfloat16 vocabulary kernel (query/vocab_scan.py) against the float32 product it replaces
(ACTDB_VOCAB_SCAN=off), the same connection and warm caches on both sides, paired round by
round in alternating order (method.py); and the two paths' answers compared.

    python benchmarks/lens_scan.py [--tokens 2048] [--rounds 5] [--workdir bench-data]
                                   [--output FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import bench_model  # noqa: E402
import numpy as np  # noqa: E402
from method import paired  # noqa: E402
from report import Result  # noqa: E402

import actdb  # noqa: E402
import actdb.plot  # noqa: E402
from actdb.query import vocab_scan  # noqa: E402

RANK_SQL = """
WITH f AS (SELECT prompt_id, position, top_logits(vec, 1)[1].token_id AS pred
           FROM acts WHERE role = 'final')
SELECT a.layer, a.prompt_id, a.position, token_rank(a.vec, f.pred) AS rank
FROM acts a JOIN f ON a.prompt_id = f.prompt_id AND a.position = f.position
WHERE a.role = 'pre_attn'
ORDER BY a.layer, a.prompt_id, a.position"""


def _with_path(on: bool, fn: Any) -> Any:
    """`fn` run with the bfloat16 kernel on or off (the float32 product)."""
    def run() -> Any:
        before = os.environ.get(vocab_scan.ENV)
        os.environ[vocab_scan.ENV] = "auto" if on else "off"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ[vocab_scan.ENV]
            else:
                os.environ[vocab_scan.ENV] = before
    return run


def lens_scan(work: Path, tokens: int, rounds: int) -> Result:
    scale = SimpleNamespace(d=768, layers=12, heads=12, vocab=50257,
                            prompts=max(1, tokens // 128), prompt_tokens=128, batch_size=8)
    store = work / f"lens-{tokens}.actdb"
    if not store.exists():
        g = bench_model.gpt2_small(scale)
        actdb.ingest(store, model=g.model, tokenizer=g.tokenizer, prompts=g.prompts,
                     batch_size=g.batch_size, device="cpu", name="gpt2")
    db = actdb.connect(store, device="cpu")
    n_rank = db.sql("SELECT count(*) FROM acts WHERE role = 'pre_attn'").fetchall()[0][0]
    pictures = list(range(min(4, scale.prompts)))

    def rank() -> Any:
        return db.sql(RANK_SQL).fetchall()

    def picture() -> Any:
        return [actdb.plot.lens_data(db, p)[2] for p in pictures]

    w, b = db.source.weights.unembed(db.source.models[0])
    t = time.perf_counter()
    vocab_scan.pack(w, b)  # once per weight, kept with it: the warm-up pays it
    pack_seconds = time.perf_counter() - t

    r_rank = paired(_with_path(True, rank), _with_path(False, rank), rounds)
    r_pic = paired(_with_path(True, picture), _with_path(False, picture), rounds)
    new, old = _with_path(True, rank)(), _with_path(False, rank)()
    differ = [i for i, (a, c) in enumerate(zip(new, old, strict=True)) if a[3] != c[3]]
    exact_new, exact_old = _exact_check(db, new, old, differ)
    p_new, p_old = _with_path(True, picture)(), _with_path(False, picture)()
    dp = max(float(np.max(np.abs(a["prob"].to_numpy() - c["prob"].to_numpy())))
             for a, c in zip(p_new, p_old, strict=True))
    db.close()

    res = Result(
        title="21. Logit lens, computed (no materialized lens)",
        what=(f"`{' '.join(RANK_SQL.split())}` over {n_rank:,} pre-attention rows "
              f"({scale.prompts} prompts x 128 tokens x 12 layers) of a store ingested from the "
              "GPT-2-small-shaped model (random weights, vocabulary 50257 x 768), and the lens "
              f"picture (`actdb.plot.lens_data`) of prompts {pictures}: actdb's bfloat16 "
              "vocabulary kernel (AVX-512 BF16, query/vocab_scan.py) against the float32 "
              "product it replaces (ACTDB_VOCAB_SCAN=off), one connection, warm caches, "
              f"{rounds} paired rounds."),
    )
    res.figure("rank query, bfloat16 kernel", f"{r_rank.seconds:.2f} s")
    res.figure("rank query, float32 product", f"{r_rank.baseline_seconds:.2f} s")
    res.figure("lens pictures, bfloat16 kernel", f"{r_pic.seconds:.2f} s")
    res.figure("lens pictures, float32 product", f"{r_pic.baseline_seconds:.2f} s")
    res.figure("the LM head packed for the kernel (once per weight)", f"{pack_seconds:.2f} s")
    res.figure("rows whose rank differs between the paths", f"{len(differ)} of {n_rank}")
    res.figure("of those, exact (float64) on the kernel's side / the float32 side's",
               f"{exact_new} / {exact_old}")
    res.figure("largest |prob difference| in the pictures", f"{dp:.2e}")
    speed = r_rank.inverted()
    res.ratio("rank query: float32 time / bfloat16 kernel time", speed, ">= 2",
              speed.median >= 2)
    pic = r_pic.inverted()
    res.ratio("lens picture: float32 time / bfloat16 kernel time", pic, "(information)", True)
    return res


def _exact_check(db: Any, new: list[Any], old: list[Any], rows: list[int]) -> tuple[int, int]:
    """How many of the rows where the paths disagree each side has right, by float64 logits
    (the final-normed vectors against W_U in float64)."""
    if not rows:
        return 0, 0
    import torch

    w, b = db.source.weights.unembed(db.source.models[0])
    w64 = w.double()
    right_new = right_old = 0
    for i in rows[:64]:
        layer, pid, pos, _ = new[i]
        x = db.vectors(f"SELECT final_norm(vec) FROM acts WHERE role = 'pre_attn' AND layer = "
                       f"{layer} AND prompt_id = {pid} AND position = {pos}").double()[0]
        pred = db.sql(f"SELECT top_logits(vec, 1)[1].token_id FROM acts WHERE role = 'final' "
                      f"AND prompt_id = {pid} AND position = {pos}").fetchall()[0][0]
        s = w64 @ x + (b.double() if b is not None else 0.0)
        want = 1 + int(torch.sum(s > s[pred]))
        right_new += new[i][3] == want
        right_old += old[i][3] == want
    return right_new, right_old


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("bench-data"))
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    res = lens_scan(args.workdir, args.tokens, args.rounds)
    lines = [f"## {res.title}", "", res.what, ""]
    lines += [f"- {label}: {value}" for label, value in res.figures]
    lines += [f"- **{r.label}: {r.value:.3g}** (rounds {r.spread}; target {r.target})"
              for r in res.ratios]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
