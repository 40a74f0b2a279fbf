"""A report's section: one measurement, as the report makes it and the page shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from .data import block_role, model_roles


@dataclass(frozen=True, kw_only=True)
class Section:
    """One measurement: the query, its answer, a figure, the claim and this model's numbers."""

    key: str
    title: str
    sql: str
    params: dict[str, Any]
    df: pd.DataFrame
    figure: Figure | None  # None: a skipped section
    claim: str
    finding: str  # with {name} fields filled from `numbers`
    numbers: dict[str, float | int | str] = field(default_factory=dict)
    # Where `sql` is empty: how the numbers are computed (the arrays read, and any SQL).
    source: str = ""
    skipped: bool = False  # not measurable on this store: `finding` says why


TOP_DIMS = 10  # the dims a report's dims section shows


def lens_roles(db: Any, model: str) -> list[str]:
    """The roles a lens reads, one site a layer: pre_attn (else post_mlp, else the blocks'
    own norms: data.block_role), and final."""
    roles = model_roles(db, model)
    base = block_role(db, model)
    return [r for r in (base, "final") if r in roles]


def stays_from(layers: list[int], shares: list[float], at_least: float = 0.5) -> int | None:
    """The first of `layers` (in order) from which every share is at least `at_least`: where
    the answer stays the top token for half the prompts. The first layer where it is, once, can
    be an early fluke (a prompt ending on its own answer), not where the answer appears."""
    stays = None
    for layer, share in zip(reversed(layers), reversed(shares), strict=True):
        if share < at_least:
            break
        stays = int(layer)
    return stays


def answer_dims_sql(rows: str) -> str:
    """The dims that push the final site's top token most, on average over the `rows` (a SQL
    condition on `acts a`: the position each input's head reads)."""
    return f"""\
WITH answer AS (
    SELECT a.prompt_id, a.vec, top_logits(a.vec, 1)[1].token_id AS token_id, s.d
    FROM acts a JOIN sites s ON s.model = a.model AND s.site = a.site
    WHERE a.model = $model AND {rows}
      AND a.site = (SELECT final_site FROM models WHERE model = $model)
), parts AS (
    SELECT dim, logit_contribution(vec, dim, token_id) AS c
    FROM (SELECT vec, token_id, unnest(range(d)) AS dim FROM answer)
)
SELECT dim, avg(c) AS mean_contribution, avg(abs(c)) AS mean_abs,
       sum(avg(abs(c))) OVER () AS total_abs, count(*) OVER () AS n_dims
FROM parts
GROUP BY dim
ORDER BY mean_abs DESC, dim
LIMIT $k"""
