"""Sharded ingest (`--shard i/N`, `actdb merge`, `--cluster`): shards run side by side as
real processes, then merge, and the store equals a single-process ingest vector for vector
(local and on a local S3 server); a killed shard resumes; merge refuses what it cannot merge
and changes nothing then; an unsharded ingest waits for the shards to be merged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from support.s3server import S3Server

import actdb
from actdb.cli import cli
from actdb.errors import IngestError, StoreBusyError
from actdb.store.objects import Objects, parse_url

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
# Varied lengths; with 4-row chunks (norm/mean chunks of 128 rows) each shard's ~60 tokens
# leave a gap of whole direction chunks before the next shard's aligned start.
PROMPTS = [f"Prompt {i}: the quick brown fox jumps over {i % 5} lazy dogs" + " again" * (i % 4)
           for i in range(12)]
# A shard process: the CLI with small commits (a few prompts each), so that a kill leaves
# some of a shard committed and the next commit patches a chunk the last one began.
_SCRIPT = (
    "import os, sys, importlib; importlib.import_module('actdb.ingestion.run').FLUSH_TOKENS "
    "= int(os.environ.get('FLUSH_TOKENS', 40)); "
    "from actdb.cli import cli; cli(sys.argv[1:])"
)
def _file_hashes(store: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and not p.name.endswith(".lock")}


ARGS = ["--batch-size", "1", "--device", "cpu", "--name", "m", "--chunk-tokens", "4", "-q"]


def _ingest(store: str | Path, model: Path, **kw: object) -> None:
    actdb.ingest(store, model=str(model), prompts=PROMPTS, batch_size=1, device="cpu",
                 name="m", chunk_tokens=4, **kw)  # type: ignore[arg-type]


def _start(store: str | Path, model: Path, prompts: Path, shard: str, *,
           fault: str | None = None, env: dict[str, str] | None = None
           ) -> subprocess.Popen[str]:
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    full.pop("ACTDB_FAULT", None)
    if fault:
        full["ACTDB_FAULT"] = fault
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, "ingest", str(store), "--model", str(model),
         "--prompts", str(prompts), "--shard", shard, *ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


def _run_shards(store: str | Path, model: Path, prompts: Path, n: int = 2,
                env: dict[str, str] | None = None) -> None:
    procs = [_start(store, model, prompts, f"{i}/{n}", env=env) for i in range(n)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err


def vectors(store: str | Path) -> dict[str, np.ndarray]:
    """Everything the store returns per (prompt text, position, site, head), in that order."""
    with actdb.connect(store) as db:
        t = db.sql(
            "SELECT p.text, a.position, a.site, coalesce(a.head, -1) AS head, a.token_id, "
            "a.token, a.norm, a.mean, to_list(a.vec) AS x FROM acts a JOIN prompts p "
            "USING (prompt_id) WHERE a.model = 'm' ORDER BY p.text, a.position, a.site, head"
        ).to_arrow_table()
    out = {c: np.asarray(t.column(c).to_pylist(), dtype=object)
           for c in ("text", "position", "site", "head", "token_id", "token")}
    for c in ("norm", "mean"):
        out[c] = np.asarray(t.column(c).to_pylist(), dtype=np.float64)
    out["x"] = np.asarray(t.column("x").to_pylist(), dtype=np.float64)
    return out


def assert_same_vectors(store: str | Path, reference: dict[str, np.ndarray]) -> None:
    got = vectors(store)
    assert len(got["x"]) == len(reference["x"]) > 0
    for key, want in reference.items():
        if want.dtype == object:
            assert (got[key] == want).all(), key
        else:  # batch size 1 both ways: the same forward passes, the same bits
            np.testing.assert_array_equal(got[key], want, err_msg=key)


def raw_directions(store: Path) -> dict[tuple[str, int], np.ndarray]:
    """Directions read with plain DuckDB and plain zarr at the rows the catalog names."""
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    rows = con.execute("SELECT p.text, t.position, t.row FROM tokens t JOIN prompts p "
                       "USING (prompt_id) ORDER BY 1, 2").fetchall()
    mid, site = con.execute("SELECT m.model_id, s.site FROM models m JOIN sites s USING "
                            "(model) ORDER BY s.site_id LIMIT 1").fetchone()
    con.close()
    arr = zarr.open_group(str(store / "tensors.zarr"), mode="r")[
        f"models/{mid}/acts/{site}/direction"]
    return {(text, pos): np.asarray(arr[row], dtype=np.float64) for text, pos, row in rows}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, model_dir: Callable[[str], Path]) -> Path:
    store = tmp_path_factory.mktemp("single") / "one.actdb"
    _ingest(store, model_dir("gpt2"))
    return store


@pytest.fixture(scope="module")
def reference(single: Path) -> dict[str, np.ndarray]:
    return vectors(single)


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory, model_dir: Callable[[str], Path],
           prompts_file: Path) -> Path:
    """2 shard ingests as processes side by side, then `actdb merge` (a copy of the store
    before the merge is kept beside it, see `unmerged`)."""
    store = tmp_path_factory.mktemp("sharded") / "s.actdb"
    _run_shards(store, model_dir("gpt2"), prompts_file)
    assert sorted(p.name for p in (store / "shards").iterdir()) == ["0-of-2", "1-of-2"]
    shutil.copytree(store, store.parent / "unmerged.actdb")
    res = CliRunner().invoke(cli, ["merge", str(store)])
    assert res.exit_code == 0, res.output
    return store


def test_two_shards_equal_one_process(merged: Path, single: Path,
                                      reference: dict[str, np.ndarray]) -> None:
    assert_same_vectors(merged, reference)
    assert not (merged / "shards").exists()
    a, b = raw_directions(merged), raw_directions(single)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    # Shard 1 starts on a whole norm/mean chunk (4 * 32 rows): rows between are unused.
    con = duckdb.connect(str(merged / "catalog.duckdb"), read_only=True)
    starts = [r[0] for r in
              con.execute("SELECT row_start FROM prompt_runs ORDER BY 1").fetchall()]
    n_rows = con.execute("SELECT n_rows FROM models").fetchone()[0]
    one = duckdb.connect(str(single / "catalog.duckdb"), read_only=True)
    first_half = one.execute("SELECT sum(n_tokens) FROM prompt_runs WHERE prompt_id < 6")
    tokens0 = first_half.fetchone()[0]
    one.close()
    assert starts[0] == 0 and starts[6] == -(-tokens0 // 128) * 128 > tokens0
    last = con.execute("SELECT row_start + n_tokens FROM prompt_runs ORDER BY 1 DESC LIMIT 1")
    assert n_rows == last.fetchone()[0]
    con.close()
    # verify, info and a partitioned query all handle the unused rows
    res = CliRunner().invoke(cli, ["verify", str(merged), "--full"])
    assert res.exit_code == 0, res.output
    with actdb.connect(merged) as db, actdb.connect(single) as ref:
        assert db.info().models[0]["tokens"] == ref.info().models[0]["tokens"]
        q = "SELECT count(*), sum(norm) FROM acts"
        assert db.sql(q).fetchall()[0] == pytest.approx(ref.sql(q).fetchall()[0])
        # Read-ahead and bulk windows stop where a shard's rows end, before the gap.
        mid = next(iter(db.source.models))
        end0 = tokens0  # shard 0's rows are 0..tokens0 - 1
        assert db.source.segment_end(mid, 0) == end0
        assert db.source.segment_end(mid, end0 - 1) == end0
        assert db.source.segment_end(mid, starts[6]) == n_rows
        # a scan walks each site's rows in order: bulk windows must stop at the gap
        q = ("SELECT site, sum(uniform_angle(vec)), sum(logit(vec, 5)) FROM acts "
             "GROUP BY site ORDER BY site")
        assert db.sql(q).fetchall() == ref.sql(q).fetchall()


def test_a_killed_shard_resumes(tmp_path: Path, model_dir: Callable[[str], Path],
                                prompts_file: Path, reference: dict[str, np.ndarray]) -> None:
    store = tmp_path / "k.actdb"
    model = model_dir("gpt2")
    killed = _start(store, model, prompts_file, "1/2", fault="tensors_written:3")
    killed.communicate(timeout=240)
    assert killed.returncode == -9
    _ingest(store, model, shard=(0, 2))
    res = CliRunner().invoke(cli, ["merge", str(store)])
    assert res.exit_code == 1 and "1-of-2" in res.output and "not finished" in res.output
    with actdb.connect(store) as db:  # the store opens; shard 1's rows are not visible yet
        assert db.sql("SELECT count(*) FROM prompt_runs").fetchall() == [(0,)]
    with duckdb.connect(str(store / "shards" / "1-of-2" / "catalog.duckdb")) as con:
        committed = con.execute("SELECT count(*) FROM prompt_runs").fetchall()[0][0]
    assert 0 < committed < 6  # two commits of a few prompts each, before the kill
    summary = actdb.ingest(store, model=str(model), prompts=PROMPTS, batch_size=1,
                           device="cpu", name="m", chunk_tokens=4, shard="1/2")
    assert summary.prompts_new == 6 - committed
    actdb.merge(store)
    assert_same_vectors(store, reference)
    assert CliRunner().invoke(cli, ["verify", str(store), "--full"]).exit_code == 0


def test_merge_refuses_and_changes_nothing(tmp_path: Path, model_dir: Callable[[str], Path]
                                           ) -> None:
    store = tmp_path / "r.actdb"
    model = model_dir("gpt2")
    actdb.ingest(store, model=str(model), prompts=PROMPTS[:1], batch_size=1, device="cpu",
                 name="m", chunk_tokens=4)
    before = vectors(store)
    # Only shard 0 of 2: the other is missing.
    _ingest(store, model, shard=(0, 2))
    res = CliRunner().invoke(cli, ["merge", str(store)])
    assert res.exit_code == 1 and "1-of-2" in res.output and "missing" in res.output
    assert "Traceback" not in res.output
    # An unsharded ingest is refused while shards are not merged.
    with pytest.raises(IngestError, match="not merged"):
        _ingest(store, model)
    # A shard of another plan (3 shards, other prompts) would own rows shard 0/2 wrote: it is
    # refused before it writes a byte (tensors, catalogs).
    files = _file_hashes(store)
    with pytest.raises(IngestError, match="another plan"):
        actdb.ingest(store, model=str(model), prompts=PROMPTS[:5], batch_size=1, device="cpu",
                     name="m", chunk_tokens=4, shard="1/3")
    assert _file_hashes(store) == files
    # Nothing changed: the store opens, verifies and holds what it held.
    assert CliRunner().invoke(cli, ["verify", str(store)]).exit_code == 0
    after = vectors(store)
    for k in before:
        assert (after[k] == before[k]).all()


def _check_exclusion(location: str) -> None:
    """Shards share the store's lock; an ingest or merge holds it alone."""
    from actdb.store.store import open_backend

    s0, s1, s0_again, whole = (open_backend(location) for _ in range(4))
    s0.lock("0-of-2")
    try:
        s1.lock("1-of-2")  # shards side by side
        s1.unlock()
        with pytest.raises(StoreBusyError):  # but one process per shard
            s0_again.lock("0-of-2")
        with pytest.raises(StoreBusyError, match="shard ingests"):
            whole.lock()
    finally:
        s0.unlock()
    whole.lock()
    try:
        with pytest.raises(StoreBusyError, match="another ingest"):
            s0_again.lock("0-of-2")
    finally:
        whole.unlock()
    s0_again.lock("0-of-2")  # free again
    s0_again.unlock()


def test_an_ingest_and_shards_exclude_each_other(tmp_path: Path,
                                                 model_dir: Callable[[str], Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACTDB_LOCK_WAIT_S", "0.1")
    store = tmp_path / "l.actdb"
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=PROMPTS[:1], batch_size=1,
                 device="cpu", name="m", chunk_tokens=4)
    _check_exclusion(str(store))
    _registration_waits_and_an_error_there_releases_the_lock(store)


def test_two_shards_on_s3_equal_one_process(s3: S3Server, model_dir: Callable[[str], Path],
                                            prompts_file: Path,
                                            reference: dict[str, np.ndarray],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from actdb.store import faults

    url = s3.url()
    # one commit (one catalog publication) per shard: a round trip each is slow on moto
    _run_shards(url, model_dir("gpt2"), prompts_file, env={**s3.env(), "FLUSH_TOKENS": "4096"})
    keys = [k for k, _ in Objects(parse_url(url)).list("shards")]
    assert any(k.startswith("shards/0-of-2/") for k in keys)
    assert any(k.startswith("shards/1-of-2/") for k in keys)
    # A merge stopped (killed) while removing the first shard: all of it gone but its
    # pointer and catalog, so it is still listed, and the next merge only finishes.
    monkeypatch.setattr(faults, "_SPEC", ("shard_removal", 1, "enospc"))
    monkeypatch.setattr(faults, "_seen", 0)
    with pytest.raises(OSError):
        actdb.merge(url)
    monkeypatch.setattr(faults, "_SPEC", None)
    left = sorted(k for k, _ in Objects(parse_url(url)).list("shards/0-of-2"))
    assert left[0] == "shards/0-of-2/catalog.json" and len(left) == 2, left
    res = CliRunner().invoke(cli, ["merge", url])
    assert res.exit_code == 0 and "already merged" in res.output, res.output
    assert Objects(parse_url(url)).list("shards") == []
    assert_same_vectors(url, reference)
    # Shard 1 starts on a whole shard object of norm/mean chunks (4 * 32 * 16 rows).
    with actdb.connect(url) as db:
        starts = sorted(r[0] for r in db.sql("SELECT min(row_start) FROM prompt_runs "
                                             "GROUP BY prompt_id >= 6").fetchall())
    assert starts == [0, 2048]
    res = CliRunner().invoke(cli, ["verify", url, "--full"])
    assert res.exit_code == 0, res.output


def test_a_dask_cluster_ingest_equals_one_process(
        tmp_path: Path, model_dir: Callable[[str], Path], single: Path,
        reference: dict[str, np.ndarray]) -> None:
    import logging

    from distributed import Client, LocalCluster

    store = tmp_path / "d.actdb"
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None, silence_logs=logging.ERROR)
    client = Client(cluster)
    try:
        summary = actdb.ingest(store, model=str(model_dir("gpt2")), prompts=PROMPTS,
                               batch_size=1, device="cpu", name="m", chunk_tokens=4,
                               cluster=client)
        assert summary.prompts_new == len(PROMPTS)
        assert not (store / "shards").exists()
        assert_same_vectors(store, reference)
        # The cluster query's row partitions cross the unused rows between the shards.
        q = "SELECT site, count(*) AS n, sum(norm) AS s FROM acts GROUP BY site ORDER BY site"
        with actdb.connect(store, cluster=client) as dist, actdb.connect(single) as one:
            got, want = dist.sql(q).fetchall(), one.sql(q).fetchall()
        assert [r[:2] for r in got] == [r[:2] for r in want]
        np.testing.assert_allclose([r[2] for r in got], [r[2] for r in want], rtol=1e-6)
    finally:
        client.close()
        cluster.close()


def test_on_s3_an_ingest_and_shards_exclude_each_other(s3: S3Server,
                                                       model_dir: Callable[[str], Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url = s3.url()
    actdb.ingest(url, model=str(model_dir("gpt2")), prompts=PROMPTS[:1], batch_size=1,
                 device="cpu", name="m", chunk_tokens=4)
    _check_exclusion(url)
    monkeypatch.setenv("ACTDB_LEASE_S", "0.6")
    monkeypatch.setenv("ACTDB_LOCK_WAIT_S", "0.1")
    _registration_lease_waits_while_renewed(url)


# -- robustness (review of the sharded ingest) ---------------------------------------------


@pytest.mark.parametrize("spec", ["²/3", "٣/4", "3/2", "0/0", "-1/2", " 1/2", "1/2 ", "1", "a/b",
                                  "1//2", "1/2\n", "0/100001", "0/" + "9" * 40, (2, 2),
                                  (0, True), (0, 2, 1), (0.0, 2), (0, 10**30), b"0/2"])
def test_a_bad_shard_is_one_clear_error(spec: object, tmp_path: Path) -> None:
    from actdb.errors import ShardSpecError
    from actdb.ingestion.shards import parse_shard

    with pytest.raises(ShardSpecError,
                       match=r"^shard .+ (is not I/N|I must be from 0|N must be at most 100000)"
                       ) as err:
        parse_shard(spec)  # type: ignore[arg-type]
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    if isinstance(spec, str):  # the CLI: a usage error (exit 2), no traceback, nothing made
        res = CliRunner().invoke(cli, ["ingest", str(tmp_path / "x.actdb"), "--model", "gpt2",
                                       "--prompts", "-", "--shard", spec], input="hi\n")
        assert res.exit_code == 2, res.output
        assert "--shard" in res.output and repr(spec) in res.output
        assert "Traceback" not in res.output and not (tmp_path / "x.actdb").exists()


def test_parse_shard_accepts_good_specs() -> None:
    from actdb.ingestion.shards import parse_shard

    assert parse_shard("0/1") == (0, 1)
    assert parse_shard("12/13") == (12, 13)
    assert parse_shard((1, 2)) == (1, 2)
    assert parse_shard([np.int64(3), np.int32(4)]) == (3, 4)  # NumPy's integers too
    assert parse_shard("99999/100000") == (99999, 100000)


@pytest.mark.parametrize("shards", [0, -1, 1.5, True, 100_001])
def test_a_cluster_ingest_needs_one_shard_or_more(shards: object, tmp_path: Path) -> None:
    from actdb.errors import ShardSpecError
    from actdb.ingestion.cluster import ingest_on_cluster
    from actdb.ingestion.options import IngestOptions

    # refused before any cluster is started or anything is read
    opts = IngestOptions(store=tmp_path / "c.actdb", model="gpt2",
                         prompts=tmp_path / "absent.txt")
    with pytest.raises(ShardSpecError, match=rf"^shards={shards!r}: .* at least 1"):
        ingest_on_cluster(opts, cluster="local:1", shards=shards)  # type: ignore[arg-type]
    assert not (tmp_path / "c.actdb").exists()


@pytest.fixture()
def unmerged(merged: Path, tmp_path: Path) -> Path:
    """A fresh copy of the sharded store as its two finished shards left it, before merge."""
    store = tmp_path / "u.actdb"
    shutil.copytree(merged.parent / "unmerged.actdb", store)
    return store


def test_a_merge_killed_while_removing_shards_is_finished_by_the_next(
        unmerged: Path, merged: Path, model_dir: Callable[[str], Path],
        reference: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    from actdb.store import faults

    store, model = unmerged, model_dir("gpt2")
    # The merge's transaction commits; its removal stops within the second shard (a kill
    # there: everything of that shard gone but its catalog).
    monkeypatch.setattr(faults, "_SPEC", ("shard_removal", 2, "enospc"))
    monkeypatch.setattr(faults, "_seen", 0)
    with pytest.raises(OSError):
        actdb.merge(store)
    monkeypatch.setattr(faults, "_SPEC", None)
    assert [p.name for p in (store / "shards").iterdir()] == ["1-of-2"]
    assert [p.name for p in (store / "shards" / "1-of-2").iterdir()] == ["catalog.duckdb"]
    res = CliRunner().invoke(cli, ["merge", str(store)])
    assert res.exit_code == 0 and "already merged" in res.output, res.output
    assert not (store / "shards").exists()
    assert_same_vectors(store, reference)
    # The catalog is the normal merge's, row for row.
    q = ("SELECT * FROM {} ORDER BY ALL", ["prompts", "prompt_runs", "tokens", "models",
                                           "sites", "meta"])
    with duckdb.connect(str(store / "catalog.duckdb"), read_only=True) as a, \
            duckdb.connect(str(merged / "catalog.duckdb"), read_only=True) as b:
        for table in q[1]:
            sql = q[0].format(table)
            assert a.execute(sql).fetchall() == b.execute(sql).fetchall(), table

    # A finished shard run again after its merge has nothing to do: it says so and writes
    # nothing (an empty shard catalog would keep unsharded ingests out until removed).
    files = _file_hashes(store)
    res = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(model), "--prompts",
                                   "-", "--shard", "1/2", *ARGS[:-1]],
                             input="\n".join(PROMPTS) + "\n")
    assert res.exit_code == 0, res.output
    assert _file_hashes(store) == files
    assert not (store / "shards").is_dir() or not any((store / "shards").rglob("catalog*"))
    assert "shard 1/2: every prompt is already stored" in res.output
    # Unsharded ingests go on: one more prompt, after the merged rows.
    summary = actdb.ingest(store, model=str(model), prompts=[*PROMPTS, "one more prompt"],
                           batch_size=1, device="cpu", name="m", chunk_tokens=4)
    assert summary.prompts_new == 1
    assert CliRunner().invoke(cli, ["verify", str(store)]).exit_code == 0


def _chunk_file(store: Path, row: int, field: str = "direction") -> tuple[Path, str]:
    """The chunk file holding `row` of the first site's `field`, and the site."""
    from actdb.store.store import Store

    with Store(store) as st:
        m = st.catalog.models()[0]
        site = st.catalog.sites(m.model)[0].site
        c = st.arrays.act_array(m.model_id, site, field).chunks[0]
        layout = st.arrays.act_layout(m.model_id, site, field)
        assert layout is not None
        return Path(layout.path(row // c)), site  # type: ignore[union-attr]


def _drop_prompt(store: Path, prompt_id: int) -> None:
    """Catalog damage no ingest makes: a prompt's run and tokens gone, its rows left."""
    with duckdb.connect(str(store / "catalog.duckdb")) as con:
        con.execute("DELETE FROM tokens WHERE prompt_id = ?", [prompt_id])
        con.execute("DELETE FROM prompt_runs WHERE prompt_id = ?", [prompt_id])


def _verify(store: Path) -> list[str]:
    from actdb.store.store import Store
    from actdb.store.verify import verify

    with Store(store) as st:
        return verify(st)


def test_verify_allows_missing_chunks_only_between_shards(
        single: Path, merged: Path, tmp_path: Path) -> None:
    with duckdb.connect(str(merged / "catalog.duckdb"), read_only=True) as con:
        runs = con.execute("SELECT prompt_id, row_start, n_tokens FROM prompt_runs "
                           "ORDER BY row_start").fetchall()
    end0, start1 = runs[5][1] + runs[5][2], runs[6][1]
    assert start1 - end0 > 8  # whole 4-row direction chunks lie in the gap
    assert _verify(merged) == []
    # The unused rows between the shards have no chunk files: that is no damage.
    gap_chunk, _ = _chunk_file(merged, start1 - 4)
    assert not gap_chunk.exists()
    for name, source in (("one", single), ("merged", merged)):
        # A chunk file of committed rows deleted: reported, in either store.
        store = tmp_path / name
        shutil.copytree(source, store)
        chunk, site = _chunk_file(store, runs[2][1])
        chunk.unlink()
        problems = _verify(store)
        assert any(site in p and "missing" in p for p in problems), problems
        # Rows in no prompt's run, not before a shard's aligned start: a hole in the
        # catalog, and the chunk files of those rows are checked too.
        store = tmp_path / f"{name}-hole"
        shutil.copytree(source, store)
        pid, start, n = next(r for r in runs if r[2] > 8 and r[1] < end0)
        _drop_prompt(store, pid)
        chunk, site = _chunk_file(store, start + 4)
        chunk.unlink()
        problems = _verify(store)
        assert any(f"rows {start}..{start + n - 1} are in no prompt's run" in p
                   for p in problems), problems
        assert any(site in p and "missing" in p for p in problems), problems


def test_a_handle_into_unused_rows_is_refused(merged: Path, single: Path) -> None:
    """No value names an unused row between merged shards: a handle moved there by changing
    its row is refused (its code no longer matches), and the function that makes handles,
    called past the sandbox, makes none for such a row."""
    from actdb.errors import QueryError
    from actdb.query.handles import ROW_MASK

    with duckdb.connect(str(merged / "catalog.duckdb"), read_only=True) as con:
        end0, start1 = con.execute(
            "SELECT max(row_start + n_tokens) FILTER (WHERE prompt_id < 6), "
            "min(row_start) FILTER (WHERE prompt_id >= 6) FROM prompt_runs").fetchone()
    with actdb.connect(merged) as db, actdb.connect(single) as one:
        h, norm = db.sql("SELECT vec, norm FROM acts a JOIN tokens t USING (model, prompt_id, "
                         "position) WHERE t.row = $r AND a.head IS NULL LIMIT 1",
                         params={"r": start1}).fetchall()[0]
        got = db.sql("SELECT vec_norm($h)", params={"h": h}).fetchall()[0][0]
        assert got == pytest.approx(norm, rel=1e-6)
        h = int(h)
        fields, code = h >> 64, h & ((1 << 64) - 1)
        session = db._functions._session
        for row in (end0, start1 - 1):  # the first and last unused row
            moved = (fields & ~ROW_MASK) | row
            forged = (moved << 64) | code
            with pytest.raises(QueryError, match=rf"^{forged} is not a vec handle of this "
                               r"connection: its code does not match"):
                db.sql("SELECT vec_norm($h)", params={"h": forged}).fetchall()
            # also among stored rows of one call (rows before and after the gap)
            with pytest.raises(QueryError, match=rf"^{forged} is not a vec handle"):
                db.sql("SELECT sum(vec_norm(x)) FROM (SELECT unnest([$a, $h, $b]) AS x)",
                       params={"a": h, "h": forged, "b": h}).fetchall()
            with pytest.raises(duckdb.Error, match=rf"row {row} holds no stored token"):
                db.con.sql(f"SELECT _actdb_handle_{session}({moved}::BIGINT)").fetchall()
        # the same scan as before is untouched: sums equal the one-process store's
        q = "SELECT site, sum(vec_norm(vec)) FROM acts GROUP BY site ORDER BY site"
        np.testing.assert_allclose([r[1] for r in db.sql(q).fetchall()],
                                   [r[1] for r in one.sql(q).fetchall()], rtol=1e-6)


def _registration_waits_and_an_error_there_releases_the_lock(store: Path) -> None:
    """A shard waits for the registration lock as long as its holder holds it (past
    ACTDB_LOCK_WAIT_S: a first registration may write a large model's weights); an error
    while it waits (here a signal, as Ctrl-C or a cancelled task) releases the store lock
    it took, so the same long-lived process can take it again."""
    import fcntl
    import signal

    from actdb.store.store import Store, open_backend

    class Stop(Exception):
        pass

    def stop(*_: object) -> None:
        raise Stop

    fd = os.open(store / "shards.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another shard registering, for as long as it takes
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0.5)  # > ACTDB_LOCK_WAIT_S (0.1 s here)
    try:
        with pytest.raises(Stop):
            Store(store, ingest=True, shard="0-of-2")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(fd)
    whole = open_backend(str(store))
    whole.lock()  # no shard's shared lock was left behind
    whole.unlock()
    with Store(store, ingest=True, shard="0-of-2"):  # and the registration lock is free
        pass


def _registration_lease_waits_while_renewed(location: str) -> None:
    """On object storage a shard waits for `shards/register.lease` while its holder renews
    it, and takes it over once its holder stopped renewing it (died on another host)."""
    import threading
    import time

    from actdb.store.lease import Lease
    from actdb.store.store import open_backend

    key = "shards/register.lease"
    holder = Lease(Objects(parse_url(location)), location, key)
    holder.acquire()  # renewed every ttl / 3
    got = threading.Event()
    waiter_backend = open_backend(location)

    def waiter() -> None:
        with waiter_backend.registering():
            got.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    assert not got.wait(1.5)  # past the lease's 0.6 s and ACTDB_LOCK_WAIT_S: still waiting
    holder._stop.set()  # the holder dies: its lease is no longer renewed, nor removed
    assert holder._thread is not None
    holder._thread.join()
    started = time.monotonic()
    assert got.wait(5)
    t.join(5)
    assert time.monotonic() - started < 2.5
    assert Objects(parse_url(location)).list(key) == []  # the waiter released it in turn


def test_merge_on_a_merged_store_says_so(merged: Path, tmp_path: Path,
                                         model_dir: Callable[[str], Path]) -> None:
    """A rerun of a merge that finished says the store is merged (exit 0) and changes
    nothing; a store that never had shards is still an error (exit 1)."""
    files = _file_hashes(merged)
    res = CliRunner().invoke(cli, ["merge", str(merged)])
    assert res.exit_code == 0, res.output
    assert res.output == (f"model 'm': the shards of {merged} are merged already (no shard "
                          "ingest is left to merge); nothing to do\n")
    assert _file_hashes(merged) == files
    plain = tmp_path / "plain.actdb"
    actdb.ingest(plain, model=str(model_dir("gpt2")), prompts=PROMPTS[:1], batch_size=1,
                 device="cpu", name="m", chunk_tokens=4)
    res = CliRunner().invoke(cli, ["merge", str(plain)])
    assert res.exit_code == 1 and "no shard ingests to merge" in res.output, res.output
    assert "Traceback" not in res.output


def _set_plan(store: Path, shard: str, **change: object) -> None:
    """Rewrite a shard catalog's recorded plan, as another run of the shard would have."""
    import json

    with duckdb.connect(str(store / "shards" / shard / "catalog.duckdb")) as con:
        (raw,) = con.execute("SELECT value FROM meta WHERE key = 'shard_plan'").fetchone()
        plan = {**json.loads(raw), **change}
        con.execute("UPDATE meta SET value = ? WHERE key = 'shard_plan'", [json.dumps(plan)])


@pytest.mark.parametrize("case", ["fingerprint", "copied"])
def test_merge_refuses_shards_of_disagreeing_plans(unmerged: Path, case: str) -> None:
    """Shards whose plans disagree (another prompts file, batch size or N: here a shard
    catalog recording another fingerprint, or shard 0's copied in as shard 1) own rows
    the others would also claim: merge refuses, names them and changes nothing."""
    store = unmerged
    if case == "fingerprint":
        _set_plan(store, "1-of-2", fingerprint="0" * 64)
    else:
        shutil.rmtree(store / "shards" / "1-of-2")
        shutil.copytree(store / "shards" / "0-of-2", store / "shards" / "1-of-2")
    files = _file_hashes(store)
    res = CliRunner().invoke(cli, ["merge", str(store)])
    assert res.exit_code == 1, res.output
    assert "disagree on their plan" in res.output and "1-of-2" in res.output, res.output
    assert _file_hashes(store) == files
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompt_runs").fetchall() == [(0,)]
