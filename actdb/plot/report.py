"""`actdb report`: the published measurements behind this tool, run on a store, as one page.

Each section is one SQL query through the query layer, a figure drawn from its answer, and two
sentences: what the published work claims, and what this model shows, with every number in the
second taken from that answer (`Section.numbers`, written into the page with `data-key`s so a
reader, or a test, can check each one). html.py writes the page.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .data import (
    OUTLIER_FACTOR,
    DbOrPath,
    Spec,
    block_role,
    head_kind,
    head_tower_sites,
    model_roles,
    model_row,
    opened,
    profile_spec,
    store_models,
)
from .report_vision import VISION_SECTIONS, is_image_lens
from .section import TOP_DIMS, Section, answer_dims_sql, lens_roles, stays_from
from .weight_reading import weight_reading

# An eigenvalue "vanishes" when it is this many times below the layer's median eigenvalue.
VANISHING = 1e-3


def _residual_roles(db: Any, model: str) -> list[str]:
    roles = model_roles(db, model, full_width=True)
    chosen: list[str] = [r for r in ("pre_attn", "pre_mlp", "final") if r in roles]
    if not {"pre_attn", "pre_mlp", "post_attn", "post_mlp"} & set(roles):
        # neither pre- nor post-norm blocks (ConvNeXt's): the blocks' own norms
        base = block_role(db, model)
        chosen = [r for r in roles if r in (base, "final")]
    return chosen or roles


# -- the sections ------------------------------------------------------------------------------


def _angles(db: Any, model: str) -> Section:
    from .figures import profile_figure

    spec = profile_spec(db, "angles", models=[model], roles=_residual_roles(db, model))
    df = spec.run(db).df
    return Section(
        key="angles", title="Angle to the all-ones vector", sql=spec.sql, params=spec.params,
        df=df, figure=profile_figure(spec, df),
        claim="Published measurements of pre-norm transformers find hidden states nearly "
              "orthogonal to the all-ones vector: 87 to 92 degrees at every layer.",
        finding="Here the per-layer mean of uniform_angle(vec) ranges from {angle_min} to "
                "{angle_max} degrees.",
        numbers={"angle_min": float(df["mean"].min()), "angle_max": float(df["mean"].max())},
    )


def _norms(db: Any, model: str) -> Section:
    from .figures import profile_figure

    roles = _residual_roles(db, model)
    spec = profile_spec(db, "norms", models=[model], roles=roles)
    df = spec.run(db).df
    # The role seen at the most layers (pre_attn in a pre-norm model) shows growth with depth.
    main = str(df.groupby("role")["layer"].nunique().idxmax())
    first = df[df["role"] == main].sort_values("layer")
    positions = sorted({int(p) for ps in df["outlier_positions"] if ps is not None
                        for p in ps})
    return Section(
        key="norms", title="Norm of the residual stream, ||x|| / sqrt(d)", sql=spec.sql,
        params=spec.params, df=df, figure=profile_figure(spec, df),
        claim="Residual-stream norms grow with depth, and a few positions (attention sinks, "
              "often the first token) carry norms orders of magnitude above the rest.",
        finding=f"Here the median at {main} sites goes from {{norm_first}} at layer "
                f"{{layer_first}} to {{norm_last}} at layer {{layer_last}}; positions above "
                f"{OUTLIER_FACTOR:g} times their layer's median: {{outliers}}.",
        numbers={"norm_first": float(first["center"].iloc[0]),
                 "layer_first": int(first["layer"].iloc[0]),
                 "norm_last": float(first["center"].iloc[-1]),
                 "layer_last": int(first["layer"].iloc[-1]),
                 "outliers": ", ".join(map(str, positions)) if positions else "none"},
    )


def _rotation(db: Any, model: str) -> Section:
    from .figures import profile_figure

    spec = profile_spec(db, "rotation", models=[model], roles=_residual_roles(db, model))
    df = spec.run(db).df
    return Section(
        key="rotation", title="Rotation by the norm", sql=spec.sql, params=spec.params, df=df,
        figure=profile_figure(spec, df),
        claim="A normalization layer is often read as a pure rescaling; with a learned "
              "per-dimension gain (and LayerNorm's centring) it also turns the vector.",
        finding="Here the per-layer mean angle between a norm's input and output ranges from "
                "{rotation_min} to {rotation_max} degrees.",
        numbers={"rotation_min": float(df["mean"].min()),
                 "rotation_max": float(df["mean"].max())},
    )


SPECTRUM_SQL = """\
SELECT layer, site, count(*) AS n, spectrum(list(normalized(vec))) AS eigenvalues
FROM acts
WHERE model = $model AND list_contains($roles, role) AND head IS NULL
GROUP BY layer, site
ORDER BY layer, site"""


def vanishing(eigenvalues: Any, n: int) -> int:
    """Eigenvalues more than 1/VANISHING times below the median, among the n - 1 that n
    vectors can span (the rest are zero by the sample count alone)."""
    if eigenvalues is None:  # spectrum() is NULL below 2 vectors (CLIP's one pooled row)
        return 0
    eig = np.asarray(eigenvalues, dtype=float)[: max(n - 1, 0)]
    if eig.size == 0:
        return 0
    return int((eig < VANISHING * np.median(eig)).sum())


def _spectrum(db: Any, model: str) -> Section:
    from .report_figures import spectrum_figure

    # One site per layer (as the lens shows them): a d x d eigendecomposition per site.
    params = {"model": model, "roles": lens_roles(db, model)}
    df = db.sql(SPECTRUM_SQL, params=params).df()
    counts = [vanishing(e, int(n)) for e, n in zip(df["eigenvalues"], df["n"], strict=True)]
    d = int(model_row(db, model)["d_model"])
    return Section(
        key="spectrum", title="Covariance spectrum of normalized vectors", sql=SPECTRUM_SQL,
        params=params, df=df, figure=spectrum_figure(df, model),
        claim="The normalized vectors are predicted to span all directions but two: their "
              "covariance spectrum should show two eigenvalues orders of magnitude below the "
              "rest (one from centring, which removes the all-ones direction).",
        finding=f"Here, per layer (d = {d}, {{n_min}} to {{n_max}} vectors), between "
                f"{{vanishing_min}} and {{vanishing_max}} eigenvalues are more than "
                f"{1 / VANISHING:g} times below the median eigenvalue.",
        numbers={"vanishing_min": min(counts), "vanishing_max": max(counts),
                 "n_min": int(df["n"].min()), "n_max": int(df["n"].max())},
    )


EMERGENCE_SQL = """\
WITH answer AS (
    SELECT prompt_id, position, top_logits(vec, 1)[1].token_id AS token_id
    FROM acts WHERE model = $model AND site = (SELECT final_site FROM models WHERE model = $model)
      AND position_from_end = 0
), ranked AS (
    SELECT a.layer, a.site, token_rank(a.vec, answer.token_id) AS rank,
           prob(a.vec, answer.token_id) AS p
    FROM acts a JOIN answer USING (prompt_id, position)
    WHERE a.model = $model AND list_contains($roles, a.role)
      AND list_contains($sites, a.site)
)
SELECT layer, site, count(*) AS prompts, avg((rank = 1)::DOUBLE) AS top1_share,
       median(rank) AS median_rank, avg(p) AS mean_prob
FROM ranked
GROUP BY layer, site
ORDER BY layer, site"""


def _emergence(db: Any, model: str) -> Section:
    from .report_figures import emergence_figure

    params = {"model": model, "roles": lens_roles(db, model),
              "sites": head_tower_sites(db, model)}
    df = db.sql(EMERGENCE_SQL, params=params).df()
    inner = df[df["site"] != model_row(db, model)["final_site"]]
    stays = stays_from(list(inner["layer"]), list(inner["top1_share"]))
    return Section(
        key="emergence", title="Where the answer first appears on the logit lens",
        sql=EMERGENCE_SQL, params=params, df=df, figure=emergence_figure(df, model),
        claim="The logit lens finds a model's final prediction readable in the residual "
              "stream several layers before the output, sharpening with depth.",
        finding="Here, over the last token of {prompts} prompts, the final answer is the "
                "lens's top token for {top1_last_inner} of them at the last layer before the "
                "final norm; the first layer from which it stays top for at least half "
                "of them: {stays_half_layer}.",
        numbers={"prompts": int(df["prompts"].max()),
                 "top1_last_inner": float(inner["top1_share"].iloc[-1]) if len(inner) else 0.0,
                 "stays_half_layer": stays if stays is not None else "none"},
    )


DIMS_SQL = answer_dims_sql("a.position_from_end = 0")


def _dims(db: Any, model: str) -> Section:
    from .report_figures import dims_summary_figure

    params = {"model": model, "k": TOP_DIMS}
    df = db.sql(DIMS_SQL, params=params).df()
    n_dims = int(df["n_dims"].iloc[0])
    return Section(
        key="dims", title="Which dimensions push toward the answer", sql=DIMS_SQL,
        params=params, df=df, figure=dims_summary_figure(df, model),
        claim="A handful of outlier ('massive' or 'rogue') dimensions are reported to "
              "dominate the residual stream and the logits read from it.",
        finding=f"Here the {TOP_DIMS} dims with the largest mean |logit_contribution| toward "
                f"each prompt's final answer carry {{top_share}} of the total over all "
                f"{n_dims} dims (an even spread would give {TOP_DIMS / n_dims:.3f}); the "
                "largest is dim {top_dim}.",
        numbers={"top_share": float(df["mean_abs"].sum() / df["total_abs"].iloc[0]),
                 "top_dim": int(df["dim"].iloc[0])},
    )


SECTIONS: tuple[Callable[[Any, str], Section], ...] = (_angles, _norms, _rotation, _spectrum)
LM_SECTIONS: tuple[Callable[[Any, str], Section], ...] = (_emergence, _dims, weight_reading)


def measure(db: Any, model: str) -> list[Section]:
    """Every section that applies to the model: the lens ones need a head; an image model's
    read the class token its head reads (report_vision.py), a text model's the last token."""
    if is_image_lens(db, model):
        lens: tuple[Callable[[Any, str], Section], ...] = VISION_SECTIONS
    else:
        lm = bool(model_row(db, model)["has_lm_head"]) and head_kind(db, model) in (None, "lm")
        lens = LM_SECTIONS if lm else ()
    return [make(db, model) for make in SECTIONS + lens]


def report(db_or_path: DbOrPath, output: str | os.PathLike[str] | None = None, *,
           models: list[str] | None = None, device: str = "auto") -> Path:
    """Run the published measurements on a store and write them as one self-contained HTML
    page (figures inline as PNG, each with its SQL).

    Args:
        db_or_path: an open Database or a store path.
        output: the .html file to write (default: report.html in the current folder).
        models: the models to report on (default: every model in the store).
        device: where the tensor functions run.

    Returns:
        The path written.
    """
    from .html import render

    out = Path(output) if output is not None else Path("report.html")
    with opened(db_or_path, device) as db:
        names = models or store_models(db)
        parts = [(name, measure(db, name)) for name in names]
        page = render(db, parts)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        from .data import PlotError

        raise PlotError(f"cannot write {str(out)!r}: {e.strerror or e}") from None
    return out


__all__ = ["Section", "Spec", "measure", "report", "stays_from", "vanishing"]
