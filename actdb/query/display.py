"""Showing values to people: tokens with their whitespace visible, and a result's first rows."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import numpy as np

from ..lazy import lazy_module

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read

VISIBLE = ((" ", "␣"), ("\n", "↵"), ("\t", "→"), ("\r", "␍"))
_NAMES = {" ": "a space", "\n": "a newline", "\t": "a tab", "\r": "a carriage return"}


def shown_whitespace(text: str) -> list[str]:
    """What each mark of whitespace in `text` stands for in the table output ("'␣' is a
    space"): a token copied from there holds the mark, not the whitespace."""
    return [f"{mark!r} is {_NAMES[plain]}" for plain, mark in VISIBLE if mark in text]


def unshown(text: str) -> str:
    """`text` with the table output's marks of whitespace turned back into it (a token copied
    from there)."""
    for plain, mark in VISIBLE:
        text = text.replace(mark, plain)
    return text


def visible_token(text: str) -> str:
    """A token with its whitespace and unprintable bytes made visible (" Paris" -> "␣Paris")."""
    for a, b in VISIBLE:
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


def _cell(value: Any) -> str:
    """One value as table text: NULL, numbers as Python prints them (floats to 6 significant
    digits), lists and structs spelled out, token-like strings made visible."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return "NaN" if value != value else f"{value:.6g}"
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_cell(v)}" for k, v in value.items()) + "}"
    return str(value)


def text_table(names: list[str], columns: list[list[Any]], *, max_colwidth: int = 80) -> str:
    """Rows as aligned plain text, from each column's Python values (no pandas: the CLI's table
    output is on the path of every `actdb query`, and importing pandas is slow)."""
    if not columns or not len(columns[0]):
        return f"(no rows) {names}"
    out = []
    for name, values in zip(names, columns, strict=True):
        cells = [_cell(v) for v in values]
        cells = [c if len(c) <= max_colwidth else c[: max_colwidth - 3] + "..." for c in cells]
        width = max(len(name), *(len(c) for c in cells))
        out.append([name.rjust(width)] + [c.rjust(width) for c in cells])
    return "\n".join(" ".join(row) for row in zip(*out, strict=True))


# What EXPLAIN answers: a plan's name and the plan drawn as lines of text, whose spaces and
# newlines are the drawing (not a token's whitespace, to be made visible).
EXPLAIN_COLUMNS = ["explain_key", "explain_value"]


def _plans(table: pa.Table) -> list[tuple[str, str]] | None:
    if table.column_names != EXPLAIN_COLUMNS:
        return None
    return [(str(k), str(v)) for k, v in zip(*(c.to_pylist() for c in table.columns),
                                             strict=True)]


def text_preview(table: pa.Table, total: int, columns: list[str]) -> str:
    """The first rows of a result as plain text, then the row count; an EXPLAIN's plans as
    drawn."""
    if not columns:
        return f"<actdb.Result: {total} rows, no columns>"
    plans = _plans(table)
    if plans is not None:
        return "\n".join(f"{key}:\n{plan.rstrip()}" for key, plan in plans)
    body = text_table(table.column_names, [c.to_pylist() for c in table.columns],
                      max_colwidth=60)
    shown = table.num_rows
    more = f" (first {shown} shown)" if total > shown else ""
    return f"{body}\n[{total} rows x {len(columns)} columns{more}]"


def html_preview(table: pa.Table, total: int, columns: list[str]) -> str:
    """The first rows of a result as an HTML table, then the row count (for notebooks); an
    EXPLAIN's plans as drawn, each in a <pre> block under its name."""
    plans = _plans(table)
    if plans is not None:
        return "<div class=\"actdb-result\">" + "".join(
            f"<p><b>{html.escape(key)}</b></p><pre>{html.escape(plan.rstrip())}</pre>"
            for key, plan in plans) + "</div>"
    df = visible_frame(table.to_pandas())
    body = df.to_html(index=False, max_cols=40, escape=True, border=0)
    more = f", first {len(df)} shown" if total > len(df) else ""
    note = html.escape(f"{total} rows x {len(columns)} columns{more}")
    return f"<div class=\"actdb-result\">{body}<p><small>{note}</small></p></div>"
