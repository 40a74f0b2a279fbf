"""Workload 19, the lens looked up against the lens recomputed: the questions researchers ask
first of a logit lens, answered from a store ingested with `--lens 10` (the materialized lens)
and by running the model again with hooks and multiplying by the vocabulary, as a researcher
without a store would. The model is workload 1's GPT-2-small-shaped one, over a quarter of its
prompts (both sides' cost grows with the tokens alike); every ratio is paired round by round
(method.py).

- the rank of the model's own prediction (the final site's top token) at every pre-attention
  site of every token;
- the lens picture (`actdb plot lens`): each pre-attention and final site's top token at each
  position of one prompt, with its probability (the picture's data; drawing it costs both
  sides the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_model
import numpy as np
import torch
from bench_model import Gpt2, gpt2_small, norm_input_hooks
from method import paired
from report import Result

import actdb
from actdb.plot.lensmap import lens_spec

K = 10

RANK_QUERY = """
WITH f AS (SELECT prompt_id, position, top_logits(vec, 1)[1].token_id AS pred
           FROM acts WHERE model = 'gpt2' AND site = 'final')
SELECT a.prompt_id, a.position, a.layer, token_rank(a.vec, f.pred) AS rank
FROM acts a JOIN f USING (prompt_id, position)
WHERE a.model = 'gpt2' AND a.role = 'pre_attn'
ORDER BY a.prompt_id, a.position, a.layer"""


@dataclass(frozen=True, kw_only=True)
class LensStore:
    g: Gpt2
    store: Path
    n_tokens: int
    n_layers: int
    ingest_seconds: float

    @classmethod
    def build(cls, scale: Any, work: Path) -> LensStore:
        import time

        g = gpt2_small(scale)
        keep = max(1, len(g.batches) // 4)
        g = Gpt2(model=g.model, tokenizer=g.tokenizer, prompts=g.prompts[: keep * g.batch_size],
                 batches=g.batches[:keep], batch_size=g.batch_size,
                 n_tokens=int(sum(int(b["attention_mask"].sum()) for b in g.batches[:keep])))
        store = work / "lens.actdb"
        t = time.perf_counter()
        actdb.ingest(store, model=g.model, tokenizer=g.tokenizer, prompts=g.prompts,
                     batch_size=g.batch_size, device=bench_model.DEVICE, name="gpt2", lens=K)
        took = time.perf_counter() - t
        return cls(g=g, store=store, n_tokens=g.n_tokens, n_layers=g.model.config.n_layer,
                   ingest_seconds=took)


def _lens_rows(g: Gpt2, b: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One batch through the model without its head, hooks taking every block's ln_1 input
    and the final norm's: each pre-attention site's lens logits [tokens, V] (final norm, LM
    head), padding dropped, and the final site's."""
    seen: dict[str, torch.Tensor] = {}
    t = g.model.transformer
    with norm_input_hooks(t, lambda name, x: seen.__setitem__(name, x)):
        t(**b, use_cache=False)
    real = b["attention_mask"].bool()  # [batch, T]
    w = g.model.lm_head.weight  # [V, d]
    n = g.model.config.n_layer
    pre = [t.ln_f(seen[f"h.{i}.ln_1"][real]) @ w.T for i in range(n)]
    return pre, t.ln_f(seen["ln_f"][real]) @ w.T


def recompute_ranks(g: Gpt2) -> np.ndarray:
    """The prediction's rank at each pre-attention site, recomputed: [tokens, layers] in the
    query's order (prompt, position, layer)."""
    out = []
    with torch.no_grad():
        for b in g.batches:
            pre, final = _lens_rows(g, b)
            pred = final.argmax(-1, keepdim=True)  # [tokens, 1]
            ranks = [1 + (lg > lg.gather(1, pred)).sum(-1) for lg in pre]
            out.append(torch.stack(ranks, dim=1).cpu().numpy())
    return np.concatenate(out)


def recompute_picture(g: Gpt2, prompt: int) -> tuple[np.ndarray, np.ndarray]:
    """The picture's data for one prompt, recomputed: each pre-attention and the final
    site's top token and its probability, [sites, positions]."""
    enc = g.tokenizer([g.prompts[prompt]], return_tensors="pt")
    b = {k: v.to(bench_model.DEVICE) for k, v in enc.items() if k != "token_type_ids"}
    with torch.no_grad():
        pre, final = _lens_rows(g, b)
        lg = torch.stack([*pre, final])  # [sites, T, V]
        p = torch.softmax(lg, dim=-1).max(-1)
        return p.indices.cpu().numpy(), p.values.cpu().numpy()


def lens_lookup(data: LensStore, repeats: int) -> list[Result]:
    db = actdb.connect(data.store, device=bench_model.DEVICE)

    def ranks() -> np.ndarray:
        db.drop_caches()
        got = db.sql(RANK_QUERY).fetchall()
        return np.array([r[3] for r in got]).reshape(-1, data.n_layers)

    def picture() -> Any:
        db.drop_caches()
        spec = lens_spec(db, 0)
        return db.sql(spec.sql, params=spec.params).df()

    got, want = ranks(), recompute_ranks(data.g)
    if got.shape != want.shape:
        raise RuntimeError(f"ranks of shape {got.shape} stored, {want.shape} recomputed")
    agree = float((got == want).mean())
    df = picture()
    top, _ = recompute_picture(data.g, 0)
    stored_top = df.pivot(index="layer", columns="position", values="top_id").to_numpy()
    pic_agree = float((stored_top == top).mean())
    rounds = max(repeats, 5)
    timed = paired(ranks, lambda: recompute_ranks(data.g), rounds)
    timed_pic = paired(picture, lambda: recompute_picture(data.g, 0), rounds)
    db.close()
    g = data.g
    rank = Result(
        title="19. The lens looked up: the prediction's rank at every layer",
        what=(f"`{' '.join(RANK_QUERY.split())}` over a store of workload 1's model ingested "
              f"with `lens={K}` ({data.n_tokens} tokens x {data.n_layers} pre-attention "
              "sites; the materialized lens), against recomputing the same ranks: the model "
              "(in memory, not loaded) without its LM head run over the same batches with a "
              "forward pre-hook on every norm module, each block's ln_1 input and the final "
              "norm's input passed through ln_f and multiplied by the LM head, the final "
              "site's top token's rank counted at each layer (float32, padding dropped); "
              f"paired in {rounds} rounds, each query on a connection with no chunk cached."),
    )
    rank.figure("stored (actdb query)", f"{timed.seconds:.3f} s")
    rank.figure("recomputed with hooks", f"{timed.baseline_seconds:.3f} s")
    rank.figure("ranks equal to the recomputed ones", f"{agree:.4f} of {got.size} "
                "(the rest: logits within float16 rounding of the prediction's)")
    rank.figure(f"ingest with lens={K} (once)", f"{data.ingest_seconds:.1f} s for "
                f"{g.n_tokens} tokens")
    rank.ratio("recompute time / stored query time", timed.inverted(), ">= 20",
               timed.inverted().median >= 20)
    pic = Result(
        title="19b. The lens looked up: the lens picture",
        what=("The data of `actdb plot lens STORE 0` (lens_spec's query: each pre-attention "
              "and the final site's top token at each position of prompt 0, with its "
              f"probability) from the store with `lens={K}`, against recomputing it: prompt 0 "
              "run alone through the model with the same hooks, each site's lens logits "
              "softmaxed and their top taken; drawing the picture costs both sides the same "
              f"and is left out; paired in {rounds} rounds."),
    )
    pic.figure("stored (actdb query)", f"{timed_pic.seconds:.4f} s")
    pic.figure("recomputed with hooks", f"{timed_pic.baseline_seconds:.4f} s")
    pic.figure("top tokens equal to the recomputed ones", f"{pic_agree:.4f}")
    pic.ratio("recompute time / stored query time", timed_pic.inverted(), ">= 20",
              timed_pic.inverted().median >= 20)
    return [rank, pic]
