"""The query engine: bulk evaluation, the thread policy, the low-precision top-k, fast start.

Bulk results are checked against the float64 reference (query_reference.py) in every SQL
context a function can sit in; DuckDB hands UDFs 2,048 rows a call, so the store here holds
enough tokens (about 7,000 a site) for a scan to walk each stream over several calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import duckdb
import numpy as np
import pytest
import torch
from support.prompts import PROMPTS
from support.query_reference import build_reference, uniform_angle, unit
from test_query_functions import (
    COS_TOL,
    LOGIT_ATOL,
    REL_TOL,
    Rows,
    check_topk,
    close,
    close_vectors,
    col,
    fetch,
    token_id,
    vocab_strings,
    words,
)

import actdb
from actdb.errors import QueryError
from actdb.query import threads, topk
from actdb.query.functions import REGISTRY

FAMILY = "gpt2"
# Long prompts (few forward passes to build) with enough tokens in all for several DuckDB
# calls per site; each differs so tokens differ.
MANY = [f"Number {i}. " + " ".join(PROMPTS) + " " + " ".join(PROMPTS[i % 3 : i % 3 + 3])
        for i in range(40)]


@pytest.fixture(scope="module")
def big(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("store-bulk") / "s.actdb"
    actdb.ingest(path, model=str(model_dir(FAMILY)), prompts=MANY, batch_size=64, device="cpu",
                 name=FAMILY, chunk_tokens=256)
    ref = build_reference(FAMILY, model_dir(FAMILY), MANY)
    db = actdb.connect(path, device="cpu")
    yield ref, db
    db.close()


def _site(db, role: str) -> str:
    return db.sql("SELECT site FROM sites WHERE role = $r ORDER BY layer DESC LIMIT 1",
                  params={"r": role}).fetchall()[0][0]


def test_store_is_big_enough_to_walk(big):
    _, db = big
    n = db.sql("SELECT count(*) FROM tokens").fetchall()[0][0]
    assert n > 3 * 2048, n


def test_scalar_functions_in_bulk(big):
    ref, db = big
    w1, _ = words(ref)
    before = db.stats["rows_bulk"]
    rows = fetch(db, f"""
        SELECT prompt_id, position, site, cosine_to_anchor(vec, '{w1}') AS c,
               dim_contribution(vec, 3) AS dc, uniform_angle(vec) AS ua,
               vec_norm(normed(vec)) AS ny, logit(vec, '{w1}') AS lg
        FROM acts""")
    assert db.stats["rows_bulk"] - before > len(rows), db.stats  # most rows came from windows
    r = Rows(ref, db, rows)
    x = r.x
    close(col(rows, "c"), unit(x) @ ref.anchors("unembed")[token_id(ref, w1)], atol=COS_TOL,
          what="cosine_to_anchor")
    close(col(rows, "dc"), unit(x)[:, 3], atol=COS_TOL, what="dim_contribution")
    close(col(rows, "ua"), uniform_angle(x), atol=0.2, what="uniform_angle")
    close(col(rows, "ny"), np.linalg.norm(r.y, axis=-1), rtol=REL_TOL, what="vec_norm(normed)")
    close(col(rows, "lg"), ref.logit(r.f, token_id(ref, w1)), atol=2e-3, rtol=2e-3,
          what="logit")


def test_aggregates_in_bulk(big):
    ref, db = big
    w1, _ = words(ref)
    groups = fetch(db, f"""
        SELECT site, count(*) AS n, avg(cosine_to_anchor(vec, '{w1}')) AS c,
               max(vec_norm(vec)) AS mx, sum(dim_contribution(vec, 5)) AS s
        FROM acts GROUP BY site ORDER BY site""")
    rows = fetch(db, "SELECT prompt_id, position, site FROM acts")
    x = Rows(ref, db, rows).x
    sites = np.array([r["site"] for r in rows])
    a = ref.anchors("unembed")[token_id(ref, w1)]
    for g in groups:
        m = sites == g["site"]
        assert g["n"] == m.sum()
        close(g["c"], (unit(x[m]) @ a).mean(), atol=COS_TOL, what=f"avg {g['site']}")
        close(g["mx"], np.linalg.norm(x[m], axis=-1).max(), rtol=REL_TOL, what="max")
        close(g["s"], unit(x[m])[:, 5].sum(), atol=COS_TOL * m.sum() ** 0.5, what="sum")


def test_list_results_from_windows_exact_rows_and_nulls(big):
    """List results are built as Arrow blocks (lists.py): rows answered from windows, rows
    computed exactly (a sparse second site in the same calls) and NULL arguments, put back
    in their places."""
    ref, db = big
    walked, sparse = _site(db, "pre_mlp"), _site(db, "final")
    q = (f"SELECT prompt_id, position, site, "
         f"top_dims(CASE WHEN position % 3 = 0 THEN NULL ELSE vec END, 2) AS a, "
         f"CASE WHEN position % 3 = 0 THEN NULL ELSE top_dims(vec, 2) END AS b, "
         f"to_list(vec) AS l FROM acts "
         f"WHERE site = '{walked}' OR (site = '{sparse}' AND position = 1)")
    before = dict(db.stats)
    rows = fetch(db, q)
    assert db.stats["rows_bulk"] > before["rows_bulk"], db.stats
    assert db.stats["rows_exact"] > before["rows_exact"], db.stats
    assert {r["site"] for r in rows} == {walked, sparse}
    x = Rows(ref, db, rows).x
    close_vectors(np.array([r["l"] for r in rows]), x, what="to_list(vec)")
    u = unit(x)
    for r, ur in zip(rows, u, strict=True):
        assert r["a"] == r["b"]
        if r["position"] % 3 == 0:
            assert r["a"] is None
            continue
        dims = [e["dim"] for e in r["a"]]
        # the two largest |contributions| (float16 storage may swap near-ties)
        close(np.abs(ur[dims]), np.sort(np.abs(ur))[::-1][:2], atol=COS_TOL, what="top_dims")
        close(np.array([e["contribution"] for e in r["a"]]), ur[dims], atol=COS_TOL,
              what="top_dims")


def test_vocabulary_wide_functions_computed_as_asked(big):
    """The six functions that rank or sum over the whole vocabulary in every row (top_logits,
    nearest_anchors, logprob, prob, token_rank, entropy): a walk of a site computes exactly
    its rows, none ahead of the query (a window's rows past the query's last would cost as
    much as the rows asked for), and their values are the float64 reference's."""
    ref, db = big
    final = _site(db, "final")
    before = dict(db.stats)
    rows = fetch(db, f"SELECT prompt_id, position, site, top_logits(vec, 3) AS tl, "
                     f"nearest_anchors(vec, 2) AS na, entropy(vec) AS h, logprob(vec, 5) AS lp, "
                     f"prob(vec, 5) AS p, token_rank(vec, 5) AS rk FROM acts "
                     f"WHERE site = '{final}'")
    assert len(rows) > 2048, len(rows)  # more than one call of DuckDB's: a walk
    assert db.stats["rows_bulk"] == before["rows_bulk"], db.stats
    assert db.stats["rows_exact"] - before["rows_exact"] == 6 * len(rows), db.stats
    r = Rows(ref, db, rows)
    strings = vocab_strings(db, FAMILY)
    b = ref.b_U if ref.b_U is not None else 0.0
    logits = r.f.astype(np.float64) @ ref.W_U.T.astype(np.float64) + b
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    close(col(rows, "h"), -(np.exp(logp) * logp).sum(-1), atol=3e-5, what="entropy")
    close(col(rows, "lp"), logp[:, 5], atol=1e-3, what="logprob")
    close(col(rows, "p"), np.exp(logp[:, 5]), atol=1e-5, what="prob")
    # token_rank: exact where no other token's logit is within the stored logits' error (about
    # 2e-4 here) of token 5's; within those ties' span elsewhere
    tol = 4e-4
    lo = 1 + (logits > logits[:, 5:6] + tol).sum(-1)
    hi = (logits > logits[:, 5:6] - tol).sum(-1)  # token 5 itself among them
    got_rank = col(rows, "rk")
    assert np.all((lo <= got_rank) & (got_rank <= hi)), "token_rank outside its ties' span"
    assert (lo == hi).mean() > 0.5, (lo == hi).mean()  # most ranks pinned exactly
    check_topk([x["tl"] for x in rows], r.f @ ref.W_U.T + b, 3, key="logit",
               id_key="token_id", tol=LOGIT_ATOL, what="top_logits", strings=strings)
    check_topk([x["na"] for x in rows], unit(r.x) @ ref.anchors("unembed").T, 2, key="cosine",
               id_key="token_id", tol=COS_TOL, what="nearest_anchors", strings=strings)


def test_where_join_and_subqueries(big):
    ref, db = big
    w1, _ = words(ref)
    site = _site(db, "pre_mlp")
    a = ref.anchors("unembed")[token_id(ref, w1)]
    cta = f"cosine_to_anchor(vec, '{w1}')"
    every = fetch(db, f"SELECT prompt_id, position FROM acts WHERE site = '{site}'")
    want = dict(zip([(e["prompt_id"], e["position"]) for e in every],
                    unit(Rows(ref, db, [{**e, "site": site} for e in every]).x) @ a,
                    strict=True))

    # A filter on the function itself, over a whole walk of the site.
    thr = float(np.median(list(want.values())))
    got = {(g["prompt_id"], g["position"]) for g in fetch(
        db, f"SELECT prompt_id, position FROM acts WHERE site = '{site}' AND {cta} > {thr}")}
    for key, c in want.items():
        if abs(c - thr) > COS_TOL:
            assert (key in got) == (c > thr), f"WHERE {key}: cos {c:.4f}, threshold {thr:.4f}"

    # Sparse rows (every third position): these go the exact way, mixed with bulk windows.
    sparse = fetch(db, f"SELECT prompt_id, position, {cta} AS c FROM acts "
                       f"WHERE site = '{site}' AND position % 3 = 1")
    close(col(sparse, "c"), [want[(s["prompt_id"], s["position"])] for s in sparse],
          atol=COS_TOL, what="sparse WHERE")

    # A join with prompts, and a correlated subquery per prompt.
    joined = fetch(db, f"""
        SELECT a.prompt_id, a.position, {cta} AS c, p.n_tokens
        FROM acts a JOIN prompts p USING (prompt_id)
        WHERE a.site = '{site}' AND p.n_tokens > 12""")
    assert joined and all(j["n_tokens"] > 12 for j in joined)
    close(col(joined, "c"), [want[(j["prompt_id"], j["position"])] for j in joined],
          atol=COS_TOL, what="join")
    best = fetch(db, f"""
        SELECT p.prompt_id, (SELECT max({cta}) FROM acts WHERE acts.prompt_id = p.prompt_id
                             AND site = '{site}') AS best
        FROM prompts p WHERE p.prompt_id % 50 = 0 ORDER BY p.prompt_id""")
    for b in best:
        close(b["best"], max(v for k, v in want.items() if k[0] == b["prompt_id"]),
              atol=COS_TOL, what=f"correlated subquery {b['prompt_id']}")
    above = fetch(db, f"""
        SELECT prompt_id, position, {cta} AS c FROM acts WHERE site = '{site}'
          AND {cta} > (SELECT avg({cta}) FROM acts WHERE site = '{site}')""")
    mean = float(np.mean(list(want.values())))
    assert abs(len(above) - sum(v > mean for v in want.values())) <= 3
    close(col(above, "c"), [want[(x["prompt_id"], x["position"])] for x in above],
          atol=COS_TOL, what="scalar subquery")


def test_selective_queries_read_exactly(big):
    """Two prompts in forty: rows are computed as asked, and few chunks are read."""
    ref, db = big
    w1, _ = words(ref)
    db.drop_caches()
    before = dict(db.stats)
    ids = [5, 25]
    rows = fetch(db, f"SELECT prompt_id, position, site, cosine_to_anchor(vec, '{w1}') AS c "
                     f"FROM acts WHERE prompt_id IN ({', '.join(map(str, ids))})")
    assert db.stats["rows_bulk"] == before["rows_bulk"], "a sparse query ran windows ahead"
    close(col(rows, "c"), unit(Rows(ref, db, rows).x) @ ref.anchors("unembed")[
        token_id(ref, w1)], atol=COS_TOL, what="selective")
    n_sites = db.sql("SELECT count(*) FROM sites").fetchall()[0][0]
    n_chunks = db.sql("SELECT ceil(n_rows / chunk_tokens) FROM models").fetchall()[0][0]
    read = db.stats["chunks_read"] - before["chunks_read"]
    # each prompt's rows lie in at most 2 chunks of 256 rows per site and field read
    assert read <= 2 * len(ids) * n_sites * 2, read
    assert read < 0.25 * n_chunks * n_sites, (read, n_chunks)


def test_a_selective_querys_chunks_are_kept_from_their_second_read(big):
    """The first read of a selective query's chunk since the cache was cleared is counted
    and not kept; the same query again reads it again and keeps it; a third time reads
    nothing. The same answers each time."""
    ref, db = big
    w1, _ = words(ref)
    q = (f"SELECT prompt_id, position, site, cosine_to_anchor(vec, '{w1}') FROM acts "
         "WHERE prompt_id IN (5, 25) ORDER BY ALL")
    db.drop_caches()
    answers, reads = [], []
    for _ in range(3):
        before = db.stats["chunks_read"]
        answers.append(db.sql(q).fetchall())
        reads.append(db.stats["chunks_read"] - before)
    assert answers[0] == answers[1] == answers[2]
    assert 0 < reads[1] <= reads[0] and reads[2] == 0, reads


def test_scan_runs_read_what_zarr_reads_and_name_a_damaged_chunk(big, tmp_path):
    """A scan's runs of chunks (one buffer, one checked read a file) hold exactly what
    zarr-python reads from the same arrays, and damage inside a run names its chunk."""
    import shutil

    import zarr

    from actdb.errors import StoreCorruptError
    from actdb.store.store import Store

    _, db = big
    site = _site(db, "pre_mlp")
    store = tmp_path / "copy.actdb"
    shutil.copytree(db.store.path, store)
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    with Store(store) as st:
        n_rows = st.catalog.models()[0].n_rows
        for field, first, count in (("direction", 2, 5), ("norm", 0, 1)):
            arr = group[f"models/0/acts/{site}/{field}"]
            c = arr.chunks[0]
            assert (first + count) * c <= -(-n_rows // c) * c
            got = st.arrays.read_chunks(0, site, field, first, count)
            assert got.shape[0] == count * c and got.dtype == arr.dtype
            want = arr[first * c : (first + count) * c]  # ends at the array's end
            np.testing.assert_array_equal(got[: len(want)], want)
    chunk = store / "tensors.zarr" / "models" / "0" / "acts" / site / "direction" / "c.4.0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x10
    chunk.write_bytes(bytes(data))
    with Store(store) as st, pytest.raises(StoreCorruptError, match="chunk 4 of array .* fails"):
        st.arrays.read_chunks(0, site, "direction", 2, 5)
    chunk.write_bytes(bytes(data[:-9]))
    with Store(store) as st, pytest.raises(StoreCorruptError, match="chunk 4 of array .* has"):
        st.arrays.read_chunks(0, site, "direction", 2, 5)
    # the whole scan meets it too, through the read-ahead thread
    with actdb.connect(store, device="cpu") as copy, pytest.raises(StoreCorruptError,
                                                                   match="chunk 4"):
        copy.sql(f"SELECT avg(vec_norm(vec) + cosine_to_anchor(vec, 3)) FROM acts "
                 f"WHERE site = '{site}'").fetchall()
    # a damaged norm chunk read through the view's plain column: the same error, itself
    # (it came as a QueryError reading "StoreCorruptError: chunk 0 ...")
    norm = store / "tensors.zarr" / "models" / "0" / "acts" / site / "norm" / "c.0"
    data = bytearray(norm.read_bytes())
    data[10] ^= 0x01
    norm.write_bytes(bytes(data))
    with actdb.connect(store, device="cpu") as copy:
        for column in ("norm", "mean + norm"):
            with pytest.raises(StoreCorruptError, match="^chunk 0 of array .*/norm' fails"):
                copy.sql(f"SELECT avg({column}) FROM acts WHERE site = '{site}'").fetchall()


@pytest.mark.cpu_only  # the runs' products are the CPU's compiled kernel; a GPU uses torch
def test_a_scan_shares_its_runs_products_with_the_read_ahead_thread(big, tmp_path, monkeypatch):
    """`cosine_to_anchor` of raw vectors over runs of chunks (runs.FieldReader._project_runs): the
    read-ahead thread makes runs' products, from the back of a window and ahead of the query,
    and every row gets the bits the chunk-by-chunk path gives it, the float64 value of its
    stored direction within float32 rounding. Damage in a run only looked at ahead is never
    reported; a scan that needs the run names its chunk."""
    import shutil

    import zarr

    from actdb.errors import StoreCorruptError
    from actdb.query import runs

    if runs._native is None:
        pytest.skip("no compiled kernels: project takes the torch path")
    ref, db = big
    site = _site(db, "pre_mlp")
    store = tmp_path / "copy.actdb"
    shutil.copytree(db.store.path, store)
    q = (f"SELECT prompt_id, position, cosine_to_anchor(vec, 3) FROM acts WHERE site = '{site}' "
         "ORDER BY prompt_id, position")
    made: list[tuple[str, int]] = []
    dots = runs.RunWalk.dots

    def spy(walk, r, vv):
        made.append((threading.current_thread().name, r))
        return dots(walk, r, vv)

    monkeypatch.setattr(runs.RunWalk, "dots", spy)
    monkeypatch.setattr(runs, "RUN_CHUNKS", 2)  # runs of 512 rows: 14 runs a site
    with actdb.connect(store, device="cpu") as fast:
        got = fast.sql(q).fetchall()
        # every chunk of the site's directions counted once, when used
        n_chunks = -(-len(got) // db.sql("SELECT chunk_tokens FROM models").fetchall()[0][0])
        assert fast.stats["chunks_read"] == n_chunks, (fast.stats, n_chunks)
    threads_used = {name.split("_")[0] for name, _ in made}
    assert threads_used == {"MainThread", "actdb-readahead"}, threads_used
    assert sorted(r for _, r in made) == sorted(set(r for _, r in made)), "a run made twice"
    monkeypatch.setattr(runs, "RUN_CHUNKS", 1 << 20)  # no runs: chunk by chunk
    with actdb.connect(store, device="cpu") as slow:
        want = slow.sql(q).fetchall()
        starts = dict(slow.sql("SELECT prompt_id, row_start FROM prompt_runs").fetchall())
    assert [r[:2] for r in got] == [r[:2] for r in want]
    a, b = (np.array([r[2] for r in rows]) for rows in (got, want))
    assert np.array_equal(a, b), np.nonzero(a != b)[0][:5]  # the same bits, row for row
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    direction = group[f"models/0/acts/{site}/direction"][:].astype(np.float64)
    rows = np.array([starts[p] + pos for p, pos, _ in got])
    anchor = ref.anchors("unembed")[3].astype(np.float64)
    close(a, direction[rows] @ (anchor / np.linalg.norm(anchor)), atol=1e-5, what="cosines")

    # A query that stops before the site's end: its last window's products and those of the
    # runs after it (the farthest run made) are made; damage in that run is never reported.
    monkeypatch.setattr(runs, "RUN_CHUNKS", 2)
    k = max(p for p, pos, _ in got if starts[p] + pos < 5000)  # past the first window's start
    part = (f"SELECT count(cosine_to_anchor(vec, 3)) FROM acts WHERE site = '{site}' "
            f"AND prompt_id <= {k}")
    made.clear()
    with actdb.connect(store, device="cpu") as copy:
        assert copy.sql(part).fetchall()[0][0] == sum(1 for p, _, _ in got if p <= k)
        copy.source.cache.submit(lambda: None).result()  # the runs queued ahead made too
    farthest = max(r for _, r in made)
    c = group[f"models/0/acts/{site}/direction"].chunks[0]
    assert farthest * 2 * c > max(rows[: sum(1 for p, _, _ in got if p <= k)]), "none ahead"
    chunk = store / "tensors.zarr/models/0/acts" / site / "direction" / f"c.{2 * farthest}.0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x10
    chunk.write_bytes(bytes(data))
    with actdb.connect(store, device="cpu") as copy:
        assert copy.sql(part).fetchall()[0][0] == sum(1 for p, _, _ in got if p <= k)
        with pytest.raises(StoreCorruptError, match=f"chunk {2 * farthest} of array"):
            copy.sql(q).fetchall()
        chunk.write_bytes(bytes(data[:100]) + bytes([data[100] ^ 0x10]) + bytes(data[101:]))
        assert len(copy.sql(q).fetchall()) == len(got)  # a failed run is read again


class _GatedWalk:
    """A stand-in for runs.RunWalk over runs 0 and 1 of 4 rows: run r's products are r,
    made when the run's gate (if any) opens."""

    def __init__(self, gates: dict[int, tuple[threading.Event, threading.Event]]) -> None:
        self.where, self.runs, self.lo, self.step = (0, "s", "direction"), range(2), 0, 4
        self.stop, self.gates = 2, gates  # not walking: nothing read ahead

    def count(self, r: int) -> int:
        return 1

    def nbytes(self, r: int) -> int:
        return 8

    def span(self, r: int) -> tuple[int, int]:
        return r * 4, r * 4 + 4

    def dots(self, r: int, vv: np.ndarray) -> np.ndarray:
        if r in self.gates:
            inside, gate = self.gates[r]
            inside.set()
            assert gate.wait(10)
        return np.full(4, float(r), dtype=np.float32)


def test_a_run_queued_by_another_query_is_taken_over_not_waited_for(big):
    """Query A makes run 0 while `drop_caches` drops its queued run 1 and query B queues both
    runs again: A takes B's queued run 1 over and makes it (it waited for B's task, which B
    then cancelled to make the run itself, and A failed with CancelledError); B then uses A's."""
    _, db = big
    with actdb.connect(db.store.path, device="cpu") as fresh:
        src = fresh.source
        release = threading.Event()
        src.cache.submit(release.wait, 60)  # the read-ahead thread busy: runs stay queued
        a_in, a_gate, b_in, b_gate = (threading.Event() for _ in range(4))
        vv = np.ones(3, dtype=np.float32)
        out = {"a": np.zeros(8, np.float32), "b": np.zeros(8, np.float32)}
        errors: list[BaseException] = []

        def query(name: str, gates: dict[int, tuple[threading.Event, threading.Event]]) -> None:
            try:
                src.reader._project_runs(_GatedWalk(gates), vv, out[name])
            except BaseException as e:
                errors.append(e)

        a = threading.Thread(target=query, args=("a", {0: (a_in, a_gate)}))
        a.start()
        assert a_in.wait(10)  # A makes run 0; its run 1 is queued
        src.clear()
        b = threading.Thread(target=query, args=("b", {0: (b_in, b_gate)}))
        b.start()
        assert b_in.wait(10)  # B makes run 0; its run 1 is queued
        a_gate.set()  # A goes on to run 1, which B has queued
        a.join(2)
        b_gate.set()  # B goes on to run 1
        b.join(10)
        a.join(10)
        release.set()
        assert not a.is_alive() and not b.is_alive() and not errors, errors
        for name in "ab":
            assert out[name].tolist() == [0.0] * 4 + [1.0] * 4, (name, out[name])


def test_repeated_rows_with_a_gap_read_each_row(big):
    """Rows asked for as (r, r, r + 2) of one stream: as many rows as the span of the first and
    last, but not consecutive; each must be its own row's value."""
    ref, db = big
    site = _site(db, "pre_mlp")
    a = ref.anchors("unembed")[3]
    rows = fetch(db, f"""
        SELECT a.prompt_id, a.position, cosine_to_anchor(a.vec, 3) AS c
        FROM acts a JOIN (SELECT unnest([4, 4, 6]) AS p) v ON a.position = v.p
        WHERE a.site = '{site}' AND a.prompt_id = 1""")
    assert sorted(r["position"] for r in rows) == [4, 4, 6]
    want = unit(Rows(ref, db, [{**r, "site": site} for r in rows]).x) @ a
    close(col(rows, "c"), want, atol=COS_TOL, what="repeated rows")


# -- vocabulary-wide top-k in low precision ----------------------------------------------------


def _near_ties(seed: int, V: int = 3000, d: int = 256, n: int = 40, tied: int = 400):
    """Rows x and a vocabulary whose `tied` best tokens for every row score within a few
    parts in 10^4 of each other: far below bfloat16's resolution, far above float32's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(V, d, generator=g) * 0.05
    direction = x.mean(0) / torch.linalg.vector_norm(x.mean(0))
    w[:tied] = direction * 2.0 + torch.randn(tied, d, generator=g) * 1e-4
    x = x * 0.1 + direction * 5.0  # every row points at the tied block
    return x, w


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_candidates_equal_fp32_topk_on_near_ties(seed):
    x, w = _near_ties(seed)
    b = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(seed)) * 1e-4
    x64, w64, b64 = x.double(), w.double(), b.double()
    want = torch.topk(x64 @ w64.T + b64, 10, dim=-1)
    got_v, got_i = topk.topk(x, w, b, 10, lowp=torch.bfloat16, transform=None)
    # bf16 alone scrambles these ranks (so the test can tell a proof from a guess) ...
    bf = torch.topk((x.bfloat16() @ w.bfloat16().T).float() + b, 10, dim=-1).indices
    assert not torch.equal(bf, want.indices)
    # ... the candidate path gives the float64 order wherever float32 can tell the values apart
    s64 = (x64 @ w64.T + b64)
    for i in range(x.shape[0]):
        order = torch.argsort(s64[i], descending=True)[:11]
        gaps = (s64[i, order[:-1]] - s64[i, order[1:]]).abs()
        if bool((gaps > 1e-5).all()):
            assert got_i[i].tolist() == order[:10].tolist(), f"row {i}"
    close(got_v.double().numpy(), want.values.numpy(), atol=1e-4, what="top-k values")


def test_bf16_candidates_on_spread_scores():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 128, generator=g), torch.randn(5000, 128, generator=g)
    got = topk.topk(x, w, None, 7, lowp=torch.bfloat16, transform=None)
    want = torch.topk(x.double() @ w.double().T, 7, dim=-1)
    assert torch.equal(got[1], want.indices)


@pytest.mark.parametrize("lowp", [None, torch.bfloat16])
def test_exact_ties_keep_the_lower_token_first(lowp):
    """Tokens with equal rows score equal in float32: both paths list them lower id first
    (torch.topk leaves the order of ties unspecified, and it differs between devices)."""
    g = torch.Generator().manual_seed(5)
    x, base = torch.randn(16, 64, generator=g), torch.randn(100, 64, generator=g)
    w = base[torch.arange(100).repeat(6)[torch.randperm(600, generator=g)]]  # 6 copies of each
    vals, ids = topk.topk(x, w, None, 8, lowp=lowp, transform=None)
    for i in range(x.shape[0]):
        row, order = vals[i].tolist(), ids[i].tolist()
        for a in range(7):
            if row[a] == row[a + 1]:
                assert order[a] < order[a + 1], f"row {i}: ties {order} by {row}"
        assert sum(row[a] == row[0] for a in range(8)) >= 2, f"row {i} has no tie to order"


@pytest.mark.parametrize("lowp", [None, torch.bfloat16])
@pytest.mark.parametrize(("k", "n_base", "n_copies"),
                         [(3, 50, 6), (8, 50, 6), (9, 50, 6), (14, 50, 6), (8, 10, 60)])
def test_ties_at_the_kth_place_admit_the_lower_ids(lowp, k, n_base, n_copies):
    """Where the k-th place falls inside a group of tied tokens, the lower ids make the top k,
    on both paths: the float64 ranking with ties broken by id, exactly. (The float32 product
    rounds equal rows differently by their place in it, so its own top k picks among them.)
    60 copies: more tied tokens than the product's candidates, so a row is finished alone."""
    g = torch.Generator().manual_seed(11)
    x, base = torch.randn(24, 96, generator=g), torch.randn(n_base, 96, generator=g)
    n = n_base * n_copies
    copies = torch.arange(n_base).repeat(n_copies)[torch.randperm(n, generator=g)]
    w = base[copies]
    b0 = torch.randn(n_base, generator=g) * 0.1
    for bias in (None, b0[copies]):  # equal rows, equal biases
        vals, ids = topk.topk(x, w, bias, k, lowp=lowp, transform=None)
        # each base row scored once, so copies tie exactly in the reference
        s64 = (x.double() @ base.double().T + (0 if bias is None else b0.double()))[:, copies]
        for i in range(x.shape[0]):
            want = sorted(range(w.shape[0]), key=lambda t: (-float(s64[i, t]), t))[:k]
            assert ids[i].tolist() == want, f"row {i}, bias {bias is not None}"
            close(vals[i].double().numpy(), s64[i, want].numpy(), atol=1e-4, what="values")


def test_exact_topk_of_a_zero_row_is_the_biases_order():
    """A zero row ties every token (all its rescores are the bias): its top k are the largest
    biases, lower id first, found without rescoring the vocabulary for the whole block; and
    k = 0 or no rows give empty results."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, 32, generator=g), torch.randn(3000, 32, generator=g)
    x[2] = 0
    b = torch.randint(0, 5, (3000,), generator=g).float()  # many equal biases
    for bias in (None, b):
        vals, ids = topk._exact(x, w, bias, 7)
        want = torch.sort(bias if bias is not None else torch.zeros(3000), descending=True,
                          stable=True).indices[:7]
        assert ids[2].tolist() == want.tolist()
        for i in (0, 1, 3, 4, 5):  # the other rows as their own float64 ranking
            s64 = x[i].double() @ w.double().T + (0 if bias is None else bias.double())
            assert ids[i].tolist() == torch.argsort(s64, descending=True)[:7].tolist()
    assert topk._exact(x, w, b, 0)[1].shape == (6, 0)
    assert topk._exact(x[:0], w, b, 3)[1].shape == (0, 3)


def test_exact_topk_bound_widens_for_rounded_float32_products(monkeypatch):
    """A float32 product that torch may run with rounded inputs (TF32, bfloat16) gets a wider
    reach; a setting torch refuses to report counts as the coarsest."""
    cpu = torch.device("cpu")
    assert topk._input_rounding(cpu) == 0.0
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert topk._input_rounding(cpu) == 2.0**-10
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    assert topk._input_rounding(cpu) == 2.0**-8

    def refuse() -> str:
        raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", refuse)
    assert topk._input_rounding(cpu) == 2.0**-8


@pytest.mark.parametrize("width", [0, 1, 2, 3, 5, 7, 64, 576, 768, 1000])
def test_tree_sum_is_a_sum_in_an_order_fixed_by_the_width(width):
    """The GPU's dot products (dots.py): the same values as a float64 sum, and a row's value
    is the same bits alone, in a block, or among thousands of rows."""
    from actdb.query.dots import row_dots, tree_sum

    g = torch.Generator().manual_seed(width)
    x, v = torch.randn(3000, width, generator=g), torch.randn(width, generator=g)
    got = tree_sum(x * v)
    want = (x.double() * v.double()).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (3000,)
    close(got.double().numpy(), want.numpy(), atol=1e-5 * (1 + width**0.5), what="tree sum")
    for lo, hi in [(0, 1), (5, 8), (100, 117), (0, 3000)]:
        assert torch.equal(tree_sum(x[lo:hi] * v), got[lo:hi]), (lo, hi)
    if torch.cuda.is_available():  # the reason it exists: torch.sum on CUDA is not this
        xc, vc = x.cuda(), v.cuda()
        full = row_dots(xc, vc)
        for lo, hi in [(0, 1), (5, 8), (100, 117), (7, 2055)]:
            assert torch.equal(row_dots(xc[lo:hi], vc), full[lo:hi]), (lo, hi)


_DELTA = 0.499 * 2.0**-7  # just under half of bfloat16's spacing in [1, 2): rounds down


def _rounding_down_together(d: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, and w's rows A and F, built so that bfloat16 gets A nearly as wrong as the bound
    allows: every x_i and w_Ai rounds down by almost u of itself, and the float32 sum lands
    on a midpoint of bfloat16 that rounds down, so that rounding it loses u of it too; the F
    rows are exact in bfloat16, score below A exactly, and above it in bfloat16."""
    x = torch.full((d,), 1 + _DELTA)  # rounds to 1
    exact_a = torch.ones(d)
    exact_a[: d // 2] += 2.0**-7  # sum 64.25 (d = 64), halfway: rounds to even, 64
    a = exact_a + _DELTA  # rounds to exact_a
    f = torch.ones(d)
    f[: d // 2 + 1] += 2.0**-7  # sum 64.258: rounds up to 64.5
    return x, a, f


def test_the_bfloat16_error_bound_holds_where_the_rounding_is_worst():
    """The margin of topk.py's proof against this machine's own bfloat16 product, on inputs
    where it is nearly reached (98% of it): a margin too small by 5% in any term fails."""
    x, a, f = _rounding_down_together()
    w = torch.stack([a, f])
    approx = (x.bfloat16() @ w.bfloat16().T).float()  # what topk's candidate product gives
    s = x.double() @ w.double().T
    x_norm = torch.linalg.vector_norm(x.double())
    w_max = torch.linalg.vector_norm(w.double(), dim=-1).max()
    scale, norms = (x_norm * w_max).reshape(1), (x_norm + w_max).reshape(1)
    assert float(approx[0]) == 64.0 and float(approx[1]) == 64.5, "not the rounding built"
    theta = approx[:1]
    low = float(s[0] - approx[0])  # how far bfloat16 fell below A's score
    allowed = float(topk.margin(x.shape[0], theta, theta, scale, norms, bias=False)[0])
    assert 0.95 * allowed < low <= allowed, (low, allowed)
    with_bias = float(topk.margin(x.shape[0], theta, theta, scale, norms, bias=True)[0])
    assert 0.95 * with_bias < low <= with_bias, (low, with_bias)


@pytest.mark.parametrize("bias", [False, True])
def test_a_token_bfloat16_pushes_out_of_the_candidates_is_still_found(bias):
    """A is the best token, but bfloat16 ranks it below 400 others: more than both rounds of
    candidates hold, so only the proof's refusal (then float32) finds it."""
    x, a, f = _rounding_down_together()
    g = torch.Generator().manual_seed(0)
    low = torch.rand(600, x.shape[0], generator=g) * 0.5  # far below
    w = torch.cat([f.expand(400, -1), a[None], low])
    b = torch.zeros(w.shape[0]) if bias else None
    assert int(torch.topk((x.bfloat16() @ w.bfloat16().T).float(), 300).indices.eq(400).sum()) == 0
    vals, ids = topk.topk(x[None], w, b, 1, lowp=torch.bfloat16, transform=None)
    assert ids.tolist() == [[400]]
    assert float(vals[0, 0]) == pytest.approx(float(x.double() @ a.double()), rel=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_tiny_and_subnormal_rows_still_get_the_exact_top_k(bias):
    """Found by review: a row of tiny values whose float32 norm underflows to 0 (the bound's
    scale vanished), and subnormal values that the bfloat16 kernel reads as zero (the
    absolute term was too small)."""
    x, a, f = _rounding_down_together()
    tiny = 2.0**-84  # every x_i still a normal float; ||x||^2 is not
    w = torch.cat([f[None], torch.full((300, x.shape[0]), 1 - 2.0**-12), a[None]])
    b = torch.zeros(w.shape[0]) if bias else None
    _, ids = topk.topk((x * tiny)[None], w, b, 1, lowp=torch.bfloat16, transform=None)
    assert ids.tolist() == [[301]]
    xs = torch.full((1, 64), 1.5 * 2.0**-128)  # subnormal
    ws = torch.ones(1000, 64) * 2.0**55
    ws[:, 0] = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).float() * 2.0**50
    b = torch.zeros(ws.shape[0]) if bias else None
    _, ids = topk.topk(xs, ws, b, 3, lowp=torch.bfloat16, transform=None)
    assert ids.tolist() == torch.topk(xs.double() @ ws.double().T, 3).indices.tolist()


def test_a_weight_changed_in_place_is_converted_again():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 32, generator=g), torch.randn(400, 32, generator=g)
    topk.topk(x, w, None, 1, lowp=torch.bfloat16, transform=None)  # caches w in bfloat16
    w[5] = x.sum(0) * 3  # now every row's best
    _, ids = topk.topk(x, w, None, 1, lowp=torch.bfloat16, transform=None)
    assert ids.tolist() == torch.topk(x.double() @ w.double().T, 1).indices.tolist()


def test_full_precision_sums_stay_on_until_the_last_thread_leaves():
    """cuBLAS's reduced-precision switch is process-wide: one thread leaving the guard must
    not turn it back on while another thread's product still runs under it."""
    flag = torch.backends.cuda.matmul
    saved = flag.allow_bf16_reduced_precision_reduction
    flag.allow_bf16_reduced_precision_reduction = True
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def a() -> None:
        with topk._full_precision_sums():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with topk._full_precision_sums():
            b_in.set()
            a_out.wait(5)
            seen.append(flag.allow_bf16_reduced_precision_reduction)  # a has left by now

    try:
        threads_ = [threading.Thread(target=f) for f in (a, b)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join(10)
        assert seen == [False]
        assert flag.allow_bf16_reduced_precision_reduction is True  # restored by the last
    finally:
        flag.allow_bf16_reduced_precision_reduction = saved


def test_top_logits_through_bf16_candidates(big, monkeypatch):
    ref, db = big
    monkeypatch.setenv(topk.ENV, "bf16")
    final = _site(db, "final")
    rows = fetch(db, f"SELECT prompt_id, position, site, top_logits(vec, 4) AS tl, "
                     f"nearest_anchors(vec, 3, 'embed') AS na FROM acts "
                     f"WHERE site = '{final}' AND prompt_id < 40 AND position = 3")
    r = Rows(ref, db, rows)
    strings = vocab_strings(db, FAMILY)
    b = ref.b_U if ref.b_U is not None else 0.0
    check_topk([x["tl"] for x in rows], r.f @ ref.W_U.T + b, 4, key="logit",
               id_key="token_id", tol=LOGIT_ATOL, what="top_logits bf16", strings=strings)
    check_topk([x["na"] for x in rows], unit(r.x) @ ref.anchors("embed").T, 3, key="cosine",
               id_key="token_id", tol=COS_TOL, what="nearest_anchors bf16", strings=strings)


# -- threads and start-up ---------------------------------------------------------------------


_CLI_SELECT_1 = """
import json, sys
from actdb.cli import cli
try:
    cli(["query", sys.argv[1], "SELECT 41 + 1 AS answer"], prog_name="actdb")
except SystemExit as e:
    assert not e.code, e.code
heavy = ("torch", "transformers", "matplotlib", "pandas", "zarr", "pyarrow", "obstore",
         "actdb.plot.data", "actdb.plot.figures", "actdb.ingestion")
print(json.dumps(sorted(m for m in heavy if m in sys.modules
                        and type(sys.modules[m]).__name__ == "module")))
"""


def test_cli_select_1_loads_no_plot_zarr_pandas_arrow_or_torch(family_store):
    """`actdb query STORE "SELECT 1"` (the CLI, table output included) imports none of the
    modules only some commands need: not even pyarrow, which the view `acts` and every tensor
    function need (0.05 s of CPU)."""
    out = subprocess.run([sys.executable, "-c", _CLI_SELECT_1, str(family_store(FAMILY))],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = out.stdout.strip().splitlines()
    assert lines[:2] == ["answer", "    42"], lines
    assert json.loads(lines[-1]) == [], lines[-1]


_CLI_NO_CALL = """
import json, os, sys
from actdb.cli import cli
blas = os.environ.get("OPENBLAS_NUM_THREADS")
try:
    cli(["query", sys.argv[1], sys.argv[2]], prog_name="actdb")
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps([blas, "sqlglot" in sys.modules]))
"""


@pytest.mark.parametrize(("query", "header", "sqlglot_loaded"), [
    ("SELECT prompt_id, n_tokens FROM prompts WHERE prompt_id = 0", "prompt_id", False),
    ("SELECT count(*) AS n FROM prompts WHERE prompt_id = 0", "n", True),
])
def test_cli_reads_with_sqlglot_only_queries_that_call_functions(family_store, query, header,
                                                                 sqlglot_loaded):
    """sqlglot's checks are about function calls: a query that calls none is not read by it
    (0.12 s of CPU to import); one that does is. The CLI keeps NumPy's BLAS to one thread
    (its spinning pool cost 0.09 s at import), unless the user set it."""
    store = str(family_store(FAMILY))
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", _CLI_NO_CALL, store, query],
                         capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["1", sqlglot_loaded]
    assert out.stdout.split()[0] == header, out.stdout
    out = subprocess.run([sys.executable, "-c", _CLI_NO_CALL, store, query],
                         capture_output=True, text=True, check=True,
                         env={**env, "OPENBLAS_NUM_THREADS": "3"})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["3", sqlglot_loaded]


def _macros(db: actdb.Database) -> list[str]:
    return sorted(r[0] for r in db.con.execute(
        "SELECT DISTINCT function_name FROM duckdb_functions() "
        "WHERE function_type = 'macro' AND NOT internal").fetchall())


def test_tensor_functions_are_registered_when_first_called(family_store):
    """A connection registers a tensor function (its UDF and macro) the first time a query
    calls it, wherever in the query and however it is spelt; the values are the same as on a
    connection where every function was called before."""
    store = family_store(FAMILY)
    with actdb.connect(store) as db:
        assert _macros(db) == []
        assert db.sql("SELECT count(*) FROM acts").fetchall()[0][0] > 0
        assert _macros(db) == []
        first = db.sql("WITH a AS (SELECT prompt_id, position, site, vec FROM acts) "
                       "SELECT prompt_id, position, site, VEC_NORM(vec) AS n FROM a "
                       "WHERE Dim_Contribution(vec, 1) IS NOT NULL "
                       "ORDER BY prompt_id, position, site").fetchall()
        assert _macros(db) == ["dim_contribution", "vec_norm"]
        db.sql("EXPLAIN SELECT uniform_angle(vec) FROM acts").fetchall()
        assert _macros(db) == ["dim_contribution", "uniform_angle", "vec_norm"]
    with actdb.connect(store) as db:
        db._functions.register(REGISTRY)
        again = db.sql("SELECT prompt_id, position, site, vec_norm(vec) AS n FROM acts "
                       "WHERE dim_contribution(vec, 1) IS NOT NULL "
                       "ORDER BY prompt_id, position, site").fetchall()
    assert first == again and len(first) > 0


def _views(db: actdb.Database) -> list[str]:
    return sorted(r[0] for r in db.con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall())


def test_acts_is_made_when_a_query_first_may_see_it(family_store):
    """The view `acts` (with the Arrow UDFs of its norm and mean columns, whose registration
    imports pyarrow) is made before the first query that names it, in any case or nesting, or
    that lists the catalog; queries over the catalog's own tables alone never make it."""
    store = family_store(FAMILY)
    with actdb.connect(store) as db:
        n_tokens = db.sql("SELECT count(*) FROM tokens").fetchall()[0][0]
        n_sites = db.sql("SELECT count(*) FROM sites").fetchall()[0][0]
        assert db.sql("SELECT 1").fetchall() == [(1,)] and n_tokens > 0
        assert _views(db) == []
        listed = db.sql("SELECT table_name FROM information_schema.tables").fetchall()
        assert ("acts",) in listed and _views(db) == ["acts"]
    with actdb.connect(store) as db:
        assert ("acts",) in db.sql("SELECT view_name FROM duckdb_views()").fetchall()
    with actdb.connect(store) as db:
        columns = db.sql("SELECT name FROM pragma_table_info('acts')").fetchall()
        assert ("norm",) in columns and ("vec",) in columns
    with actdb.connect(store) as db:
        got = db.sql("WITH a AS (SELECT norm FROM ACTS) SELECT count(*), count(norm) FROM a "
                     "WHERE norm > 0").fetchall()
        assert got == [(n_tokens * n_sites, n_tokens * n_sites)]
    with actdb.connect(store) as db:
        got = db.sql('SELECT count(*) FROM (SELECT * FROM "Acts") WHERE mean IS NOT NULL'
                     ).fetchall()
        assert got == [(n_tokens * n_sites,)]
    # a table function taking the view by name, and SHOW as a subquery (review findings)
    with actdb.connect(store) as db:
        got = db.sql("SELECT sum(count) FROM histogram_values('acts', layer)").fetchall()
        assert got == [(n_tokens * n_sites,)]
    with actdb.connect(store) as db:
        assert ("acts",) in db.sql("SELECT name FROM (SHOW ALL TABLES)").fetchall()


@pytest.mark.parametrize(("query", "message"), [
    ("SELECT setseed(0.1) OVER ()", "changes the session"),
    # DuckDB's tree leaves out a named window nothing uses; sqlglot's reading still sees it
    ("SELECT 1 WINDOW w AS (ORDER BY setseed(0.1))", "changes the session"),
    ("SELECT read_csv('x') OVER () FROM prompts", "queries cannot read files"),
    ("SELECT nosuch(prompt_id) OVER () FROM prompts", "unknown function 'nosuch'"),
])
def test_calls_dropped_or_windowed_in_duckdbs_tree_are_still_refused(family_store, query,
                                                                     message):
    """Window calls and unused named windows were refused by name before sqlglot's reading
    became conditional; they still are, with the same sentences (review finding)."""
    with actdb.connect(family_store(FAMILY)) as db, pytest.raises(QueryError, match=message):
        db.sql(query).fetchall()


def test_lazy_registration_keeps_what_a_query_sees(family_store, monkeypatch):
    """A tensor function shadowing a DuckDB built-in (`entropy`) is in place for a window call
    too, whatever ran before; `duckdb_functions()` lists every tensor function on a fresh
    connection; a registration that fails half way (UDF made, macro refused) is finished by
    the next query instead of failing for good."""
    store = family_store(FAMILY)
    with actdb.connect(store) as db:
        q = "SELECT entropy(prompt_id) OVER () FROM prompts"
        with pytest.raises(QueryError) as first:
            db.sql(q).fetchall()
        db.sql("SELECT entropy(vec) FROM acts LIMIT 1").fetchall()
        with pytest.raises(QueryError) as again:
            db.sql(q).fetchall()
        assert str(first.value) == str(again.value)
    with actdb.connect(store) as db:
        listed = {r[0] for r in db.sql(
            "SELECT function_name FROM duckdb_functions() WHERE function_type = 'macro'"
        ).fetchall()}
        assert set(REGISTRY) <= listed
    with actdb.connect(store) as db:
        functions = db._functions
        real_con = functions._con
        failed: list[str] = []

        class MacroRefusedOnce:
            def __getattr__(self, name: str) -> object:
                return getattr(real_con, name)

            def execute(self, sql: str, *a: object) -> object:
                if "MACRO vec_norm" in sql and not failed:
                    failed.append(sql)
                    raise duckdb.Error("injected failure after the UDF was created")
                return real_con.execute(sql, *a)

        monkeypatch.setattr(functions, "_con", MacroRefusedOnce())
        with pytest.raises(QueryError, match="injected"):
            db.sql("SELECT vec_norm(vec) FROM acts LIMIT 1")
        monkeypatch.setattr(functions, "_con", real_con)
        assert failed
        assert db.sql("SELECT vec_norm(vec) AS n FROM acts LIMIT 1").fetchall()[0][0] > 0


def test_thread_policy_keeps_the_callers_setting(big):
    _, db = big
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        db.sql("SELECT avg(vec_norm(normed(vec))) FROM acts").fetchall()
        assert torch.get_num_threads() == 2
        with threads.torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert threads.threads_for(1e6) == 1  # small ops never fan out
    assert 1 <= threads.threads_for(1e12) <= threads.cores()


def test_start_imports_nothing_heavy(family_store):
    """`actdb query STORE "SELECT 1"` loads neither transformers nor matplotlib, and torch only
    when a tensor function runs; reading a local store's vectors and weights loads no zarr
    (0.3 s of CPU to import)."""
    code = f"""
import json, sys
import actdb.cli
seen = {{"cli": sorted(m for m in ("transformers", "matplotlib", "pandas") if m in sys.modules)}}
import actdb
db = actdb.connect({str(family_store(FAMILY))!r})
db.sql("SELECT 1").fetchall()
torch = sys.modules.get("torch")
seen["torch_loaded_by_select_1"] = torch is not None and type(torch).__name__ == "module"
seen["query"] = sorted(m for m in ("transformers", "matplotlib") if m in sys.modules)
db.sql("SELECT vec_norm(vec) FROM acts LIMIT 1").fetchall()
seen["torch_loaded_by_vec_norm"] = type(sys.modules["torch"]).__name__ == "module"
# weights and vectors of a local store are read from their metadata files, without zarr
db.sql("SELECT nearest_anchors(vec, 2), top_logits(vec, 2), cosine_to_anchor(vec, 1) "
       "FROM acts LIMIT 3").fetchall()
seen["zarr_loaded_by_reads"] = "zarr" in sys.modules
print(json.dumps(seen))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"cli": [], "torch_loaded_by_select_1": False, "query": [],
                    "torch_loaded_by_vec_norm": True, "zarr_loaded_by_reads": False}, seen
