"""The store contract on both backends, a local directory and an S3 prefix on a local S3
server (moto), plus what only object storage has: sharded vectors that plain zarr reads,
the catalog pointer's conditional swap, the lease, and every command on an `s3://` store."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import test_faults
import zarr
from click.testing import CliRunner
from support.prompts import PROMPTS
from support.s3server import S3Server
from support.snapshots import assert_same, open_plain, snapshot

import actdb
from actdb.cli import cli
from actdb.errors import StoreBusyError, StoreCorruptError, StoreNotFoundError
from actdb.store.objects import Objects, parse_url
from actdb.store.published import POINTER_KEY, Publisher
from actdb.store.store import Store

# Every kind of row and function: plain columns, vectors through views, weights, logits.
QUERIES = [
    "SELECT prompt_id, position, site, norm, mean FROM acts ORDER BY ALL",
    "SELECT prompt_id, position, site, cosine_to_anchor(vec, 5) AS c, logit(vec, 7) AS l, "
    "uniform_angle(normed(vec)) AS u FROM acts ORDER BY prompt_id, position, site",
    "SELECT site, sum(list_sum(to_list(final_norm(vec)))) FROM acts GROUP BY site ORDER BY site",
]


@pytest.fixture(scope="module")
def local_store(model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Path:
    path = tmp_path_factory.mktemp("local") / "s.actdb"
    _ingest(path, model_dir)
    return path


# each fixture ingest's summary, by location
SUMMARIES: dict[str, actdb.IngestSummary] = {}


def _ingest(location: Path | str, model_dir: Callable[[str], Path], **kw: object) -> None:
    SUMMARIES[str(location)] = actdb.ingest(
        location, model=str(model_dir("gpt2")), prompts=PROMPTS, batch_size=4, device="cpu",
        name="gpt2", chunk_tokens=8, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def s3_ingested(s3_server: S3Server, model_dir: Callable[[str], Path]) -> str:
    """The same ingest as `local_store`, into S3 (AWS variables set only while it runs)."""
    url = s3_server.url()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env().items():
            mp.setenv(key, value)
        _ingest(url, model_dir)
    return url


@pytest.fixture()
def s3_store(s3: S3Server, s3_ingested: str) -> str:
    """The S3 store, with the AWS variables set for this test (read it, do not change it)."""
    return s3_ingested


@pytest.fixture(params=["local", "s3"])
def fresh(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A location where no store is yet, on each backend."""
    if request.param == "local":
        return str(tmp_path / "s.actdb")
    return request.getfixturevalue("s3").url()


@pytest.fixture(params=["local", "s3"])
def copied(request: pytest.FixtureRequest, tmp_path: Path, local_store: Path) -> str:
    """A copy of the ingested store, on each backend, free to damage."""
    if request.param == "local":
        shutil.copytree(local_store, tmp_path / "s.actdb")
        return str(tmp_path / "s.actdb")
    s3: S3Server = request.getfixturevalue("s3")
    source = request.getfixturevalue("s3_ingested")
    url = s3.url()
    client = s3.client()
    src_prefix, dst_prefix = (u[len("s3://"):].partition("/")[2] for u in (source, url))
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=src_prefix + "/")
    for obj in listed["Contents"]:
        key = obj["Key"]
        client.copy_object(Bucket=s3.bucket, Key=dst_prefix + key[len(src_prefix):],
                           CopySource={"Bucket": s3.bucket, "Key": key})
    return url


@pytest.fixture(params=["local", "s3"])
def stored(request: pytest.FixtureRequest, local_store: Path) -> str:
    """The ingested store on each backend (read only)."""
    return str(local_store) if request.param == "local" else request.getfixturevalue("s3_store")


def test_same_answers_as_local(s3_store: str, local_store: Path) -> None:
    """Ingested to S3: every query answers as on a local store, verify --full is clean, and
    plain duckdb + zarr (zarr's own sharding codec) read the same rows and vectors."""
    for query in QUERIES:
        with actdb.connect(s3_store) as db:
            got = db.sql(query).fetchall()
        with actdb.connect(local_store) as db:
            want = db.sql(query).fetchall()
        assert got == want, query
    with actdb.connect(s3_store) as db:
        assert db.verify(full=True) == []
        assert db.info().format_version == 5 and db.store.has_digests
    with actdb.connect(local_store) as db:
        assert db.info().format_version == 5
    assert_same(snapshot(s3_store, "gpt2"), snapshot(local_store, "gpt2"))


def test_s3_store_takes_the_bytes_of_a_local_one(s3: S3Server, s3_store: str,
                                                local_store: Path) -> None:
    """The same ingest on S3 and on disk: the objects under the prefix (listed with boto3,
    not actdb) come to at most 1.1x the local files' bytes (walked with os), though the
    vectors on S3 lie in shards of 16 chunks and the last shard of each array is partly
    filled; and `info` and the ingest summary give each store's bytes alike."""
    local = sum(f.stat().st_size for f in local_store.rglob("*") if f.is_file()
                and f.name not in ("catalog.duckdb.lock", "ingest.lock"))
    prefix = s3_store[len("s3://"):].partition("/")[2] + "/"
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)["Contents"]
    with actdb.connect(s3_store) as db:
        info_s3 = db.info().bytes_on_disk
    pointer = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=prefix + "catalog.json")
                         ["Body"].read())
    # the current catalog object only, as info counts it
    remote = sum(o["Size"] for o in listed if o["Key"].startswith(
        (prefix + "tensors.zarr/", prefix + "tokenizers/", prefix + pointer["catalog"])))
    assert remote <= 1.1 * local, (remote, local)
    assert info_s3["total"] == remote
    # one catalog object once the ingest has closed: the last, compacted
    assert [o["Key"] for o in listed if "/catalogs/" in o["Key"]] == [prefix + pointer["catalog"]]
    with actdb.connect(local_store) as db:
        info_local = db.info().bytes_on_disk
    assert info_local["total"] == local
    for where, info in ((str(local_store), info_local), (s3_store, info_s3)):
        summary = SUMMARIES[where]
        assert summary.store_bytes == info["total"], where
        assert 0 < summary.bytes_stored <= summary.store_bytes, where


def test_chunk_reads_equal_zarr_reads(stored: str, tmp_path: Path) -> None:
    """actdb's own chunk reader (a file, or a range of a shard) agrees with zarr-python."""
    _, group = open_plain(stored, tmp_path)
    with Store(stored) as st:
        model = st.catalog.models()[0]
        for s in st.catalog.sites(model.model):
            for field in ("direction", "norm", "mean"):
                arr = group[f"models/{model.model_id}/acts/{s.site}/{field}"]
                assert isinstance(arr, zarr.Array)
                layout = st.arrays.act_layout(model.model_id, s.site, field)
                assert layout is not None and layout.crc
                c = layout.shape[0]
                for chunk in range(-(-model.n_rows // c)):
                    got = st.arrays.read_chunk(model.model_id, s.site, field, chunk)
                    lo, hi = chunk * c, min(chunk * c + c, arr.shape[0])
                    np.testing.assert_array_equal(got[: hi - lo], np.asarray(arr[lo:hi]))


def test_missing_chunk_is_an_error_naming_it(fresh: str) -> None:
    st = Store.open_or_create(fresh)
    try:
        st.arrays.ensure_act_arrays(0, "x", inner=(4,), rows=32, chunk_tokens=8)
        st.arrays.write_rows(0, "x", 0, {"direction": np.ones((8, 4), np.float16),
                                         "norm": np.ones(8, np.float32),
                                         "mean": np.ones(8, np.float32)})
        assert (st.arrays.read_chunk(0, "x", "direction", 0) == 1).all()
        # On S3, shards of 16 chunks: chunk 2 would lie in shard 0, which holds chunk 0 alone
        # (a shard ends with the last chunk written), and chunk 16 in shard 1, never written.
        for missing in (2, 16):
            with pytest.raises(StoreCorruptError, match=rf"chunk {missing} of array "
                                                        r"'models/0/acts/x/direction' is "
                                                        "missing"):
                st.arrays.read_chunk(0, "x", "direction", missing)
    finally:
        st.close()


def _damage_s3(url: str, key: str, how: str) -> None:
    objects = Objects(parse_url(url))
    if how == "delete":
        objects.delete(key)
        return
    data, _ = objects.get(key)
    buf = bytearray(data)
    if how == "flip":
        buf[10] ^= 0xFF  # inside inner chunk 0's values
    else:
        del buf[-3:]
    objects.put(key, bytes(buf))


def _damage_local(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "flip":
        data = bytearray(path.read_bytes())
        data[10] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        os.truncate(path, path.stat().st_size - 3)


DAMAGE = {"direction": "flip", "norm": "truncate", "mean": "delete"}
FOUND = {"flip": "fails its checksum", "truncate": "bytes, not", "delete": "is missing"}


def test_damaged_vectors_are_found(copied: str) -> None:
    """A changed byte fails its CRC-32C (verify --full and any query reading it); a short
    or missing shard or chunk is found by the quick verify too. Never a number."""
    for field, how in DAMAGE.items():
        # vectors on object storage are sharded (zarr's keys, "/"); a local store's chunk keys
        # use the separator "."
        sep = "/" if copied.startswith("s3://") else "."
        key = f"tensors.zarr/models/0/acts/final/{field}/c{sep}0" + (
            f"{sep}0" if field == "direction" else "")
        if copied.startswith("s3://"):
            _damage_s3(copied, key, how)
        else:
            _damage_local(Path(copied) / key, how)
    with actdb.connect(copied) as db:
        full = db.verify(full=True)
        quick = db.verify()
        for field, how in DAMAGE.items():
            label = f"chunk 0 of array 'models/0/acts/final/{field}'"
            assert [p for p in full if label in p], (field, full)
            assert [p for p in quick if label in p] or how == "flip", (field, quick)
        if copied.startswith("s3://"):  # a shard's index or size gives it away
            assert any("shard" in p for p in full)
        else:
            assert all(any(FOUND[how] in p for p in full) for how in DAMAGE.values())
        assert len(full) == 3 and len(quick) == 2
        # each reads one array (a raw cosine reads the stored direction alone; `to_list`
        # would read the norm too, which is damaged as well)
        reads = {"cosine_to_anchor(vec, 5)": "direction", "norm": "norm", "mean": "mean"}
        for column, field in reads.items():
            # (the `norm` and `mean` columns' reader reports it as a QueryError on main)
            with pytest.raises(actdb.ActdbError, match=f"'models/0/acts/final/{field}'.*"
                                                        "the store is damaged"):
                db.sql(f"SELECT sum({column}) FROM acts WHERE site = 'final'").fetchall()


def test_a_valid_chunk_in_the_wrong_place_is_found_naming_both(copied: str) -> None:
    """Two sites' norm chunks (on object storage: whole shard objects, each inner chunk with a
    valid CRC-32C) swapped: every read of them names both places, through verify --full and a
    query (format 5's chunk digests)."""
    with actdb.connect(copied) as db:
        other = db.sql("SELECT site FROM sites WHERE site <> 'final' ORDER BY site_id "
                       "LIMIT 1").fetchall()[0][0]
    sep = "/" if copied.startswith("s3://") else "."
    keys = [f"tensors.zarr/models/0/acts/{site}/norm/c{sep}0" for site in ("final", other)]
    if copied.startswith("s3://"):
        objects = Objects(parse_url(copied))
        a, b = (objects.get(k)[0] for k in keys)
        objects.put(keys[0], bytes(b))
        objects.put(keys[1], bytes(a))
    else:
        pa, pb = (Path(copied) / k for k in keys)
        da, db_ = pa.read_bytes(), pb.read_bytes()
        pa.write_bytes(db_)
        pb.write_bytes(da)
    here, there = ("chunk 0 of array 'models/0/acts/final/norm' holds the bytes of chunk 0 of "
                   f"array 'models/0/acts/{other}/norm'", "chunk 0 of array "
                   f"'models/0/acts/{other}/norm' holds the bytes of chunk 0 of array "
                   "'models/0/acts/final/norm'")
    with actdb.connect(copied) as db:
        full = db.verify(full=True)
        assert any(here in p for p in full) and any(there in p for p in full), full
        with pytest.raises(actdb.ActdbError, match=re.escape(here)):
            db.sql("SELECT sum(norm) FROM acts WHERE site = 'final'").fetchall()


def test_no_store_is_one_sentence(s3: S3Server) -> None:
    url = s3.url()
    with pytest.raises(StoreNotFoundError, match=f"no store at {url!r}"):
        actdb.connect(url)
    result = CliRunner().invoke(cli, ["info", url])
    assert result.exit_code == 1 and f"no store at {url!r}" in result.stderr
    assert "Traceback" not in result.output


def test_every_command_on_s3(s3: S3Server, model_dir: Callable[[str], Path],
                             local_store: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    url = s3.url()
    run = CliRunner().invoke
    res = run(cli, ["ingest", url, "--model", str(model_dir("gpt2")), "--prompts",
                    str(prompts), "--device", "cpu", "--name", "gpt2", "--batch-size", "4"])
    assert res.exit_code == 0, res.output
    info = run(cli, ["info", url])
    assert info.exit_code == 0 and url in info.output and "format 5" in info.output
    assert run(cli, ["verify", url, "--full"]).exit_code == 0
    q = "SELECT count(*) AS n, sum(norm) AS s FROM acts"
    out = run(cli, ["query", url, q, "--format", "json"])
    with actdb.connect(local_store) as db:
        (n, s), = db.sql(q).fetchall()
    got = json.loads(out.output.splitlines()[0])
    assert out.exit_code == 0 and got["n"] == n and got["s"] == pytest.approx(s)
    npy = tmp_path / "v.npy"
    res = run(cli, ["export", url, "SELECT vec FROM acts WHERE site = 'final'", "-o", str(npy)])
    assert res.exit_code == 0, res.output
    with actdb.connect(local_store) as db:
        want = db.vectors("SELECT vec FROM acts WHERE site = 'final'").numpy()
    np.testing.assert_allclose(np.load(npy), want, rtol=1e-6)
    png = tmp_path / "n.png"
    res = run(cli, ["plot", "norms", url, "-o", str(png)])
    assert res.exit_code == 0 and png.stat().st_size > 0, res.output


def test_storage_options_instead_of_environment(
    s3_store: str, s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key)
    options = {"endpoint": s3.endpoint, "access_key_id": "testing",
               "secret_access_key": "testing"}
    with actdb.connect(s3_store, storage_options=options) as db:
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(len(PROMPTS),)]


def test_second_ingest_is_refused_while_the_lease_is_held(
    s3_store: str, model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    holder = Store(s3_store, ingest=True)  # holds the lease, as a running ingest does
    try:
        prompts = tmp_path / "p.txt"
        prompts.write_text("another prompt\n")
        res = CliRunner().invoke(cli, ["ingest", s3_store, "--model", str(model_dir("gpt2")),
                                       "--prompts", str(prompts), "--device", "cpu"])
        assert res.exit_code == 1
        line = res.stderr.strip()
        assert "is being written by another ingest" in line and f"PID {os.getpid()}" in line
        assert len(line.splitlines()) == 1
    finally:
        holder.close()
    with actdb.connect(s3_store) as db:  # nothing of the refused ingest is there
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(len(PROMPTS),)]


def test_two_writers_cannot_both_publish(s3: S3Server, tmp_path: Path) -> None:
    """The pointer swap is conditional on the ETag each writer read: the second loses."""
    url = s3.url()
    Store.open_or_create(url).close()
    objects = Objects(parse_url(url))
    first = Publisher(objects, tmp_path / "a.duckdb", url)
    second = Publisher(objects, tmp_path / "b.duckdb", url)
    first.publish()
    with pytest.raises(StoreBusyError, match="changed by another writer"):
        second.publish()
    pointer = json.loads(objects.get(POINTER_KEY)[0])
    assert pointer["catalog"] == first.pointer["catalog"]
    with actdb.connect(url) as db:
        assert db.verify() == []


# The fault tests' ingest script (tests/slow/test_faults.py), with commits of about 3 prompts.
FAULT_SCRIPT = test_faults._SCRIPT.replace("_FLUSH_TOKENS = 32", "_FLUSH_TOKENS = 40")
FAULT_PROMPTS = test_faults.PROMPTS[:8]


@pytest.fixture(scope="module")
def fault_reference(model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, object]:
    """An uninterrupted local ingest of the fault tests' prompts: what a killed and resumed
    ingest to S3 must equal."""
    store = tmp_path_factory.mktemp("whole") / "whole.actdb"
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=FAULT_PROMPTS, batch_size=1,
                 device="cpu", name="m", chunk_tokens=8)
    return snapshot(store, "m")


@pytest.mark.slow
# One point keeps the test time down: after a batch's catalog object is uploaded and before
# the pointer names it (the protocol step only object storage has). chunk_write:20 (a kill
# between shard PUTs) passes too; run it with -k and ACTDB_S3_FAULTS=all.
@pytest.mark.parametrize("point", ["catalog_uploaded:3"] + (
    ["chunk_write:20", "tensors_written:2", "committed:3"]
    if os.environ.get("ACTDB_S3_FAULTS") == "all" else []))
def test_kill_then_resume_on_s3(s3: S3Server, model_dir: Callable[[str], Path], tmp_path: Path,
                                fault_reference: dict[str, object], point: str) -> None:
    """A real process SIGKILLed mid-ingest (mid shard write; after a catalog upload, before
    its pointer swap): the store opens and verifies clean with what was published, the same
    ingest resumes at once (the dead holder's lease is taken over) and ends equal to an
    uninterrupted local ingest; the killed writer's unpublished catalog object is removed."""
    url = s3.url()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(FAULT_PROMPTS) + "\n")
    script = tmp_path / "ingest.py"
    script.write_text(FAULT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "ACTDB_FAULT": point}
    work_folders = set(Path(tempfile.gettempdir()).glob("actdb-s3-*"))
    proc = subprocess.run([sys.executable, str(script), url, str(model_dir("gpt2")),
                           str(prompts)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"{point} was never reached: {proc.stderr[-2000:]}"
    orphans = set(Path(tempfile.gettempdir()).glob("actdb-s3-*")) - work_folders
    assert orphans  # the killed process's working copy of the catalog, never removed by it
    objects = Objects(parse_url(url))
    assert objects.exists("ingest.lease")  # a killed ingest cannot release its lease
    with actdb.connect(url) as db:
        assert db.verify(full=True) == []
        committed = db.sql("SELECT count(*) FROM prompt_runs").fetchall()[0][0]
        assert 0 < committed < len(FAULT_PROMPTS)
    actdb.ingest(url, model=str(model_dir("gpt2")), prompts=FAULT_PROMPTS, batch_size=1,
                 device="cpu", name="m", chunk_tokens=8)
    with actdb.connect(url) as db:
        assert db.verify() == []  # every byte is compared below
    assert_same(snapshot(url, "m"), fault_reference)
    assert not objects.exists("ingest.lease")
    assert not any(folder.exists() for folder in orphans)  # swept by the next process
    catalogs = [key for key, _ in objects.list("catalogs")]
    assert len(catalogs) <= 2, catalogs  # the current one and the one it replaced
