"""The report's weight reading (Traveling Words, arXiv 2309.07315): each head's OV circuit read
as the token directions it writes, and the MLP neurons whose output points at the answer.

Per head, the right singular vectors v_1..v_k of its gain-folded OV circuit (the directions it
writes, largest singular values first; circuits.py stores them) are compared with every token
anchor (the model's default anchor set: unit LM-head rows, or unit embedding rows without a
head), in both signs, since an SVD fixes a direction only up to its sign: a head "lands near a
token" by its largest |cosine|. Per neuron, its output row W_out[n] against the anchor of the
answer the lens section names (the model's top token at the last position, the most frequent
over the prompts, the lowest token id among as frequent ones), through the view `neurons`.
The heads are read from the stored arrays (store/layer_weights.py) and anchors (the query
layer's, as `nearest_anchors` ranks them): a head writes +v_i or -v_i as its input's component
along u_i is positive or negative, and `nearest_anchors(v, k)` over the view `circuits` ranks
one sign only. A store without layer weights gets a sentence.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..store.layer_weights import array_name, read_manifest
from .canvas import new_figure
from .section import Section

RANKS = 3  # singular directions read per head
HEADS_SHOWN = 2  # heads per layer named in the table
NEURONS_SHOWN = 5

ANSWER_SQL = """\
SELECT top_logits(vec, 1)[1].token_id AS token_id, top_logits(vec, 1)[1].token AS token
FROM acts WHERE model = $model AND position_from_end = 0
  AND site = (SELECT final_site FROM models WHERE model = $model)"""


@dataclass(frozen=True, kw_only=True)
class HeadReading:
    layer: int
    head: int
    rank: int  # 1-based
    sigma: float
    token_id: int
    token: str
    cosine: float  # signed: the sign of v that lands near the token


def _anchors(db: Any, model: str) -> tuple[Any, np.ndarray, list[str | None]]:
    """(the model's record, unit anchors float64 [V, d], token strings)."""
    src = db.source
    record = next(m for m in src.models.values() if m.model == model)
    anchors = src.weights.anchors(record, None).double().cpu().numpy()
    tokens = src.tokens.token_column(record).to_pylist()
    return record, anchors, tokens


def read_heads(db: Any, model: str, ranks: int = RANKS) -> list[HeadReading]:
    """For every stored head and rank 1..ranks: its nearest anchor by |cosine|."""
    record, anchors, tokens = _anchors(db, model)
    store = db.source.store
    manifest = read_manifest(store.arrays, record.model_id) or {}
    out = []
    for entry in manifest.get("layers", []):
        attn = entry.get("attn")
        if not attn:
            continue
        layer, heads = int(entry["layer"]), int(attn["n_heads"])
        sigma = store.arrays.weight(record.model_id, array_name(layer, "circuits/OV", "sigma"))
        v = store.arrays.weight(record.model_id, array_name(layer, "circuits/OV", "v"))
        v = v.reshape(heads, -1, v.shape[-1]).astype(np.float64)  # [H, r, d]
        for h in range(heads):
            for r in range(min(ranks, v.shape[1])):
                vec = v[h, r] / np.linalg.norm(v[h, r])
                cos = anchors @ vec  # [V]
                best = int(np.argmax(np.abs(cos)))
                out.append(HeadReading(layer=layer, head=h, rank=r + 1,
                                       sigma=float(sigma[h, r]), token_id=best,
                                       token=str(tokens[best]) if best < len(tokens) else "",
                                       cosine=float(cos[best])))
    return out


NEURONS_SQL = """\
SELECT layer, expert, neuron, cosine_to_anchor(w_out, $token) AS cosine
FROM neurons WHERE model = $model AND cosine IS NOT NULL
ORDER BY cosine DESC, layer, expert, neuron
LIMIT $k"""


def read_neurons(db: Any, model: str, token_id: int, k: int = NEURONS_SHOWN
                 ) -> pd.DataFrame:
    """The k neurons (any layer, expert) whose W_out row has the largest cosine with the
    token's anchor, through the view `neurons`: layer, expert, neuron, cosine."""
    df: pd.DataFrame = db.sql(NEURONS_SQL, params={"model": model, "token": int(token_id),
                                                   "k": k}).df()
    return df


def weight_reading(db: Any, model: str) -> Section:
    """The section, or a skipped one (a sentence) for a model stored without layer weights."""
    title = "Weights as token directions (Traveling Words)"
    claim = ("Reading each head's OV circuit by its singular vectors, projected on the "
             "token embedding, shows many heads writing interpretable token directions; "
             "and individual MLP neurons' output rows point at the tokens they promote.")
    record = next(m for m in db.source.models.values() if m.model == model)
    manifest = read_manifest(db.source.store.arrays, record.model_id)
    heads = read_heads(db, model) if manifest is not None else []
    if not heads:
        why = ("it was stored without its layer weights (--weights none, or an actdb before "
               "0.3)" if manifest is None else "no layer's attention could be mapped")
        return Section(key="weights", title=title, sql="", params={}, df=pd.DataFrame(),
                       figure=None, claim=claim, finding=f"Not measured here: {why}.",
                       skipped=True)
    df = pd.DataFrame([h.__dict__ for h in heads])
    df["abs_cosine"] = df["cosine"].abs()
    answers = [r for r in db.sql(ANSWER_SQL, params={"model": model}).fetchall()
               if r[0] is not None]
    # the most frequent answer; among as frequent ones, the lowest token id
    counts = Counter(answers)
    answer_id, answer = (max(counts, key=lambda a: (counts[a], -int(a[0]))) if counts
                         else (None, None))
    neurons = read_neurons(db, model, int(answer_id)) if answer_id is not None else None
    best = df.sort_values(["abs_cosine", "layer", "head", "rank"],
                          ascending=[False, True, True, True]).iloc[0]
    numbers: dict[str, float | int | str] = {
        "best_layer": int(best["layer"]), "best_head": int(best["head"]),
        "best_rank": int(best["rank"]), "best_token": str(best["token"]),
        "best_cosine": float(best["cosine"]),
        "median_cosine": float(df[df["rank"] == 1]["abs_cosine"].median()),
    }
    finding = ("Here, over the top {ranks} OV directions of every head, the one nearest to a "
               "token anchor is layer {best_layer}, head {best_head}, rank {best_rank}: "
               "{best_token} at cosine {best_cosine} (the median head's rank-1 direction "
               "reaches |cosine| {median_cosine}).")
    numbers["ranks"] = RANKS
    if neurons is not None and len(neurons):
        top = neurons.iloc[0]
        numbers.update({"answer": str(answer), "neuron_layer": int(top["layer"]),
                        "neuron": int(top["neuron"]), "neuron_cosine": float(top["cosine"])})
        finding += (" The neuron whose output points most at the lens's answer {answer} is "
                    "neuron {neuron} of layer {neuron_layer} (cosine {neuron_cosine}).")
    table = df.sort_values(["layer", "abs_cosine"], ascending=[True, False]) \
        .groupby("layer").head(HEADS_SHOWN)
    return Section(
        key="weights", title=title, sql="", params={}, df=table,
        figure=_figure(df, model, neurons, answer), claim=claim, finding=finding,
        numbers=numbers,
        source=(f"The stored circuits (models/{record.model_id}/weights/{{layer}}/circuits/OV/"
                "v and sigma) against the unit anchors nearest_anchors(v, 1) ranks, in both "
                "signs; the answer, then the neurons pointing at it:\n"
                + ANSWER_SQL.replace("$model", f"'{model}'") + ";\n"
                + NEURONS_SQL.replace("$model", f"'{model}'").replace(
                    "$token", str(answer_id)).replace("$k", str(NEURONS_SHOWN)) + ";"),
    )


def _figure(df: pd.DataFrame, model: str, neurons: pd.DataFrame | None,
            answer: str | None) -> Figure:
    """Layers x heads: |cosine| of each head's best direction, its token written in the cell."""
    rank1 = df.sort_values("abs_cosine", ascending=False).groupby(["layer", "head"]).head(1)
    layers = sorted(rank1["layer"].unique())
    heads = int(rank1["head"].max()) + 1
    grid = np.full((len(layers), heads), np.nan)
    fig = new_figure(min(2.0 + 0.9 * heads, 14.0), 2.0 + 0.45 * len(layers)
                     + (0.8 if neurons is not None else 0.0))
    ax = fig.add_subplot()
    for _, r in rank1.iterrows():
        i = layers.index(r["layer"])
        grid[i, int(r["head"])] = r["abs_cosine"]
        ax.text(int(r["head"]), i, repr(str(r["token"]))[1:-1][:10], ha="center",
                va="center", fontsize=6)
    im = ax.imshow(grid, aspect="auto", cmap="Blues", vmin=0.0)
    fig.colorbar(im, ax=ax, label="|cosine| of the head's best OV direction (ranks 1-3)")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([str(x) for x in layers])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    title = f"What each head's OV circuit writes, model {model}"
    if neurons is not None and len(neurons):
        title += (f"\nneurons pointing most at {answer!r}: "
                  + ", ".join(f"L{int(r.layer)} n{int(r.neuron)} ({r.cosine:.2f})"
                              for r in neurons.itertuples()))
    ax.set_title(title, fontsize=10)
    return fig
