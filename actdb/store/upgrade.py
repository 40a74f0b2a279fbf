"""The upgrade of a store of format 2, 3 or 4 to format 5: every chunk of committed data read
(its own checksum checked) and its digest recorded under its place, in one catalog
transaction with the new version. The digests say what the chunks hold at the upgrade: a
chunk moved before it is taken as it lies (its own checksum cannot tell), one moved after it is
damage. Run by the first writer that opens such a store (an ingest, a merge,
`connect(read_only=False)`); readers read older stores with their chunks' own checksums alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .arrays import ACT_FIELDS, write_alignment
from .digests import DIGESTS_VERSION, SCHEMA, Digest, chunk_digest, digests_table
from .layer_weights import manifest_arrays, read_manifest
from .records import ModelRecord, SiteRecord

if TYPE_CHECKING:
    from .arrays import Arrays
    from .catalog import Catalog


def to_digests(cat: Catalog, arrays: Arrays, version: int) -> int:
    """Upgrade a store of format `version`, open for writing, to format 5 where it is older
    (from 2, 3 or 4; a format-1 store has no checksums to start from and stays as it is);
    returns its format. A kill midway leaves the store as it was (the catalog's one
    transaction), or upgraded with its Zarr root's version still older, which the next
    writer sets."""
    if version < DIGESTS_VERSION:
        if version < 2:
            return version
        found: list[Digest] = []
        names: dict[int, str] = {}
        for m in cat.models():
            names[m.model_id] = m.model
            sites = cat.sites(m.model)
            found += weight_digests(arrays, m, sites)
            runs = [(int(a), int(n)) for a, n in cat.all(
                "SELECT row_start, n_tokens FROM prompt_runs WHERE model = ? AND n_tokens > 0 "
                "ORDER BY row_start", [m.model])]
            align = write_alignment(m.chunk_tokens, sharded=arrays.sharded)
            gaps, _ = unused_rows(runs, m.n_rows, align)
            found += act_digests(arrays, m, sites, 0, m.n_rows, gaps)
        table = digests_table(found, names)
        with cat.transaction():
            cat.con.execute(SCHEMA)
            cat.put_digests(table)
            cat.con.execute("UPDATE meta SET value = ? WHERE key = 'format_version'",
                            [str(DIGESTS_VERSION)])
        version = DIGESTS_VERSION
    if arrays.format_version() < version:
        arrays.set_format_version(version)
    return version


def weight_digests(arrays: Arrays, m: ModelRecord, sites: list[SiteRecord]) -> list[Digest]:
    """The digests of a model's weight chunks as stored, each chunk's checksum checked."""
    names = ["embed", "lm_head", "lm_head_bias", "projection"]
    names += [f"sites/{s.site}/{f}" for s in sites for f in ("gain", "bias")]
    names += manifest_arrays(read_manifest(arrays, m.model_id) or {})
    out = []
    for name in names:
        found = arrays.weight_blocks(m.model_id, name)
        if found is None:
            continue
        label = f"models/{m.model_id}/{name}"
        for i, (lo, block) in enumerate(found[1]):
            out.append(chunk_digest(label, i, lo, lo + block.shape[0], block, None))
    return out


def act_digests(arrays: Arrays, m: ModelRecord, sites: list[SiteRecord], lo: int, hi: int,
                gaps: list[tuple[int, int]]) -> list[Digest]:
    """The digests of the chunks of a model's vectors holding committed rows in [lo, hi),
    each chunk's checksum checked: a digest covers a chunk's rows up to `hi` or to the start
    of the unused rows (`gaps`) it holds, and chunks wholly unused are skipped."""
    out = []
    for s in sites:
        for field in ACT_FIELDS:
            info = arrays.act_info(m.model_id, s.site, field)
            c = info.chunks[0]
            label = f"models/{m.model_id}/acts/{s.site}/{field}"
            unused = {k for a, b in gaps for k in range(-(-a // c), b // c)}
            for chunk in range(lo // c, -(-hi // c)):
                if chunk in unused:
                    continue
                start = chunk * c
                end = min(start + c, hi)
                end = min([a for a, _ in gaps if start < a < end] + [end])
                values = arrays.read_chunk(m.model_id, s.site, field, chunk)
                out.append(chunk_digest(label, chunk, start, end, values, None))
    return out


def unused_rows(runs: list[tuple[int, int]], n_rows: int, align: int
                ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The rows below `n_rows` in no prompt run, as ranges [a, b): those a sharded ingest
    leaves between a shard's last row and the next shard's start (a multiple of `align`,
    less than `align` rows on), whose chunks may never have been written; and any other,
    which no ingest leaves (an unsharded store has none at all)."""
    allowed: list[tuple[int, int]] = []
    bad: list[tuple[int, int]] = []
    pos = 0
    for start, n in [*runs, (n_rows, 0)]:
        if start > pos:
            ok = start % align == 0 and start - pos < align
            (allowed if ok else bad).append((pos, start))
        pos = max(pos, start + n)
    return allowed, bad


__all__ = ["act_digests", "to_digests", "unused_rows", "weight_digests"]
