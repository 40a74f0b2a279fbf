"""The lens picture: layers by token positions for one prompt.

By logit (the default with an LM head): each cell is the token the model's own next-token
distribution puts first when read at that layer (`top_logits`), coloured by its probability
(`prob`); with `token` given, cells show that token's rank (`token_rank`) and are coloured by
its probability. By anchor: the nearest anchor on the sphere (`nearest_anchors`) and its
cosine. The colour scale is fitted to the layers above the first, whose extreme values would
otherwise spend it (the first layer's colours are clipped, marked on the colour bar).
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from ..query import Database
from .canvas import new_figure, shorten, show_token
from .data import (
    DbOrPath,
    PlotData,
    PlotError,
    Spec,
    block_role,
    head_kind,
    head_tower_sites,
    is_missing,
    model_roles,
    model_row,
    opened,
    prompt_length,
    prompt_text,
    resolve_model,
    resolve_roles,
)

BY = ("logit", "anchor")

_WHERE = "model = $model AND prompt_id = $prompt_id AND list_contains($roles, role)"
ANCHOR_SQL = f"""\
SELECT layer, site, role, position, token,
       near[1].token_id AS anchor_id, near[1].token AS anchor, near[1].cosine AS cosine
FROM (
    SELECT layer, site, role, position, token, nearest_anchors(vec, 1{{anchors}}) AS near
    FROM acts
    WHERE {_WHERE}
)
ORDER BY layer, site, position"""
LOGIT_SQL = f"""\
SELECT layer, site, role, position, token, top[1].token_id AS top_id, top[1].token AS top_token,
       prob(vec, top[1].token_id) AS prob
FROM (
    SELECT layer, site, role, position, token, vec, top_logits(vec, 1) AS top
    FROM acts
    WHERE {_WHERE}
)
ORDER BY layer, site, position"""
TOKEN_SQL = f"""\
SELECT layer, site, role, position, token, token_rank(vec, $token) AS rank,
       prob(vec, $token) AS prob
FROM acts
WHERE {_WHERE}
ORDER BY layer, site, position"""


def lens_spec(db: Database, prompt_id: int, *, model: str | None = None, by: str | None = None,
              anchors: str | None = None, role: str | None = None,
              token: str | int | None = None) -> Spec:
    name = resolve_model(db, model)
    n = prompt_length(db, name, prompt_id)
    info = model_row(db, name)
    has_head = bool(info["has_lm_head"])
    by = by or ("logit" if has_head and anchors is None else "anchor")
    if by not in BY:
        raise PlotError(f"unknown lens {by!r}; choose one of {', '.join(BY)}")
    if by == "logit" and not has_head:
        raise PlotError(f"model {name!r} has no LM head, so no logit lens; use --by anchor")
    if token is not None and by != "logit":
        raise PlotError("--token shows a token's rank and probability on the logit lens; "
                        "it does not apply to --by anchor")
    roles_present = model_roles(db, name)
    if role is None:
        found = block_role(db, name)
        if found is None:
            raise PlotError(f"model {name!r} has no norm in its blocks at its width; "
                            f"choose a role with --role (its roles are "
                            f"{', '.join(roles_present)})")
        base = found
    else:
        base = resolve_roles(db, [name], role)[0]
    roles = [base] + (["final"] if base != "final" and "final" in roles_present else [])
    params: dict[str, Any] = {"model": name, "prompt_id": int(prompt_id), "roles": roles}
    text = prompt_text(db, prompt_id)
    decoder = _decoder_sites(db, name)
    if decoder:  # an encoder-decoder: the lens reads the tokens its decoder read
        params["sites"] = decoder
        n = int(db.sql("SELECT count(*) FROM tokens WHERE model = $m AND prompt_id = $p AND "
                       "tower = 'decoder'", params={"m": name, "p": int(prompt_id)}
                       ).fetchall()[0][0])
        text = f"{text} (its decoder's tokens)"
    meta: dict[str, Any] = {"model": name, "prompt_id": int(prompt_id), "n_tokens": n,
                            "roles": roles, "by": by, "text": text,
                            "classifier": head_kind(db, name), "pooled": _pooled(db, name)}
    if by == "anchor":
        if anchors is not None:
            params["anchors"] = anchors
        sql = ANCHOR_SQL.format(anchors=", $anchors" if anchors is not None else "")
        meta["anchors"] = anchors or ("unembed" if has_head else "embed")
    elif token is not None:
        params["token"] = token
        # One row first: a string that is not one token fails here, in one sentence.
        db.sql("SELECT token_rank(vec, $token) FROM acts WHERE model = $model LIMIT 1",
               params={"model": name, "token": token}).fetchall()
        sql, meta["token"] = TOKEN_SQL, token
    else:
        sql = LOGIT_SQL
    # A hierarchical model's early stages are narrower than its head (ConvNeXt's, Swin's):
    # the lens reads the sites of the head's width.
    narrow = _narrow_sites(db, name, roles)
    if by != "anchor":  # another tower's rows (a vision tower's) never meet the head's norm
        narrow |= set(_role_sites(db, name, roles)) - set(head_tower_sites(db, name))
    if narrow:
        kept = [s for s in params.get("sites", _role_sites(db, name, roles))
                if s not in narrow]
        params["sites"] = kept
    if decoder or narrow:
        sql = sql.replace(_WHERE, _WHERE + " AND list_contains($sites, site)")
    return Spec("lens", sql, params, meta)


def _role_sites(db: Database, model: str, roles: list[str]) -> list[str]:
    return [r[0] for r in db.sql("SELECT site FROM sites WHERE model = $m AND "
                                 "list_contains($roles, role)",
                                 params={"m": model, "roles": roles}).fetchall()]


def _narrow_sites(db: Database, model: str, roles: list[str]) -> set[str]:
    """The sites of `roles` narrower than the model's width (a hierarchical model's early
    stages), which no head reads."""
    return {r[0] for r in db.sql(
        "SELECT s.site FROM sites s JOIN models m USING (model) WHERE s.model = $m AND "
        "list_contains($roles, s.role) AND s.d <> m.d_model",
        params={"m": model, "roles": roles}).fetchall()}


def _pooled(db: Database, model: str) -> bool:
    """Whether the model's head averages its positions (models.head_pool; older stores have
    no such column: no)."""
    df = db.sql("SELECT * FROM models WHERE model = $m", params={"m": model}).df()
    return bool(len(df)) and df.iloc[0].get("head_pool") == "mean"


def _decoder_sites(db: Database, model: str) -> list[str]:
    """An encoder-decoder's decoder sites (whose rows are the tokens its decoder read); empty
    for any other model."""
    towers = db.sql("SELECT towers FROM models WHERE model = $m", params={"m": model}
                    ).fetchall()[0][0]
    if not towers or not {"encoder", "decoder"} <= set(json.loads(towers)):
        return []
    return [r[0] for r in db.sql("SELECT site FROM sites WHERE model = $m AND tower = "
                                 "'decoder'", params={"m": model}).fetchall()]


def _colour_norm(grid: np.ndarray) -> tuple[Normalize, str]:
    """A scale fitted to the layers above the first (row 0), and the colour bar's `extend`."""
    rest = grid[1:] if grid.shape[0] > 1 and np.isfinite(grid[1:]).any() else grid
    finite = rest[np.isfinite(rest)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if hi <= lo:
        hi = lo + 1e-9
    first = grid[0][np.isfinite(grid[0])]
    below, above = bool((first < lo).any()), bool((first > hi).any())
    extend = {(True, True): "both", (True, False): "min", (False, True): "max"}.get(
        (below, above), "neither")
    return Normalize(vmin=lo, vmax=hi, clip=False), extend


def lens_figure(spec: Spec, df: pd.DataFrame) -> Figure:

    m = spec.meta
    by, token = m["by"], m.get("token")
    rows = df[["layer", "site"]].drop_duplicates().reset_index(drop=True)
    positions = sorted(int(p) for p in df["position"].unique())
    col = {p: j for j, p in enumerate(positions)}
    row = {s: i for i, s in enumerate(rows["site"])}
    grid = np.full((len(rows), len(positions)), np.nan)
    labels = [[""] * len(positions) for _ in range(len(rows))]
    tokens = {int(p): t for p, t in zip(df["position"], df["token"], strict=True)}
    value = "cosine" if by == "anchor" else "prob"
    label = {"anchor": "anchor", "logit": "top_token"}[by] if token is None else "rank"
    # a classifier's or a contrastive model's anchors are label names, not text tokens
    named = m.get("classifier") in ("classifier", "labels")
    for site, pos, lab, v in zip(df["site"], df["position"], df[label], df[value],
                                 strict=True):
        i, j = row[site], col[int(pos)]
        grid[i, j] = np.nan if is_missing(v) else float(v)
        labels[i][j] = (str(int(lab)) if token is not None and not is_missing(lab)
                        else show_token(lab, 8, label=named))

    n_cols, n_rows = len(positions), len(rows)
    dense = n_cols > 60  # too many columns to label each cell readably
    cell_w = 0.22 if dense else 0.62
    fig = new_figure(max(6.5, 3.6 + cell_w * n_cols), max(3.5, 2.6 + 0.45 * n_rows))
    ax = fig.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad="#d9d9d9")  # NULL cells: grey
    norm, extend = _colour_norm(grid)
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto",
                   origin="lower", interpolation="nearest")
    if not dense:
        for i in range(n_rows):
            for j in range(n_cols):
                v = grid[i, j]
                light = bool(np.isnan(v) or np.asarray(norm(v)) > 0.55)
                ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=8,
                        color="black" if light else "white", gid=f"cell {i} {j}")
        ax.set_xticks(range(n_cols))
        names = [show_token(tokens[p]) for p in positions]
        ax.set_xticklabels(names, rotation=60, ha="right", rotation_mode="anchor")
        spaced = ", ␣ marks a space" if any("␣" in t for t in names) else ""
        ax.set_xlabel(f"input token (positions 0 to {n_cols - 1}{spaced})")
    else:  # every few positions, by number
        step = -(-n_cols // 40)
        ticks = list(range(0, n_cols, step))
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(positions[j]) for j in ticks])
        ax.set_xlabel(f"token position (0 to {n_cols - 1}; too many tokens to name each)")
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels(list(rows["site"]))
    ax.set_ylabel("layer (norm site, input side)")
    cbar = fig.colorbar(im, ax=ax, pad=0.01, extend=extend)
    roles = " + ".join(m["roles"])
    if by == "anchor":
        cbar.set_label(f"cosine to the nearest {m['anchors']} anchor (unitless)")
        head = "Logit lens on the sphere"
        what = (f"Each cell: the token of the nearest {m['anchors']} anchor, coloured by its "
                "cosine")
    elif token is None:
        cbar.set_label("probability of the top token (logit lens)")
        head = "Logit lens"
        what = ("Each cell: the label that position's vote puts first at that layer, coloured "
                "by its probability (the head averages its positions: the model's answer is "
                "the mean of the final row's votes)" if m.get("pooled")
                else "Each cell: the label the classifier's distribution puts first at that "
                "layer, coloured by its probability" if m.get("classifier") == "classifier"
                else "Each cell: the label the zero-shot distribution (softmax over the "
                "labels) puts first at that layer, coloured by its probability"
                if m.get("classifier") == "labels" else
                "Each cell: the token the model's next-token distribution puts first at that "
                "layer, coloured by its probability")
    else:
        tok = repr(token) if isinstance(token, str) else f"token id {token}"
        cbar.set_label(f"probability of {tok} (logit lens)")
        head = f"Logit lens for {tok}"
        what = f"Each cell: the rank of {tok} (1 = top), coloured by its probability"
    clipped = " (colours fitted above the first layer)" if extend != "neither" else ""
    # The title wraps to the figure's width: a narrow picture (few tokens) cut it off.
    width = max(40, int(fig.get_figwidth() * 11))
    ax.set_title(f"{head}: model {m['model']}, prompt {m['prompt_id']}, {roles} sites\n"
                 + textwrap.fill(what + clipped, width)
                 + f"\n\u201c{shorten(m['text'], width)}\u201d", fontsize=11)
    return fig


def lens_data(db_or_path: DbOrPath, prompt_id: int, *, model: str | None = None,
              by: str | None = None, anchors: str | None = None, role: str | None = None,
              token: str | int | None = None, device: str = "auto") -> PlotData:
    """The lens picture's (sql, params, DataFrame): per site and position, the top token and
    its probability (by logit), a chosen token's rank and probability, or the nearest anchor
    and its cosine (by anchor)."""
    with opened(db_or_path, device) as db:
        return lens_spec(db, prompt_id, model=model, by=by, anchors=anchors, role=role,
                         token=token).run(db)


def lens(db_or_path: DbOrPath, prompt_id: int, *, model: str | None = None,
         by: str | None = None, anchors: str | None = None, role: str | None = None,
         token: str | int | None = None, device: str = "auto") -> Figure:
    """Heatmap of layers by positions for one prompt: the logit lens (default with an LM
    head: top token coloured by probability, or `token`'s rank and probability) or, with
    `by="anchor"`, the nearest anchor and its cosine.

    Args:
        db_or_path: an open Database or a store path.
        prompt_id: the prompt to follow.
        model: the model (default: the store's only one).
        by: "logit" or "anchor" (default: logit with an LM head, or when `anchors` is given,
            anchor).
        anchors: the anchor set for `by="anchor"`.
        role: the role of the sites shown, one per layer (default pre_attn, else post_mlp).
        token: a token (string or id) whose rank and probability to show.
        device: where the tensor functions run.

    Returns:
        A matplotlib Figure.
    """
    with opened(db_or_path, device) as db:
        spec = lens_spec(db, prompt_id, model=model, by=by, anchors=anchors, role=role,
                         token=token)
        return lens_figure(spec, spec.run(db).df)
