"""Pictures of where each layer moves on the sphere, drawn from the query layer's SQL.

Each picture has a function returning a matplotlib Figure and a `*_data` twin returning the
`(sql, params, DataFrame)` it plots; `save(fig, path)` writes PNG, SVG or PDF by extension.

    import actdb.plot
    fig = actdb.plot.lens("runs.actdb", prompt_id=3)          # in a notebook, shows itself
    actdb.plot.save(fig, "lens.svg")
    sql, params, df = actdb.plot.lens_data("runs.actdb", prompt_id=3)

matplotlib is imported on first use, so `import actdb.plot` (and the CLI) stays quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .data import PlotData, PlotError, inline_sql
    from .figures import (
        angles,
        angles_data,
        dims,
        dims_data,
        lens,
        lens_data,
        norms,
        norms_data,
        rotation,
        rotation_data,
        save,
    )

__all__ = ["PlotData", "PlotError", "angles", "angles_data", "dims", "dims_data",
           "inline_sql", "lens", "lens_data", "norms", "norms_data", "rotation",
           "rotation_data", "save"]

# The query layer (through .data) loads on first use too: the CLI registers `actdb plot`
# without paying for it when another command runs.
_DATA = frozenset({"PlotData", "PlotError", "inline_sql"})
_FIGURES = frozenset(__all__) - _DATA


def __getattr__(name: str) -> Any:
    if name in _FIGURES:
        return getattr(importlib.import_module(".figures", __name__), name)
    if name in _DATA:
        return getattr(importlib.import_module(".data", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
