"""How much one store may hold: the bit budget of the query layer's `vec` handles.

A handle's fields word (docs/FORMAT.md, "Handles"; its other 64 bits are an authentication
code) holds 38 bits of token row, 20 bits naming a (model, site, head) stream of the store, 3
bits of view and a tag bit. The
limits live here, beside the catalog that enforces them at ingest, so that a store can never
grow past what a handle addresses; the query layer packs its handles with the same numbers.
"""

from __future__ import annotations

from ..errors import IngestError

ROW_BITS = 38
STREAM_BITS = 20
MAX_ROWS = 1 << ROW_BITS  # token rows per model: 2.7e11
MAX_STREAMS = 1 << STREAM_BITS  # (model, site, head) triples per store: 1,048,576


def check_streams(existing: int, new: int, model: str) -> None:
    """Refuse a model whose sites (one stream per head at q/k-norm sites) would take the store
    past MAX_STREAMS."""
    if existing + new > MAX_STREAMS:
        raise IngestError(
            f"model {model!r} would bring the store to {existing + new} (model, site, head) "
            f"streams, more than the {MAX_STREAMS} a vec handle can name; put it in a new store "
            "or select fewer sites with --sites"
        )


def check_rows(n_rows: int, model: str) -> None:
    """Refuse to commit token rows past MAX_ROWS for one model."""
    if n_rows > MAX_ROWS:
        raise IngestError(
            f"model {model!r} would hold {n_rows} token rows, more than the {MAX_ROWS} a vec "
            "handle can address; ingest further prompts under another --name or into a new store"
        )
