"""The materialized lens through a stopped-and-resumed ingest and a sharded one: the lens of
each (prompt, position, site) is the one a single uninterrupted ingest stores, and the stores
verify (its arrays are written in the same commits as the rows they describe)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest
import zarr
from support.prompts import PROMPTS

import actdb

pytestmark = pytest.mark.slow

FIELDS = ("lens_ids", "lens_logits", "lens_stats")


def _ingest(store: Path, model: Path, prompts: list[str], **kw: object) -> None:
    actdb.ingest(store, model=str(model), prompts=prompts, batch_size=2, device="cpu",
                 name="m", chunk_tokens=4, lens=3, **kw)  # type: ignore[arg-type]


def _lens(store: Path) -> dict[tuple[str, int, str], np.ndarray]:
    """Each (prompt text, position, site)'s stored lens, read with plain DuckDB and zarr."""
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    rows = con.execute("SELECT p.text, t.position, t.row FROM tokens t JOIN prompts p "
                       "USING (prompt_id)").fetchall()
    sites = [r[0] for r in con.execute("SELECT site FROM sites").fetchall()]
    con.close()
    g = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    out = {}
    for site in sites:
        arrays = [np.asarray(g[f"models/0/acts/{site}/{f}"][:]) for f in FIELDS]
        for text, pos, row in rows:
            out[(text, pos, site)] = np.concatenate([a[row].astype(np.float64) for a in arrays])
    return out


def test_resumed_and_sharded_ingests_store_the_same_lens(
        tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    model = model_dir("gpt2")
    single = tmp_path / "single.actdb"
    _ingest(single, model, PROMPTS)
    want = _lens(single)
    resumed = tmp_path / "resumed.actdb"
    _ingest(resumed, model, PROMPTS[:5])  # stopped after 5 prompts, then run again
    _ingest(resumed, model, PROMPTS)
    sharded = tmp_path / "sharded.actdb"
    for i in range(2):
        _ingest(sharded, model, PROMPTS, shard=(i, 2))
    actdb.merge(sharded)
    for store in (resumed, sharded):
        with actdb.connect(store) as db:
            assert db.verify(full=True) == []
            assert db.sql("SELECT lens_k FROM models").fetchall() == [(3,)]
        got = _lens(store)
        assert got.keys() == want.keys()
        for key, value in want.items():
            # one row's lens does not depend on its batch-mates: bitwise where the rows'
            # stored fields are (float32 products over another batch may round apart)
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6,
                                       err_msg=str(key))
