"""`actdb serve`'s API on a real store, the server in a subprocess: answers against `actdb
query` and a float64 reference, the sandbox through HTTP, the time and row limits, clients that
go away, 20 clients at once, and the token. (The pages in a browser: test_serve_browser.py.)"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from support.escapes import ESCAPES, SECRET
from support.query_reference import uniform_angle, unit
from support.serving import ROOT, running

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

FAMILY = "gpt2"
# Plain SQL that runs for hours unless stopped, and tensor work that does too.
ENDLESS = "SELECT count(*) FROM range(100000000000000) AS r"
ENDLESS_TENSOR = ("SELECT sum(uniform_angle(a.vec)) FROM acts AS a, range(1000000000) AS r "
                  "WHERE a.site = 'final'")


@pytest.fixture(scope="module")
def store(family_store) -> Path:
    return family_store(FAMILY)


@pytest.fixture(scope="module")
def server(store):
    with running(store, "--max-rows", "50", "--connections", "4") as s:
        yield s


def cli_json(store: Path, sql: str, *params: str) -> list[dict]:
    """`actdb query STORE SQL --format json`'s rows."""
    args = [a for p in params for a in ("-p", p)]
    out = subprocess.run([sys.executable, "-m", "actdb", "query", str(store), sql, "--format",
                          "json", "--device", "cpu", *args], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def cli_error(store: Path, sql: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "actdb", "query", str(store), sql, "--device",
                           "cpu", *args], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done
    return done.stderr.strip().removeprefix("Error: ")


def close(a: float | None, b: float | None, rel: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def test_answers_match_the_cli_and_a_float64_reference(server, store, reference):
    sql = ("SELECT s.module, a.site, a.prompt_id, a.position, a.norm, uniform_angle(a.vec) AS "
           "angle, top_logits(a.vec, 1)[1].token_id AS top, prob(a.vec, top_logits(a.vec, 1)"
           "[1].token_id) AS p FROM acts AS a JOIN sites AS s USING (model, site) "
           "WHERE a.model = $m AND a.prompt_id < 3 ORDER BY a.site, a.prompt_id, a.position")
    status, body = server.query(sql, {"m": FAMILY})
    assert status == 200, body
    assert body["columns"] == ["module", "site", "prompt_id", "position", "norm", "angle",
                               "top", "p"]
    assert body["truncated"] is True and body["row_count"] == 50  # --max-rows 50
    rows = [dict(zip(body["columns"], r, strict=True)) for r in body["rows"]]
    # the same rows as `actdb query --format json`
    cli = cli_json(store, sql + " LIMIT 50", f"m={FAMILY}")
    assert len(cli) == 50
    for got, want in zip(rows, cli, strict=True):
        assert got.keys() == want.keys()
        for k in got:
            assert (close(got[k], want[k]) if isinstance(got[k], float) else got[k] == want[k]), (
                k, got, want)
    # and the float64 reference: the hooked norm inputs and the model's own weights
    ref = reference(FAMILY)
    for r in rows:
        site = ref.sites[r["module"]]
        x = site.x[ref.rows(r["prompt_id"], r["position"])]
        assert math.isclose(r["norm"], float(np.linalg.norm(x)), rel_tol=1e-5)
        assert abs(r["angle"] - float(uniform_angle(x[None])[0])) < 0.05
        logits = ref.lens_logits(x[None])[0]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] > 1e-2:  # a near tie may flip within float16 rounding
            assert r["top"] == int(logits.argmax())
        assert math.isclose(r["p"], float(probs[r["top"]]), rel_tol=2e-2)


def test_arrow_ipc_when_asked(server):
    import pyarrow as pa

    sql = "SELECT prompt_id, position, token, norm FROM acts WHERE site = 'final' ORDER BY 1, 2"
    status, body = server.query(sql)
    status_a, raw, headers = server.post("/api/query", {"sql": sql},
                                         headers={"Accept": "application/vnd.apache.arrow.stream"})
    assert status == status_a == 200
    table = pa.ipc.open_stream(raw).read_all()
    assert table.column_names == body["columns"]
    assert [list(r.values()) for r in table.to_pylist()] == body["rows"]
    assert headers.get("x-actdb-truncated") == "true"  # more than 50 final rows
    _, raw2, _ = server.post("/api/query", {"sql": sql, "format": "arrow"})
    assert pa.ipc.open_stream(raw2).read_all().equals(table)


@pytest.mark.parametrize("sql", [
    "SELEC 1",
    "SELECT nosuchcolumn FROM acts",
    "SELECT cosine_to_anchor(vec, 'no such token at all') FROM acts LIMIT 1",
    "SELECT vec FROM acts LIMIT 1",  # handles: refused as the CLI's JSON output refuses them
])
def test_errors_are_the_clis(server, store, sql):
    status, body = server.query(sql)
    assert status == 400
    assert body == {"error": cli_error(store, sql, "--format", "json")}


def test_sandbox_escapes_are_refused(tmp_path, family_store):
    """Every escape the sandbox is tested against (support/escapes.py), sent through the API:
    400 with one sentence, no secret in it, nothing written, the store byte for byte the same."""
    import hashlib
    import shutil

    store = tmp_path / "s.actdb"
    shutil.copytree(family_store(FAMILY), store)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text(f"{SECRET}\n{SECRET},1\n")
    target = tmp_path / "target.out"

    def digest() -> dict[str, str]:
        return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(store.rglob("*")) if p.is_file()}

    before = digest()
    reference = ("SELECT site, count(*), round(sum(vec_norm(vec)), 6) FROM acts GROUP BY 1 "
                 "ORDER BY 1")
    with running(store, "--query-timeout", "60") as s:
        want = s.query(reference)[1]["rows"]
        for template in ESCAPES:
            sql = template.format(secret=outside / "secret.csv", target=target,
                                  catalog=store / "catalog.duckdb", dir=outside)
            status, body = s.query(sql)
            assert status == 400, (sql, body)
            assert SECRET not in json.dumps(body), (sql, body)
            assert "Traceback" not in body["error"], body
            assert not target.exists(), sql
        # parameters are values, never SQL
        status, body = s.query("SELECT $x AS x", {"x": "'; DROP VIEW acts; --"})
        assert status == 200 and body["rows"] == [["'; DROP VIEW acts; --"]]
        assert s.query(reference)[1]["rows"] == want
    assert sorted(p.name for p in outside.iterdir()) == ["secret.csv"]
    assert digest() == before


def test_bad_requests_say_what(server):
    assert server.post("/api/query", {"params": {}})[0] == 400
    status, body, _ = server.post("/api/query", {"sql": "SELECT 1", "params": "x"})
    assert status == 400 and "params" in body["error"]
    status, body, _ = server.post("/api/query", ["SELECT 1"])
    assert status == 400 and "object" in body["error"]


def test_time_limit_cancels_and_the_server_keeps_answering(store):
    with running(store, "--query-timeout", "1.5", "--connections", "2") as s:
        for sql in (ENDLESS, ENDLESS_TENSOR):
            started = time.monotonic()
            status, body = s.query(sql)
            took = time.monotonic() - started
            assert status == 400 and "time limit of 1.5 s" in body["error"], body
            # by the limit itself, not by the server's answer to an overdue query (6.5 s)
            assert took < 6, took
        assert s.query("SELECT 42 AS x") == (200, {
            "columns": ["x"], "rows": [[42]], "row_count": 1, "truncated": False,
            "max_rows": 10000, "seconds": pytest.approx(0, abs=5)})
        status, body = s.query("SELECT count(*) FROM acts WHERE site = 'final'")
        assert status == 200 and body["rows"][0][0] > 0


def test_a_query_whose_client_goes_away_is_cancelled(store):
    # one connection and no time limit worth the name: the second query can only be answered
    # once the first, whose client gave up, has been stopped
    with running(store, "--query-timeout", "600", "--connections", "1") as s:
        for sql in (ENDLESS, ENDLESS_TENSOR):
            with pytest.raises((TimeoutError, socket.timeout, OSError)):
                s.query(sql, timeout=1.5)
            started = time.monotonic()
            status, body = s.query("SELECT 7 AS x", timeout=60)
            assert status == 200 and body["rows"] == [[7]]
            assert time.monotonic() - started < 30


def test_twenty_concurrent_clients(server, store):
    import actdb

    sql = ("SELECT position, top_logits(vec, 3) AS top, uniform_angle(vec) AS angle FROM acts "
           "WHERE model = $m AND prompt_id = $p AND site = $s ORDER BY position")
    sites = ["blocks.0.ln1", "blocks.1.ln2", "final"]
    cases = [{"m": FAMILY, "p": i % 6, "s": sites[i % 3]} for i in range(20)]
    with actdb.connect(store, device="cpu") as db:
        want = [[list(r) for r in db.sql(sql, params=c).fetchall()] for c in cases]
    barrier = threading.Barrier(20)

    def ask(case: dict) -> tuple[int, dict]:
        barrier.wait()  # all 20 requests in flight together
        return server.query(sql, case)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, cases))
    for (status, body), rows in zip(answers, want, strict=True):
        assert status == 200, body
        assert len(body["rows"]) == len(rows) > 0
        for got, exp in zip(body["rows"], rows, strict=True):
            assert got[0] == exp[0] and got[1] == exp[1]
            assert math.isclose(got[2], exp[2], rel_tol=1e-9)


def test_token_required_beyond_localhost(store):
    with running(store, "--host", "0.0.0.0") as s:
        assert "?token=" in s.url
        token = s.url.split("?token=")[1]
        local = s.base.replace("0.0.0.0", "127.0.0.1")
        s.url = local
        status, body, _ = s.post("/api/query", {"sql": "SELECT 1"})
        assert status == 401 and "token" in body["error"]
        wrong = {"Authorization": "Bearer " + "x" * len(token)}
        assert s.post("/api/query", {"sql": "SELECT 1"}, headers=wrong)[0] == 401
        assert s.get("/")[0] == 401
        right = {"Authorization": f"Bearer {token}"}
        assert s.post("/api/query", {"sql": "SELECT 1 AS x"}, headers=right)[1]["rows"] == [[1]]
        status, _, headers = s.get(f"/?token={token}")
        assert status == 200 and f"actdb_token={token}" in headers.get("set-cookie", "")
        cookie = {"Cookie": f"actdb_token={token}"}
        assert s.post("/api/query", {"sql": "SELECT 2 AS x"}, headers=cookie)[1]["rows"] == [[2]]


def test_localhost_guards(server):
    # a page elsewhere reaching 127.0.0.1 through its own DNS name is refused
    status, body, _ = server.get("/", headers={"Host": "attacker.example:80"})
    assert status == 403
    # a cross-site form's text/plain POST is refused before any query runs
    import urllib.request

    req = urllib.request.Request(server.base + "api/query", data=b'{"sql": "SELECT 1"}',
                                 method="POST", headers={"Content-Type": "text/plain"})
    from support.serving import _send

    assert _send(req, 30)[0] == 415


def test_start_errors_are_one_sentence(tmp_path, store):
    done = subprocess.run([sys.executable, "-m", "actdb", "serve", str(tmp_path / "none")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1 and done.stderr.startswith("Error: ")
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "actdb", "serve", str(store), "--token",
                           "short"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1 and "at least 16" in done.stderr


def test_functions_are_the_registry(server):
    import actdb

    status, body, _ = server.get("/api/functions")
    assert status == 200 and body["functions"] == actdb.Database.functions()


def test_trajectory_against_a_float64_reference(server, store, reference):
    import actdb

    ref = reference(FAMILY)
    positions = [1, 3]
    status, body, _ = server.post("/api/trajectory", {"model": FAMILY, "prompt_id": 0,
                                                      "positions": positions,
                                                      "role": "pre_attn"})
    assert status == 200, body
    # the projection: PCA of the stored unit directions at pre_attn and final sites, fitted
    # here by an eigendecomposition of their covariance
    with actdb.connect(store, device="cpu") as db:
        sample = db.vectors("SELECT vec FROM acts WHERE model = $m AND role IN ('pre_attn', "
                            "'final') AND norm > 0", params={"m": FAMILY}).double().numpy()
        modules = dict(db.sql("SELECT site, module FROM sites WHERE model = $m",
                              params={"m": FAMILY}).fetchall())
    u = unit(sample)
    assert body["projection"]["fitted_on"] == len(u)  # the tiny store: every row
    mean = u.mean(0)
    vals, vecs = np.linalg.eigh(np.cov(u.T, bias=True))
    axes = vecs[:, ::-1][:, :2].T  # [2, d], largest first
    axes *= np.sign(axes[np.arange(2), np.abs(axes).argmax(1)])[:, None]
    np.testing.assert_allclose(body["projection"]["explained"], vals[::-1][:2] / vals.sum(),
                               rtol=1e-6)
    # each point: the hooked float64 input, on the sphere, through the projection
    for path in body["paths"]:
        assert path["position"] in positions
        assert [p["layer"] for p in path["points"]] == [0, 1, 2]
        for p in path["points"]:
            x = ref.sites[modules[p["site"]]].x[ref.rows(0, path["position"])]
            want = (unit(x) - mean) @ axes.T
            assert np.allclose([p["x"], p["y"]], want, atol=2e-3), (p, want)
    # each anchor: the model's own LM-head row, normalized, through the same map
    assert body["anchors"]
    for a in body["anchors"]:
        row = ref.W_U[a["token_id"]]
        want = (row / np.linalg.norm(row) - mean) @ axes.T
        assert np.allclose([a["x"], a["y"]], want, atol=2e-3), (a, want)


def test_projection_docstring_example():
    import doctest

    from actdb.serve import projection

    assert doctest.testmod(projection).failed == 0


def test_a_store_being_ingested_is_served_as_readers_see_it(tmp_path, family_store, model_dir):
    """An ingest into the served store runs beside it; every answer meanwhile is a committed
    state, and the new prompts appear once the connections refresh their snapshots."""
    import shutil

    from support.prompts import PROMPTS

    import actdb

    store = tmp_path / "s.actdb"
    shutil.copytree(family_store(FAMILY), store)
    more = [f"Prompt number {i} arrives while the explorer serves the store." for i in range(24)]
    count = "SELECT count(*) FROM prompts"
    seen: list[int] = []
    with running(store, "--connections", "2") as s:
        assert s.query(count)[1]["rows"] == [[len(PROMPTS)]]
        done = threading.Event()

        def ingest() -> None:
            try:
                actdb.ingest(store, model=str(model_dir(FAMILY)), prompts=PROMPTS + more,
                             batch_size=2, device="cpu", name=FAMILY, chunk_tokens=8)
            finally:
                done.set()

        worker = threading.Thread(target=ingest)
        worker.start()
        while not done.is_set():
            status, body = s.query(count)
            assert status == 200, body
            seen.append(body["rows"][0][0])
        worker.join()
        deadline = time.monotonic() + 30
        while seen[-1] != len(PROMPTS) + len(more) and time.monotonic() < deadline:
            time.sleep(0.5)
            seen.append(s.query(count)[1]["rows"][0][0])
        # the new rows' tensors are there too: a tensor function reads them
        status, body = s.query("SELECT count(vec_norm(vec)) FROM acts WHERE prompt_id >= $p",
                               {"p": len(PROMPTS)})
        assert status == 200 and body["rows"][0][0] > 0, body
    assert seen[-1] == len(PROMPTS) + len(more), seen
    assert all(len(PROMPTS) <= n <= len(PROMPTS) + len(more) for n in seen)


def test_ctrl_c_stops_running_queries_and_the_server(store):
    import signal

    with running(store, "--query-timeout", "600", "--connections", "1") as s:
        answers: list = []
        asking = threading.Thread(target=lambda: answers.append(s.query(ENDLESS, timeout=60)))
        asking.start()
        time.sleep(2)  # the query is running
        started = time.monotonic()
        s.process.send_signal(signal.SIGINT)
        assert s.process.wait(timeout=20) == 130  # as a shell reports Ctrl-C
        asking.join(timeout=20)
        assert time.monotonic() - started < 10
    assert answers == [(400, {"error": "the query was cancelled: the server is stopping"})]
