"""Check that a store's catalog and tensors agree; list every problem found.

The quick check is structural: catalog counts, array shapes and types, and every chunk
holding committed rows present with its exact size. `full` also reads every such chunk and
every weight, checking their checksums (format 2)."""

from __future__ import annotations

import numpy as np

from ..errors import StoreCorruptError
from .arrays import ACT_FIELDS
from .records import ModelRecord, SiteRecord
from .store import Store


def verify(store: Store, *, full: bool = False) -> list[str]:
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
        problems += _check_weights(store, m, sites, where, full=full)
        for s in sites:
            problems += _check_site(store, m, s, where, full=full)
    return problems


def _check_weights(store: Store, m: ModelRecord, sites: list[SiteRecord], where: str, *,
                   full: bool) -> list[str]:
    """Every weight the catalog says the model has: present, whole, (`full`) checksummed."""
    if not store.arrays.has_model(m.model_id):
        return [f"{where}: no weights in the tensors (models/{m.model_id} is missing)"]
    wanted = [("embed", True),
              ("lm_head", m.has_lm_head and not m.tied_embeddings),
              ("lm_head_bias", m.has_lm_head_bias)]
    for s in sites:
        wanted += [(f"sites/{s.site}/gain", s.has_gain), (f"sites/{s.site}/bias", s.has_bias)]
    out = []
    for name, required in wanted:
        if not required:
            continue
        try:
            store.arrays.check_weight(m.model_id, name, required=True, full=full)
        except StoreCorruptError as e:
            out.append(f"{where}: {e}")
    return out


def _check_site(store: Store, m: ModelRecord, s: SiteRecord, where: str, *, full: bool
                ) -> list[str]:
    out = []
    here = f"{where}, site {s.site!r}"
    inner = (s.n_heads, s.d) if s.n_heads else (s.d,)
    shapes = {"direction": (inner, "float16"), "norm": (inner[:-1], "float32"),
              "mean": (inner[:-1], "float32")}
    for field in ACT_FIELDS:
        tail, dtype = shapes[field]
        try:
            arr = store.arrays.act_array(m.model_id, s.site, field)
        except StoreCorruptError as e:
            if m.n_rows:
                out.append(f"{here}: {e}")
            continue
        if arr.shape[0] < m.n_rows or tuple(arr.shape[1:]) != tuple(tail):
            out.append(
                f"{here}: {field} has shape {arr.shape}, expected at least "
                f"({m.n_rows}, {', '.join(map(str, tail))})"
            )
        if str(arr.dtype) != dtype:
            out.append(f"{here}: {field} is {arr.dtype}, expected {dtype}")
    if out or not m.n_rows:
        return out
    # Every chunk holding committed rows: present and whole, or (full) read and checksummed.
    for field in ACT_FIELDS:
        arr = store.arrays.act_array(m.model_id, s.site, field)
        raw = store.arrays.act_layout(m.model_id, s.site, field)
        for chunk in range(-(-m.n_rows // arr.chunks[0])):
            try:
                if full or raw is None:
                    store.arrays.read_chunk(m.model_id, s.site, field, chunk)
                else:
                    raw.stat(chunk)
            except StoreCorruptError as e:
                out.append(f"{here}: {e}")
                break  # one damaged chunk per array is enough to say
    if out:
        return out
    # Spot-check the last committed rows: unit directions where the norm is positive.
    lo = max(0, m.n_rows - 64)
    d = _rows(store, m, s, "direction", lo).astype(np.float32)
    n = _rows(store, m, s, "norm", lo)
    lengths = np.linalg.norm(d, axis=-1)
    bad = ((n > 0) & (np.abs(lengths - 1) > 1e-2)) | ~np.isfinite(n)
    if bad.any():
        out.append(f"{here}: stored directions near row {lo} are not unit")
    return out


def _rows(store: Store, m: ModelRecord, s: SiteRecord, field: str, lo: int) -> np.ndarray:
    """Committed rows lo..n_rows of a field, through the checked chunk reader."""
    c = store.arrays.act_array(m.model_id, s.site, field).chunks[0]
    parts = [store.arrays.read_chunk(m.model_id, s.site, field, i)
             for i in range(lo // c, (m.n_rows - 1) // c + 1)]
    joined = np.concatenate(parts)
    start = lo - (lo // c) * c
    return joined[start : start + m.n_rows - lo]
