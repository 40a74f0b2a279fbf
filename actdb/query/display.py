"""Showing values to people: tokens with their whitespace visible, and a result's first rows."""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pyarrow as pa

_VISIBLE = ((" ", "␣"), ("\n", "↵"), ("\t", "→"), ("\r", "␍"))


def visible_token(text: str) -> str:
    """A token with its whitespace and unprintable bytes made visible (" Paris" -> "␣Paris")."""
    for a, b in _VISIBLE:
        text = text.replace(a, b)
    text = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)
    return text or "∅"


def _looks_like_token(text: str) -> bool:
    # Prose keeps its spaces; a token's leading/trailing space or control byte is information.
    return (text != text.strip() or not text or not text.isprintable())


def visible(value: Any) -> Any:
    """`value` with every token-like string in it (also inside lists and structs) made visible."""
    if isinstance(value, str):
        return visible_token(value) if _looks_like_token(value) else value
    if isinstance(value, list | tuple | np.ndarray):
        return [visible(v) for v in value]
    if isinstance(value, dict):
        return {k: visible(v) for k, v in value.items()}
    return value


def visible_frame(df: Any) -> Any:
    """A pandas DataFrame with token-like strings made visible, in text and nested columns."""
    import pandas as pd

    out = df.copy()
    for c in out.columns:
        if out[c].dtype == object or pd.api.types.is_string_dtype(out[c].dtype):
            out[c] = out[c].map(visible).astype(object)
    return out


def text_preview(table: pa.Table, total: int, columns: list[str]) -> str:
    """The first rows of a result as plain text, then the row count."""
    if not columns:
        return f"<actdb.Result: {total} rows, no columns>"
    import pandas as pd

    df = visible_frame(table.to_pandas())
    with pd.option_context("display.max_colwidth", 60, "display.width", 120):
        body = df.to_string(index=False) if len(df) else f"(no rows) {columns}"
    more = f" (first {len(df)} shown)" if total > len(df) else ""
    return f"{body}\n[{total} rows x {len(columns)} columns{more}]"


def html_preview(table: pa.Table, total: int, columns: list[str]) -> str:
    """The first rows of a result as an HTML table, then the row count (for notebooks)."""
    df = visible_frame(table.to_pandas())
    body = df.to_html(index=False, max_cols=40, escape=True, border=0)
    more = f", first {len(df)} shown" if total > len(df) else ""
    note = html.escape(f"{total} rows x {len(columns)} columns{more}")
    return f"<div class=\"actdb-result\">{body}<p><small>{note}</small></p></div>"
