"""What two stores must share to be "the same": every catalog row a user can see (minus
creation times) and every stored field of every site, byte for byte."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import duckdb
import numpy as np
import zarr


def open_plain(store: Path | str, scratch: Path) -> tuple[Path, zarr.Group]:
    """The catalog file and the tensors group of a store, found without actdb: a local
    directory, or on S3 the pointer `catalog.json`, the catalog object it names (downloaded
    into `scratch` with boto3), and zarr's own ObjectStore over the tensors prefix."""
    if not str(store).startswith("s3://"):
        path = Path(store)
        return path / "catalog.duckdb", zarr.open_group(str(path / "tensors.zarr"), mode="r")
    import boto3
    from obstore.store import S3Store

    bucket, _, prefix = str(store)[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    pointer = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/catalog.json")
                         ["Body"].read())
    local = scratch / "catalog.duckdb"
    client.download_file(bucket, f"{prefix}/{pointer['catalog']}", str(local))
    objects = S3Store(bucket, prefix=f"{prefix}/tensors.zarr", client_options={
        "allow_http": True})
    return local, zarr.open_group(zarr.storage.ObjectStore(objects, read_only=True), mode="r")


def snapshot(store: Path | str, model: str) -> dict[str, object]:
    """Catalog rows and every stored field of every site, in row order (plain duckdb and
    zarr: the reference reads the store without actdb)."""
    with tempfile.TemporaryDirectory() as scratch:
        catalog, group = open_plain(store, Path(scratch))
        return _snapshot(catalog, group, model)


def _snapshot(catalog: Path, group: zarr.Group, model: str) -> dict[str, object]:
    con = duckdb.connect(str(catalog), read_only=True)
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
