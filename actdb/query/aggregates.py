"""Vector aggregates over lists of handles (`list(vec)`) and functions of a FLOAT[] direction.

DuckDB has no Python aggregate UDFs, but a UDF can take `list(vec)`: each row of the batch is
then a whole group's handles, read together by (model, site, view) and reduced in float64.
A direction is a FLOAT[] per row (a literal, a parameter, or a subquery such as the
difference of two `mean_vector`s); a constant one arrives repeated, row by row.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import QueryError
from ..lazy import lazy_module
from .dots import row_dots
from .handles import Codec
from .kernels import Arg, _unit, stored_cosines
from .threads import threads_for, torch_threads
from .vectors import VectorSource

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)
    pc = lazy_module("pyarrow.compute")  # imported when a function first runs


# float64 [d, d] sums of outer products that `spectrum` holds at once: a batch of up to 2,048
# lists (GROUP BY prompt) is taken a few lists at a time (d = 768: 28; d = 4,096: one)
_GRAM_BYTES = 128 << 20


class HandleLists:
    """A batch of handle lists: `handles` flat (NULL entries dropped), `owner[j]` the batch
    row that handle j belongs to."""

    def __init__(self, column: pa.Array | pa.ChunkedArray, codec: Codec) -> None:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        self.n = len(column)
        owner = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(column)
        keep = ~flat.is_null().to_numpy(zero_copy_only=False)
        self.handles = codec.open(pc.drop_null(flat))  # fields words, each handle checked
        self.owner = owner[keep].astype(np.int64)

    def owned_by(self, lo: int, hi: int) -> HandleLists:
        """The handles of batch rows lo..hi - 1 (their row numbers kept)."""
        part = object.__new__(HandleLists)
        take = (self.owner >= lo) & (self.owner < hi)
        part.n, part.handles, part.owner = self.n, self.handles[take], self.owner[take]
        return part


class DirectionTable:
    """The FLOAT[] directions of one connection's queries, each kept once under an id.

    A direction argument reaches its function's UDF as an id (`functions.py`: the macro wraps
    it in this table's UDF, `ids`). DuckDB folds a UDF of constants into one call when it
    plans the query, so a literal or a parameter is registered once, and a scalar subquery
    once per 2,048 rows; the function then gets a column of one integer a row, where the list
    itself, copied into every row of every call, was most of a full scan's time. Directions that
    differ by row are registered row by row, each distinct one once. Past `max_bytes` the table
    forgets the least recently used of those registered row by row first, and only then the ones
    registered alone (the constants, which a bulk window may use for many calls without asking
    for them again); a query that still needs one it forgot gets a QueryError, never another's
    values. Each direction's bytes are held once (its key, read as float32)."""

    MAX_BYTES = 256 << 20

    def __init__(self) -> None:
        self.max_bytes = self.MAX_BYTES
        self._ids: dict[bytes, int] = {}
        # id -> values, least recently used first: registered alone (constants), or row by row
        self._alone: OrderedDict[int, np.ndarray] = OrderedDict()
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()

    def ids(self, column: pa.Array | pa.ChunkedArray) -> pa.Array:
        """The id of each row's direction (NULL for a NULL list); its values as float32, NaN
        where an element is NULL (the functions refuse such a direction when they use it)."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float32)
        null = column.is_null().to_numpy(zero_copy_only=False)
        out = np.zeros(len(column), dtype=np.int64)
        at = 0
        with self._lock:
            for i, n in enumerate(lengths):
                if null[i]:
                    continue
                n = int(n)
                out[i] = self._id(flat[at : at + n], alone=len(column) == 1)
                at += n
        return pa.array(out, mask=null)

    def _id(self, values: np.ndarray, *, alone: bool) -> int:
        key = values.tobytes()
        got = self._ids.get(key)
        if got is not None:
            self._use(got)
            return got
        got, self._next = self._next, self._next + 1
        self._ids[key] = got
        (self._alone if alone else self._rows)[got] = np.frombuffer(key, dtype=np.float32)
        self._bytes += len(key)
        while self._bytes > self.max_bytes and len(self._alone) + len(self._rows) > 1:
            _, v = (self._rows or self._alone).popitem(last=False)
            del self._ids[v.tobytes()]  # its key: the values are the key's bytes
            self._bytes -= v.nbytes
        return got

    def _use(self, direction_id: int) -> np.ndarray | None:
        for held in (self._alone, self._rows):
            if direction_id in held:
                held.move_to_end(direction_id)
                return held[direction_id]
        return None

    def values(self, direction_id: int, name: str) -> np.ndarray:
        with self._lock:
            got = self._use(direction_id)
            if got is None:
                raise QueryError(
                    f"{name}: the query's directions passed {self.max_bytes >> 20} MiB, and one "
                    "it still needed was forgotten; use fewer distinct directions in one query")
            return got


class Directions:
    """One FLOAT[] direction per batch row, as ids of a DirectionTable. A constant direction
    (a literal, a parameter, a scalar subquery) is one id on every row (`same`): kept once
    and broadcast, so that no [rows, d] copy of it is made or normalised row by row."""

    def __init__(self, ids: np.ndarray, table: DirectionTable) -> None:
        self.ids, self.table = ids, table
        self.same = bool(len(ids)) and bool(np.all(ids == ids[0]))

    def units(self, index: np.ndarray, d: int, name: str, where: str,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The directions of these rows ([len(index), d], or [1, d] when every row holds the
        same one; their width must be d) scaled to unit length, and which are nonzero. Each
        distinct direction's length is taken in float64, where a float32 direction's squares
        neither overflow (entries past about 1e18) nor vanish (entries below about 1e-20), so
        the answer does not depend on the direction's scale."""
        distinct, inverse = self._distinct(index, d, name, where)
        u, ok = _unit(torch.from_numpy(distinct).double())
        at = torch.from_numpy(inverse)
        return u.float()[at].to(device), ok[at].to(device)

    def _distinct(self, index: np.ndarray, d: int, name: str, where: str
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct directions of these rows [u, d], each row's index into them)."""
        ids = self.ids[index[:1]] if self.same else self.ids[index]
        uniq, inverse = np.unique(ids, return_inverse=True)
        data = []
        for i in uniq:
            v = self.table.values(int(i), name)
            if len(v) != d:
                raise QueryError(f"{name}: the direction has {len(v)} values but {where} has "
                                 f"width {d}; a direction must have one value per dimension")
            if not np.all(np.isfinite(v)):
                raise QueryError(f"{name}: the direction holds NULL, NaN or infinite values")
            data.append(v)
        distinct = np.stack(data) if data else np.zeros((0, d), np.float32)
        return distinct, inverse.reshape(-1)


def _where(g: Any) -> str:
    return f"site {g.site.site!r} of model {g.model.model!r}"


# -- direction functions: fill `out` (float64 [n], NaN = NULL) -----------------------------


def _against(src: VectorSource, h: np.ndarray, out: np.ndarray, dirs: Directions,
             name: str, *, unit_v: bool) -> None:
    for g in src.groups(h):
        if g.view == "raw" and dirs.same:
            _against_stored(src, g, out, dirs, name, unit_v=unit_v)
            continue
        unit_dir: tuple[torch.Tensor, torch.Tensor] | None = None
        for a, b, x in g.x_blocks():
            if unit_dir is None:
                unit_dir = dirs.units(g.index, x.shape[-1], name, _where(g), src.device)
            du, dok = unit_dir
            d_block, ok_block = (du, dok) if du.shape[0] == 1 else (du[a:b], dok[a:b])
            if unit_v:
                u, ok = _unit(x)
                cos = row_dots(u, d_block).clamp(-1.0, 1.0)  # float32 rounding can pass 1
                val = torch.where(ok & ok_block, cos, torch.nan)
            else:
                val = torch.where(ok_block, row_dots(x, d_block), torch.nan)
            out[g.index[a:b]] = val.double().cpu().numpy()


def _against_stored(src: VectorSource, g: Any, out: np.ndarray, dirs: Directions, name: str,
                    *, unit_v: bool) -> None:
    """`_against` for raw vectors and one direction for all rows (a literal, a parameter, a
    scalar subquery): the stored unit directions dotted with the direction's unit by
    `FieldReader.project` (float16 converted and multiplied-added in one compiled pass,
    where `x_blocks` makes three), times the norm for `project`. As with
    `cosine_to_anchor`, a cosine is clamped to [-1, 1] (a float16 direction's length is 1
    within 2^-11), and is NULL for a zero vector (its stored direction is all zeros)."""
    du, dok = dirs.units(g.index, g.site.d, name, _where(g), torch.device("cpu"))
    if not bool(dok[0]):
        out[g.index] = np.nan  # a zero direction: no cosine, no projection
        return
    if unit_v:
        out[g.index] = stored_cosines(src, g, du[0])
    else:
        dots = g.project(du[0]).numpy().astype(np.float64)
        out[g.index] = dots * g.norm.cpu().numpy()


def cosine_to(src: VectorSource, h: np.ndarray, out: np.ndarray, direction: Directions) -> None:
    _against(src, h, out, direction, "cosine_to", unit_v=True)


def project(src: VectorSource, h: np.ndarray, out: np.ndarray, direction: Directions) -> None:
    _against(src, h, out, direction, "project", unit_v=False)


# -- aggregates over lists: one Python value (or None) per row ------------------------------


class _Moments:
    """Per batch row: the count, the sum and (`second`) what the covariance needs, in float64.

    Each group's vectors come in blocks of 1 MiB (Group.x_blocks), so a float64 copy of a
    whole group never exists: per block, the sums of the rows of every owner at once
    (index_add_). With `second`, a list of more vectors than dimensions sums its outer
    products (`gram`: one [d, d] product per owner run, on more than one core when large and
    a core is idle: threads.py); a shorter list keeps its vectors (`rows`), whose covariance
    has at most n - 1 nonzero eigenvalues, found from an [n, n] matrix (`spectrum`)."""

    def __init__(self, src: VectorSource, lists: HandleLists, name: str, *, second: bool):
        self.count: dict[int, int] = {}
        self.total: dict[int, torch.Tensor] = {}
        self.gram: dict[int, torch.Tensor] = {}
        self.rows: dict[int, list[torch.Tensor]] = {}
        width: dict[int, tuple[int, str]] = {}
        if not len(lists.handles):
            return
        sizes = np.bincount(lists.owner, minlength=lists.n)
        for g in src.groups(lists.handles):
            owners, inverse = np.unique(lists.owner[g.index], return_inverse=True)
            total = None
            for a, b, x in g.x_blocks():
                d = x.shape[-1]
                if total is None:
                    for r in owners.tolist():
                        have = width.setdefault(r, (d, _where(g)))
                        if have[0] != d:
                            raise QueryError(
                                f"{name} needs vectors of one width; one list holds width "
                                f"{have[0]} ({have[1]}) and width {d} ({_where(g)})")
                    total = torch.zeros((len(owners), d), dtype=torch.float64, device=x.device)
                x64 = x.double()
                inv = inverse[a:b]
                total.index_add_(0, torch.from_numpy(inv).to(x.device), x64)
                if second:
                    for i, at in _runs_of(inv):
                        r = int(owners[i])
                        xr = x64[at]
                        if sizes[r] <= d:
                            self.rows.setdefault(r, []).append(
                                xr.clone() if isinstance(at, slice) else xr)
                            continue
                        with torch_threads(threads_for(2.0 * xr.shape[0] * d * d, xr.device)):
                            gram = self.gram.get(r)
                            self.gram[r] = xr.T @ xr if gram is None else gram.addmm_(xr.T, xr)
            assert total is not None
            counts = np.bincount(inverse, minlength=len(owners))
            for i, r in enumerate(owners.tolist()):
                self.count[r] = self.count.get(r, 0) + int(counts[i])
                self.total[r] = self.total.get(r, 0) + total[i]


def _runs_of(inv: np.ndarray) -> Iterator[tuple[int, slice | torch.Tensor]]:
    """(owner, its rows) for each owner in a block: a slice when they are consecutive (a
    list of one prompt's or one site's rows), else their positions."""
    if len(inv) and inv[0] == inv[-1] and np.all(inv == inv[0]):
        yield int(inv[0]), slice(None)
        return
    order = np.argsort(inv, kind="stable")
    cuts = np.flatnonzero(np.diff(inv[order])) + 1
    for part in np.split(order, cuts):
        lo, hi = int(part[0]), int(part[-1]) + 1
        rows = slice(lo, hi) if hi - lo == len(part) else torch.from_numpy(part)
        yield int(inv[part[0]]), rows


def mean_vector(src: VectorSource, lists: pa.Array, out: list[Any]) -> None:
    hl = HandleLists(lists, src.codec)
    m = _Moments(src, hl, "mean_vector", second=False)
    for r, n in m.count.items():
        out[r] = (m.total[r] / n).float().cpu().numpy()


def spectrum(src: VectorSource, lists: pa.Array, out: list[Any], k: Arg) -> None:
    """Eigenvalues of the sample covariance (divided by n - 1), largest first; NULL below 2
    vectors. k = 0 (the default) keeps all of them."""
    hl = HandleLists(lists, src.codec)
    d = max((s.d for s in src.sites.values()), default=1)
    per = max(1, _GRAM_BYTES // (8 * d * d))  # lists whose [d, d] sums are held at once
    for lo in range(0, hl.n, per):
        m = _Moments(src, hl.owned_by(lo, lo + per), "spectrum", second=True)
        for r, n in m.count.items():
            kv = int(k.values[k.codes[r]])
            if kv < 0:
                raise QueryError(f"spectrum: k must be at least 1, got {kv}")
            if n < 2:
                continue
            mu = m.total[r] / n
            if r in m.rows:  # n <= d: the nonzero eigenvalues of Xc^T Xc are those of Xc Xc^T
                xc = torch.cat(m.rows[r]) - mu
                vals = torch.linalg.eigvalsh(xc @ xc.T / (n - 1))
                vals = torch.cat([vals, vals.new_zeros(xc.shape[1] - n)])
                vals = torch.sort(vals, descending=True).values
            else:
                cov = (m.gram[r] - n * torch.outer(mu, mu)) / (n - 1)
                vals = torch.linalg.eigvalsh(cov).flip(0)  # largest first
            out[r] = vals[: kv or None].cpu().numpy()
