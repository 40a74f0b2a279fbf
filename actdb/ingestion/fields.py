"""Turn a norm module's hooked input and output into the stored fields, checking faithfulness:
the output recomputed from what is stored must match what the module really produced.

The fields of a group of batches (what the ingest commits at once) are written straight into
host buffers that live for the whole ingest, and the arithmetic runs in work buffers that
live as long: two sets of host buffers are alternated (one filled while the commit thread
writes the other), so no batch allocates memory of its own size. Fresh buffers cost a page
fault every 4 KiB: measured on GPT-2 small, allocating per site and batch took more system
time than the hooks' arithmetic. A set's buffers are therefore one anonymous mapping advised
for huge pages where the system has them (`_host_buffers`): the batches that first fill a set
took about 30,000 faults on each of the forward pass's two threads.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np
import torch

from .. import norms
from ..errors import IngestError
from ..store.records import SiteRecord
from ..store.store import ActBatch
from .grids import Grid, GridPlan
from .layouts import FEATURE_MAPS, as_rows
from .sites import FoundSite

try:  # the compiled kernels (actdb/_native.c), built at install when a C compiler is there
    from .. import _native
except ImportError:  # pragma: no cover - a build without a C compiler
    _native = None  # type: ignore[assignment]
if _native is not None and not hasattr(_native, "split_rows"):  # pragma: no cover
    _native = None  # type: ignore[assignment]  # a build older than its source: torch's path

FAITHFULNESS_LIMIT = 1e-2
_SHARED_SPLIT_VALUES = 1 << 16  # a batch's rows worth a parallel region (a row of d = 768: 85)


def _split_threads(values: int) -> int:
    """Threads for `split_rows` over `values` floats: torch's own intra-op count (the cores
    the forward pass uses), or one for a few rows, where waking the kernel's threads would
    cost more than it saves."""
    return torch.get_num_threads() if values >= _SHARED_SPLIT_VALUES else 1


def _heads_last(x: torch.Tensor, layout: str) -> torch.Tensor:
    """One per-head module's tensor as [B, T, h, d]."""
    if layout == "bhtd":
        return x.transpose(1, 2)
    return x if layout == "bthd" else x.unsqueeze(-2)


_ALIGN = 64  # each buffer's start: a cache line
_HUGE_MIN_BYTES = 8 << 20  # smaller sets stay on the heap (a huge page is 2 MiB)


def _host_buffers(specs: list[tuple[tuple[int, ...], type[np.generic]]]) -> list[np.ndarray]:
    """Empty arrays of these shapes and dtypes, in one anonymous mapping advised for
    transparent huge pages (Linux): a 2 MiB page is one fault where 4 KiB pages are 512, and
    on a virtual machine each fault of either size costs microseconds. The mapping lives as
    long as any of the arrays. Elsewhere, or for a small set, plain heap arrays."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or total < _HUGE_MIN_BYTES:
        return [np.empty(shape, dtype) for shape, dtype in specs]
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another setting
    # (shmem_enabled, "never" by default), and forked children would share the buffers.
    region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages: 4 KiB pages
        pass
    return [np.frombuffer(region, dtype, int(np.prod(shape)), at).reshape(shape)
            for (shape, dtype), at in zip(specs, offsets, strict=True)]


class _Group:
    """Host buffers for the rows of one commit group: per site direction, norm and mean."""

    def __init__(self, found: list[FoundSite], rows: int) -> None:
        self.rows = rows
        self.fields: dict[str, ActBatch] = {}
        specs: list[tuple[tuple[int, ...], type[np.generic]]] = []
        for f in found:
            s = f.record
            heads = (s.n_heads,) if s.n_heads else ()
            specs += [((rows, *heads, s.d), np.float16), ((rows, *heads), np.float32),
                      ((rows, *heads), np.float32)]
        arrays = iter(_host_buffers(specs))
        for f in found:
            self.fields[f.record.site] = ActBatch(
                direction=next(arrays), norm=next(arrays), mean=next(arrays))


class _Work:
    """A float32 buffer on the ingest's device, grown on demand, viewed in any shape."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device, self.dtype = device, dtype
        self.flat = torch.empty(0, dtype=dtype, device=device)

    def view(self, *shape: int) -> torch.Tensor:
        n = int(np.prod(shape))
        if self.flat.numel() < n:
            self.flat = torch.empty(n, dtype=self.dtype, device=self.device)
        return self.flat[:n].view(shape)


class _Part:
    """The rows of a batch that one tower's sites see (an encoder-decoder's encoder input,
    then its decoder tokens; one part for every other model): its real tokens `mask` [B, T]
    and where its rows start among the batch's."""

    def __init__(self, tower: str | None, mask: torch.Tensor, offset: int) -> None:
        self.tower, self.mask, self.offset = tower, mask, offset
        self.no_padding = bool(mask.all())
        lengths = mask.sum(dim=1)
        t = mask.shape[1]
        prefix = torch.arange(t, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)
        # each row's real tokens, when they come first
        self.lengths: list[int] | None = (lengths.tolist() if bool((prefix == mask).all())
                                          else None)
        self.n = int(lengths.sum())


class SiteSink:
    """Turns each hooked (input, output) into stored fields and a faithfulness figure.

    Each batch's rows are appended to the current group (`start` begins a batch, `take`,
    after a batch has run, ends the group and hands over its rows). `out[site]` are the
    current batch's rows (of the site's tower)."""

    def __init__(self, found: list[FoundSite], device: torch.device, *, rows: int = 2048,
                 grids: GridPlan | None = None) -> None:
        """`rows`: the most rows a group will hold (its buffers' pages, 2 MiB ones where huge,
        are only taken as rows are written, so a generous size costs address space, not
        memory). `grids`: where sites see different positions, each site's place among an
        input's rows (its other rows are zeros, never read: no token of its grid)."""
        self.found = found
        self.places: dict[str, Grid] = {}
        for f in found:
            place = grids.place(f.record.site) if grids is not None else None
            if place is not None:
                self.places[f.record.site] = place
        self._placed: dict[str, ActBatch] = {}  # a placed site's rows of a batch, compact
        self.by_module = {path: (f, i) for f in found for i, (path, _) in enumerate(f.hooks)}
        self.records = {f.record.site: f.record for f in found}
        self.params = {
            f.record.site: (
                f.gain.float().to(device) if f.gain is not None else None,
                f.bias.float().to(device) if f.bias is not None else None,
            )
            for f in found
        }
        # On the CPU, sites whose gain and bias (if any) are one vector of the site's width go
        # through the compiled kernel (`_split_native`): their float32 bytes, or b"" for none.
        self.native: dict[str, tuple[bytes, bytes]] = {}
        if _native is not None and device.type == "cpu":
            for site, (g, b) in self.params.items():
                if all(t is None or t.dim() == 1 for t in (g, b)):
                    self.native[site] = tuple(  # type: ignore[assignment]
                        b"" if t is None else t.detach().contiguous().numpy().tobytes()
                        for t in (g, b))
        self.mask = torch.zeros(0, dtype=torch.bool)
        self._parts: list[_Part] = []  # the batch's rows, by the tower that sees them
        self._tokens: torch.Tensor | None = None  # start's `tokens`
        self._rows = rows
        self._groups: list[_Group | None] = [None, None]
        self._current = 0
        self._filled = 0  # rows of the current group before this batch
        self._n = 0  # real tokens in this batch, of every part
        self._x, self._y, self._d = _Work(device), _Work(device), _Work(device)
        self._d16 = _Work(device, torch.float16)  # off the CPU: the direction, on its device
        self.out: dict[str, ActBatch] = {}
        self.errors: dict[str, float] = {}
        self._heads: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        # Called with (site, its direction rows of the current group) once a site's rows of
        # the batch are stored and checked; the ingest sets it for its last batch.
        self.on_site: Callable[[str, np.ndarray], None] | None = None

    def start(self, mask: torch.Tensor,
              towers: list[tuple[str | None, torch.Tensor]] | None = None,
              tokens: torch.Tensor | None = None) -> None:
        """A new forward pass over a batch whose real tokens are `mask` [B, T]; `towers`, for
        a model whose towers read different sequences, each tower's mask instead, in the
        order of their rows (an encoder-decoder's encoder, then decoder): a site stores its
        tower's rows and zeros in the others'. `tokens`: where an input's rows end with its
        text tokens (grids.Grid.tokens: text and images together), which of the padded
        sequence's positions they are [B, T'] (its attention mask)."""
        self._filled += self._n  # the previous batch (which ran) stays in the group
        self.mask = mask
        self._tokens = tokens
        self._parts = []
        at = 0
        for tower, m in towers or [(None, mask)]:
            self._parts.append(_Part(tower, m, at))
            at += self._parts[-1].n
        self._n = at
        self.out, self.errors, self._heads = {}, {}, {}
        group = self._groups[self._current]
        need = self._filled + self._n
        if group is None:
            self._groups[self._current] = _Group(self.found, max(self._rows, need))
        elif group.rows < need:
            raise RuntimeError(f"a group of {group.rows} rows cannot take a batch of {self._n} "
                               f"after {self._filled}: the sink was sized too small")

    def take(self) -> dict[str, ActBatch]:
        """The current group's rows (views of its buffers), then the next batch starts the
        other group. The caller must be done with the rows taken before last (the commit
        thread's previous write) before the next batch runs."""
        n = self._filled + self._n
        group = self._groups[self._current]
        assert group is not None
        taken = {site: ActBatch(direction=f.direction[:n], norm=f.norm[:n], mean=f.mean[:n])
                 for site, f in group.fields.items()}
        self._current, self._filled, self._n = 1 - self._current, 0, 0
        self.out = {}
        return taken

    def _part(self, s: SiteRecord) -> _Part:
        """The part of the batch's rows a site sees: its tower's."""
        part = next((p for p in self._parts if p.tower is None or p.tower == s.tower), None)
        if part is None:
            raise IngestError(f"site {s.site!r} is in tower {s.tower!r}, which reads none of "
                              "this batch's sequences")
        return part

    def _rows_of(self, part: _Part, v: torch.Tensor, work: _Work, tail: tuple[int, ...]
                 ) -> torch.Tensor:
        """The real tokens' rows of v [B, T, *tail] as float32 [n, *tail] on the mask's
        device: a view where v already is that, else copied into `work`."""
        b, t = part.mask.shape
        v = v.to(part.mask.device)  # under a device_map the module may live elsewhere
        if part.no_padding and v.dtype == torch.float32 and v.is_contiguous():
            return v.reshape(b * t, *tail)
        v = v.reshape(b, t, *tail)
        rows = work.view(part.n, *tail)
        if part.no_padding:
            rows.view(b, t, *tail).copy_(v)
        elif part.lengths is not None:  # each row's real tokens first: one copy a row
            at = 0
            for i, length in enumerate(part.lengths):
                rows[at : at + length].copy_(v[i, :length])
                at += length
        else:
            rows.copy_(v[part.mask])
        return rows

    @torch.no_grad()
    def __call__(self, module_path: str, x: torch.Tensor, y: torch.Tensor) -> None:
        f, head = self.by_module[module_path]
        s = f.record
        if s.site in self.out:
            return  # called again in one pass (find_sites refuses such sites): the first
        if f.layout == "list":  # one module per head: stack the heads when all have run
            parts = self._heads.setdefault(s.site, {})
            parts.setdefault(head, (x, y))
            if len(parts) < len(f.hooks):
                return
            x = torch.cat([_heads_last(parts[i][0], f.member_layout)
                           for i in range(len(f.hooks))], dim=-2)  # [B, T, H, d]
            y = torch.cat([_heads_last(parts[i][1], f.member_layout)
                           for i in range(len(f.hooks))], dim=-2)
        elif f.layout == "bhtd":
            x, y = x.transpose(1, 2), y.transpose(1, 2)  # [B, T, H, d]
        elif f.layout in (*FEATURE_MAPS, "kbtd"):  # each input's positions: [B, P, d]
            b = self.mask.shape[0]
            x, y = as_rows(x, f.layout, b), as_rows(y, f.layout, b)
        if s.site in self.places:
            self._store_placed(f, x, y)
            return
        tail = tuple(x.shape[-(2 if s.n_heads else 1):])
        part = self._part(s)
        x = self._rows_of(part, x, self._x, tail)
        y = self._rows_of(part, y, self._y, tail)
        group = self._groups[self._current]
        assert group is not None
        lo = self._filled + part.offset
        hi = lo + part.n
        stored = group.fields[s.site]
        if part.n != self._n:  # the other towers' rows: never named by a token of this tower
            for a, b in ((self._filled, lo), (hi, self._filled + self._n)):
                stored.direction[a:b] = 0
                stored.norm[a:b] = 0
                stored.mean[a:b] = 0
        worst = self._split(s, x, y, stored, lo, hi)
        self._stored(s, worst, ActBatch(direction=stored.direction[lo:hi],
                                        norm=stored.norm[lo:hi], mean=stored.mean[lo:hi]))
        if self.on_site is not None:
            self.on_site(s.site, stored.direction[:self._filled + self._n])

    def mask_of(self, site: str) -> torch.Tensor:
        """The positions of the current batch that `site`'s rows in `out` are: [B, T], or a
        placed site's own grid's [B, size]."""
        g = self.places.get(site)
        if g is None:
            return self._part(self.records[site]).mask
        if g.tokens:
            assert self._tokens is not None
            return self._tokens
        return torch.ones((self.mask.shape[0], g.size), dtype=torch.bool,
                          device=self.mask.device)

    def _store_placed(self, f: FoundSite, x: torch.Tensor, y: torch.Tensor) -> None:
        """A site on a grid of its own: its rows [B, size, d] split and checked compactly,
        then placed at its grid's offset in each input's rows; the input's other rows of
        this site are zeros (the catalog has no token of its grid there)."""
        s, g = f.record, self.places[f.record.site]
        b, total = self.mask.shape
        if s.n_heads and not (self._tokens is not None and g.tokens):
            raise IngestError(f"site {s.site!r} ({s.module}) is a per-head site of a model whose "
                              "sites see different grids of positions; actdb places per-head "
                              "rows on a text token grid only")
        if self._tokens is not None:
            self._store_among_tokens(f, x, y)
            return
        x, y = as_rows(x, "btd", b), as_rows(y, "btd", b)  # [B, size, d]
        if x.shape[1] != g.size:
            raise IngestError(f"site {s.site!r} ({s.module}) sees {x.shape[1]} positions an "
                              f"input in this batch, not the {g.size} it saw when probed")
        n, d = b * g.size, s.d
        rows = self._placed.get(s.site)
        if rows is None or rows.norm.shape[0] != n:
            rows = ActBatch(direction=np.empty((n, d), np.float16),
                            norm=np.empty(n, np.float32), mean=np.empty(n, np.float32))
            self._placed[s.site] = rows
        x = self._x.view(n, d).copy_(x.reshape(n, d))
        y = self._y.view(n, d).copy_(y.reshape(n, d))
        worst = self._split(s, x, y, rows, 0, n)
        group = self._groups[self._current]
        assert group is not None
        lo, hi = self._filled, self._filled + self._n
        stored = group.fields[s.site]
        at = slice(g.offset, g.offset + g.size)
        for name, part in (("direction", rows.direction), ("norm", rows.norm),
                           ("mean", rows.mean)):
            whole = getattr(stored, name)[lo:hi].reshape(b, total, *part.shape[1:])
            whole[:, : g.offset] = 0
            whole[:, g.offset + g.size :] = 0
            whole[:, at] = part.reshape(b, g.size, *part.shape[1:])
        self._stored(s, worst, rows)
        if self.on_site is not None:
            self.on_site(s.site, stored.direction[:hi])

    def _store_among_tokens(self, f: FoundSite, x: torch.Tensor, y: torch.Tensor) -> None:
        """`_store_placed` where each input's rows end with its text tokens (inputs of text
        and images together): the token grid's rows are an input's real tokens (its attention
        mask) after the other grids' rows, each input's at its own place."""
        s, g = f.record, self.places[f.record.site]
        tokens = self._tokens
        assert tokens is not None
        b, d = self.mask.shape[0], s.d
        # a row's vector, or its heads' ([H, d]: a per-head site on the token grid, [B, T, H, d])
        tail = (s.n_heads, d) if s.n_heads else (d,)
        counts = tokens.sum(dim=1).tolist()  # each input's text tokens
        if g.tokens:
            keep = tokens.to(x.device)
            x, y = x.reshape(b, -1, *tail)[keep], y.reshape(b, -1, *tail)[keep]  # [sum T_i, *tail]
            sizes, offsets = counts, [g.offset] * b
        else:
            x, y = as_rows(x, "btd", b), as_rows(y, "btd", b)  # [B, size, d]
            if x.shape[1] != g.size:
                raise IngestError(f"site {s.site!r} ({s.module}) sees {x.shape[1]} positions "
                                  f"an input in this batch, not the {g.size} it saw when "
                                  "probed")
            x, y = x.reshape(-1, d), y.reshape(-1, d)
            sizes, offsets = [g.size] * b, [g.offset] * b
        n = int(sum(sizes))
        rows = ActBatch(direction=np.empty((n, *tail), np.float16),
                        norm=np.empty((n, *tail[:-1]), np.float32),
                        mean=np.empty((n, *tail[:-1]), np.float32))
        worst = self._split(s, self._x.view(n, *tail).copy_(x), self._y.view(n, *tail).copy_(y),
                            rows, 0, n)
        group = self._groups[self._current]
        assert group is not None
        stored = group.fields[s.site]
        start, at = self._filled, 0
        for total, size, offset in zip(self.mask.sum(dim=1).tolist(), sizes, offsets,
                                       strict=True):
            for name in ("direction", "norm", "mean"):
                whole = getattr(stored, name)[start : start + total]
                whole[:] = 0
                whole[offset : offset + size] = getattr(rows, name)[at : at + size]
            start, at = start + total, at + size
        self._stored(s, worst, rows)
        if self.on_site is not None:
            self.on_site(s.site, stored.direction[: self._filled + self._n])

    def _split(self, s: SiteRecord, x: torch.Tensor, y: torch.Tensor, stored: ActBatch,
               lo: int, hi: int) -> float:
        if s.site in self.native and x.device.type == "cpu":
            return self._split_native(s, x, y, stored, lo, hi)
        return self._split_torch(s, x, y, stored, lo, hi)

    def _stored(self, s: SiteRecord, worst: float, rows: ActBatch) -> None:
        """A site's rows of the batch are stored and checked: the check's verdict."""
        if not worst <= FAITHFULNESS_LIMIT:
            raise IngestError(
                f"site {s.site!r} ({s.module}, kind {s.kind}): the output recomputed from the "
                f"stored fields differs from the module's output by {worst:.3g} (relative), "
                f"more than {FAITHFULNESS_LIMIT}; actdb's maths for this norm is wrong"
            )
        self.errors[s.site] = worst
        self.out[s.site] = rows

    def _split_native(self, s: SiteRecord, x: torch.Tensor, y: torch.Tensor, stored: ActBatch,
                      lo: int, hi: int) -> float:
        """The fields and the check in one compiled pass a row (`_native.split_rows`): the
        same formulas as `_split_torch`, with the sums in float64, in three passes over memory
        where torch's ops make about twenty, without the GIL, the rows shared among the
        kernel's threads. Per-head rows [n, h, d] are n * h rows of d."""
        gain, bias = self.native[s.site]
        x, y = x.detach().contiguous(), y.detach().contiguous()
        return _native.split_rows(
            x.numpy(), y.numpy(), stored.direction[lo:hi], stored.norm[lo:hi],
            stored.mean[lo:hi], gain, bias, int(x.shape[-1]), bool(s.centered), float(s.eps),
            False, _split_threads(x.numel()))

    def _split_torch(self, s: SiteRecord, x: torch.Tensor, y: torch.Tensor, stored: ActBatch,
                     lo: int, hi: int) -> float:
        """The fields written into `stored`'s rows lo:hi, then the worst relative error of the
        output rebuilt from them, with torch's ops in reused buffers (any device)."""
        direction, norm, mean = norms.split(x, out=self._d.view(*x.shape))
        host16 = torch.from_numpy(stored.direction[lo:hi])
        if direction.device.type == "cpu":
            direction16 = host16.copy_(direction)
        else:
            direction16 = self._d16.view(*direction.shape).copy_(direction)
            host16.copy_(direction16)
        torch.from_numpy(stored.norm[lo:hi]).copy_(norm)
        torch.from_numpy(stored.mean[lo:hi]).copy_(mean)
        gain, bias = self.params[s.site]
        # the vector rebuilt from what is stored, then the norm's output, in one buffer
        y_hat = norms.apply_(bool(s.centered),
                             direction.copy_(direction16).mul_(norm.unsqueeze(-1)),
                             gain=gain, bias=bias, eps=s.eps)
        err = torch.linalg.vector_norm(y_hat.sub_(y), dim=-1).div_(
            torch.linalg.vector_norm(y, dim=-1).add_(1e-6))
        if not err.numel():
            return 0.0
        # NaN anywhere is the worst (torch's max propagates it), so the check fails on it
        return float(err.max())
