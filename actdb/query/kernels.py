"""Batched implementations of the tensor functions: one call per DuckDB vector of rows.

Each kernel takes a VectorSource, the batch's handles (numpy int64), an output to fill (NaN or
None for NULL) and its other arguments as `Arg` columns. Vectors are read per (model, site,
view) group and computed with torch on the source's device; never one Python call per row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import QueryError
from ..lazy import lazy_module
from .dots import row_dots
from .lists import ListResults, float_lists, struct_lists
from .topk_lists import _to_logits, topk_rows
from .vectors import OFF_STREAM_ROLES, Group, VectorSource

if TYPE_CHECKING:
    import pyarrow as pa
    import torch
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)



def _unit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = torch.linalg.vector_norm(x, dim=-1)  # [n]
    return x / torch.where(n > 0, n, torch.ones_like(n)).unsqueeze(-1), n > 0


def _require_width(name: str, g: Group, want: int, what: str) -> None:
    have = g.site.d
    if have != want:
        raise QueryError(
            f"{name} needs a vector of width {want} ({what}); site {g.site.site!r} of model "
            f"{g.model.model!r} has width {have}"
        )


def _require_anchor_width(name: str, src: VectorSource, g: Group, anchor_set: str) -> None:
    _require_width(name, g, src.weights.anchor_width(g.model, anchor_set),
                   f"the width of the {anchor_set!r} anchors")


def _check_k(name: str, k: int, limit: int) -> int:
    if k < 1:
        raise QueryError(f"{name}: k must be at least 1, got {k}")
    return min(int(k), limit)


def _check_dim(g: Group, dim: int) -> int:
    d = g.site.d
    if not 0 <= dim < d:
        raise QueryError(
            f"dim {dim} is out of range for site {g.site.site!r} of model {g.model.model!r} "
            f"(d = {d}: dims are 0..{d - 1})"
        )
    return int(dim)


def _final_normed(src: VectorSource, g: Group) -> torch.Tensor:
    """What the head reads of the group's vectors: final_norm(v) (a final_norm view is kept),
    for a contrastive model's labels divided by the length of its image embedding
    (ModelWeights.head_input)."""
    if g.view == "final_norm":
        return src.weights.head_input(g.model, g.x)
    return src.weights.head_input(g.model, src.apply_view(
        g.model, g.site, "final_norm", g.x, g.mean if g.view == "raw" else None))


def _final_normed_blocks(src: VectorSource, g: Group) -> Iterator[tuple[int, int, torch.Tensor]]:
    """`_final_normed` by blocks of rows (Group.x_blocks)."""
    mean = g.mean if g.view == "raw" else None
    for a, b, x in g.x_blocks():
        if g.view == "final_norm":
            yield a, b, src.weights.head_input(g.model, x)
        else:
            yield a, b, src.weights.head_input(g.model, src.apply_view(
                g.model, g.site, "final_norm", x, mean[a:b] if mean is not None else None))


def _block_rows(combos: dict[tuple[Any, ...], np.ndarray], a: int, b: int
                ) -> Iterator[tuple[tuple[Any, ...], slice | torch.Tensor, np.ndarray]]:
    """For each combination of argument values (`_per_value`: sorted positions in the group)
    with rows among the group's rows [a, b): (its values, its rows within the block, their
    positions in the group)."""
    for key, pos in combos.items():
        lo, hi = np.searchsorted(pos, (a, b))
        if lo == hi:
            continue
        at = pos[lo:hi]
        yield key, (slice(None) if hi - lo == b - a else torch.from_numpy(at - a)), at


def _lm_groups(src: VectorSource, h: np.ndarray) -> Iterator[Group]:
    """Groups whose vectors can meet the LM head; rows of the others stay NULL."""
    return (g for g in src.groups(h) if g.site.role not in OFF_STREAM_ROLES)


def _head_groups(src: VectorSource, h: np.ndarray, name: str) -> Iterator[Group]:
    """`_lm_groups` for a function that reads rows through the final norm and LM head (the
    logit lens): rows of a tower whose output never meets that norm (an encoder-decoder's
    encoder, a multimodal model's vision tower) are refused (VectorSource.off_head)."""
    for g in _lm_groups(src, h):
        why = src.off_head(g.model, g.site, name)
        if why is not None:
            raise QueryError(why)
        yield g


def _degrees(cos: torch.Tensor) -> torch.Tensor:
    return torch.rad2deg(torch.arccos(cos.clamp(-1.0, 1.0)))


# Between a token's SQL type and its text in the one string its UDF gets (functions.token_sql):
# no type name holds it, and the text, last, may hold anything.
TOKEN_SEP = "\x01"
# The most token anchors a connection keeps looked up (_token_anchor); each is a row of
# weights held anyway, so the bound is on the table, not on memory.
TOKEN_ANCHORS = 4096


class Arg:
    """A non-vector argument column: its distinct values, and each row's index into them."""

    def __init__(self, values: list[Any], codes: np.ndarray) -> None:
        self.values, self.codes = values, codes

    @classmethod
    def of(cls, column: pa.Array | pa.ChunkedArray) -> Arg:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        encoded = column.dictionary_encode()
        return cls(encoded.dictionary.to_pylist(),
                   encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64))

    @classmethod
    def repeat(cls, one: pa.Array, n: int) -> Arg:
        """`n` rows of the single value in `one` (read-only: bulk.py keeps it for later calls)."""
        codes = np.zeros(n, dtype=np.int64)
        codes.setflags(write=False)
        return cls(one.to_pylist(), codes)

    @classmethod
    def tokens(cls, column: pa.Array | pa.ChunkedArray, anchors: bool = False
               ) -> tuple[Arg, ...]:
        """A token column as its macro packs it (functions.token_sql): each row's text and
        its SQL type, and with `anchors` the anchor set packed between them, as Args over
        the same rows (text, type[, anchor set])."""
        return cls._unpacked(cls.of(column), anchors)

    @classmethod
    def repeat_tokens(cls, one: pa.Array, n: int, anchors: bool = False) -> tuple[Arg, ...]:
        """`n` rows of the single packed token in `one`."""
        return cls._unpacked(cls.repeat(one, n), anchors)

    @classmethod
    def _unpacked(cls, packed: Arg, anchors: bool) -> tuple[Arg, ...]:
        # the text comes last and may hold the separator: the first ones split it off
        split = [str(v).split(TOKEN_SEP, 2 if anchors else 1) for v in packed.values]
        text = cls([parts[-1] for parts in split], packed.codes)
        sqltype = cls([parts[0] for parts in split], packed.codes)
        return (text, sqltype, cls([parts[1] for parts in split], packed.codes)) if anchors \
            else (text, sqltype)


def _per_value(args: list[Arg], index: np.ndarray) -> dict[tuple[Any, ...], np.ndarray]:
    """Positions (into `index`) of each distinct combination of argument values in a group:
    one entry when the arguments are constants, as they usually are."""
    if all(len(a.values) == 1 for a in args):
        return {tuple(a.values[0] for a in args): np.arange(len(index))}
    combined = np.zeros(len(index), dtype=np.int64)
    for a in args:
        combined = combined * len(a.values) + a.codes[index]
    uniq, inverse = np.unique(combined, return_inverse=True)
    out = {}
    for u, code in enumerate(uniq):
        key, rest = [], int(code)
        for a in reversed(args):
            rest, c = divmod(rest, len(a.values))
            key.append(a.values[c])
        out[tuple(reversed(key))] = np.nonzero(inverse == u)[0]
    return out


# -- scalar kernels: fill `out` (float64 [n], NaN = NULL) ---------------------------------------


def _token_anchor(src: VectorSource, name: str, g: Group, token: str, ttype: str,
                  anchors: str) -> tuple[torch.Tensor, bool]:
    """Function `name`'s unit anchor [d] of a token argument (its text and SQL type) in an
    anchor-set argument ('' for the default) for group `g`'s model, and whether it is nonzero;
    checked in this order: the anchor set, the width of `g`'s site, the token. A stored
    model's weights and vocabulary never change, so what one call looked up serves every
    later call of the connection (VectorSource.token_anchors); only the width, a property of
    `g`'s site, is checked again."""
    key = (g.model.model_id, token, ttype, anchors)
    found = src.token_anchors.get(key)
    if found is None:
        a_set = src.weights.anchor_set(g.model, anchors or None)  # checked before the token
        _require_anchor_width(name, src, g, a_set)
        anchor = src.weights.anchor(g.model, a_set, src.tokens.resolve_token(g.model, token,
                                                                             ttype))
        found = (a_set, g.site.d, anchor, bool(anchor.any()))
        if len(src.token_anchors) >= TOKEN_ANCHORS:  # a column of many tokens
            src.token_anchors.clear()
        src.token_anchors[key] = found
    a_set, width, anchor, nonzero = found
    if g.site.d != width:
        _require_anchor_width(name, src, g, a_set)
    return anchor, nonzero


def cosine_to_anchor(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg,
                     ttype: Arg, anchors: Arg) -> None:
    for g in _lm_groups(src, h):
        combos = _per_value([token, ttype, anchors], g.index)
        # each value's unit anchor (a token whose anchor is the zero vector: NULL)
        live: dict[tuple[Any, ...], tuple[torch.Tensor, np.ndarray]] = {}
        for key, pos in combos.items():
            unit, nonzero = _token_anchor(src, "cosine_to_anchor", g, *key)
            if nonzero:
                live[key] = (unit, pos)
            else:
                out[g.index[pos]] = np.nan
        if g.view == "raw":
            # The stored direction is x / ||x|| already, so no norm to divide by; a zero
            # vector's direction is all zeros, so only rows whose cosine comes out exactly 0
            # need their norm read to tell NULL from a true 0. Each token's rows alone: a
            # column of many tokens must not multiply every row by every token's anchor.
            # Rounded to float16, a direction's length is 1 within 2^-11, so a vector along
            # its anchor could come out past 1 (and acos() NULL): clamped, as a cosine is.
            for unit, pos in live.values():
                whole = len(pos) == len(g.index)
                c = stored_cosines(src, g, unit, None if whole else pos)
                out[g.index if whole else g.index[pos]] = c
            continue
        rows_of = {key: pos for key, (_, pos) in live.items()}
        for lo, hi, x in g.x_blocks():  # one pass over the vectors for all the tokens
            for key, rows, at in _block_rows(rows_of, lo, hi):
                u, ok = _unit(x[rows])
                cos = torch.where(ok, row_dots(u, live[key][0]), torch.nan)
                out[g.index[at]] = cos.cpu().numpy()


def stored_cosines(src: VectorSource, g: Group, unit: torch.Tensor,
                   at: np.ndarray | None = None) -> np.ndarray:
    """float32 cosines of the group's raw vectors (rows `at`, or all) with a unit vector, from
    the stored directions (`FieldReader.project`): clamped to [-1, 1], since a float16
    direction's length is 1 only within 2^-11; NaN for a zero vector, whose direction is all
    zeros (only rows whose product is exactly 0 have their norm read)."""
    c = g.project(unit, at).cpu().numpy()
    np.minimum(np.maximum(c, -1.0, out=c), 1.0, out=c)  # np.clip's, as two ufuncs
    if not c.all():  # one pass, no mask, in the usual case of no exact 0
        norm = g.norm if at is None else g.norm[at]
        c = np.where((c == 0) & (norm.cpu().numpy() == 0), np.nan, c)
    return c


def dim_contribution(src: VectorSource, h: np.ndarray, out: np.ndarray, dim: Arg) -> None:
    for g in src.groups(h):
        combos = _per_value([dim], g.index)
        dims = {key: _check_dim(g, int(key[0])) for key in combos}
        for a, b, x in g.x_blocks():
            u, ok = _unit(x)
            for key, rows, at in _block_rows(combos, a, b):
                c = torch.where(ok[rows], u[rows, dims[key]], torch.nan)
                out[g.index[at]] = c.double().cpu().numpy()


def anchor_contribution(src: VectorSource, h: np.ndarray, out: np.ndarray, dim: Arg,
                        token: Arg, ttype: Arg, anchors: Arg) -> None:
    for g in _lm_groups(src, h):
        combos = _per_value([dim, token, ttype, anchors], g.index)
        args = {}
        for dv, t, ty, a in combos:
            d = _check_dim(g, int(dv))
            anchor, nonzero = _token_anchor(src, "anchor_contribution", g, t, ty, a)
            # a token whose anchor is the zero vector: NULL, as its cosine_to_anchor is
            args[(dv, t, ty, a)] = (d, anchor[d] if nonzero else torch.nan)
        for lo, hi, x in g.x_blocks():
            u, ok = _unit(x)
            for key, rows, at in _block_rows(combos, lo, hi):
                d, weight = args[key]
                val = torch.where(ok[rows], u[rows, d] * weight, torch.nan)
                out[g.index[at]] = val.double().cpu().numpy()


def logit(src: VectorSource, h: np.ndarray, out: np.ndarray, token: Arg, ttype: Arg) -> None:
    for g in _head_groups(src, h, "logit"):
        _require_width("logit", g, src.weights.unembed_width(g.model), "the LM head's width")
        combos = _per_value([token, ttype], g.index)
        # each token's row of W_U and b_U (model_weights.py: read alone while few are asked for)
        heads = {key: src.weights.unembed_row(g.model, src.tokens.resolve_token(g.model, *key))
                 for key in combos}
        for lo, hi, hn in _final_normed_blocks(src, g):
            for key, rows, at in _block_rows(combos, lo, hi):
                w, b = heads[key]
                val = row_dots(hn[rows], w) + (b if b is not None else 0.0)
                out[g.index[at]] = _to_logits(g.model, val).double().cpu().numpy()


def logit_contribution(src: VectorSource, h: np.ndarray, out: np.ndarray, dim: Arg,
                       token: Arg, ttype: Arg) -> None:
    for g in _head_groups(src, h, "logit_contribution"):
        _require_width("logit_contribution", g, src.weights.unembed_width(g.model),
                       "the LM head's width")
        combos = _per_value([dim, token, ttype], g.index)
        args = {}
        for dv, t, ty in combos:
            d = _check_dim(g, int(dv))
            tid = src.tokens.resolve_token(g.model, t, ty)
            args[(dv, t, ty)] = (d, src.weights.unembed_row(g.model, tid)[0])
        for lo, hi, hn in _final_normed_blocks(src, g):
            for key, rows, at in _block_rows(combos, lo, hi):
                d, w = args[key]
                out[g.index[at]] = (hn[rows, d] * w[d]).double().cpu().numpy()


def uniform_angle(src: VectorSource, h: np.ndarray, out: np.ndarray) -> None:
    for g in src.groups(h):
        if g.view == "raw":  # from the stored norm and mean alone: cos = mean * sqrt(d) / norm
            n = g.norm.double()
            cos = g.mean.double() * math.sqrt(g.site.d) / torch.where(n > 0, n, 1.0)
            ok = n > 0
        else:
            for a, b, x in g.x_blocks():
                n = torch.linalg.vector_norm(x, dim=-1)
                ok = n > 0
                cos = x.sum(-1) / (torch.where(ok, n, 1.0) * math.sqrt(x.shape[-1]))
                out[g.index[a:b]] = torch.where(ok, _degrees(cos.double()), torch.nan).cpu().numpy()
            continue
        out[g.index] = torch.where(ok, _degrees(cos.double()), torch.nan).cpu().numpy()


def rotation_angle(src: VectorSource, h: np.ndarray, out: np.ndarray) -> None:
    for g in src.groups(h):
        if g.view != "raw":
            raise QueryError("rotation_angle takes a raw vec (the norm's input), not a view")
        mean = g.mean
        for a, b, x in g.x_blocks():
            y = src.site_output(g.model, g.site, x, mean[a:b], g.heads[a:b])
            ux, okx = _unit(x)
            uy, oky = _unit(y)
            cos = row_dots(ux, uy)
            angle = torch.where(okx & oky, _degrees(cos), torch.nan)
            out[g.index[a:b]] = angle.double().cpu().numpy()


def vec_norm(src: VectorSource, h: np.ndarray, out: np.ndarray) -> None:
    for g in src.groups(h):
        if g.view == "raw":
            out[g.index] = g.norm.double().cpu().numpy()
            continue
        for a, b, x in g.x_blocks():
            out[g.index[a:b]] = torch.linalg.vector_norm(x, dim=-1).double().cpu().numpy()


def _by_width(src: VectorSource, h: np.ndarray) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
    """Each row's width (0 where its vector is NULL: final_norm off the residual stream) and,
    for each width, float32 [len(h), width] holding the rows of that width (zeros elsewhere):
    one call may pair rows of sites of different widths (a self-join across layers)."""
    widths = np.zeros(len(h), dtype=np.int64)
    parts: dict[int, torch.Tensor] = {}
    for g in src.groups(h):
        x = g.x
        w = int(x.shape[-1])
        if w not in parts:
            parts[w] = torch.zeros((len(h), w), dtype=x.dtype, device=src.device)
        parts[w][torch.from_numpy(g.index).to(src.device)] = x
        widths[g.index] = w
    return widths, parts


def cosine(src: VectorSource, h1: np.ndarray, h2: np.ndarray, out: np.ndarray) -> None:
    """Row by row; NULL where either vector is zero or NULL."""
    wa, xa = _by_width(src, h1)
    wb, xb = _by_width(src, h2)
    bad = np.nonzero((wa > 0) & (wb > 0) & (wa != wb))[0]
    if len(bad):
        i = int(bad[0])
        raise QueryError(
            f"cosine needs two vectors of the same width; got {wa[i]} and {wb[i]}")
    for w in sorted(set(xa) & set(xb)):
        rows = np.nonzero((wa == w) & (wb == w))[0]
        at = torch.from_numpy(rows).to(src.device)
        ua, oka = _unit(xa[w][at])
        ub, okb = _unit(xb[w][at])
        cos = row_dots(ua, ub).clamp(-1.0, 1.0)  # float32 rounding can pass 1
        out[rows] = torch.where(oka & okb, cos, torch.nan).double().cpu().numpy()


def angle(src: VectorSource, h1: np.ndarray, h2: np.ndarray, out: np.ndarray) -> None:
    cosine(src, h1, h2, out)
    out[:] = np.degrees(np.arccos(out))


# -- list kernels: fill a ListResults (lists.py) with Arrow blocks of rows ------------------


def nearest_anchors(src: VectorSource, h: np.ndarray, out: ListResults, k: Arg,
                    anchors: Arg) -> None:
    for g in _lm_groups(src, h):
        combos = _per_value([k, anchors], g.index)
        for _, a in combos:  # before any vector is read
            _require_anchor_width("nearest_anchors", src, g,
                                  src.weights.anchor_set(g.model, a or None))
        u, ok = _unit(g.x)
        tokens = src.tokens.token_column(g.model)
        for (kv, a), pos in combos.items():
            a_set = src.weights.anchors(g.model, a or None)
            kk = _check_k("nearest_anchors", kv, a_set.shape[0])
            topk_rows(u[pos], a_set, None, kk, g.index[pos], ok[pos], out, tokens, "cosine")


def top_logits(src: VectorSource, h: np.ndarray, out: ListResults, k: Arg) -> None:
    for g in _head_groups(src, h, "top_logits"):
        w, b = src.weights.unembed(g.model)
        _require_width("top_logits", g, w.shape[1], "the LM head's width")
        hn = _final_normed(src, g)
        tokens = src.tokens.token_column(g.model)
        for (kv,), pos in _per_value([k], g.index).items():
            kk = _check_k("top_logits", kv, w.shape[0])
            ok = torch.ones(len(pos), dtype=torch.bool, device=hn.device)
            topk_rows(hn[pos], w, b, kk, g.index[pos], ok, out, tokens, "logit", g.model)


def top_dims(src: VectorSource, h: np.ndarray, out: ListResults, k: Arg) -> None:
    for g in src.groups(h):
        combos = _per_value([k], g.index)
        for a, b, x in g.x_blocks():
            u, ok = _unit(x)
            for key, rows, at in _block_rows(combos, a, b):
                c, kk = u[rows], _check_k("top_dims", key[0], x.shape[-1])
                # ties (frequent among float16 directions) lower dim first, as top_logits
                # lists tokens: torch.topk leaves their order unspecified
                dims = torch.sort(c.abs(), dim=-1, descending=True, stable=True).indices[:, :kk]
                vals = torch.gather(c, 1, dims)
                out.put(g.index[at], struct_lists(kk, {
                    "dim": pa.array(dims.cpu().numpy().astype(np.int64).reshape(-1)),
                    "contribution": pa.array(vals.double().cpu().numpy().reshape(-1)),
                }, ok[rows].cpu().numpy()))


def to_list(src: VectorSource, h: np.ndarray, out: ListResults) -> None:
    for g in src.groups(h):
        for a, b, x in g.x_blocks():
            out.put(g.index[a:b], float_lists(x.cpu().numpy()))  # copied: x is a scratch


