"""What two stores must share to be "the same": every catalog row a user can see (minus
creation times) and every stored field of every site, byte for byte."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import zarr


def snapshot(store: Path, model: str) -> dict[str, object]:
    """Catalog rows and every stored field of every site, in row order (plain duckdb and
    zarr: the reference reads the store without actdb)."""
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    try:
        tokens = con.execute(
            "SELECT p.text, t.position, t.token_id, t.token, t.row FROM tokens t JOIN prompts p "
            "USING (prompt_id) WHERE t.model = ? ORDER BY t.row", [model]).fetchall()
        mid, n_rows = con.execute("SELECT model_id, n_rows FROM models WHERE model = ?",
                                  [model]).fetchone()
        models = con.execute("SELECT * EXCLUDE (created_at) FROM models ORDER BY model_id"
                             ).fetchall()
        site_rows = con.execute("SELECT * FROM sites WHERE model = ? ORDER BY site_id",
                                [model]).fetchall()
        sites = [r[0] for r in con.execute("SELECT site FROM sites WHERE model = ?",
                                           [model]).fetchall()]
        prompts = con.execute("SELECT * FROM prompts ORDER BY prompt_id").fetchall()
        runs = con.execute("SELECT * FROM prompt_runs ORDER BY model, prompt_id").fetchall()
        vocab = con.execute("SELECT count(*), sum(hash(token)) FROM vocab").fetchall()
    finally:
        con.close()
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    fields = {
        (s, f): np.asarray(group[f"models/{mid}/acts/{s}/{f}"][:n_rows])
        for s in sites for f in ("direction", "norm", "mean")
    }
    return {"tokens": tokens, "fields": fields, "prompts": prompts, "models": models,
            "sites": site_rows, "runs": runs, "vocab": vocab}


def assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    for key in ("tokens", "prompts", "models", "sites", "runs", "vocab"):
        assert a[key] == b[key], key
    fa, fb = a["fields"], b["fields"]
    assert isinstance(fa, dict) and isinstance(fb, dict) and fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=str(k))
