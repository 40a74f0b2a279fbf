"""A report's section: one measurement, as the report makes it and the page shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from matplotlib.figure import Figure


@dataclass(frozen=True, kw_only=True)
class Section:
    """One measurement: the query, its answer, a figure, the claim and this model's numbers."""

    key: str
    title: str
    sql: str
    params: dict[str, Any]
    df: pd.DataFrame
    figure: Figure
    claim: str
    finding: str  # with {name} fields filled from `numbers`
    numbers: dict[str, float | int | str] = field(default_factory=dict)
