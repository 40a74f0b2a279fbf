"""List results of tensor functions, built as Arrow columns rather than Python objects.

A list function (`top_logits`, `nearest_anchors`, `top_dims`, `to_list`, `delta`, ...) returns
one list per row. Building a Python dict per entry and letting pyarrow parse them back cost more
than the function itself on a scan. `ListResults` takes whole blocks of rows as Arrow arrays
made from the kernel's tensors (`put`), and still takes a Python value per row (`out[i] =
value`) from kernels whose rows are few (`mean_vector`, `spectrum`); `arrow()` makes the column.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..lazy import lazy_module

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read


class ListResults:
    """n results, NULL until set: per row (`out[i] = v`) or by blocks (`put(index, array)`)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._items: list[Any] | None = None  # Python values, made on the first per-row set
        self._blocks: list[tuple[np.ndarray, pa.Array]] = []

    def __len__(self) -> int:
        return self.n

    def __setitem__(self, i: int, value: Any) -> None:
        if self._items is None:
            self._items = [None] * self.n
        self._items[i] = value

    def put(self, index: np.ndarray, values: pa.Array) -> None:
        """Rows `index` (positions, int) take `values` (an Arrow array of the same length)."""
        assert len(index) == len(values), (len(index), len(values))
        self._blocks.append((np.asarray(index, dtype=np.int64), values))

    def arrow(self, type: pa.DataType) -> pa.Array:
        """The n results as one Arrow array of `type` (a later set of a row wins)."""
        blocks = [(at, v if v.type == type else v.cast(type)) for at, v in self._blocks]
        if self._items is not None or not blocks:
            items = self._items if self._items is not None else [None] * self.n
            blocks.insert(0, (np.arange(self.n), pa.array(items, type=type)))
        if len(blocks) == 1 and len(blocks[0][0]) == self.n and _is_range(blocks[0][0]):
            return blocks[0][1]
        # where each row's value lies in the blocks laid end to end; NULL where none is set
        where = np.full(self.n, -1, dtype=np.int64)
        start = 0
        for at, v in blocks:
            where[at] = start + np.arange(len(v))
            start += len(v)
        joined = pa.concat_arrays([v for _, v in blocks])
        return joined.take(pa.array(where, mask=where < 0))


def _is_range(at: np.ndarray) -> bool:
    return bool(at[0] == 0 and np.all(np.diff(at) == 1)) if len(at) else True


def struct_lists(k: int, columns: dict[str, pa.Array], valid: np.ndarray | None = None
                 ) -> pa.Array:
    """m lists of k structs each: `columns` hold m * k values row by row; rows where `valid`
    is False are NULL."""
    values = pa.StructArray.from_arrays(list(columns.values()), names=list(columns))
    m = len(values) // k if k else 0
    offsets = pa.array(np.arange(0, m * k + 1, k, dtype=np.int32))
    mask = None if valid is None or bool(np.all(valid)) else pa.array(~np.asarray(valid))
    return pa.ListArray.from_arrays(offsets, values, mask=mask)


def float_lists(rows: np.ndarray) -> pa.Array:
    """A FLOAT[] per row of a float32 [m, d] array (copied)."""
    m, d = rows.shape
    offsets = pa.array(np.arange(0, m * d + 1, d, dtype=np.int32))
    # a copy: pyarrow would wrap the memory, and `rows` may be a reused scratch buffer
    flat = pa.array(np.array(rows, dtype=np.float32, copy=True).reshape(-1))
    return pa.ListArray.from_arrays(offsets, flat)
