"""`vec` handles: one BIGINT naming a stored vector (model, site, head, row) and a view of it.

Bits, low to high: row (34), head + 1 (8; 0 = no head), site_id (12), model_id (7), view (2).
A handle is a plain integer in SQL, so DuckDB joins, filters and sorts rows that carry one
without touching a vector; vectors are read only when a tensor function receives the handle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROW_BITS, HEAD_BITS, SITE_BITS, MODEL_BITS = 34, 8, 12, 7
HEAD_SHIFT = ROW_BITS
SITE_SHIFT = HEAD_SHIFT + HEAD_BITS
MODEL_SHIFT = SITE_SHIFT + SITE_BITS
VIEW_SHIFT = MODEL_SHIFT + MODEL_BITS

VIEWS = ("raw", "normalized", "normed", "final_norm")


@dataclass(frozen=True)
class Decoded:
    row: np.ndarray  # int64 [n]
    head: np.ndarray  # int64 [n], -1 where the site has no heads
    site_id: np.ndarray
    model_id: np.ndarray
    view: np.ndarray


def decode(h: np.ndarray) -> Decoded:
    h = h.astype(np.int64, copy=False)
    return Decoded(
        row=h & ((1 << ROW_BITS) - 1),
        head=((h >> HEAD_SHIFT) & ((1 << HEAD_BITS) - 1)) - 1,
        site_id=(h >> SITE_SHIFT) & ((1 << SITE_BITS) - 1),
        model_id=(h >> MODEL_SHIFT) & ((1 << MODEL_BITS) - 1),
        view=(h >> VIEW_SHIFT) & 3,
    )


def encode_sql(row: str, head: str, site_id: str, model_id: str) -> str:
    """The SQL expression that builds a raw handle from column expressions."""
    return (
        f"({row}::BIGINT | ((coalesce({head}, -1) + 1)::BIGINT << {HEAD_SHIFT}) "
        f"| ({site_id}::BIGINT << {SITE_SHIFT}) | ({model_id}::BIGINT << {MODEL_SHIFT}))"
    )


def view_sql(handle: str, view: str) -> str:
    """SQL turning a raw handle into a view of it; a handle that already is a view is an error."""
    code = VIEWS.index(view)
    return (
        f"CASE WHEN ({handle} >> {VIEW_SHIFT}) & 3 <> 0 THEN error('{view}() takes a raw vec, "
        f"not a view of one') ELSE {handle} | ({code}::BIGINT << {VIEW_SHIFT}) END"
    )
