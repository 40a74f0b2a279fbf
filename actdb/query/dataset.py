"""`db.dataset(sql)`: a store's vectors as a torch IterableDataset, for training probes and SAEs.

Memory stays bounded whatever the selection's size: the query's rows are streamed in record
batches (handles and the chosen columns only), and vectors are read a batch at a time, in the
query's order (a scan of `acts` comes in storage order, so chunks are read once each).
Shuffling draws from a bounded buffer, as tf.data and torchdata do: `shuffle_buffer` rows
are held, and each emitted batch is a random draw from them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import QueryError
from .result import converted

if TYPE_CHECKING:
    from .connection import Connection

Batch = dict[str, Any]


class VectorDataset(IterableDataset[Batch]):
    """Batches `{"vec": Tensor[B, d], column: Tensor[B] or list, ...}` from a query.

    Use with `DataLoader(ds, batch_size=None)`: the dataset batches itself. With
    `num_workers > 0`, each worker opens the store itself and takes every n-th block of rows.
    """

    def __init__(self, db: Connection, query: str, *, batch_size: int = 4096,
                 shuffle_buffer: int = 0, seed: int | None = None,
                 columns: Sequence[str] | None = None,
                 params: dict[str, Any] | list[Any] | None = None,
                 drop_last: bool = False) -> None:
        if batch_size < 1:
            raise QueryError(f"batch_size must be at least 1, got {batch_size}")
        if shuffle_buffer < 0:
            raise QueryError(f"shuffle_buffer must be 0 or more, got {shuffle_buffer}")
        self.db, self.query, self.params = db, query, params
        self.batch_size, self.shuffle_buffer, self.seed = batch_size, shuffle_buffer, seed
        self.drop_last = drop_last
        self._epoch = 0
        result = db.sql(query, params=params)  # checked now, so a bad query fails here
        handles = result.handle_columns()
        self.vec = "vec" if "vec" in handles else (handles[0] if len(handles) == 1 else None)
        if self.vec is None:
            raise QueryError("dataset() needs a query selecting one vec column (vec or a view "
                             f"of it); it selects {result.columns}")
        if columns is None:  # what the query selects: every column but the vectors
            columns = [c for c in result.columns if c not in handles]
        missing = [c for c in columns if c not in result.columns]
        if missing:
            raise QueryError(f"columns {missing} are not in the query's columns "
                             f"{result.columns}")
        self.columns = list(columns)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        db, owned = self.db, None
        if info is not None:  # a DataLoader worker: a connection of its own (not fork-safe)
            db = owned = self.db.reopened(device="cpu")
        rng = np.random.default_rng(None if self.seed is None else
                                    [self.seed, self._epoch, info.id if info else 0])
        self._epoch += 1
        try:
            yield from self._batches(db, rng, info)
        finally:
            if owned is not None:
                owned.close()

    def _blocks(self, db: Connection, info: Any) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(vectors [n, d], chosen columns) for each block of the query's rows."""
        result = db.sql(self.query, params=self.params)
        assert self.vec is not None
        for i, batch in enumerate(result.record_batches(self.batch_size)):
            if info is not None and i % info.num_workers != info.id:
                continue
            handles = batch.column(self.vec)
            if handles.null_count:
                raise QueryError(f"column {self.vec!r} holds NULL handles; filter them out")
            if len(handles):
                fields = db.source.codec.open(handles)  # each handle checked (handles.py)
                x = db.source.gather(fields, db.device, "the dataset's vectors")
                yield x, {c: _column(batch.column(c), c) for c in self.columns}

    def _batches(self, db: Connection, rng: np.random.Generator, info: Any) -> Iterator[Batch]:
        buf_x: torch.Tensor | None = None
        buf_c: dict[str, Any] = {}
        hold = self.shuffle_buffer
        for x, cols in self._blocks(db, info):
            if buf_x is None:
                buf_x, buf_c = x, cols
            elif x.shape[1] != buf_x.shape[1]:
                raise QueryError(f"the dataset's vectors have different widths "
                                 f"({buf_x.shape[1]} and {x.shape[1]}); select one width")
            else:
                buf_x = torch.cat([buf_x, x])
                buf_c = {c: _concat(buf_c[c], v) for c, v in cols.items()}
            # Emit while the buffer holds more than it must keep back for shuffling.
            while len(buf_x) >= hold + self.batch_size:
                if hold:
                    order = torch.from_numpy(rng.permutation(len(buf_x))).to(buf_x.device)
                    buf_x, buf_c = buf_x[order], {c: _take(v, order) for c, v in buf_c.items()}
                out_x, buf_x = buf_x[: self.batch_size], buf_x[self.batch_size:]
                out_c = {c: v[: self.batch_size] for c, v in buf_c.items()}
                buf_c = {c: v[self.batch_size:] for c, v in buf_c.items()}
                yield {"vec": out_x, **out_c}
        if buf_x is None or not len(buf_x):
            return
        if hold:
            order = torch.from_numpy(rng.permutation(len(buf_x))).to(buf_x.device)
            buf_x, buf_c = buf_x[order], {c: _take(v, order) for c, v in buf_c.items()}
        for i in range(0, len(buf_x), self.batch_size):
            if self.drop_last and i + self.batch_size > len(buf_x):
                break
            yield {"vec": buf_x[i: i + self.batch_size],
                   **{c: v[i: i + self.batch_size] for c, v in buf_c.items()}}


def _column(values: pa.ChunkedArray | pa.Array, name: str) -> Any:
    """A numeric column as a tensor; anything else (text, lists) as a Python list."""
    t = values.type
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)) \
            and not values.null_count:
        return torch.from_numpy(np.array(values.to_numpy(zero_copy_only=False)))
    return converted(pa.table({name: values}), lambda t: t.column(0).to_pylist(),
                     "a dataset's batch")


def _concat(a: Any, b: Any) -> Any:
    return torch.cat([a, b]) if isinstance(a, torch.Tensor) else a + b


def _take(v: Any, order: torch.Tensor) -> Any:
    if isinstance(v, torch.Tensor):
        return v[order.to(v.device)]
    return [v[i] for i in order.tolist()]
