"""`ingest --attention` killed mid-write and just before its commit, then resumed; and split
into shards, then merged: each store verifies clean and holds the attention weights of one
uninterrupted ingest, bit for bit (store/attention.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import actdb

pytestmark = pytest.mark.slow

PROMPTS = [f"Prompt {i}: the quick brown fox jumps over {i % 7} lazy dogs." for i in range(8)]
ROOT = Path(__file__).parents[2]
KW = {"batch_size": 1, "device": "cpu", "name": "m", "chunk_tokens": 8, "weights": "none",
      "attention": True}

_SCRIPT = textwrap.dedent("""
    import importlib, sys
    import torch
    import actdb
    torch.set_num_threads(1)
    importlib.import_module("actdb.ingestion.run").FLUSH_TOKENS = 32
    prompts = [l for l in open(sys.argv[3]).read().splitlines() if l]
    actdb.ingest(sys.argv[1], model=sys.argv[2], prompts=prompts, batch_size=1, device="cpu",
                 name="m", chunk_tokens=8, weights="none", attention=True)
""")


def _attention(store: Path) -> dict[int, np.ndarray]:
    with actdb.connect(store) as db:
        assert db.verify(full=True) == []
        rows = db.sql("SELECT prompt_id, layer, head, query_position, key_position, weight "
                      "FROM attention").fetchnumpy()
    out = {}
    for pid in np.unique(rows["prompt_id"]):
        at = rows["prompt_id"] == pid
        n = int(rows["query_position"][at].max()) + 1
        a = np.zeros((2, 4, n, n))
        a[rows["layer"][at], rows["head"][at], rows["query_position"][at],
          rows["key_position"][at]] = rows["weight"][at]
        out[int(pid)] = a
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory,
              model_dir: Callable[[str], Path]) -> dict[int, np.ndarray]:
    store = tmp_path_factory.mktemp("whole") / "whole.actdb"
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=PROMPTS, **KW)
    return _attention(store)


def _same(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> None:
    assert sorted(got) == sorted(want) == list(range(len(PROMPTS)))
    for pid, a in want.items():
        assert np.array_equal(got[pid], a), pid


@pytest.mark.parametrize("point", ["attention_write:5", "tensors_written:3"])
def test_killed_then_resumed(tmp_path: Path, model_dir: Callable[[str], Path],
                             reference: dict[int, np.ndarray], point: str) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    script = tmp_path / "ingest.py"
    script.write_text(_SCRIPT)
    store = tmp_path / "s.actdb"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ACTDB_FAULT": point}
    proc = subprocess.run([sys.executable, str(script), str(store), str(model_dir("gpt2")),
                           str(prompts)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = _attention(store)  # opens and verifies clean, some prompts committed
    assert 0 < len(partial) < len(PROMPTS)
    for pid, a in partial.items():
        assert np.array_equal(a, reference[pid])
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=PROMPTS, **KW)
    assert not list(store.rglob("*.partial"))
    _same(_attention(store), reference)


def test_shards_merged_hold_one_ingests_attention(tmp_path: Path,
                                                  model_dir: Callable[[str], Path],
                                                  reference: dict[int, np.ndarray]) -> None:
    store = tmp_path / "s.actdb"
    for i in range(2):
        actdb.ingest(store, model=str(model_dir("gpt2")), prompts=PROMPTS, shard=(i, 2), **KW)
    actdb.merge(store)
    _same(_attention(store), reference)
