"""Check that a store's catalog and tensors agree; list every problem found.

The quick check is structural: catalog counts, array shapes and types, and every chunk
below the model's row count present with its exact size, but for the unused rows a sharded
ingest leaves before each shard's aligned start (and nowhere else). `full` also reads every
such chunk and every weight, checking their checksums (format 2)."""

from __future__ import annotations

import json

import numpy as np

from ..errors import StoreCorruptError
from .arrays import ACT_FIELDS, write_alignment
from .attention import array_name as attention_array
from .attention import stored_prompts as attention_prompts
from .layer_weights import manifest_arrays, read_manifest
from .lens_layout import LENS_FIELDS, is_lens_site, lens_shapes
from .records import ModelRecord, SiteRecord
from .store import Store
from .upgrade import unused_rows

# Damaged chunks listed per array before verify moves on to the next one.
_DAMAGED_PER_ARRAY = 4


def verify(store: Store, *, full: bool = False) -> list[str]:
    """Problems found, one sentence each; an empty list means the store is consistent."""
    problems: list[str] = []
    cat = store.catalog
    models = store.catalog.models()
    for group in ("", "models") if models else ("",):
        try:
            store.arrays.check_group(group)
        except StoreCorruptError as e:
            problems.append(str(e))
    if problems:
        return problems  # nothing below can be read
    for m in models:
        where = f"model {m.model!r}"
        sites = store.catalog.sites(m.model)
        metadata = _check_metadata(store, m, sites, where, full=full)
        if metadata:
            problems += metadata
            continue
        if len(sites) != m.n_sites:
            problems.append(f"{where}: catalog lists {len(sites)} sites, models says {m.n_sites}")
        n_tokens, lo, hi, distinct = cat.one(
            'SELECT count(*), min("row"), max("row"), count(DISTINCT "row") FROM tokens '
            "WHERE model = ?", [m.model],
        ) or (0, None, None, 0)
        # Rows are 0..n_rows - 1 but for the unused rows a sharded ingest leaves between its
        # shards (each shard starts on a whole chunk): distinct, in range, as the runs say.
        if n_tokens and (lo < 0 or hi >= m.n_rows or distinct != n_tokens):
            problems.append(
                f"{where}: token rows are not distinct rows within 0..{m.n_rows - 1} "
                f"({n_tokens} rows, min {lo}, max {hi}, {distinct} distinct)"
            )
        run_tokens = cat.one(
            "SELECT coalesce(sum(n_tokens), 0) FROM prompt_runs WHERE model = ?", [m.model]
        )
        if run_tokens and int(run_tokens[0]) != n_tokens:
            problems.append(f"{where}: prompt runs hold {run_tokens[0]} tokens, the tokens "
                            f"table {n_tokens}")
        outside = cat.one(
            'SELECT count(*) FROM tokens t JOIN prompt_runs r USING (model, prompt_id) '
            'WHERE t.model = ? AND t."row" <> r.row_start + t.position'
            + (' AND r.tower IS NOT DISTINCT FROM t.tower' if m.row_towers else ''), [m.model])
        if outside and outside[0]:
            problems.append(f"{where}: {outside[0]} token rows lie outside their prompt's run")
        orphans = cat.one(
            "SELECT count(*) FROM prompt_runs r ANTI JOIN prompts p USING (prompt_id) "
            "WHERE r.model = ?", [m.model],
        )
        if orphans and orphans[0]:
            problems.append(f"{where}: {orphans[0]} prompt runs refer to no prompt")
        problems += _check_weights(store, m, sites, where, full=full)
        runs = [(int(a), int(n)) for a, n in cat.all(
            "SELECT row_start, n_tokens FROM prompt_runs WHERE model = ? AND n_tokens > 0 "
            "ORDER BY row_start", [m.model])]
        align = write_alignment(m.chunk_tokens, sharded=store.arrays.sharded)
        gaps, bad = unused_rows(runs, m.n_rows, align)
        problems += [f"{where}: rows {a}..{b - 1} are in no prompt's run and are not the "
                     f"unused rows before a shard's aligned start (every {align} rows)"
                     for a, b in bad]
        for s in sites:
            problems += _check_site(store, m, s, where, gaps, full=full)
    return problems


def _check_metadata(store: Store, m: ModelRecord, sites: list[SiteRecord], where: str, *,
                    full: bool) -> list[str]:
    """The model's group metadata (its own, its `sites` and `acts` groups and theirs: the
    arrays' own are read with them below), and its saved tokenizer: the folder is there, its
    JSON files parse, and (`full`) it loads and gives each token id the piece the catalog
    recorded for it."""
    groups = [f"models/{m.model_id}"]
    with_params = [s for s in sites if s.has_gain or s.has_bias]
    if with_params:
        groups += [f"models/{m.model_id}/sites"]
        groups += [f"models/{m.model_id}/sites/{s.site}" for s in with_params]
    if m.n_rows:
        groups += [f"models/{m.model_id}/acts"]
        groups += [f"models/{m.model_id}/acts/{s.site}" for s in sites]
    out = []
    for group in groups:
        try:
            store.arrays.check_group(group)
        except StoreCorruptError as e:
            out.append(f"{where}: {e}")
    out += _check_tokenizer(store, m, where, full=full)
    return out


def _check_tokenizer(store: Store, m: ModelRecord, where: str, *, full: bool) -> list[str]:
    folder = store.tokenizer_dir(m.model_id)
    if not folder.is_dir():
        if m.has_embed is False:  # a model of images alone may come without a tokenizer
            return []
        return [f"{where}: its tokenizer ({str(folder)!r}) is missing: the store is damaged"]
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if not any(p.name == "tokenizer_config.json" for p in files):
        return [f"{where}: its tokenizer has no tokenizer_config.json ({str(folder)!r}): the "
                "store is damaged"]
    for p in files:
        if p.suffix == ".json":
            try:
                json.loads(p.read_bytes())
            except ValueError as e:
                return [f"{where}: the tokenizer file {str(p)!r} cannot be read "
                        f"({_first_line(e)}): the store is damaged"]
    if not full:
        return []
    from transformers import AutoTokenizer  # transformers' own loader, as queries load it

    try:  # a store's folder may come from anyone: its code never runs
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            return []  # one only its own code loads: queries resolve tokens by `vocab`
        return [f"{where}: its tokenizer in {str(folder)!r} does not load "
                f"({_first_line(e)}): the store is damaged"]
    except Exception as e:  # noqa: BLE001 - any failure to load is damage, said in a sentence
        return [f"{where}: its tokenizer in {str(folder)!r} does not load "
                f"({_first_line(e)}): the store is damaged"]
    if m.head_kind not in (None, "lm"):
        return []  # the vocabulary is a classifier's labels, not the tokenizer's pieces
    pieces = store.catalog.all("SELECT token_id, piece FROM vocab WHERE model = ? AND "
                               "token_id < ? ORDER BY token_id", [m.model, len(tok)])
    got = tok.convert_ids_to_tokens([int(i) for i, _ in pieces])
    wrong = [int(i) for (i, want), have in zip(pieces, got, strict=True)
             if want is not None and want != str(have)]
    if wrong:
        return [f"{where}: its tokenizer in {str(folder)!r} gives {len(wrong)} token ids "
                f"(first {wrong[0]}) another piece than the catalog's vocab: the store is "
                "damaged"]
    return []


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_weights(store: Store, m: ModelRecord, sites: list[SiteRecord], where: str, *,
                   full: bool) -> list[str]:
    """Every weight the catalog says the model has: present, whole, (`full`) checksummed."""
    if not store.arrays.has_model(m.model_id):
        return [f"{where}: no weights in the tensors (models/{m.model_id} is missing)"]
    wanted = [("embed", m.has_embed is not False),  # an image model has no token embedding
              ("lm_head", m.has_lm_head and not m.tied_embeddings),
              ("lm_head_bias", m.has_lm_head_bias),
              # a contrastive model's projection, where its labels lens reads the class token
              ("projection", m.head_kind == "labels" and m.head_position is not None)]
    for s in sites:
        wanted += [(f"sites/{s.site}/gain", s.has_gain), (f"sites/{s.site}/bias", s.has_bias)]
    manifest = read_manifest(store.arrays, m.model_id)
    wanted += [(name, True) for name in manifest_arrays(manifest or {})]
    if store.has_digests:  # each prompt's attention weights (--attention) its commit recorded
        wanted += [(attention_array(pid), True) for model, pid in attention_prompts(
            lambda sql, params: store.catalog.all(sql, params)) if model == m.model]
    out = []
    for name, required in wanted:
        if not required:
            continue
        try:
            store.arrays.check_weight(m.model_id, name, required=True, full=full)
        except StoreCorruptError as e:
            out.append(f"{where}: {e}")
    return out


def _check_site(store: Store, m: ModelRecord, s: SiteRecord, where: str,
                gaps: list[tuple[int, int]], *, full: bool) -> list[str]:
    out = []
    here = f"{where}, site {s.site!r}"
    inner = (s.n_heads, s.d) if s.n_heads else (s.d,)
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "direction": (inner, "float16"), "norm": (inner[:-1], "float32"),
        "mean": (inner[:-1], "float32")}
    fields: tuple[str, ...] = ACT_FIELDS
    if is_lens_site(m, s):
        shapes.update(lens_shapes(m.lens_k or 0))
        fields = (*ACT_FIELDS, *LENS_FIELDS)
    for field in fields:
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
    # Every chunk below n_rows but those wholly in the unused rows between shards (never
    # written, maybe absent): present and whole, or (full) read and checksummed.
    for field in fields:
        arr = store.arrays.act_array(m.model_id, s.site, field)
        raw = store.arrays.act_layout(m.model_id, s.site, field)
        c = arr.chunks[0]
        unused = {k for a, b in gaps for k in range(-(-a // c), b // c)}
        damaged = 0
        for chunk in range(-(-m.n_rows // c)):
            if chunk in unused:
                continue
            try:
                if full or raw is None:
                    store.arrays.read_chunk(m.model_id, s.site, field, chunk)
                else:
                    raw.stat(chunk)
            except StoreCorruptError as e:
                out.append(f"{here}: {e}")
                damaged += 1
                if damaged == _DAMAGED_PER_ARRAY:
                    break  # a few are enough to say, and to name both ends of a moved chunk
    if out:
        return out
    # Spot-check the last committed rows: unit directions where the norm is positive.
    hi = gaps[-1][0] if gaps and gaps[-1][1] == m.n_rows else m.n_rows
    lo = max([b for _, b in gaps if b <= hi] + [0, hi - 64])
    if hi <= lo:
        return out
    d = _rows(store, m, s, "direction", lo, hi).astype(np.float32)
    n = _rows(store, m, s, "norm", lo, hi)
    lengths = np.linalg.norm(d, axis=-1)
    bad = ((n > 0) & (np.abs(lengths - 1) > 1e-2)) | ~np.isfinite(n)
    if bad.any():
        out.append(f"{here}: stored directions near row {lo} are not unit")
    return out


def _rows(store: Store, m: ModelRecord, s: SiteRecord, field: str, lo: int, hi: int
          ) -> np.ndarray:
    """Committed rows lo..hi of a field, through the checked chunk reader."""
    c = store.arrays.act_array(m.model_id, s.site, field).chunks[0]
    parts = [store.arrays.read_chunk(m.model_id, s.site, field, i)
             for i in range(lo // c, (hi - 1) // c + 1)]
    joined = np.concatenate(parts)
    start = lo - (lo // c) * c
    return joined[start : start + hi - lo]
