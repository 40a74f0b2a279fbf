"""Vector aggregates over lists of handles (`list(vec)`) and functions of a FLOAT[] direction.

DuckDB has no Python aggregate UDFs, but a UDF can take `list(vec)`: each row of the batch is
then a whole group's handles, read together by (model, site, view) and reduced in float64.
A direction is a FLOAT[] per row (a literal, a parameter, or a subquery such as the
difference of two `mean_vector`s); a constant one arrives repeated, row by row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from ..errors import QueryError
from ..lazy import lazy_module
from .dots import row_dots
from .kernels import Arg, _unit
from .vectors import VectorSource

if TYPE_CHECKING:
    import pyarrow.compute as pc
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)
    pc = lazy_module("pyarrow.compute")  # 0.1 s to import: when a function first runs


class HandleLists:
    """A batch of handle lists: `handles` flat (NULL entries dropped), `owner[j]` the batch
    row that handle j belongs to."""

    def __init__(self, column: pa.Array | pa.ChunkedArray) -> None:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        self.n = len(column)
        owner = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(column)
        keep = ~flat.is_null().to_numpy(zero_copy_only=False)
        self.handles = flat.to_numpy(zero_copy_only=False)[keep].astype(np.int64)
        self.owner = owner[keep].astype(np.int64)


class Directions:
    """One FLOAT[] direction per batch row."""

    def __init__(self, column: pa.Array | pa.ChunkedArray, device: torch.device) -> None:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        self.lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        self.values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.device = device

    def rows(self, index: np.ndarray, d: int, name: str, where: str) -> torch.Tensor:
        """float32 [len(index), d]: the directions of these rows; their width must be d."""
        bad = self.lengths[index] != d
        if np.any(bad):
            have = int(self.lengths[index][bad][0])
            raise QueryError(f"{name}: the direction has {have} values but {where} has width "
                             f"{d}; a direction must have one value per dimension")
        at = self.starts[index][:, None] + np.arange(d)[None, :]  # [m, d]
        data = np.asarray(self.values[at], dtype=np.float32)
        if not np.all(np.isfinite(data)):
            raise QueryError(f"{name}: the direction holds NULL, NaN or infinite values")
        return torch.from_numpy(data).to(self.device)


def _where(g: Any) -> str:
    return f"site {g.site.site!r} of model {g.model.model!r}"


# -- direction functions: fill `out` (float64 [n], NaN = NULL) -----------------------------


def _against(src: VectorSource, h: np.ndarray, out: np.ndarray, direction: pa.Array,
             name: str, *, unit_v: bool) -> None:
    dirs = Directions(direction, src.device)
    for g in src.groups(h):
        dv = dirs.rows(g.index, g.x.shape[-1], name, _where(g))
        du, dok = _unit(dv)
        if unit_v:
            u, ok = _unit(g.x)
            val = torch.where(ok & dok, row_dots(u, du), torch.nan)
        else:
            val = torch.where(dok, row_dots(g.x, du), torch.nan)
        out[g.index] = val.double().cpu().numpy()


def cosine_to(src: VectorSource, h: np.ndarray, out: np.ndarray, direction: pa.Array) -> None:
    _against(src, h, out, direction, "cosine_to", unit_v=True)


def project(src: VectorSource, h: np.ndarray, out: np.ndarray, direction: pa.Array) -> None:
    _against(src, h, out, direction, "project", unit_v=False)


# -- aggregates over lists: one Python value (or None) per row ------------------------------


class _Moments:
    """Per batch row: the count, sum and (optionally) sum of outer products, in float64."""

    def __init__(self, src: VectorSource, lists: HandleLists, name: str, *, second: bool):
        self.count: dict[int, int] = {}
        self.total: dict[int, torch.Tensor] = {}
        self.gram: dict[int, torch.Tensor] = {}
        width: dict[int, tuple[int, str]] = {}
        if not len(lists.handles):
            return
        for g in src.groups(lists.handles):
            owners = lists.owner[g.index]
            x = g.x.double()  # [m, d]
            for r in np.unique(owners):
                r = int(r)
                have = width.setdefault(r, (x.shape[-1], _where(g)))
                if have[0] != x.shape[-1]:
                    raise QueryError(f"{name} needs vectors of one width; one list holds "
                                     f"width {have[0]} ({have[1]}) and width {x.shape[-1]} "
                                     f"({_where(g)})")
                xr = x[torch.from_numpy(np.nonzero(owners == r)[0]).to(x.device)]
                self.count[r] = self.count.get(r, 0) + xr.shape[0]
                self.total[r] = self.total.get(r, 0) + xr.sum(0)
                if second:
                    self.gram[r] = self.gram.get(r, 0) + xr.T @ xr  # [d, d]


def mean_vector(src: VectorSource, lists: pa.Array, out: list[Any]) -> None:
    hl = HandleLists(lists)
    m = _Moments(src, hl, "mean_vector", second=False)
    for r, n in m.count.items():
        out[r] = (m.total[r] / n).float().cpu().numpy()


def spectrum(src: VectorSource, lists: pa.Array, out: list[Any], k: Arg) -> None:
    """Eigenvalues of the sample covariance (divided by n - 1), largest first; NULL below 2
    vectors. k = 0 (the default) keeps all of them."""
    hl = HandleLists(lists)
    m = _Moments(src, hl, "spectrum", second=True)
    for r, n in m.count.items():
        kv = int(k.values[k.codes[r]])
        if kv < 0:
            raise QueryError(f"spectrum: k must be at least 1, got {kv}")
        if n < 2:
            continue
        mu = m.total[r] / n
        cov = (m.gram[r] - n * torch.outer(mu, mu)) / (n - 1)
        vals = torch.linalg.eigvalsh(cov).flip(0)  # largest first
        out[r] = vals[: kv or None].cpu().numpy()
