"""A user's own tables for queries: a frame, an Arrow table or a file, loaded here in Python.

Queries cannot read files (the sandbox turns DuckDB's external access off), so a file the user
names explicitly is read by pyarrow and handed to DuckDB as an in-memory Arrow table: the query
sees exactly that table, read-only, under the name the user chose.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import QueryError
from ..lazy import lazy_module

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read

# Catalog tables and the views built on them: a user table may not hide one.
STORE_TABLES = frozenset({"acts", "models", "prompts", "tokens", "sites", "vocab", "meta",
                          "prompt_runs", "attention", "neurons", "circuits"})
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".jsonl": "json",
           ".ndjson": "json", ".json": "json"}

# A pandas DataFrame is the Any: pandas is imported only where a frame arrives.
TableLike = Any


def check_name(name: object, taken: set[str]) -> str:
    """`name` if it is a plain SQL identifier that hides no table of the store."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        raise QueryError(f"table name {name!r} must be a plain identifier (letters, digits and "
                         "underscores, not starting with a digit)")
    low = name.lower()
    if low in STORE_TABLES or low in taken or low.startswith("_actdb"):
        raise QueryError(f"table name {name!r} is taken by the store; choose another name")
    return name


def load_table(source: TableLike) -> pa.Table:
    """An Arrow table from a pandas DataFrame, an Arrow table or batch, or a file path
    (.csv, .parquet, .jsonl/.ndjson/.json with one JSON object per line)."""
    if isinstance(source, pa.Table):
        return source
    if isinstance(source, pa.RecordBatch):
        return pa.Table.from_batches([source])
    if isinstance(source, str | os.PathLike):
        return _read_file(Path(source))
    if type(source).__name__ == "DataFrame" and hasattr(source, "to_dict"):
        try:
            return pa.Table.from_pandas(source, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise QueryError(f"the data frame cannot become a table: {_first(e)}") from None
    raise QueryError(f"a table is a pandas DataFrame, an Arrow table or a file path, "
                     f"not a {type(source).__name__}")


def _read_file(path: Path) -> pa.Table:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise QueryError(f"table file {str(path)!r} has an unknown extension; use one of "
                         f"{', '.join(sorted(FORMATS))}")
    if not path.is_file():
        raise QueryError(f"table file {str(path)!r} does not exist")
    try:
        if fmt == "csv":
            import pyarrow.csv as pacsv

            return pacsv.read_csv(path)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        import pyarrow.json as pajson

        return pajson.read_json(path)
    except (pa.ArrowException, OSError) as e:
        raise QueryError(f"cannot read table file {str(path)!r} as {fmt}: {_first(e)}") from None


def _first(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["STORE_TABLES", "check_name", "load_table"]
