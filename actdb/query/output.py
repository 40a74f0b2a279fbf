"""Write a query result as a table, CSV, JSON Lines or Parquet, streaming record batches."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import OutputError
from ..lazy import lazy_module
from .result import Result, converted

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read


def _json_default(value: Any) -> Any:
    return str(value)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def check_output(output: Path) -> None:
    """One sentence, before the query runs, for an output path that cannot be a file."""
    if output.is_dir():
        raise OutputError(f"output {str(output)!r} is a folder; give a file path, e.g. "
                          f"{str(output / 'result.csv')!r}")
    parent = output.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {str(output)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"cannot write {str(output)!r}: folder {str(parent)!r} is not writable")


def write_result(result: Result, fmt: str, output: Path | None) -> None:
    """Write `result` in `fmt` to `output` (stdout when None).

    An output path that cannot be written is an OutputError, checked before the query runs;
    so is a vec handle column in a file format (see query/export.py)."""
    if fmt != "table":
        from .export import refuse_handles

        refuse_handles(result, fmt)
    if output is not None:
        check_output(output)
        try:
            _write(result, fmt, output)
        except OSError as e:
            raise OutputError(f"cannot write {str(output)!r}: {e.strerror or e}") from None
        return
    _write(result, fmt, None)


def _write(result: Result, fmt: str, output: Path | None) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        assert output is not None
        writer: Any = None
        try:
            for batch in result.record_batches():
                if writer is None:
                    writer = converted(pa.Table.from_batches([batch]), lambda t: pq.ParquetWriter(
                        str(output), t.schema), "Parquet")
                writer.write_batch(batch)
            if writer is None:  # no rows: still write the schema
                converted(result.to_arrow_table(), lambda t: pq.write_table(t, str(output)),
                          "Parquet")
        finally:
            if writer is not None:
                writer.close()
        return
    stream: IO[str] = open(output, "w", encoding="utf-8") if output else sys.stdout
    try:
        if fmt == "table":
            _write_table(result, stream)
        elif fmt == "csv":
            _write_csv(result, stream)
        else:
            for batch in result.record_batches():
                rows = converted(pa.Table.from_batches([batch]), lambda t: t.to_pylist(), "JSON")
                for row in rows:
                    stream.write(json.dumps(_clean(row), default=_json_default) + "\n")
    finally:
        if output:
            stream.close()


def _write_csv(result: Result, stream: IO[str]) -> None:
    header = True
    for batch in result.record_batches():
        table = pa.Table.from_batches([batch])
        # Nested columns (lists, structs) go out as JSON text; CSV has no nesting.
        for i, field in enumerate(table.schema):
            if pa.types.is_nested(field.type):
                values = converted(table.select([i]), lambda t: t.column(0).to_pylist(), "CSV")
                text = [json.dumps(_clean(v), default=_json_default) if v is not None else None
                        for v in values]
                table = table.set_column(i, field.name, pa.array(text, pa.string()))
        stream.write(converted(table, _csv_text if header else _csv_rows, "CSV"))
        header = False
    if header:  # no rows at all: the header alone
        stream.write(",".join(f'"{c}"' for c in result.columns) + "\n")


def _csv_text(table: pa.Table, header: bool = True) -> str:
    import pyarrow.csv as pacsv

    sink = pa.BufferOutputStream()
    pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=header))
    return str(sink.getvalue().to_pybytes().decode("utf-8"))


def _csv_rows(table: pa.Table) -> str:
    return _csv_text(table, header=False)


def _write_table(result: Result, stream: IO[str]) -> None:
    if result.columns == ["explain_key", "explain_value"]:  # EXPLAIN: its plans as drawn
        for key, plan in result.fetchall():
            stream.write(f"{key}:\n{plan.rstrip()}\n")
        return
    # tokens' whitespace visible, as in the pictures
    stream.write(result.text(max_colwidth=80) + "\n")
