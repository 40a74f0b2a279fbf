"""Check that a store's catalog and tensors agree; list every problem found."""

from __future__ import annotations

import numpy as np

from .records import SiteRecord
from .store import Store


def verify(store: Store) -> list[str]:
    """Problems found, one sentence each; an empty list means the store is consistent."""
    problems: list[str] = []
    cat = store.catalog
    for m in store.catalog.models():
        where = f"model {m.model!r}"
        sites = store.catalog.sites(m.model)
        if len(sites) != m.n_sites:
            problems.append(f"{where}: catalog lists {len(sites)} sites, models says {m.n_sites}")
        n_tokens, lo, hi, distinct = cat.one(
            'SELECT count(*), min("row"), max("row"), count(DISTINCT "row") FROM tokens '
            "WHERE model = ?", [m.model],
        ) or (0, None, None, 0)
        if n_tokens != m.n_rows or (n_tokens and (lo != 0 or hi != m.n_rows - 1
                                                   or distinct != n_tokens)):
            problems.append(
                f"{where}: token rows are not exactly 0..{m.n_rows - 1} "
                f"({n_tokens} rows, min {lo}, max {hi}, {distinct} distinct)"
            )
        run_tokens = cat.one(
            "SELECT coalesce(sum(n_tokens), 0) FROM prompt_runs WHERE model = ?", [m.model]
        )
        if run_tokens and int(run_tokens[0]) != m.n_rows:
            problems.append(f"{where}: prompt runs hold {run_tokens[0]} tokens, not {m.n_rows}")
        orphans = cat.one(
            "SELECT count(*) FROM prompt_runs r ANTI JOIN prompts p USING (prompt_id) "
            "WHERE r.model = ?", [m.model],
        )
        if orphans and orphans[0]:
            problems.append(f"{where}: {orphans[0]} prompt runs refer to no prompt")
        problems += _check_weights(store, m.model_id, m.has_lm_head, m.tied_embeddings, where)
        for s in sites:
            problems += _check_site(store, m.model_id, m.n_rows, s, where)
    return problems


def _check_weights(
    store: Store, model_id: int, has_head: bool, tied: bool, where: str
) -> list[str]:
    out = []
    if not store.arrays.has_model(model_id):
        return [f"{where}: no weights in the tensors (models/{model_id} is missing)"]
    if store.arrays.weight(model_id, "embed") is None:
        out.append(f"{where}: input embeddings are missing")
    if has_head and not tied and store.arrays.weight(model_id, "lm_head") is None:
        out.append(f"{where}: LM head is missing")
    return out


def _check_site(store: Store, model_id: int, n_rows: int, s: SiteRecord, where: str
                ) -> list[str]:
    out = []
    inner = (s.n_heads, s.d) if s.n_heads else (s.d,)
    arrays = {}
    for field, tail, dtype in (("direction", inner, "float16"), ("norm", inner[:-1], "float32"),
                               ("mean", inner[:-1], "float32")):
        try:
            arr = store.arrays.act_array(model_id, s.site, field)
        except KeyError:
            if n_rows:
                out.append(f"{where}, site {s.site!r}: array {field!r} is missing")
            continue
        if arr.shape[0] < n_rows or tuple(arr.shape[1:]) != tuple(tail):
            out.append(
                f"{where}, site {s.site!r}: {field} has shape {arr.shape}, expected at least "
                f"({n_rows}, {', '.join(map(str, tail))})"
            )
        if str(arr.dtype) != dtype:
            out.append(f"{where}, site {s.site!r}: {field} is {arr.dtype}, expected {dtype}")
        arrays[field] = arr
    if out or not n_rows:
        return out
    # Every chunk holding committed rows must exist on disk (a missing one reads as zeros).
    for field, arr in arrays.items():
        chunks_needed = (n_rows + arr.chunks[0] - 1) // arr.chunks[0]
        folder = store.arrays.path / "models" / str(model_id) / "acts" / s.site / field / "c"
        tail_key = "/0" * (arr.ndim - 1)
        missing = [i for i in range(chunks_needed) if not (folder / f"{i}{tail_key}").is_file()]
        if missing:
            out.append(
                f"{where}, site {s.site!r}: {field} chunks {missing[:5]} holding committed rows "
                "are missing on disk"
            )
    if out:
        return out
    # Spot-check the last committed rows: unit directions where the norm is positive.
    lo = max(0, n_rows - 64)
    d = np.asarray(arrays["direction"][lo:n_rows], dtype=np.float32)
    n = np.asarray(arrays["norm"][lo:n_rows], dtype=np.float32)
    lengths = np.linalg.norm(d, axis=-1)
    bad = ((n > 0) & (np.abs(lengths - 1) > 1e-2)) | ~np.isfinite(n)
    if bad.any():
        out.append(f"{where}, site {s.site!r}: stored directions near row {lo} are not unit")
    return out
