"""Fault injection: the ingest killed at each named point of the commit protocol (and at
random moments), or hit by a full disk, leaves a store that opens, passes `verify --full`,
holds no temporary files once resumed, and the same command completes it identically to an
uninterrupted run. See docs/FORMAT.md ("Fault points")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.snapshots import assert_same, snapshot

import actdb
from actdb.cli import cli

pytestmark = pytest.mark.slow

PROMPTS = [f"Prompt {i}: the quick brown fox jumps over {i % 7} lazy dogs." for i in range(24)]
ROOT = Path(__file__).parents[2]

# Small commits (a few prompts each) so that every point is passed several times.
_SCRIPT = textwrap.dedent("""
    import importlib, sys
    import torch
    import actdb
    torch.set_num_threads(1)
    importlib.import_module("actdb.ingestion.run").FLUSH_TOKENS = 32
    if len(sys.argv) > 4:  # weight chunks of at least this many bytes past the page cache
        importlib.import_module("actdb.store.chunks").DIRECT_MIN_BYTES = int(sys.argv[4])
    log = importlib.import_module("actdb.store.catalog_log")
    log.FOLD_MIN_BYTES, log.FOLD_FILE_SHARE = 1, 10**9  # fold the catalog's log every commit
    prompts = [l for l in open(sys.argv[3]).read().splitlines() if l]
    actdb.ingest(sys.argv[1], model=sys.argv[2], prompts=prompts, batch_size=1,
                 device="cpu", name="m", chunk_tokens=8,
                 on_plan=lambda plan: print("planned", flush=True))
    print("done", flush=True)
""")


def _ingest_in_process(store: Path, model: str, prompts: list[str] = PROMPTS) -> None:
    actdb.ingest(store, model=model, prompts=prompts, batch_size=1, device="cpu", name="m",
                 chunk_tokens=8)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory,
              model_dir: Callable[[str], Path]) -> dict[str, object]:
    """The store every interrupted-then-resumed ingest must end up equal to."""
    store = tmp_path_factory.mktemp("whole") / "whole.actdb"
    _ingest_in_process(store, str(model_dir("gpt2")))
    return snapshot(store, "m")


@pytest.fixture()
def run_script(tmp_path: Path, model_dir: Callable[[str], Path]
               ) -> Callable[..., subprocess.Popen[str]]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    script = tmp_path / "ingest.py"
    script.write_text(_SCRIPT)

    def start(store: Path, fault: str | None = None,
              direct_min: int | None = None) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("ACTDB_FAULT", None)
        if fault:
            env["ACTDB_FAULT"] = fault
        extra = [] if direct_min is None else [str(direct_min)]
        return subprocess.Popen(
            [sys.executable, str(script), str(store), str(model_dir("gpt2")), str(prompts),
             *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    return start


def _partials(store: Path) -> list[Path]:
    return list(store.rglob("*.partial"))


def _resume_and_compare(store: Path, model: str, reference: dict[str, object]) -> None:
    """The same ingest again, in this process: it completes the store, identically."""
    _ingest_in_process(store, model)
    assert _partials(store) == []
    assert not list(store.parent.glob(f".{store.name}.creating-*"))
    # No copy of a killed catalog fold, and the log folded into the file at the end.
    assert sorted(p.name for p in store.glob("*catalog*")) == [
        "catalog.duckdb", "catalog.duckdb.lock"]
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
    assert_same(snapshot(store, "m"), reference)


@pytest.mark.parametrize("point", [
    "create_before_catalog:1", "create_after_catalog:1", "weights_written:1",
    "chunk_write:40", "tensors_written:2", "catalog_commit:4", "committed:3",
    "catalog_fold:3", "catalog_folded:3",
])
def test_kill_at_each_point_then_resume(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object],
    run_script: Callable[..., subprocess.Popen[str]], point: str,
) -> None:
    store = tmp_path / "s.actdb"
    proc = run_script(store, point)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"{point} was never reached: {err[-2000:]}"
    if point.startswith("create"):
        # Built aside and renamed into place: no store yet, only the half-built copy.
        assert not store.exists()
        assert list(tmp_path.glob(".s.actdb.creating-*"))
    else:
        with actdb.connect(store) as db:
            assert db.verify(full=True) == []
            committed = db.sql("SELECT count(*) FROM prompt_runs").fetchall()[0][0]
            assert committed < len(PROMPTS)
    if point.startswith("chunk_write"):
        assert _partials(store), "the kill mid-write should leave a temporary file"
    _resume_and_compare(store, str(model_dir("gpt2")), reference)


@pytest.mark.parametrize("lost", ["emptied", "removed"])
def test_site_metadata_lost_to_a_power_cut_is_rebuilt_on_resume(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object],
    run_script: Callable[..., subprocess.Popen[str]], lost: str,
) -> None:
    """A new model's site arrays are written (renamed into place) before one syncfs makes
    them durable, after the model's catalog row. A power cut between the two can leave the
    row with metadata files that are empty (renamed, their data never written back) or
    gone. No row of those sites is committed then: the resume rebuilds them, and ends equal
    to an uninterrupted run. Here: killed before the first chunk is written, then the loss
    made by hand (a kill alone keeps the page cache)."""
    store = tmp_path / "s.actdb"
    proc = run_script(store, "chunk_write:1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"chunk_write was never reached: {err[-2000:]}"
    metadata = sorted((store / "tensors.zarr" / "models").glob("*/acts/**/zarr.json"))
    assert len(metadata) > 4
    for i, f in enumerate(metadata):
        if lost == "emptied":
            f.write_bytes(b"")
        elif i % 2:  # some gone, some kept: whole and partial sites
            f.unlink()
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompt_runs").fetchall()[0][0] == 0
    _resume_and_compare(store, str(model_dir("gpt2")), reference)


def test_kill_mid_write_past_the_page_cache_then_resume(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object],
    run_script: Callable[..., subprocess.Popen[str]],
) -> None:
    """A model's weight chunks of 4 MiB or more are written with O_DIRECT (`write_direct`);
    the tiny model's are small, so here every weight chunk goes that way, and the ingest is
    killed after a chunk's padded bytes are written, before the file is cut to its size and
    fsynced: the store still opens and verifies, and the same command completes it."""
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        pytest.skip("this file system takes no O_DIRECT")
    probe.unlink()
    store = tmp_path / "s.actdb"
    proc = run_script(store, "weight_write:1", direct_min=1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"weight_write was never reached: {err[-2000:]}"
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
    # The embedding's first chunk (up to 8,192 rows of float32), written padded to 4 KiB
    # (values, checksum, zeros): it is cut to its size only after the kill point. A buffered
    # write killed there leaves the values alone.
    config = json.loads((model_dir("gpt2") / "config.json").read_text())
    values = min(config["vocab_size"], 8192) * config["n_embd"] * 4
    torn = [p.stat().st_size for p in _partials(store)]
    assert torn == [-(-(values + 4) // 4096) * 4096], (torn, values)
    _resume_and_compare(store, str(model_dir("gpt2")), reference)


@pytest.mark.parametrize("split", [1, 7, 13, 17])
def test_an_ingest_stopped_after_any_prompt_resumes_to_the_same_store(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object], split: int,
) -> None:
    """Where a run stops decides nothing stored: the logit check's recorded worst error
    included (its sample is chosen by prompt id, not by the batch's place in this run)."""
    store = tmp_path / "s.actdb"
    _ingest_in_process(store, str(model_dir("gpt2")), PROMPTS[:split])
    _resume_and_compare(store, str(model_dir("gpt2")), reference)


@pytest.mark.parametrize("delay", [0.5])
def test_kill_at_a_random_moment_then_resume(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object],
    run_script: Callable[..., subprocess.Popen[str]], delay: float,
) -> None:
    store = tmp_path / "s.actdb"
    proc = run_script(store)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "planned"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
    _resume_and_compare(store, str(model_dir("gpt2")), reference)


@pytest.mark.parametrize("point", ["chunk_write:3:enospc", "catalog_commit:3:enospc",
                                   "weight_write:2:enospc"])
def test_disk_full_is_one_sentence_and_the_same_command_resumes(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object], point: str,
) -> None:
    """ENOSPC injected at the write layer (a chunk file, the catalog commit), through the
    CLI: exit 1, one sentence naming what filled up; then the same command completes (here
    in this process, as after a real full file system below: the fault is the
    subprocess's)."""
    store = tmp_path / "s.actdb"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    args = ["ingest", str(store), "--model", str(model_dir("gpt2")), "--prompts", str(prompts),
            "--batch-size", "1", "--device", "cpu", "--name", "m", "--chunk-tokens", "8"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ACTDB_FAULT": point}
    full = subprocess.run([sys.executable, "-m", "actdb.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert full.returncode == 1, full.stderr[-2000:]
    # stderr: the ingest's announcement, then the error: one sentence, no traceback.
    error = [line for line in full.stderr.strip().splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "Traceback" not in full.stderr, full.stderr
    what = {"catalog_commit": "the catalog", "chunk_write": "vectors of model 'm'",
            "weight_write": "the weights of model 'm'"}[point.split(":")[0]]
    assert "is full" in error[0] and what in error[0] and "run the same command" in error[0]
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0, again.output[-2000:]
    assert _partials(store) == []
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
    assert_same(snapshot(store, "m"), reference)


def test_real_full_file_system_then_resume(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object],
) -> None:
    """A real small tmpfs, where mounting is permitted (root): the ingest fills it, says so
    in one sentence, and after the file system grows the same command completes."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    size_kib = 3000
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs",
                              str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here; the injected ENOSPC tests cover disk full")
    try:
        store = mnt / "s.actdb"
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        args = ["ingest", str(store), "--model", str(model_dir("gpt2")), "--prompts",
                str(prompts), "--batch-size", "1", "--device", "cpu", "--name", "m",
                "--chunk-tokens", "8"]
        full = CliRunner().invoke(cli, args)
        assert full.exit_code == 1, full.output
        error = [line for line in full.stderr.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and "is full" in error[0], full.stderr
        subprocess.run(["mount", "-o", f"remount,size={size_kib * 8}k", str(mnt)], check=True)
        again = CliRunner().invoke(cli, args)
        assert again.exit_code == 0, again.output
        assert _partials(store) == []
        with actdb.connect(store) as db:
            assert db.verify(full=True) == []
        assert_same(snapshot(store, "m"), reference)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# The ingest of the concurrency test: commits held apart a little so readers see it grow.
_SLOW_INGEST = _SCRIPT.replace("torch.set_num_threads(1)", textwrap.dedent("""
    torch.set_num_threads(1)
    import time
    from actdb.store.store import Store
    commit = Store.commit_batch
    def paced(*args, **kw):
        out = commit(*args, **kw)
        time.sleep(0.15)
        return out
    Store.commit_batch = paced"""))

_API_READER = textwrap.dedent("""
    import json, os, sys, time
    import actdb
    store, done = sys.argv[1], sys.argv[2]
    VEC_LENGTH = "sqrt(list_sum(list_transform(to_list(vec), lambda x: x * x)))"
    while True:
        finished = os.path.exists(done)
        if not os.path.exists(os.path.join(store, "catalog.duckdb")):
            if finished:
                sys.exit("the store never appeared")
            time.sleep(0.05)
            continue
        with actdb.connect(store) as db:
            n, = db.sql("SELECT count(*) FROM prompt_runs").fetchall()[0]
            # every committed prompt has all its tokens ...
            short, = db.sql("SELECT count(*) FROM prompt_runs r WHERE n_tokens != (SELECT "
                            "count(*) FROM tokens t WHERE t.model = r.model AND "
                            "t.prompt_id = r.prompt_id)").fetchall()[0]
            # ... and every vector of every token is readable and is its stored norm long
            rows, bad = db.sql(f"SELECT count(*), count(*) FILTER (abs({VEC_LENGTH} - norm) "
                               "> 1e-2 * norm + 1e-6) FROM acts").fetchall()[0]
        print(json.dumps({"n": n, "short": short, "rows": rows, "bad": bad}), flush=True)
        if finished:
            break
        time.sleep(0.05)
""")

_CLI_READER = textwrap.dedent("""
    import json, os, sys, time
    from click.testing import CliRunner
    from actdb.cli import cli
    store, done = sys.argv[1], sys.argv[2]
    runner = CliRunner()
    while True:
        finished = os.path.exists(done)
        if not os.path.exists(os.path.join(store, "catalog.duckdb")):
            if finished:
                sys.exit("the store never appeared")
            time.sleep(0.05)
            continue
        q = runner.invoke(cli, ["query", store, "SELECT count(*) AS n FROM prompt_runs",
                                "--format", "csv"])
        rest = [runner.invoke(cli, [c, store]) for c in ("info", "verify")]
        codes = [r.exit_code for r in [q, *rest]]
        n = int(q.output.split()[-1]) if q.exit_code == 0 else -1
        err = " | ".join((r.stderr or repr(r.exception))[-300:] for r in [q, *rest]
                         if r.exit_code != 0)
        print(json.dumps({"n": n, "codes": codes, "err": err}), flush=True)
        if finished:
            break
        time.sleep(0.05)
""")


def test_readers_follow_an_ingest(
    tmp_path: Path, model_dir: Callable[[str], Path], reference: dict[str, object],
) -> None:
    """One ingest and two readers (one through Python, one through the CLI), all separate
    processes: readers only ever see whole committed prompts and a count that never falls,
    nobody fails, and the ingest ends equal to an uninterrupted one."""
    store, done = tmp_path / "s.actdb", tmp_path / "done"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    scripts = {}
    for name, text in (("ingest", _SLOW_INGEST), ("api", _API_READER), ("cli", _CLI_READER)):
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ACTDB_FAULT", None)
    # Readers write to files: a pipe nobody drains during the ingest would fill and stop them.
    logs = [(tmp_path / f"reader{i}.out", tmp_path / f"reader{i}.err") for i in range(2)]
    readers = []
    for kind, (out, err) in zip(("api", "cli"), logs, strict=True):
        with out.open("w") as fo, err.open("w") as fe:
            readers.append(subprocess.Popen(
                [sys.executable, str(scripts[kind]), str(store), str(done)],
                stdout=fo, stderr=fe, text=True, env=env))
    try:
        ingest = subprocess.run([sys.executable, str(scripts["ingest"]), str(store),
                                 str(model_dir("gpt2")), str(prompts)],
                                capture_output=True, text=True, env=env, timeout=300)
    finally:
        done.touch()
        for r in readers:
            r.wait(timeout=120)
    assert ingest.returncode == 0, ingest.stderr[-2000:]
    seen_between = False
    for reader, (out, err) in zip(readers, logs, strict=True):
        assert reader.returncode == 0, err.read_text()[-2000:]
        records = [json.loads(line) for line in out.read_text().splitlines()]
        counts = [r["n"] for r in records]
        assert counts == sorted(counts), counts  # never falls
        assert counts[-1] == len(PROMPTS)
        seen_between |= any(0 < c < len(PROMPTS) for c in counts)
        for r in records:
            assert r.get("short", 0) == 0 and r.get("bad", 0) == 0, r
            assert r.get("codes", [0, 0, 0]) == [0, 0, 0], r
    assert seen_between, "no reader saw the ingest half way: the test tested nothing"
    assert_same(snapshot(store, "m"), reference)
