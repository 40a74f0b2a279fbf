"""The report's sections for an image model whose head reads its class token (an image
classifier's 'classifier' anchors, a contrastive model's 'labels'): the lens on the class
token over every image, the lens and the patches picture of one image, and the dims that push
the class token toward its label. The text model's lens sections read the last token, which
an image model's head never reads.

The head's row is the class token (`<cls>`) at every site, or the one pooled row of a final
norm that reads the class token alone (CLIP's `post_layernorm`, token `<pooled>`).
"""

from __future__ import annotations

from typing import Any

from .data import is_missing, model_row
from .section import TOP_DIMS, Section, answer_dims_sql, lens_roles, stays_from

# The rows an image model's head reads: its class token, or the final norm's pooled row.
HEAD_ROWS = "('<cls>', '<pooled>')"

CLASS_LENS_SQL = f"""\
WITH answer AS (
    SELECT prompt_id, top_logits(vec, 1)[1].token_id AS token_id
    FROM acts WHERE model = $model AND site = (SELECT final_site FROM models WHERE model = $model)
      AND token IN {HEAD_ROWS}
), ranked AS (
    SELECT a.layer, a.site, token_rank(a.vec, answer.token_id) AS rank,
           prob(a.vec, answer.token_id) AS p
    FROM acts a JOIN answer USING (prompt_id)
    WHERE a.model = $model AND list_contains($roles, a.role) AND a.token IN {HEAD_ROWS}
)
SELECT layer, site, count(*) AS prompts, avg((rank = 1)::DOUBLE) AS top1_share,
       median(rank) AS median_rank, avg(p) AS mean_prob
FROM ranked
GROUP BY layer, site
ORDER BY layer, site"""

CLASS_DIMS_SQL = answer_dims_sql(f"a.token IN {HEAD_ROWS}")

_VILAS = ("Projecting a vision transformer's tokens onto its classifier's class embeddings "
          "(Vilas et al., 2023)")


def is_image_lens(db: Any, model: str) -> bool:
    """Whether the model reads images and its head reads the class token (the lens exists)."""
    df = db.sql("SELECT * FROM models WHERE model = $m", params={"m": model}).df()
    row = df.iloc[0].to_dict()
    kind = row.get("head_kind")
    if kind not in ("classifier", "labels") or not bool(row.get("has_lm_head")):
        return False
    if row.get("head_pool") == "mean":  # its answer is every position's mean: no class token
        return False
    return not (kind == "labels" and is_missing(row.get("head_position")))


def _first_image(db: Any, model: str) -> int:
    rows = db.sql("SELECT min(prompt_id) FROM acts WHERE model = $m AND patch_row IS NOT NULL",
                  params={"m": model}).fetchall()
    return int(rows[0][0])


def _class_lens(db: Any, model: str) -> Section:
    from .report_figures import emergence_figure

    params = {"model": model, "roles": lens_roles(db, model)}
    df = db.sql(CLASS_LENS_SQL, params=params).df()
    inner = df[df["site"] != model_row(db, model)["final_site"]]
    stays = stays_from(list(inner["layer"]), list(inner["top1_share"]))
    return Section(
        key="class_lens", title="The class token on the lens, layer by layer",
        sql=CLASS_LENS_SQL, params=params, df=df,
        figure=emergence_figure(df, model, answer="the model's top label, read at the class "
                                "token of each image"),
        claim=f"{_VILAS} finds the image's class readable from the class token in the later "
              "layers, not the early ones.",
        finding="Here, over the class token of {prompts} images, the model's label is the "
                "lens's top label for {top1_last_inner} of them at the last layer before the "
                "final norm; the first layer from which it stays top for at least half of "
                "them: {stays_half_layer}.",
        numbers={"prompts": int(df["prompts"].max()),
                 "top1_last_inner": float(inner["top1_share"].iloc[-1]) if len(inner) else 0.0,
                 "stays_half_layer": stays if stays is not None else "none"},
    )


def _image_lens(db: Any, model: str) -> Section:
    from .lensmap import lens_figure, lens_spec

    prompt = _first_image(db, model)
    spec = lens_spec(db, prompt, model=model)
    df = spec.run(db).df
    final = model_row(db, model)["final_site"]
    head = df[(df["site"] == final) & df["token"].isin(["<cls>", "<pooled>"])]
    cls = df[df["token"] == "<cls>"].sort_values("layer")
    return Section(
        key="image_lens", title=f"The lens on one image (input {prompt})", sql=spec.sql,
        params=spec.params, df=df, figure=lens_figure(spec, df),
        claim=f"{_VILAS} reads every token of an image, the class token and the patches, "
              "through the head at every layer.",
        finding="Here, on input {prompt}, the class token reads {label} at the final site "
                "with probability {prob}; at the first layer shown it reads {first_label}.",
        numbers={"prompt": prompt, "label": str(head["top_token"].iloc[0]),
                 "prob": float(head["prob"].iloc[0]),
                 "first_label": str(cls["top_token"].iloc[0]) if len(cls) else "none"},
    )


def _patches(db: Any, model: str) -> Section:
    from .patches import patches_figure, patches_spec

    prompt = _first_image(db, model)
    spec = patches_spec(db, prompt, model=model)
    df = spec.run(db).df
    last = df[df["layer"] == df["layer"].max()]
    counts = last["top"].value_counts()
    return Section(
        key="patches", title=f"The patches of one image (input {prompt})", sql=spec.sql,
        params=spec.params, df=df, figure=patches_figure(spec, df),
        claim=f"{_VILAS} finds the image (patch) tokens, too, coming to carry class "
              "information in the later layers.",
        finding="Here, at the last layer drawn (layer {layer}), {share} of the {patches} "
                "patches of input {prompt} read as {label}, the most common label among them.",
        numbers={"layer": int(last["layer"].iloc[0]), "patches": int(len(last)),
                 "share": float(counts.iloc[0] / len(last)), "label": str(counts.index[0]),
                 "prompt": prompt},
    )


def _class_dims(db: Any, model: str) -> Section:
    from .report_figures import dims_summary_figure

    params = {"model": model, "k": TOP_DIMS}
    df = db.sql(CLASS_DIMS_SQL, params=params).df()
    n_dims = int(df["n_dims"].iloc[0])
    return Section(
        key="class_dims", title="Which dimensions push the class token toward its label",
        sql=CLASS_DIMS_SQL, params=params, df=df, figure=dims_summary_figure(df, model),
        claim="A handful of outlier ('massive') dimensions are reported to dominate the "
              "residual stream of transformers, vision transformers included, and what is "
              "read from it.",
        finding=f"Here the {TOP_DIMS} dims with the largest mean |logit_contribution| toward "
                f"each image's label at the class token carry {{top_share}} of the total over "
                f"all {n_dims} dims (an even spread would give {TOP_DIMS / n_dims:.3f}); the "
                "largest is dim {top_dim}.",
        numbers={"top_share": float(df["mean_abs"].sum() / df["total_abs"].iloc[0]),
                 "top_dim": int(df["dim"].iloc[0])},
    )


VISION_SECTIONS = (_class_lens, _image_lens, _patches, _class_dims)
