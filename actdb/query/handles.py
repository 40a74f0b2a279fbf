"""`vec` handles: one BIGINT naming a stored vector (stream, row) and a view of it.

Bits, low to high (docs/FORMAT.md, "Handles"):
    0-37   row: the token row in the model's arrays (store/limits.py: ROW_BITS)
    38-57  stream: a (model, site, head) triple of the store (store/limits.py: STREAM_BITS),
           numbered 0, 1, ... in (model_id, site_id, head) order when the store is opened,
           plus the store's salt (modulo 2^20): a number drawn from the store's models, so
           that a handle of another store opened in the same process names no stream here
    58-59  view: raw, normalized, normed, final_norm
    60-62  tag 0b101; bit 63 (the sign) is 0
A handle is a plain integer in SQL, so DuckDB joins, filters and sorts rows that carry one
without touching a vector; vectors are read only when a tensor function receives the handle.
The tag makes any ordinary integer (a position, a token id, a count) fail to decode, and every
field is checked against the store, so a value that is not a handle of this store is an error.
Handles are computed by the `acts` view, never stored: they are valid for the session only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..errors import QueryError
from ..store.limits import MAX_STREAMS, ROW_BITS, STREAM_BITS

STREAM_SHIFT = ROW_BITS
VIEW_SHIFT = STREAM_SHIFT + STREAM_BITS
TAG_SHIFT = VIEW_SHIFT + 2
TAG = 0b101
TAG_BITS = TAG << TAG_SHIFT
ROW_MASK = (1 << ROW_BITS) - 1
STREAM_MASK = (1 << STREAM_BITS) - 1

VIEWS = ("raw", "normalized", "normed", "final_norm")

_ADVICE = "pass the vec column of acts, or a view of it such as normed(vec)"


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One (model, site, head) of the store; head is -1 at sites without heads."""

    model_id: int
    site_id: int
    head: int
    n_rows: int  # the model's committed token rows


@dataclass(frozen=True)
class Decoded:
    row: np.ndarray  # int64 [n]
    head: np.ndarray  # int64 [n], -1 where the site has no heads
    site_id: np.ndarray
    model_id: np.ndarray
    view: np.ndarray
    one: bool = False  # every handle of one stream and view


class Codec:
    """The store's streams, numbered: turns handles into (model, site, head, row, view) and
    refuses any value that is not a handle of this store."""

    def __init__(self, streams: Iterable[Stream], salt: int = 0) -> None:
        ordered = sorted(streams, key=lambda s: (s.model_id, s.site_id, s.head))
        if len(ordered) > MAX_STREAMS:
            raise QueryError(f"the store holds {len(ordered)} (model, site, head) streams, more "
                             f"than the {MAX_STREAMS} a vec handle can name")
        self.streams = ordered
        self._model = np.array([s.model_id for s in ordered], dtype=np.int64)
        self._site = np.array([s.site_id for s in ordered], dtype=np.int64)
        self._head = np.array([s.head for s in ordered], dtype=np.int64)
        self._rows = np.array([s.n_rows for s in ordered], dtype=np.int64)
        self.salt = salt & STREAM_MASK

    def code(self, index: int) -> int:
        """The stream bits that handles of stream `index` carry."""
        return (index + self.salt) & STREAM_MASK

    def stream(self, bits: int) -> Stream:
        """The stream named by a handle shifted right by STREAM_SHIFT (view and tag bits are
        ignored); the handle must have been decoded (checked) already."""
        return self.streams[((bits & STREAM_MASK) - self.salt) & STREAM_MASK]

    def decode(self, h: np.ndarray) -> Decoded:
        """Fields of a batch of handles; a QueryError naming the first value that is not one.
        A batch of one stream and view (every bulk window, most calls) is checked through
        its first handle and its largest row: a third of the work over the batch."""
        h = np.asarray(h).astype(np.int64, copy=False)
        if len(h) > 1:
            top = h >> STREAM_SHIFT  # the stream, view and tag bits, and the sign
            if (top == top[0]).all():
                one = self.decode(h[:1])
                row = h & ROW_MASK
                if int(row.max()) < int(self._rows[
                        ((int(top[0]) - self.salt) & STREAM_MASK)]):
                    def same(a: np.ndarray) -> np.ndarray:  # read-only, nothing copied
                        return np.broadcast_to(a[:1], h.shape)

                    return Decoded(row=row, head=same(one.head), site_id=same(one.site_id),
                                   model_id=same(one.model_id), view=same(one.view), one=True)
        stream = ((h >> STREAM_SHIFT) - self.salt) & STREAM_MASK
        row = h & ROW_MASK
        bad_tag = (h >> TAG_SHIFT) != TAG  # also every negative value
        known = stream < len(self.streams)
        safe = np.where(known & ~bad_tag, stream, 0)
        past = known & (row >= self._rows[safe] if len(self.streams) else True)
        bad = bad_tag | ~known | past
        if bad.any():
            i = int(np.argmax(bad))
            raise QueryError(self._why(int(h[i]), bool(bad_tag[i]), bool(known[i]), int(row[i])))
        return Decoded(row=row, head=self._head[stream], site_id=self._site[stream],
                       model_id=self._model[stream], view=(h >> VIEW_SHIFT) & 3)

    def _why(self, value: int, bad_tag: bool, known: bool, row: int) -> str:
        if bad_tag:
            # A plain integer given to a view has the view's bits added: show what was given.
            shown = value & ~(3 << VIEW_SHIFT) if value >= 0 else value
            return (f"{shown} is not a vec handle of this store (a plain number, not a value of "
                    f"acts.vec); {_ADVICE}")
        if not known:
            return (f"{value} is not a vec handle of this store: it names no model, site and "
                    f"head of the store (a handle of another store, or changed by arithmetic); "
                    f"{_ADVICE}")
        stream = self.stream(value >> STREAM_SHIFT)
        return (f"{value} is not a vec handle of this store: row {row} is past the "
                f"{stream.n_rows} rows stored for its model; {_ADVICE}")


def unused_row(value: int, row: int) -> QueryError:
    """A handle of a row below the model's row count that no token was stored in."""
    return QueryError(f"{value} is not a vec handle of this store: row {row} holds no stored "
                      f"token (it is one of the unused rows between the shards of a sharded "
                      f"ingest); {_ADVICE}")


def encode_sql(row: str, stream: str) -> str:
    """The SQL expression that builds a raw handle from column expressions."""
    return f"({row}::BIGINT | ({stream}::BIGINT << {STREAM_SHIFT}) | {TAG_BITS}::BIGINT)"


def view_sql(handle: str, view: str) -> str:
    """SQL turning a raw handle into a view of it; a handle that already is a view is an error.
    A value that is no handle passes through here and is refused when it is decoded."""
    code = VIEWS.index(view)
    return (
        f"CASE WHEN ({handle} >> {TAG_SHIFT}) = {TAG} AND ({handle} >> {VIEW_SHIFT}) & 3 <> 0 "
        f"THEN error('{view}() takes a raw vec, not a view of one') "
        f"ELSE {handle} | ({code}::BIGINT << {VIEW_SHIFT}) END"
    )
