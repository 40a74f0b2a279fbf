"""Stored vectors for handles: what a tensor function reads, on one device.

VectorSource holds the store's identity (models, sites, the handles' codec, where committed
rows run), turns opened handles into groups of one (model, site, view) and their vectors, and
holds one object for each kind of reading: the chunk cache (chunk_cache.py), stored fields by
chunks and runs (runs.py), the models' weights and anchors (model_weights.py), and token
arguments (tokens.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import norms
from ..errors import QueryError
from ..lazy import lazy_module
from ..store.records import ModelRecord, SiteRecord
from ..store.store import Store
from . import handles as H
from . import runs
from .chunk_cache import ChunkCache
from .head_weights import HeadWeights
from .model_weights import ModelWeights
from .runs import FieldReader
from .threads import READAHEAD_CHUNKS
from .tokens import Vocabulary
from .weight_rows import ROLE as WEIGHT_ROLE
from .weight_rows import WeightPlan, WeightRows, WeightSpec

if TYPE_CHECKING:
    import pyarrow as pa
    import torch
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

# Sites off the residual stream: their vectors never meet the LM head, so anchor and logit
# functions (and final_norm) are NULL there.
OFF_STREAM_ROLES = frozenset({"inner", "q_norm", "k_norm"})


class Group:
    """Handles of one (model, site, view): their positions in the batch, and their stored
    fields read on first use (a function that needs only the norm reads no direction)."""

    def __init__(self, src: VectorSource, index: np.ndarray, model: ModelRecord,
                 site: SiteRecord, view: str, rows: np.ndarray, heads: np.ndarray) -> None:
        self.src, self.index, self.model, self.site, self.view = src, index, model, site, view
        self.rows, self.heads = rows, heads
        self._cache: dict[str, torch.Tensor] = {}

    def _field(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            data = self.src.reader.field(self.model, self.site, name, self.rows, self.heads)
            self._cache[name] = torch.from_numpy(data).to(self.src.device)
        return self._cache[name]

    @property
    def norm(self) -> torch.Tensor:
        """float32 [n]: ||x|| of the stored input (before any view)."""
        return self._field("norm")

    @property
    def mean(self) -> torch.Tensor:
        """float32 [n]: mean(x) of the stored input."""
        return self._field("mean")

    @property
    def direction(self) -> torch.Tensor:
        """float16 [n, d]: the stored unit direction of x."""
        return self._field("direction")

    def x_blocks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """`x` by blocks of consecutive rows: (start, end, float32 [end - start, d]). On the
        CPU each block is converted from the stored float16 in a scratch buffer that stays in
        the core's cache (VectorSource.x_blocks), so the float32 copy of a whole window never
        exists; a block is valid until the next one is asked for. Elsewhere, or when `x` is
        held already, one block of every row."""
        if "x" in self._cache or self.src.device.type != "cpu":
            yield 0, len(self.rows), self.x
            return
        yield from self.src.x_blocks(self)

    def project(self, v: torch.Tensor, at: np.ndarray | None = None) -> torch.Tensor:
        """float32 [n] on the CPU: the stored unit directions dotted with `v` (rows `at` of
        the group, or all): FieldReader.project."""
        return self.src.reader.project(self, v, at)

    @property
    def x(self) -> torch.Tensor:
        """float32 [n, d]: the vector with the group's view applied."""
        if "x" not in self._cache:
            x = self.direction.float() * self.norm.unsqueeze(-1)
            if self.view != "raw":
                x = self.src.apply_view(self.model, self.site, self.view, x, self.mean,
                                        self.heads)
            self._cache["x"] = x
        return self._cache["x"]


class VectorSource:
    """Everything tensor functions read from a store, cached, on one device."""

    def __init__(self, store: Store, device: torch.device | str, *,
                 cache_bytes: int = 256 << 20, key: bytes | None = None):
        """`key`: the handles' key (handles.py); None draws a new one."""
        self.store = store
        self._device = device
        # Object storage reads with several readers, each keeping its share of read-ahead.
        self.cache = ChunkCache(cache_bytes, readahead=READAHEAD_CHUNKS * store.readers,
                                readers=store.readers)
        self.models = {m.model_id: m for m in store.catalog.models()}
        self.sites: dict[tuple[int, int], SiteRecord] = {}
        for m in self.models.values():
            for s in store.catalog.sites(m.model):
                self.sites[(m.model_id, s.site_id)] = s
        # each model's tower whose final norm its head reads (that of models.final_site)
        self._head_tower = {mid: s.tower for (mid, _), s in self.sites.items()
                            if s.site == self.models[mid].final_site}
        self.codec = H.Codec((
            H.Stream(model_id=mid, site_id=sid, head=head, n_rows=self.models[mid].n_rows)
            for (mid, sid), s in self.sites.items()
            for head in (range(s.n_heads) if s.n_heads else (-1,))
        ), key=key)
        # Where each model's committed rows run without a break: a merged sharded ingest
        # leaves unused rows (maybe without chunks) between shards, never to be read ahead.
        self._segments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # Read up front: UDFs run inside a query on the catalog connection and may not use it.
        for m in self.models.values():
            spans = store.catalog.con.execute(
                "SELECT row_start, row_start + n_tokens FROM prompt_runs WHERE model = ? "
                "AND n_tokens > 0 ORDER BY row_start", [m.model]).fetchall()
            self._segments[m.model_id] = _segments(spans)
        self._local = threading.local()  # x_blocks' scratch, one a thread
        self.reader = FieldReader(store, self.cache, self.segment_end)
        self.weights = ModelWeights(store, self.sites, lambda: self.device)
        self.tokens = Vocabulary(store, self.models)
        # (model id, token, its SQL type, anchor-set argument) -> what kernels._token_anchor
        # looked up for them: a stored model's weights and vocabulary never change
        self.token_anchors: dict[tuple[Any, ...], tuple[str, int, torch.Tensor, bool]] = {}
        self.heads = HeadWeights(store, lambda: self.device)  # head_kernels.py
        # the layer weights as rows (the views neurons and circuits), numbered on first use
        self.weight_rows = WeightRows(store, self.models, self.weights.gain, self.sites,
                                      lambda: self.device)
        self._plan: WeightPlan | None = None
        self._plan_lock = threading.Lock()

    def clear(self) -> None:
        """Forget every chunk read (the next query reads from the store again)."""
        self.cache.clear()
        self.reader.clear()

    @property
    def device(self) -> torch.device:
        """The device, resolved on first use: the first tensor function imports torch."""
        if isinstance(self._device, str):
            from ..devices import resolve_device
            from ..lazy import load

            load(torch)
            self._device = resolve_device(self._device)
        return self._device

    def weight_plan(self) -> WeightPlan:
        """The store's weight streams, added to the codec's on first use (weight_rows.py)."""
        with self._plan_lock:
            if self._plan is None:
                plan = self.weight_rows.plan(len(self.codec.streams))
                self.codec.extend(plan.streams)
                self._plan = plan
            return self._plan

    def stream_end(self, bits: int, row: int) -> int:
        """`segment_end` for the stream of a fields word shifted right by STREAM_SHIFT: a
        weight stream's rows run unbroken to its last."""
        stream = self.codec.stream(bits)
        if stream.kind != "acts":
            return stream.n_rows
        return self.segment_end(stream.model_id, row)

    def segment_end(self, model_id: int, row: int) -> int:
        """The end of the unbroken run of committed rows holding `row` (rows past it up to
        the next run's start are unused)."""
        starts, ends = self._segments.get(int(model_id), (np.zeros(0), np.zeros(0)))
        i = int(np.searchsorted(starts, row, side="right")) - 1
        return int(ends[i]) if i >= 0 and row < ends[i] else row + 1

    def model(self, model_id: int) -> ModelRecord:
        return self.models[int(model_id)]

    def site(self, model_id: int, site_id: int) -> SiteRecord:
        return self.sites[(int(model_id), int(site_id))]

    def off_tower(self, model: ModelRecord, site: SiteRecord) -> bool:
        """Whether `site` is another tower's than the final norm the model's head reads."""
        head = self._head_tower.get(model.model_id)
        return site.tower is not None and head is not None and site.tower != head

    def off_head(self, model: ModelRecord, site: SiteRecord, name: str) -> str | None:
        """Why function `name` may not read a row of `site` through the model's LM head: the
        site is another tower's than the final norm the head reads (an encoder-decoder's
        encoder, a multimodal model's vision tower), whose rows never meet that norm, so no
        logits were proven for them (the width alone need not tell: towers may share it).
        None where it may."""
        if not self.off_tower(model, site):
            return None
        head = self._head_tower[model.model_id]
        where = f"{name} reads a row through the LM head of model {model.model!r}, which reads"
        if site.tower == "encoder" and head == "decoder":
            return (f"{where} its decoder's final norm; site {site.site!r} is its encoder's, "
                    "whose output meets the decoder only through cross-attention, so no "
                    "logits are proven there: keep to the decoder's sites (WHERE site NOT "
                    "LIKE 'encoder.%')")
        return (f"{where} its {head} tower's final norm; site {site.site!r} is its "
                f"{site.tower} tower's, whose rows never meet that norm, so no logits are "
                f"proven there: keep to the {head} tower's sites (WHERE site NOT LIKE "
                f"'{site.tower}.%')")

    def x_blocks(self, g: Group) -> Iterator[tuple[int, int, torch.Tensor]]:
        """`Group.x_blocks` on the CPU: each block of stored directions converted to float32
        in this thread's scratch buffer, times its norms, then the group's view applied. The
        same float32 operations as `Group.x`, row by row, in blocks of 1 MiB, so that a window's
        float32 copy never exists whole."""
        d = g.site.d
        step = max(1, runs.SCRATCH_FLOATS // d)
        scratch = getattr(self._local, "x_scratch", None)
        if scratch is None or scratch.numel() < step * d:
            scratch = self._local.x_scratch = torch.empty(step * d, dtype=torch.float32)
        norm = g.norm
        mean = g.mean if g.view != "raw" else None
        for a, b, part in self.reader.pieces(g.model, g.site, "direction", g.rows, g.heads):
            piece = torch.from_numpy(part)
            for i in range(0, b - a, step):
                lo, m = a + i, min(step, b - a - i)
                x = scratch[: m * d].view(m, d)
                x.copy_(piece[i : i + m])
                x.mul_(norm[lo : lo + m].unsqueeze(-1))
                if mean is not None:
                    x = self.apply_view(g.model, g.site, g.view, x, mean[lo : lo + m],
                                        g.heads[lo : lo + m])
                yield lo, lo + m, x

    def gather(self, handles: np.ndarray, device: torch.device | str, what: str
               ) -> torch.Tensor:
        """float32 [n, d] on `device`: the vectors of `handles` (no NULLs), views applied, in
        their order; [0, 0] for none. `what` names the rows in errors. A QueryError when they
        have different widths, or when a row's vector is NULL (`final_norm` of a vector off
        the residual stream): never a row left unfilled."""
        out: torch.Tensor | None = None
        filled = 0
        for g in self.groups(handles):
            if out is None:
                out = torch.empty((len(handles), g.x.shape[-1]), dtype=g.x.dtype, device=device)
            if g.x.shape[-1] != out.shape[-1]:
                raise QueryError(f"{what} have different widths ({out.shape[-1]} and "
                                 f"{g.x.shape[-1]}); select one site width at a time")
            out[torch.from_numpy(g.index).to(out.device)] = g.x.to(out.device)
            filled += len(g.index)
        if filled != len(handles):
            raise QueryError(
                f"{what} include final_norm(vec) of {len(handles) - filled} rows at q_norm, "
                "k_norm or inner sites, which is NULL (those vectors never meet the final "
                "norm); filter them out, e.g. WHERE role NOT IN ('q_norm', 'k_norm', 'inner')")
        return out if out is not None else torch.empty((0, 0), device=device)

    def groups(self, handles: np.ndarray) -> Iterator[Group]:
        """Split a batch of opened handles (their fields words: handles.Codec.open) by
        (model, site, view); fields are read when first used."""
        weights = self.codec.weight_rows(handles)
        if weights is not None and weights.any():
            yield from self._weight_groups(handles, weights)
            if weights.all():
                return
            rest = np.nonzero(~weights)[0]
            for g in self._act_groups(handles[rest]):
                g.index = rest[g.index]
                yield g
            return
        yield from self._act_groups(handles)

    def _weight_groups(self, handles: np.ndarray, weights: np.ndarray) -> Iterator[Group]:
        """One group for each weight stream among opened handles (`weights`: which are)."""
        at = np.nonzero(weights)[0]
        streams = (handles[at] >> H.STREAM_SHIFT) & H.STREAM_MASK
        specs = self.weight_plan().specs
        for stream in np.unique(streams):
            index = at[streams == stream]
            rows = handles[index] & H.ROW_MASK
            order = np.argsort(rows, kind="stable")
            spec = specs[int(stream)]
            yield WeightGroup(self, index[order], self.model(spec.model_id), spec, rows[order])

    def _act_groups(self, handles: np.ndarray) -> Iterator[Group]:
        n = len(handles)
        if n == 0:
            return
        # A handle's bits above its row are its view and stream (handles.py): split by those,
        # then join the streams of one (model, site, view) (a site's heads), so that no
        # handle's model, site or head is looked up row by row.
        order, tops, bounds = H.by_stream(handles)  # order None: one stream (most calls)
        runs: list[tuple[int, np.ndarray | None]] = [(tops[0], None)] if order is None else [
            (top, order[a:b]) for top, a, b in zip(tops, bounds[:-1], bounds[1:], strict=True)]
        joined: dict[tuple[int, int, int], list[tuple[H.Stream, np.ndarray | None]]] = {}
        for top, at in runs:
            stream = self.codec.stream(top)
            code = (top >> H.STREAM_BITS) & H.VIEW_MASK
            joined.setdefault((stream.model_id, stream.site_id, code), []).append((stream, at))
        # groups in (model, site, view) order: the runs' own where they are of one view (the
        # streams are numbered in (model, site, head) order)
        in_order = (runs[0][0] >> H.STREAM_BITS) == (runs[-1][0] >> H.STREAM_BITS)
        for (model_id, site_id, view_code), parts in (
                joined.items() if in_order else sorted(joined.items(), key=lambda kv: kv[0])):
            model = self.model(model_id)
            site = self.site(model_id, site_id)
            view = H.VIEWS[view_code]
            if view == "final_norm" and (site.role in OFF_STREAM_ROLES
                                         or self.off_tower(model, site)):
                continue  # final_norm(v) is NULL where v never meets the final norm
            if len(parts) == 1:
                stream, at = parts[0]
                index = np.arange(n) if at is None else at
                rows = (handles if at is None else handles[at]) & H.ROW_MASK
                heads = _heads_of(stream.head, len(rows))
            else:  # a site's heads: the positions of all of them, in the call's order
                index = np.sort(np.concatenate([at for _, at in parts if at is not None]))
                words = handles[index]
                rows = words & H.ROW_MASK
                heads = self.codec.heads((words >> H.STREAM_SHIFT) & H.STREAM_MASK)
            if (rows[1:] < rows[:-1]).any():  # chunk-friendly reading order
                by_row = np.argsort(rows, kind="stable")
                index, rows, heads = index[by_row], rows[by_row], heads[by_row]
            yield Group(self, index, model, site, view, rows, heads)

    def issue(self, fields: np.ndarray) -> pa.Array:
        """Raw handles of the view `acts`' rows (their fields words, handles.py), each of a
        stored row (`check_stored`): the one function making raw handles makes none the
        store would not."""
        self.check_stored(fields)
        return self.codec.seal(fields)

    def check_stored(self, fields: np.ndarray) -> None:
        """Refuse fields words (int64) that do not name a raw vector of a stored row: the
        view `acts` passes them to `issue` and to its norm and mean columns, which read no
        handle. Per call, not per row, where one stream's rows lie within one unbroken run of
        committed rows (every call of an unsharded store)."""
        if not len(fields):
            return
        top = fields >> H.STREAM_SHIFT  # stream, view and tag
        # Every word raw (view 0), tagged, of a stream of the store, and of one model's
        # streams: the rows checked at once (a call's rows are often of several sites).
        tag = H.TAG >> H.STREAM_SHIFT
        lo, hi = int(top.min()), int(top.max())
        if tag <= lo and hi < tag + len(self.codec.streams):
            model_id = self.codec.model_ids(lo - tag, hi - tag + 1)
            if model_id is not None and self._in_one_run(model_id, fields & H.ROW_MASK):
                return
        first = int(top[0])
        streams = [first] if (top == first).all() else np.unique(top).tolist()
        for bits in streams:
            stream = bits & H.STREAM_MASK
            if bits != (H.TAG >> H.STREAM_SHIFT) | stream or stream >= len(self.codec.streams):
                raise QueryError(f"{bits << H.STREAM_SHIFT} names no raw vector of a stream "
                                 "of the store")
            rows = (fields if len(streams) == 1 else fields[top == bits]) & H.ROW_MASK
            self._check_stored(self.codec.streams[stream].model_id, rows)

    def _check_stored(self, model_id: int, rows: np.ndarray) -> None:
        """Refuse a row that holds no stored token. Per call, not per row, where the rows lie
        within one unbroken run of committed rows (every call of an unsharded store)."""
        if self._in_one_run(model_id, rows):
            return
        starts, ends = self._segments[model_id]
        seg = np.searchsorted(starts, rows, side="right") - 1
        stored = (rows >= 0) & (seg >= 0) & (rows < ends[np.maximum(seg, 0)]) if len(
            starts) else np.zeros(len(rows), dtype=bool)
        if not stored.all():
            raise H.unused_row(int(rows[int(np.argmin(stored))]))

    def _in_one_run(self, model_id: int, rows: np.ndarray) -> bool:
        """Whether `rows` (of model `model_id`) all lie in one unbroken run of committed
        rows."""
        starts, ends = self._segments[model_id]
        lo, hi = int(rows.min()), int(rows.max())
        i = int(np.searchsorted(starts, lo, side="right")) - 1
        return lo >= 0 and i >= 0 and hi < ends[i]

    def apply_view(self, model: ModelRecord, site: SiteRecord, view: str, x: torch.Tensor,
                   mean: torch.Tensor | None, heads: np.ndarray | None = None) -> torch.Tensor:
        """A view of raw vectors x; `mean` is their stored mean (None: computed from x)."""
        if site.role == WEIGHT_ROLE and view != "final_norm":
            raise not_a_norm_input(site, f"the {view} view")
        if view == "normalized":
            return norms.normalize(self.weights.centered(site), x, site.eps, mean)
        if view == "normed":
            return self.site_output(model, site, x, mean, heads)
        final = self.weights.final_site(model)
        if final.d != x.shape[-1]:
            raise QueryError(
                f"final_norm needs width {final.d}, but site {site.site!r} has width {x.shape[-1]}"
            )
        return self.site_output(model, final, x, mean if final.site_id == site.site_id else None)

    def site_output(self, model: ModelRecord, site: SiteRecord, x: torch.Tensor,
                    mean: torch.Tensor | None, heads: np.ndarray | None = None) -> torch.Tensor:
        """y = gain * z + bias with the site's effective gain and bias; a per-head site whose
        heads are separate modules has one gain row per head, picked by `heads`."""
        if site.role == WEIGHT_ROLE:
            raise not_a_norm_input(site, "a norm's output")
        gain = self.weights.gain(model, site)
        bias = self.weights.param(model, site, "bias")
        if heads is not None:
            at = torch.from_numpy(np.array(heads, dtype=np.int64)).to(self.device)  # writable
            gain = gain[at] if gain is not None and gain.dim() == 2 else gain
            bias = bias[at] if bias is not None and bias.dim() == 2 else bias
        return norms.apply(self.weights.centered(site), x, gain=gain, bias=bias, eps=site.eps,
                           mean=mean)


def not_a_norm_input(site: SiteRecord, what: str) -> QueryError:
    """The one sentence for a weight row where a norm's input was needed."""
    return QueryError(f"{what} is not defined for {site.site!r}: it is a weight row (neurons, "
                      "circuits), a direction in the residual stream with no norm of its own; "
                      "pass a vec of acts")


class WeightGroup(Group):
    """Rows of one weight stream (weight_rows.py): their vectors read whole, float32, with
    the fold the view states; direction, norm and mean made from them."""

    def __init__(self, src: VectorSource, index: np.ndarray, model: ModelRecord,
                 spec: WeightSpec, rows: np.ndarray) -> None:
        site = src.weight_rows.site(spec, src.weight_rows.width(spec))
        super().__init__(src, index, model, site, "raw", rows,
                         np.full(len(rows), -1, dtype=np.int64))
        self.spec = spec

    def _field(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            x = self.x
            n = torch.linalg.vector_norm(x, dim=-1)
            self._cache["norm"] = n
            self._cache["mean"] = x.mean(-1)
            self._cache["direction"] = x / torch.where(n > 0, n, 1.0).unsqueeze(-1)
        return self._cache[name]

    @property
    def x(self) -> torch.Tensor:
        if "x" not in self._cache:
            self._cache["x"] = self.src.weight_rows.rows(self.spec, self.rows)
        return self._cache["x"]

    def x_blocks(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        yield 0, len(self.rows), self.x

    def project(self, v: torch.Tensor, at: np.ndarray | None = None) -> torch.Tensor:
        u = self.direction if at is None else self.direction[torch.from_numpy(at)]
        return (u @ v.to(u.device, torch.float32)).cpu()


_HEADS: dict[int, np.ndarray] = {}  # head -> a read-only run of it, sliced for each group


def _heads_of(head: int, n: int) -> np.ndarray:
    """int64 [n] of `head`, read-only: a group of one stream's rows (one head, or -1)."""
    run = _HEADS.get(head)
    if run is None or len(run) < n:
        run = np.full(max(n, 4096), head, dtype=np.int64)
        run.setflags(write=False)
        _HEADS[head] = run
    return run[:n]


def _segments(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (start, end) runs of rows joined where one ends as the next starts."""
    starts: list[int] = []
    ends: list[int] = []
    for a, b in spans:
        if ends and a == ends[-1]:
            ends[-1] = b
        else:
            starts.append(a)
            ends.append(b)
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
