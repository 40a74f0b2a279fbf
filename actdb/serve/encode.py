"""A query's answer as the API sends it: JSON rows or an Arrow IPC stream, and errors as text.

JSON has no NaN, infinity, decimal, date or byte string, so each value becomes the nearest
thing JSON has (NaN and infinities: null, as the CLI's JSON output writes NaN; decimals:
numbers; times and dates: ISO 8601 text; bytes: hex). Arrow IPC keeps every type as it is.
"""

from __future__ import annotations

import datetime
import decimal
import math
import uuid
from typing import TYPE_CHECKING, Any

from ..errors import QuerySyntaxError

if TYPE_CHECKING:
    import pyarrow as pa

ARROW_STREAM = "application/vnd.apache.arrow.stream"


def json_value(value: Any) -> Any:
    """One Arrow value (as `to_pylist` gives it) as a JSON value."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, decimal.Decimal):
        return json_value(float(value))
    if isinstance(value, datetime.date | datetime.time | datetime.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, datetime.timedelta | uuid.UUID):
        return str(value)
    return str(value)


def json_rows(table: pa.Table) -> list[list[Any]]:
    """The table's rows, each a list of JSON values in column order."""
    columns = [[json_value(v) for v in c.to_pylist()] for c in table.columns]
    return [list(row) for row in zip(*columns, strict=True)] if columns else []


def arrow_stream(table: pa.Table) -> bytes:
    """The table as one Arrow IPC stream (pyarrow.ipc.open_stream reads it)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def error_text(e: BaseException) -> str:
    """The error as the CLI prints it (without its `Error: ` prefix): a syntax error with its
    query line and a caret under the spot, any other one sentence."""
    return e.with_caret() if isinstance(e, QuerySyntaxError) else str(e)
