"""A report's section: one measurement, as the report makes it and the page shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from .data import model_roles


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
    """The roles a lens reads, one site a layer: pre_attn (else post_mlp), and final."""
    roles = model_roles(db, model)
    base = "pre_attn" if "pre_attn" in roles else "post_mlp"
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
