"""The data behind each picture: the SQL (run by the query layer) and the checks of its inputs.

Every picture is one SQL statement with `$name` parameters, the same a user could run with
`actdb query` (`inline_sql` writes the parameters in as literals for `--sql`). Inputs are
checked first, through small catalog queries, so that bad input is one clear sentence instead
of an empty picture.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import QueryError
from ..query import Database, connect

if TYPE_CHECKING:
    import pandas as pd

DbOrPath = Database | str | os.PathLike[str]

# The spread band of the per-layer profiles: this quantile range around the mean.
BAND = (0.1, 0.9)


class PlotError(QueryError):
    """A picture's request names something the store does not hold (prompt, position, ...)."""


class PlotData(NamedTuple):
    """What a picture plots: the SQL, its parameters, and the query layer's answer."""

    sql: str
    params: dict[str, Any]
    df: pd.DataFrame


@dataclass
class Spec:
    """A picture's SQL and parameters, plus what its title and axes need to say."""

    kind: str
    sql: str
    params: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def run(self, db: Database) -> PlotData:
        return PlotData(self.sql, dict(self.params), db.sql(self.sql, params=self.params).df())


@contextmanager
def opened(db_or_path: DbOrPath, device: str = "auto") -> Iterator[Database]:
    """A Database as given, or one opened read-only on a path (and closed afterwards)."""
    if isinstance(db_or_path, Database):
        yield db_or_path
        return
    db = connect(db_or_path, device=device)
    try:
        yield db
    finally:
        db.close()


# -- SQL text ---------------------------------------------------------------------------------


def sql_literal(value: Any) -> str:
    """A Python value as a DuckDB literal."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(sql_literal(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as a SQL literal")


def inline_sql(sql: str, params: dict[str, Any]) -> str:
    """The SQL with each `$name` replaced by its value: runnable as is by `actdb query`."""
    return re.sub(r"\$([A-Za-z_]\w*)", lambda m: sql_literal(params[m.group(1)]), sql)


# -- resolving and checking the request --------------------------------------------------------


def _quoted(names: Sequence[Any]) -> str:
    return ", ".join(repr(n) for n in names)


def store_models(db: Database) -> list[str]:
    return [r[0] for r in db.sql("SELECT model FROM models ORDER BY model_id").fetchall()]


def resolve_model(db: Database, model: str | None) -> str:
    """The model asked for, or the store's only model."""
    names = store_models(db)
    if not names:
        raise PlotError("the store holds no models yet; ingest one first")
    if model is None:
        if len(names) > 1:
            raise PlotError(f"the store holds {len(names)} models ({_quoted(names)}); "
                            "choose one with --model")
        return names[0]
    if model not in names:
        raise PlotError(f"model {model!r} is not in the store; its models are {_quoted(names)}")
    return model


def resolve_models(db: Database, models: str | Sequence[str] | None) -> list[str]:
    """Several models (for comparisons); none given means the store's only model."""
    if models is None or isinstance(models, str):
        return [resolve_model(db, models)]
    if not models:
        return [resolve_model(db, None)]
    out: list[str] = []
    for m in models:
        name = resolve_model(db, m)
        if name not in out:
            out.append(name)
    return out


def head_kind(db: Database, model: str) -> str | None:
    """'lm', 'classifier' or None (no head; older stores have no such column: None)."""
    df = db.sql("SELECT * FROM models WHERE model = $model", params={"model": model}).df()
    value = df.iloc[0].get("head_kind") if len(df) else None
    return value if isinstance(value, str) else None


def model_row(db: Database, model: str) -> dict[str, Any]:
    df = db.sql("SELECT model, d_model, n_layers, has_lm_head, final_site FROM models "
                "WHERE model = $model", params={"model": model}).df()
    row: dict[str, Any] = df.iloc[0].to_dict()
    return row


def model_roles(db: Database, model: str, *, full_width: bool = False) -> list[str]:
    """The model's roles in forward order (optionally only those at the model width)."""
    width = "AND s.d = m.d_model" if full_width else ""
    rows = db.sql(
        f"SELECT s.role, min(s.site_id) AS first FROM sites s JOIN models m USING (model) "
        f"WHERE s.model = $model {width} GROUP BY s.role ORDER BY first",
        params={"model": model},
    ).fetchall()
    return [r[0] for r in rows]


def block_role(db: Database, model: str) -> str | None:
    """The role a lens reads one site a layer of: pre_attn, else post_mlp, else the model's
    own blocks' norm (ConvNeXt's, after its depthwise convolution, has no attention to be
    before: `other`), the full-width role at the most layers besides embed and final."""
    roles = model_roles(db, model)
    for role in ("pre_attn", "post_mlp"):
        if role in roles:
            return role
    rows = db.sql(
        "SELECT s.role FROM sites s JOIN models m USING (model) WHERE s.model = $model "
        "AND s.d = m.d_model AND s.role NOT IN ('embed', 'final') AND s.layer >= 0 "
        "GROUP BY s.role ORDER BY count(DISTINCT s.layer) DESC, min(s.site_id) LIMIT 1",
        params={"model": model}).fetchall()
    return str(rows[0][0]) if rows else None


def head_tower_sites(db: Database, model: str) -> list[str]:
    """The sites of the tower whose final norm the model's head reads (`models.final_site`):
    the ones a logit lens reads. An encoder-decoder's encoder rows and a multimodal model's
    vision tower's never meet that norm, and the lens functions refuse them. Every site in a
    store without towers."""
    sites = db.sql("SELECT * FROM sites WHERE model = $m", params={"m": model}).df()
    final = model_row(db, model)["final_site"]
    if "tower" not in sites.columns or final not in set(sites["site"]):
        return [str(s) for s in sites["site"]]
    tower = sites.loc[sites["site"] == final, "tower"].iloc[0]
    same = sites["tower"].isna() if is_missing(tower) else sites["tower"] == tower
    return [str(s) for s in sites.loc[same, "site"]]


def resolve_roles(db: Database, models: Sequence[str], roles: str | Sequence[str] | None
                  ) -> list[str]:
    """Roles asked for (each must exist in some model); default: every role at model width."""
    present: list[str] = []
    for m in models:
        present += [r for r in model_roles(db, m) if r not in present]
    if roles is None or (not isinstance(roles, str) and not roles):
        out: list[str] = []
        for m in models:
            out += [r for r in model_roles(db, m, full_width=True) if r not in out]
        return out
    wanted = [roles] if isinstance(roles, str) else list(roles)
    for r in wanted:
        if r not in present:
            whose = f"model {models[0]!r}" if len(models) == 1 else "the models"
            raise PlotError(f"{whose} has no sites with role {r!r}; its roles are "
                            f"{', '.join(present)}")
    return wanted


def prompt_length(db: Database, model: str, prompt_id: int) -> int:
    """Tokens of a prompt stored for a model; a clear error if the prompt is not there."""
    n = db.sql("SELECT count(*) FROM tokens WHERE model = $model AND prompt_id = $prompt_id",
               params={"model": model, "prompt_id": int(prompt_id)}).fetchall()[0][0]
    if n:
        return int(n)
    count, lo, hi = db.sql("SELECT count(*), min(prompt_id), max(prompt_id) FROM prompts"
                           ).fetchall()[0]
    if not count:
        raise PlotError(f"prompt id {prompt_id} does not exist: the store holds no prompts")
    known = db.sql("SELECT count(*) FROM prompts WHERE prompt_id = $p",
                   params={"p": int(prompt_id)}).fetchall()[0][0]
    if known:
        raise PlotError(f"prompt id {prompt_id} has not been ingested for model {model!r}")
    raise PlotError(f"prompt id {prompt_id} does not exist: the store holds {count} prompts, "
                    f"ids {lo} to {hi}")


def prompt_text(db: Database, prompt_id: int) -> str:
    """The prompt's text; for an input of media alone (text NULL), its image, video or
    sound file."""
    rows = db.sql("SELECT * FROM prompts WHERE prompt_id = $p",
                  params={"p": int(prompt_id)}).df()
    if rows.empty:
        return ""
    row = rows.iloc[0]
    if isinstance(row["text"], str):
        return str(row["text"])
    return next((f"{k}: {row[k]}" for k in ("image", "video", "audio")
                 if k in row and isinstance(row[k], str)), "")


def resolve_position(db: Database, model: str, prompt_id: int, position: int) -> int:
    """A position in the prompt; negative counts from the end (-1 is the last token)."""
    n = prompt_length(db, model, prompt_id)
    p = position + n if position < 0 else position
    if not 0 <= p < n:
        where = "past the end" if position >= 0 else "before the start"
        raise PlotError(f"position {position} is {where} of prompt {prompt_id}, which has {n} "
                        f"tokens for model {model!r} (positions 0 to {n - 1})")
    return p


def resolve_site(db: Database, model: str, site: str | None) -> str:
    """The site asked for; default the model's final site, else its last layer's last site."""
    sites = [r[0] for r in db.sql("SELECT site FROM sites WHERE model = $model ORDER BY site_id",
                                  params={"model": model}).fetchall()]
    if site is not None:
        if site not in sites:
            raise PlotError(f"model {model!r} has no site {site!r}; its sites are "
                            f"{', '.join(sites)}")
        return site
    final = model_row(db, model)["final_site"]
    if isinstance(final, str) and final in sites:
        return final
    rows = db.sql("SELECT s.site FROM sites s JOIN models m USING (model) "
                  "WHERE s.model = $model AND s.d = m.d_model "
                  "ORDER BY s.layer DESC, s.site_id DESC LIMIT 1",
                  params={"model": model}).fetchall()
    if not rows:
        raise PlotError(f"model {model!r} has no site at the model width")
    return str(rows[0][0])


# -- the pictures' SQL ------------------------------------------------------------------------


PROFILE_SQL = """\
SELECT model, layer, role, depth, count(x) AS n, {center} AS center, avg(x) AS mean,
       stddev_pop(x) AS std, quantile_cont(x, {lo}) AS lo, quantile_cont(x, {hi}) AS hi{extra}
FROM ({inner})
GROUP BY model, layer, role, depth
ORDER BY model, layer, role"""
_INNER = """
    SELECT a.model, a.layer, a.role, a.position,
           a.layer / greatest(m.n_layers, 1) AS depth, {expr} AS x
    FROM acts a JOIN models m ON m.model = a.model{join}
    WHERE list_contains($models, a.model) AND list_contains($roles, a.role)
"""
_WITH_MEDIAN = """
  SELECT *, median(x) OVER (PARTITION BY model, layer, role) AS med
  FROM ({inner})
"""

# A token is an outlier of its layer when its norm is this many times the layer's median
# (an attention sink's norm is tens to thousands of times the rest).
OUTLIER_FACTOR = 10.0
_NORM_OUTLIERS = """,
       max(x) AS top, arg_max(position, x) AS top_position,
       list(DISTINCT position ORDER BY position) FILTER (WHERE x > $outlier * med)
           AS outlier_positions"""

_PROFILES = {
    "angles": ("uniform_angle(a.vec)", ""),
    "norms": ("a.norm / sqrt(s.d)", "\n    JOIN sites s ON s.model = a.model AND s.site = a.site"),
    "rotation": ("rotation_angle(a.vec)", ""),
}


def profile_spec(db: Database, kind: str, *, models: str | Sequence[str] | None = None,
                 roles: str | Sequence[str] | None = None,
                 relative_depth: bool | None = None) -> Spec:
    """Per (model, layer, role): centre (median for norms, else mean), spread and quantile
    band of one per-token quantity; norms also name the outlier positions of each layer.
    `relative_depth` puts layer / n_layers on the x axis (default: when the models given
    differ in depth)."""
    names = resolve_models(db, models)
    chosen = resolve_roles(db, names, roles)
    if not chosen:
        raise PlotError(f"model {names[0]!r} has no sites to plot")
    expr, join = _PROFILES[kind]
    params: dict[str, Any] = {"models": names, "roles": chosen}
    inner = _INNER.format(expr=expr, join=join)
    if kind == "norms":
        center, extra = "median(x)", _NORM_OUTLIERS
        inner = _WITH_MEDIAN.format(inner=inner)
        params["outlier"] = OUTLIER_FACTOR
    else:
        center, extra = "avg(x)", ""
    sql = PROFILE_SQL.format(inner=inner, lo=BAND[0], hi=BAND[1], center=center, extra=extra)
    n_tokens = {m: int(db.sql("SELECT count(*) FROM tokens WHERE model = $m",
                              params={"m": m}).fetchall()[0][0]) for m in names}
    depths = {int(db.sql("SELECT n_layers FROM models WHERE model = $m",
                         params={"m": m}).fetchall()[0][0]) for m in names}
    relative = len(depths) > 1 if relative_depth is None else bool(relative_depth)
    return Spec(kind, sql, params, {"models": names, "roles": chosen, "n_tokens": n_tokens,
                                    "relative_depth": relative})


# Which dims push toward a token: the split of its logit, or, for a model without an LM head
# (no logits), the split of the cosine with its input-embedding anchor (anchor_contribution
# sums to cosine_to_anchor over the dims).
_DIMS_TEMPLATE = """\
WITH v AS (
    SELECT a.vec, s.d
    FROM acts a JOIN sites s ON s.model = a.model AND s.site = a.site
    WHERE a.model = $model AND a.prompt_id = $prompt_id AND a.position = $position
      AND a.site = $site AND a.head IS NULL
), c AS (
    SELECT dim, {part} AS contribution
    FROM (SELECT vec, unnest(range(d)) AS dim FROM v)
)
SELECT dim, contribution, sum(contribution) OVER () AS total, count(*) OVER () AS n_dims,
       (SELECT {whole} FROM v) AS {name}
FROM c
ORDER BY abs(contribution) DESC, dim
LIMIT $k"""
DIMS_SQL = _DIMS_TEMPLATE.format(part="logit_contribution(vec, dim, $token)",
                                 whole="logit(vec, $token)", name="logit")
COSINE_DIMS_SQL = _DIMS_TEMPLATE.format(
    part="anchor_contribution(vec, dim, $token, 'embed')",
    whole="cosine_to_anchor(vec, $token, 'embed')", name="cosine")


def dims_spec(db: Database, prompt_id: int, position: int, token: str | int, *,
              model: str | None = None, site: str | None = None, k: int = 20) -> Spec:
    name = resolve_model(db, model)
    info = model_row(db, name)
    measure = "logit" if bool(info["has_lm_head"]) else "cosine"
    if int(k) < 1:
        raise PlotError(f"k must be at least 1, got {k}")
    pos = resolve_position(db, name, prompt_id, position)
    site_name = resolve_site(db, name, site)
    where = {"model": name, "prompt_id": int(prompt_id), "position": pos, "site": site_name}
    # One row through the query layer: a token that is not one token fails here, clearly.
    check = "logit(vec, $token)" if measure == "logit" else "cosine_to_anchor(vec, $token, 'embed')"
    db.sql(f"SELECT {check} FROM acts WHERE model = $model AND prompt_id = $prompt_id "
           "AND position = $position AND site = $site AND head IS NULL",
           params={**where, "token": token}).fetchall()
    at = db.sql("SELECT token FROM tokens WHERE model = $model AND prompt_id = $prompt_id "
                "AND position = $position",
                params={k: where[k] for k in ("model", "prompt_id", "position")}).fetchall()
    params = {**where, "token": token, "k": int(k)}
    return Spec("dims", DIMS_SQL if measure == "logit" else COSINE_DIMS_SQL, params, {
        "measure": measure, "model": name, "prompt_id": int(prompt_id), "position": pos,
        "site": site_name,
        "token": token, "k": int(k), "at_token": at[0][0] if at else "",
        "text": prompt_text(db, prompt_id),
    })


def is_missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))
