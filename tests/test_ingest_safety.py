"""Safety of data: re-runs add nothing, SIGKILL at any moment leaves a store that opens,
verifies clean, and resumes to the same vectors as an uninterrupted run."""

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

import duckdb
import numpy as np
import pytest
import zarr

import actdb

KILL_PROMPTS = [f"Prompt number {i}: the quick brown fox jumps over {i % 7} lazy dogs."
                for i in range(160)]


def _snapshot(store: Path, model: str) -> dict[str, object]:
    """Tokens and every stored field of every site, in row order."""
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    tokens = con.execute(
        "SELECT p.text, t.position, t.token_id, t.row FROM tokens t JOIN prompts p "
        "USING (prompt_id) WHERE t.model = ? ORDER BY t.row", [model]).fetchall()
    mid, n_rows = con.execute("SELECT model_id, n_rows FROM models WHERE model = ?",
                              [model]).fetchone()
    sites = [r[0] for r in con.execute("SELECT site FROM sites WHERE model = ?",
                                       [model]).fetchall()]
    prompts = con.execute("SELECT prompt_id, text FROM prompts ORDER BY prompt_id").fetchall()
    con.close()
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    fields = {
        (s, f): np.asarray(group[f"models/{mid}/acts/{s}/{f}"][:n_rows])
        for s in sites for f in ("direction", "norm", "mean")
    }
    return {"tokens": tokens, "fields": fields, "prompts": prompts}


def _assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["prompts"] == b["prompts"]
    fa, fb = a["fields"], b["fields"]
    assert isinstance(fa, dict) and isinstance(fb, dict) and fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=str(k))


def test_rerun_adds_nothing(tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    store = tmp_path / "s.actdb"
    kw = {"model": str(model_dir("gpt2")), "prompts": KILL_PROMPTS[:5], "device": "cpu",
          "name": "m"}
    first = actdb.ingest(store, **kw)
    before = _snapshot(store, "m")
    again = actdb.ingest(store, **kw)
    assert first.prompts_new == 5 and again.prompts_new == 0 and again.prompts_skipped == 5
    _assert_same(before, _snapshot(store, "m"))


def test_second_model_shares_prompts(tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    store = tmp_path / "s.actdb"
    prompts = KILL_PROMPTS[:4]
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=prompts, device="cpu", name="a")
    actdb.ingest(store, model=str(model_dir("llama")), prompts=prompts[::-1], device="cpu",
                 name="b")
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(4,)]
        per_model = db.sql("SELECT model, count(DISTINCT prompt_id) FROM tokens GROUP BY model "
                           "ORDER BY model").fetchall()
        assert per_model == [("a", 4), ("b", 4)]
        assert db.verify() == []


def test_jsonl_fields_become_columns_and_truncation_is_counted(
    tmp_path: Path, model_dir: Callable[[str], Path]
) -> None:
    path = tmp_path / "p.jsonl"
    records = [{"text": "the cat sat on the mat and purred", "topic": "pets", "level": 1},
               {"text": "two plus two is four", "topic": "math", "level": 2, "ok": True}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    s = actdb.ingest(tmp_path / "s.actdb", model=str(model_dir("gpt2")), prompts=path,
                     device="cpu", max_length=4)
    assert s.prompts_truncated == 2
    with actdb.connect(tmp_path / "s.actdb") as db:
        rows = db.sql("SELECT text, topic, level, ok, n_tokens FROM prompts ORDER BY prompt_id"
                      ).fetchall()
        assert rows == [(records[0]["text"], "pets", 1, None, 4),
                        (records[1]["text"], "math", 2, True, 4)]
        assert db.sql("SELECT bool_and(truncated) FROM prompt_runs").fetchall() == [(True,)]


_KILL_SCRIPT = textwrap.dedent("""
    import sys, actdb
    prompts = [l for l in open(sys.argv[3]).read().splitlines() if l]
    actdb.ingest(sys.argv[1], model=sys.argv[2], prompts=prompts, batch_size=1,
                 device="cpu", name="m", chunk_tokens=8,
                 on_plan=lambda plan: print("planned", flush=True))
    print("done", flush=True)
""")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory,
                  model_dir: Callable[[str], Path]) -> dict[str, object]:
    """The store the killed-and-resumed ingests must end up equal to."""
    reference = tmp_path_factory.mktemp("whole") / "whole.actdb"
    actdb.ingest(reference, model=str(model_dir("gpt2")), prompts=KILL_PROMPTS, batch_size=1,
                 device="cpu", name="m", chunk_tokens=8)
    return _snapshot(reference, "m")


@pytest.mark.parametrize("delay", [0.0, 0.2, 0.6])
def test_sigkill_then_resume_gives_the_same_store(
    tmp_path: Path, model_dir: Callable[[str], Path], uninterrupted: dict[str, object],
    delay: float,
) -> None:
    model = str(model_dir("gpt2"))
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(KILL_PROMPTS) + "\n")
    script = tmp_path / "ingest.py"
    script.write_text(_KILL_SCRIPT)
    store = tmp_path / "killed.actdb"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, str(script), str(store), model, str(prompts_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "planned"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # The killed store opens and verifies clean; whatever it shows is complete.
    with actdb.connect(store) as db:
        assert db.verify() == []
        committed = db.sql("SELECT count(*) FROM prompt_runs").fetchall()[0][0]
        assert committed < len(KILL_PROMPTS), "the kill came too late to test anything"

    # The same command resumes and completes it.
    done = subprocess.run([sys.executable, str(script), str(store), model, str(prompts_file)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with actdb.connect(store) as db:
        assert db.verify() == []
    _assert_same(_snapshot(store, "m"), uninterrupted)
