"""Vectors out of the store: `actdb export` / `db.export` to Parquet, NumPy or safetensors, and
the rule that plain query output never carries `vec` handles (integers meaningless elsewhere).

Query output refuses handles rather than expanding them into numbers: a vector is d floats per
row, so expanding silently would turn a small CSV into a large one; `to_list(vec)` asks for the
numbers on purpose, and `export` writes them in formats made for matrices.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..errors import QueryError
from .result import Result, column_values, converted, handle_values

if TYPE_CHECKING:
    from .connection import Connection

FORMATS = (".parquet", ".npy", ".safetensors")


@dataclass(frozen=True, kw_only=True)
class Exported:
    """What `export` wrote."""

    path: str
    rows: int
    d: int
    columns: list[str]  # the other columns written beside `vec`
    left_out: list[str]  # the query's other columns the format cannot hold (.npy: all)


def refuse_handles(result: Result, fmt: str) -> None:
    """One sentence instead of writing handles into a file (see the module's docstring)."""
    handles = result.handle_columns()
    if handles:
        raise QueryError(
            f"column {handles[0]!r} holds vec handles, which mean nothing outside this store; "
            f"select to_list({handles[0]}) for its numbers in {fmt}, or write the vectors with "
            "`actdb export STORE SQL -o FILE.parquet` (db.export in Python)")


def export(db: Connection, query: str, path: str | os.PathLike[str], *,
           params: dict[str, Any] | list[Any] | None = None,
           rows_per_batch: int = 4096) -> Exported:
    """Write the vectors `query` selects, with its other columns, to `path`.

    Args:
        db: the open store.
        query: a SELECT with one vec column (`vec` or a view of it), or else one list of
            numbers it computes (`delta(vec)`, `mean_vector(list(vec))`; a list named `vec`
            where there are several), and any other columns.
        path: `.parquet` (the columns and `vec` as a FLOAT[d] list column, streamed),
            `.npy` (the matrix [N, d] alone, streamed) or `.safetensors` (a `vec` tensor and
            one tensor per numeric column; built in memory). Whatever view the query
            selects, the vectors are written under the name `vec`.
        params: values for `$name` / `?` in the query.
        rows_per_batch: rows read and written at a time (bounds memory for parquet and npy).

    Returns:
        What was written: path, rows, d and the other columns.
    """
    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise QueryError(f"cannot export to {str(out)!r}: the file name must end in "
                         f"{', '.join(FORMATS)}")
    if not out.parent.is_dir():
        raise QueryError(f"cannot export to {str(out)!r}: the folder {str(out.parent)!r} "
                         "does not exist")
    result = db.sql(query, params=params)
    vec, computed = _vec_column(result)
    others = [c for c in result.columns if c != vec]
    batches = _with_vectors(db, result, vec, rows_per_batch, computed=computed)
    try:
        if suffix == ".parquet":
            rows, d = _write_parquet(batches, out)
        elif suffix == ".npy":
            rows, d = _write_npy(batches, out)
            return Exported(path=str(out), rows=rows, d=d, columns=[], left_out=others)
        else:
            rows, d = _write_safetensors(batches, out, others)
    finally:
        # a write that stopped early (a column a format cannot hold) ends the stream now: a
        # result left open refuses the connection's next query
        batches.close()
    return Exported(path=str(out), rows=rows, d=d, columns=others, left_out=[])


def _vec_column(result: Result) -> tuple[str, bool]:
    """The column of vectors to write, and whether the query computed them (a list of numbers:
    `delta(vec)`, `mean_vector(...)`, `to_list(vec)`) rather than selecting vec handles."""
    handles = result.handle_columns()
    if "vec" in handles:
        return "vec", False
    if len(handles) == 1:
        return handles[0], False
    if handles:
        raise QueryError(f"export writes one vector column, and the query selects {handles}; "
                         "keep one, or name one of them vec")
    lists = [name for name, t in zip(result.columns, result.types, strict=True)
             if t.id in ("list", "array") and t.children[0][1].id in _NUMBER_TYPES]
    if len(lists) == 1 or "vec" in lists:
        return ("vec" if "vec" in lists else lists[0]), True
    if lists:
        raise QueryError(f"export writes one vector column, and the query selects the lists "
                         f"{lists}; keep one, or name one of them vec")
    raise QueryError("export needs a query selecting vec (or a view of it, such as "
                     "normalized(vec)), or one list of numbers such as delta(vec); it selects "
                     + ", ".join(result.columns))


# DuckDB's type ids of numbers: the elements of a list column export writes as vectors
_NUMBER_TYPES = frozenset({"tinyint", "smallint", "integer", "bigint", "hugeint", "utinyint",
                           "usmallint", "uinteger", "ubigint", "float", "double", "decimal"})


def _with_vectors(db: Connection, result: Result, vec: str, rows_per_batch: int, *,
                  computed: bool = False) -> Generator[tuple[pa.RecordBatch, np.ndarray]]:
    """(the batch without its vector column, its vectors [n, d] float32), batch by batch:
    gathered from the store for handles, or the query's own lists (`computed`)."""
    width: int | None = None
    for batch in result.record_batches(rows_per_batch):
        col = batch.column(vec)
        if not len(col):
            continue
        if computed:
            x = column_values(pa.chunked_array([col]), vec, "export").astype(np.float32)
        else:
            fields = db.source.codec.open(handle_values(pa.chunked_array([col]), vec))
            x = db.source.gather(fields, "cpu", "the exported vectors").numpy()
        if width is not None and x.shape[1] != width:
            raise QueryError(f"the exported vectors have different widths ({width} and "
                             f"{x.shape[1]}); export one site width at a time")
        width = x.shape[1]
        yield batch.drop_columns([vec]), x


def _write_parquet(batches: Iterator[tuple[pa.RecordBatch, np.ndarray]], out: Path
                   ) -> tuple[int, int]:
    import pyarrow.parquet as pq

    writer: pq.ParquetWriter | None = None
    rows = d = 0
    try:
        for batch, x in batches:
            d = x.shape[1]
            column = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), d)
            table = pa.Table.from_batches([batch]).append_column("vec", column)
            if writer is None:
                writer = converted(table, lambda t: pq.ParquetWriter(str(out), t.schema),
                                   "Parquet")
            writer.write_table(table)
            rows += len(x)
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise QueryError("the query selects no rows: nothing to export")
    return rows, d


def _write_npy(batches: Iterator[tuple[pa.RecordBatch, np.ndarray]], out: Path
               ) -> tuple[int, int]:
    # The header holds the row count, unknown until the end: rows go to a temporary file
    # first, then header and rows into the target, so memory stays one batch.
    rows = d = 0
    with tempfile.TemporaryFile(dir=out.parent) as tmp:
        for _, x in batches:
            d = x.shape[1]
            tmp.write(np.ascontiguousarray(x).tobytes())
            rows += len(x)
        if not rows:
            raise QueryError("the query selects no rows: nothing to export")
        tmp.seek(0)
        with open(out, "wb") as f:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                      "fortran_order": False, "shape": (rows, d)}
            np.lib.format.write_array_header_2_0(f, header)
            while block := tmp.read(16 << 20):
                f.write(block)
    return rows, d


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for a moment, for
    every thread); where /proc has no line for it, read by setting it back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_safetensors(batches: Iterator[tuple[pa.RecordBatch, np.ndarray]], out: Path,
                       others: list[str]) -> tuple[int, int]:
    from safetensors.numpy import save_file

    parts: list[np.ndarray] = []
    columns: dict[str, list[np.ndarray]] = {c: [] for c in others}
    for batch, x in batches:
        for name in others:
            field = batch.schema.field(name)
            if not (pa.types.is_integer(field.type) or pa.types.is_floating(field.type)
                    or pa.types.is_boolean(field.type)):
                raise QueryError(
                    f"safetensors holds only numbers, and column {name!r} is {field.type}; "
                    "leave it out, or export to .parquet")
            values = batch.column(name)
            if values.null_count:
                raise QueryError(f"column {name!r} has NULLs, which safetensors cannot hold; "
                                 "filter or coalesce them, or export to .parquet")
            columns[name].append(values.to_numpy(zero_copy_only=False))
        parts.append(x)
    if not parts or not sum(len(p) for p in parts):
        raise QueryError("the query selects no rows: nothing to export")
    tensors = {"vec": np.concatenate(parts)}
    tensors.update({name: np.concatenate(v) for name, v in columns.items()})
    save_file(tensors, str(out), metadata={"columns": json.dumps(others), "source": "actdb"})
    os.chmod(out, 0o666 & ~_umask())  # safetensors makes its file private (0600)
    return len(tensors["vec"]), tensors["vec"].shape[1]
