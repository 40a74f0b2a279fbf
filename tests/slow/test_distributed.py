"""Queries on a Dask cluster: every split rule gives the single-process answer and the NumPy
reference; what does not split runs in one process and is still right."""

from __future__ import annotations

import csv
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
import sqlglot
import zarr
from support.prompts import PROMPTS

import actdb
from actdb.query.distributed import partitions
from actdb.query.split import Unsplittable, split

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None, silence_logs=logging.ERROR)
    c = Client(cluster)
    yield c
    c.close()
    cluster.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, model_dir: Callable[[str], Path]) -> Path:
    """Two models (one with per-head q/k norms), 8-row chunks: several partitions each."""
    path = tmp_path_factory.mktemp("dist") / "s.actdb"
    for family in ("gpt2", "qwen3"):
        actdb.ingest(path, model=str(model_dir(family)), prompts=PROMPTS, batch_size=4,
                     device="cpu", name=family, chunk_tokens=8)
    return path


@pytest.fixture(scope="module")
def dbs(store: Path, client: Any) -> Iterator[tuple[actdb.Database, actdb.Database]]:
    with actdb.connect(store, device="cpu") as local, \
            actdb.connect(store, device="cpu", cluster=client) as dist:
        yield local, dist


def _same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> None:
    """Equal row for row; floats to float64 rounding (partial sums add in another order)."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert len(ra) == len(rb)
        for x, y in zip(ra, rb, strict=True):
            if isinstance(x, float) and isinstance(y, float):
                assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12), (ra, rb)
            else:
                assert x == y, (ra, rb)


def _rows(db: actdb.Database, result: Any) -> list[tuple[Any, ...]]:
    """The result's rows, a `vec` column as its vectors: each connection's handles are its
    own numbers (handles.py), and the ones a cluster's workers return open on their
    coordinator, which reads their vectors."""
    table = result.to_arrow_table()
    columns = [c.to_pylist() for c in table.columns]
    if "vec" in table.column_names:
        col = table.column("vec")  # one row at a time: sites of several widths
        columns[table.column_names.index("vec")] = [
            tuple(db._gather(col.slice(i, 1), "vec").numpy()[0].tolist())
            for i in range(len(col))]
    return list(zip(*columns, strict=True))


def _reference(store: Path) -> list[dict[str, Any]]:
    """Every acts row's keys and stored fields, read with plain duckdb and zarr (float64)."""
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    rows: list[dict[str, Any]] = []
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    models = con.execute("SELECT model, model_id, n_rows FROM models").fetchall()
    for model, mid, n in models:
        tokens = con.execute('SELECT "row", prompt_id, position FROM tokens WHERE model = ?',
                             [model]).fetchall()
        for site, layer, heads in con.execute(
                "SELECT site, layer, n_heads FROM sites WHERE model = ?", [model]).fetchall():
            arrays = group[f"models/{mid}/acts/{site}"]
            norm = np.asarray(arrays["norm"][:n], dtype=np.float64)
            direction = np.asarray(arrays["direction"][:n], dtype=np.float64)
            for r, pid, pos in tokens:
                for h in range(heads or 1):
                    rows.append({"model": model, "site": site, "layer": layer,
                                 "head": h if heads else None, "prompt_id": pid,
                                 "position": pos,
                                 "norm": norm[r, h] if heads else norm[r],
                                 "d0": direction[r, h, 0] if heads else direction[r, 0]})
    con.close()
    return rows


# (query, rows compared in order) that must split
SPLIT = [
    ("SELECT count(*) AS n, sum(norm) AS s FROM acts", True),
    ("SELECT model, layer, count(*) AS n, sum(norm), avg(norm) AS a, min(norm), max(norm) "
     "FROM acts GROUP BY model, layer ORDER BY model, layer", True),
    ("SELECT role, avg(dim_contribution(vec, 0)) AS d, count(*) FILTER (WHERE position > 2) "
     "FROM acts WHERE layer >= 0 GROUP BY role HAVING count(*) > 10 ORDER BY d DESC", True),
    ("SELECT layer % 2 AS parity, max(cosine_to_anchor(vec, 5)) - min(norm) AS x FROM acts "
     "WHERE role <> 'k_norm' GROUP BY layer % 2 ORDER BY 1 LIMIT 1 OFFSET 1", True),
    ("SELECT model, prompt_id, position, site, head, norm FROM acts "
     "ORDER BY norm DESC, model, site, prompt_id, position, head LIMIT 7", True),
    ("SELECT model, prompt_id, position, site, head FROM acts WHERE prompt_id = $p "
     "ORDER BY uniform_angle(vec), model, site, position, head LIMIT 5 OFFSET 2", True),
    ("SELECT model, prompt_id, position, site, head FROM acts "
     "ORDER BY model, prompt_id, position, site, head LIMIT 3 OFFSET 6", True),
    ("SELECT 1 AS one FROM acts ORDER BY count(*)", True),
    ("SELECT model, site, head, position, vec FROM acts WHERE position < 2", False),
    ("SELECT * FROM acts WHERE position = 0 ORDER BY 1, 2, 3, 6, 9", True),
]

LOCAL = [
    ("SELECT count(DISTINCT token) FROM acts", "COUNT(DISTINCT"),
    ("SELECT median(norm) FROM acts", "MEDIAN"),
    ("SELECT model, site, norm - avg(norm) OVER (PARTITION BY site) AS c FROM acts "
     "ORDER BY c DESC, model, site LIMIT 3", "window"),
    ("SELECT a.layer, count(*) FROM acts a JOIN acts b ON a.prompt_id = b.prompt_id AND "
     "a.position = b.position AND a.site = b.site AND a.model = b.model AND "
     "a.head IS NOT DISTINCT FROM b.head GROUP BY 1 ORDER BY 1", "JOIN"),
    ("SELECT count(*) FROM acts WHERE prompt_id IN (SELECT prompt_id FROM prompts "
     "WHERE n_tokens > 8)", "subquery"),
    ("SELECT DISTINCT layer FROM acts ORDER BY layer", "DISTINCT"),
    ("SELECT count(*) FROM prompts", "acts alone"),
    # one expression for several columns: its sort key took one of them, its aggregate
    # failed in Python (review finding)
    ("SELECT layer, position FROM acts ORDER BY COLUMNS(*) DESC LIMIT 3", "COLUMNS"),
    ("SELECT max(COLUMNS('position|layer')) FROM acts", "COLUMNS"),
    ("SELECT layer, position FROM acts ORDER BY ALL DESC LIMIT 3", "ORDER BY ALL"),
    ("SELECT layer, count(*) FROM acts GROUP BY layer ORDER BY ALL", "ORDER BY ALL"),
]


@pytest.mark.parametrize(("query", "ordered"), SPLIT)
def test_split_rules_give_the_single_process_answer(
        dbs: tuple[actdb.Database, actdb.Database], query: str, ordered: bool) -> None:
    local, dist = dbs
    params = {"p": 3} if "$p" in query else None
    got = dist.sql(query, params=params)
    want = local.sql(query, params=params)
    assert got.note is not None and got.note.startswith("split into"), got.note
    assert "on 2 workers (2 threads)" in got.note, got.note  # processes, as --help says
    assert got.columns == want.columns
    a, b = _rows(dist, got), _rows(local, want)
    assert len(a) > 0
    if not ordered:  # plain rows come partition by partition: same rows, store order
        a, b = sorted(a, key=repr), sorted(b, key=repr)
    _same(a, b)


@pytest.mark.parametrize(("query", "why"), LOCAL)
def test_unsplittable_queries_run_in_one_process(
        dbs: tuple[actdb.Database, actdb.Database], query: str, why: str) -> None:
    local, dist = dbs
    got = dist.sql(query)
    assert got.note is not None and got.note.startswith("runs in one process"), got.note
    assert why in got.note
    _same(got.fetchall(), local.sql(query).fetchall())


def test_aggregates_match_a_numpy_reference(store: Path,
                                            dbs: tuple[actdb.Database, actdb.Database]) -> None:
    _, dist = dbs
    ref = _reference(store)
    got = dist.sql("SELECT model, layer, count(*), sum(norm), avg(norm), min(norm), max(norm), "
                   "avg(dim_contribution(vec, 0)) FROM acts GROUP BY model, layer")
    assert got.note is not None and got.note.startswith("split into")
    rows = got.fetchall()
    keys = sorted({(r["model"], r["layer"]) for r in ref})
    assert sorted((m, layer) for m, layer, *_ in rows) == keys
    for model, layer, n, s, a, lo, hi, d0 in rows:
        norms = np.array([r["norm"] for r in ref if (r["model"], r["layer"]) == (model, layer)])
        dirs = np.array([r["d0"] for r in ref if (r["model"], r["layer"]) == (model, layer)])
        assert n == len(norms)
        np.testing.assert_allclose([s, a, lo, hi], [norms.sum(), norms.mean(), norms.min(),
                                                    norms.max()], rtol=1e-6)
        # dim_contribution is x_0 / ||x|| from float16 directions: float16 rounding
        np.testing.assert_allclose(d0, dirs.mean(), atol=2e-3)


def test_top_k_matches_a_numpy_reference(store: Path,
                                         dbs: tuple[actdb.Database, actdb.Database]) -> None:
    _, dist = dbs
    ref = _reference(store)
    want = sorted(ref, key=lambda r: -r["norm"])[:9]
    got = dist.sql("SELECT model, site, prompt_id, position, head, norm FROM acts "
                   "ORDER BY norm DESC LIMIT 9").fetchall()
    assert [(r["model"], r["site"], r["prompt_id"], r["position"], r["head"]) for r in want] \
        == [g[:5] for g in got]
    np.testing.assert_allclose([g[5] for g in got], [r["norm"] for r in want], rtol=1e-6)


def test_explain_shows_the_split(dbs: tuple[actdb.Database, actdb.Database]) -> None:
    _, dist = dbs
    rows = dict(dist.sql("EXPLAIN SELECT role, avg(norm) FROM acts GROUP BY role").fetchall())
    assert rows["split"].startswith("aggregate")
    assert "SUM(norm)" in rows["per partition"] and "COUNT(norm)" in rows["per partition"]
    assert "GROUP BY" in rows["combine"]
    local = dict(dist.sql("EXPLAIN SELECT median(norm) FROM acts WHERE layer = $l",
                          params={"l": 1}).fetchall())
    assert local["split"].startswith("runs in one process")
    assert "physical_plan" in local


def test_workers_run_the_sandbox(dbs: tuple[actdb.Database, actdb.Database]) -> None:
    """What the coordinator refuses never reaches a worker, and a tensor function's error on
    a worker comes back as the same error."""
    _, dist = dbs
    with pytest.raises(actdb.QueryError, match="read_csv"):
        dist.sql("SELECT count(*) FROM read_csv('/etc/passwd')")
    with pytest.raises(actdb.ActdbError, match="tokenizes"):
        dist.sql("SELECT max(cosine_to_anchor(vec, ' not one token at all')) FROM acts "
                 "WHERE model = 'gpt2'").fetchall()


def test_cli_cluster_flag(store: Path, client: Any,
                          dbs: tuple[actdb.Database, actdb.Database]) -> None:
    query = "SELECT layer, count(*) AS n FROM acts GROUP BY layer ORDER BY layer"
    run = subprocess.run(
        [sys.executable, "-m", "actdb", "query", str(store), query, "--format", "csv",
         "--cluster", client.scheduler.address], capture_output=True, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = list(csv.reader(run.stdout.strip().splitlines()))
    assert lines[0] == ["layer", "n"]
    want = dbs[0].sql(query).fetchall()
    assert [tuple(map(int, ln)) for ln in lines[1:]] == want
    with pytest.raises(actdb.QueryError, match="local:N"):
        actdb.connect(store, cluster="local:zero")
    # An address distributed cannot parse: one sentence, exit 1, no traceback.
    with pytest.raises(actdb.QueryError, match="not local:N or a scheduler address"):
        actdb.connect(store, cluster="bogus")
    run = subprocess.run(
        [sys.executable, "-m", "actdb", "query", str(store), "SELECT 1", "--cluster", "bogus"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "cluster 'bogus' is not local:N" in run.stderr


@pytest.mark.parametrize(("models", "target"), [
    ([("a", 123, 8)], 4), ([("a", 5, 8), ("b", 200, 16)], 3), ([("a", 64, 8)], 100),
    ([("a", 0, 8)], 2)])
def test_partitions_are_whole_chunks_covering_every_row(
        models: list[tuple[str, int, int]], target: int) -> None:
    parts = partitions(models, target)
    for name, n, chunk in models:
        mine = [p for p in parts if p.model == name]
        covered = [r for p in mine for r in range(p.lo, p.hi)]
        assert covered == list(range(n))
        assert all(p.lo % chunk == 0 and p.hi > p.lo for p in mine)


@pytest.mark.parametrize(("query", "kind"), [
    ("SELECT count(*) FROM acts", "aggregate"),
    ("SELECT layer FROM acts GROUP BY layer", "aggregate"),
    ("SELECT norm FROM acts a ORDER BY a.norm LIMIT 3", "rows"),
    ("SELECT 1 AS one FROM acts ORDER BY count(*)", "aggregate"),
    ("SELECT x FROM acts AS a(x, y)", None),
    ("SELECT sum(norm) FILTER (WHERE layer > 0) FROM acts", "aggregate"),
    ("SELECT string_agg(token, ',') FROM acts", None),
    ("SELECT list(vec) FROM acts", None),
    ("SELECT min(norm, 3) FROM acts", None),
    ("SELECT avg(norm ORDER BY layer) FROM acts", None),
    ("SELECT layer, count(*) FROM acts GROUP BY 1", None),
    ("SELECT layer AS x, count(*) FROM acts GROUP BY ROLLUP (layer)", None),
    ("SELECT norm, layer FROM acts GROUP BY layer", None),
    ("SELECT -norm AS n FROM acts ORDER BY n + 1", None),
    ("SELECT norm FROM acts LIMIT $k", None),
    ("SELECT norm FROM acts USING SAMPLE 10", None),
    ("SELECT count(*) FROM acts QUALIFY true", None),
    ("WITH x AS (SELECT * FROM acts) SELECT count(*) FROM x", None),
    ("SELECT count(*) FROM acts UNION ALL SELECT count(*) FROM acts", None),
    ("SELECT count(*) FROM acts, range(3)", None),
    ("SELECT layer % 2 AS parity, count(*) FROM acts GROUP BY parity", None),
    ("SELECT norm * 2 AS n2, count(*) FROM acts WHERE n2 > 1 GROUP BY norm", None),
    ("SELECT uniform_angle(vec), count(*) FROM acts GROUP BY vec", None),
    ("SELECT layer, count(*) AS n FROM acts GROUP BY layer HAVING n > 2", None),
])
def test_split_shapes(query: str, kind: str | None) -> None:
    tree = sqlglot.parse_one(query, read="duckdb")
    aggregates = {"string_agg", "list", "median", "avg", "count", "sum", "min", "max"}
    if kind is None:
        with pytest.raises(Unsplittable):
            split(tree, aggregates)
    else:
        assert split(tree, aggregates).kind == kind


def test_a_cluster_query_stops_at_its_time_limit(dbs: tuple[actdb.Database, actdb.Database]
                                                 ) -> None:
    """A split query past its limit stops at it (the coordinator waits no longer; each
    worker's query has the same limit, which DuckDB checks between its steps, so a step over
    a batch of rows through a costly expression finishes first), as does one run in one
    process; the connection and the workers then answer as before."""
    import time

    local, dist = dbs
    reference = "SELECT layer, count(*), sum(norm) FROM acts GROUP BY layer ORDER BY layer"
    want = local.sql(reference).fetchall()
    slow = {  # about 10 ms of edit distance a row, with little memory: 15 s in all
        "split": "SELECT count(*) FROM acts WHERE levenshtein(repeat(token || 'abc', 300), "
                 "repeat('xyz', 600)) > 0",
        "one process": "SELECT count(*) FROM acts a, acts b, acts c, acts d",
    }
    for how, query in slow.items():
        note = dist.sql(f"EXPLAIN {query}").fetchall()[0][1]
        assert note.startswith("runs in one process") == (how == "one process"), note
        start = time.monotonic()
        with pytest.raises(actdb.QueryTimeoutError, match="time limit of 1 s"):
            dist.sql(query, timeout=1).fetchall()
        assert time.monotonic() - start < 6, how
        got = dist.sql(reference)
        assert got.note is not None and got.note.startswith("split into")
        _same(got.fetchall(), want)


@pytest.mark.parametrize("order", ["as opened", "reversed"])
def test_cluster_connections_never_become_dasks_default(order: str, store: Path) -> None:
    """Two cluster connections, closed in either order, leave dask's scheduler as it was: a
    default left on dask.distributed made every later xarray or dask read in the process fail
    ("no Client active"), as `test_xarray_opens_every_array` did after this module."""
    import dask
    import dask.array as da
    import xarray as xr

    before = dask.config.get("scheduler", None)
    first = actdb.connect(store, device="cpu", cluster="local:1")
    second = actdb.connect(store, device="cpu", cluster="local:1")
    try:
        for db in (first, second):
            got = db.sql("SELECT count(*) FROM acts")
            assert got.note is not None and got.note.startswith("split into")
        assert dask.config.get("scheduler", None) == before
    finally:
        for db in ((first, second) if order == "as opened" else (second, first)):
            db.close()
    assert dask.config.get("scheduler", None) == before
    want = np.asarray(zarr.open_group(str(store / "tensors.zarr"), mode="r")[
        "models/0/acts/final/norm"][:7], dtype=np.float64)
    ds = xr.open_zarr(str(store / "tensors.zarr"), group="models/0/acts/final",
                      consolidated=False)
    np.testing.assert_array_equal(ds["norm"][:7].values, want)
    lazy = da.from_zarr(str(store / "tensors.zarr"), component="models/0/acts/final/norm")
    assert float(lazy[:7].sum().compute()) == pytest.approx(float(want.sum()), rel=1e-6)


def test_workers_see_the_coordinators_snapshot(store: Path, client: Any,
                                               model_dir: Callable[[str], Path],
                                               dbs: tuple[actdb.Database, actdb.Database]
                                               ) -> None:
    """Rows committed after the coordinator's snapshot stay out of its queries (the workers'
    open snapshots are reused); a coordinator that sees them gets them from every worker.
    Runs last: it grows the module's store."""
    _, dist = dbs
    query = "SELECT model, count(*), sum(norm) FROM acts GROUP BY model ORDER BY model"
    before = dist.sql(query).fetchall()
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=["More text for the workers."],
                 device="cpu", name="gpt2")
    assert dist.sql(query).fetchall() == before
    with actdb.connect(store, device="cpu") as local, \
            actdb.connect(store, device="cpu", cluster=client) as fresh:
        after = fresh.sql(query)
        assert after.note is not None and after.note.startswith("split into")
        rows = after.fetchall()
        _same(rows, local.sql(query).fetchall())
    assert rows[0][1] > before[0][1] and rows[1] == before[1]


def test_cluster_query_on_an_s3_store(client: Any, model_dir: Callable[[str], Path]) -> None:
    """Workers open an S3 store themselves, with the coordinator's storage_options (they do
    not share its environment): the split answers equal the single-process ones."""
    from support.s3server import running

    query = ("SELECT layer, count(*), sum(norm), max(uniform_angle(vec)) FROM acts "
             "GROUP BY layer ORDER BY layer")
    with running() as s3:
        url = s3.url()
        options = {"endpoint": s3.endpoint, "access_key_id": "testing",
                   "secret_access_key": "testing", "region": "us-east-1"}
        actdb.ingest(url, model=str(model_dir("gpt2")), prompts=PROMPTS, batch_size=4,
                     device="cpu", name="gpt2", chunk_tokens=8, storage_options=options)
        with actdb.connect(url, device="cpu", storage_options=options, cluster=client) as db:
            got = db.sql(query)
            assert got.note is not None and got.note.startswith("split into"), got.note
            rows = got.fetchall()
        with actdb.connect(url, device="cpu", storage_options=options) as db:
            _same(rows, db.sql(query).fetchall())
