"""One batch plan, whoever runs it: a sharded ingest (`--shard I/N`, then `merge`), an
ingest killed and resumed, and one uninterrupted process store the same bytes for every
direction, norm and mean, at batch sizes 1, 4 and 16 with prompts of very different lengths
(padding changes a model's hidden states slightly, so a prompt's vectors depend on which
prompts share its batch)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest
import zarr
from click.testing import CliRunner

import actdb
from actdb.cli import cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
_WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing in the old "
          "oak tree near the river bank").split()
# 42 prompts of 2 to 43 words, longer as they go: a batch is padded to its last prompt, so
# prompts batched otherwise are padded otherwise. 42 is no multiple of 4 or 16: halves of
# the prompts are not whole batches (a shard cut by prompts would batch them otherwise).
PROMPTS = [f"{i}: " + " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(2 + i))
           for i in range(42)]
_KW = {"device": "cpu", "name": "m", "chunk_tokens": 4}
# A process killed (SIGKILL) once `after` commits are done, as the next one's vectors are
# written, with small commits.
# The same torch thread count as this process's (an earlier test may have changed it): some
# of the model's arithmetic depends on it.
_SCRIPT = (
    "import importlib, json, os, sys; import torch; import actdb; "
    "importlib.import_module('actdb.ingestion.run').FLUSH_TOKENS = 40; "
    "a = json.loads(sys.argv[1]); torch.set_num_threads(a['threads']); "
    "actdb.ingest(a['store'], model=a['model'], prompts=a['prompts'], batch_size=a['b'], "
    "shard=a['shard'], device='cpu', name='m', chunk_tokens=4)"
)


def _killed(store: Path, model: Path, batch_size: int, shard: str | None, after: int) -> None:
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT), "ACTDB_FAULT": f"tensors_written:{after + 1}"}
    import torch

    arg = json.dumps({"store": str(store), "model": str(model), "prompts": PROMPTS,
                      "b": batch_size, "shard": shard, "threads": torch.get_num_threads()})
    p = subprocess.run([sys.executable, "-c", _SCRIPT, arg], env=env, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == -9, p.stderr


def stored_bytes(store: Path) -> dict[tuple[str, int, str, str], bytes]:
    """Every stored (prompt text, position, site, field) -> its bytes, read with plain DuckDB
    and plain zarr at the rows the catalog names."""
    con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
    rows = con.execute("SELECT p.text, t.position, t.row FROM tokens t JOIN prompts p "
                       "USING (prompt_id) ORDER BY 1, 2").fetchall()
    (mid,) = con.execute("SELECT model_id FROM models").fetchone()
    sites = [r[0] for r in con.execute("SELECT site FROM sites ORDER BY site_id").fetchall()]
    con.close()
    group = zarr.open_group(str(store / "tensors.zarr"), mode="r")
    index = np.array([r[2] for r in rows])
    out = {}
    for site in sites:
        for field in ("direction", "norm", "mean"):
            values = np.asarray(group[f"models/{mid}/acts/{site}/{field}"][:])[index]
            for (text, pos, _), v in zip(rows, values, strict=True):
                out[text, pos, site, field] = v.tobytes()
    return out


def _differences(got: dict[tuple[str, int, str, str], bytes],
                 want: dict[tuple[str, int, str, str], bytes]) -> list[tuple[str, int, str, str]]:
    assert got.keys() == want.keys()
    return [k for k in want if got[k] != want[k]]


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_shards_and_a_resumed_ingest_store_one_process_bytes(
        batch_size: int, tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    model = model_dir("gpt2")
    one = tmp_path / "one.actdb"
    actdb.ingest(one, model=str(model), prompts=PROMPTS, batch_size=batch_size, **_KW)
    want = stored_bytes(one)
    assert len({len(p.split()) for p in PROMPTS}) > 30 and len(want) > 1000

    # Two shards; the one with several batches is killed after its first commit and resumed.
    sharded = tmp_path / "sharded.actdb"
    killed = 1 if batch_size < 16 else 0  # at 16, shard 1 holds one batch: one commit
    _killed(sharded, model, batch_size, f"{killed}/2", after=1)
    for i in (0, 1):
        actdb.ingest(sharded, model=str(model), prompts=PROMPTS, batch_size=batch_size,
                     shard=(i, 2), **_KW)
    actdb.merge(sharded)
    assert _differences(stored_bytes(sharded), want) == []

    # One process killed after its second commit, then the same command again.
    resumed = tmp_path / "resumed.actdb"
    _killed(resumed, model, batch_size, None, after=2)
    with duckdb.connect(str(resumed / "catalog.duckdb"), read_only=True) as con:
        done = con.execute("SELECT count(*) FROM prompt_runs").fetchone()[0]
    assert 0 < done < len(PROMPTS)
    summary = actdb.ingest(resumed, model=str(model), prompts=PROMPTS, batch_size=batch_size,
                           **_KW)
    assert summary.prompts_new == len(PROMPTS) - done
    assert _differences(stored_bytes(resumed), want) == []
    for store in (sharded, resumed):
        res = CliRunner().invoke(cli, ["verify", str(store), "--full"])
        assert res.exit_code == 0, res.output


def test_prompts_batched_otherwise_store_other_bytes(tmp_path: Path,
                                                     model_dir: Callable[[str], Path]) -> None:
    """The premise of the test above, in the tiny model it uses: a batch of other prompts
    (another padded length) gives some of the same prompts' vectors other bytes."""
    model = model_dir("gpt2")
    a, b = tmp_path / "a.actdb", tmp_path / "b.actdb"
    actdb.ingest(a, model=str(model), prompts=PROMPTS[:16], batch_size=16, **_KW)
    actdb.ingest(b, model=str(model), prompts=PROMPTS[:16], batch_size=4, **_KW)
    assert _differences(stored_bytes(a), stored_bytes(b))


def test_a_shard_of_another_batch_size_is_another_plan(tmp_path: Path,
                                                       model_dir: Callable[[str], Path]) -> None:
    """The batch size is part of a sharded ingest's plan: a shard run with another one would
    batch (and pad) its prompts otherwise, so it is refused beside the first, writing
    nothing."""
    from actdb.errors import IngestError

    store, model = tmp_path / "s.actdb", model_dir("gpt2")
    actdb.ingest(store, model=str(model), prompts=PROMPTS[:12], batch_size=4, shard=(0, 2),
                 **_KW)
    with pytest.raises(IngestError, match="another plan"):
        actdb.ingest(store, model=str(model), prompts=PROMPTS[:12], batch_size=2,
                     shard=(1, 2), **_KW)
    assert not (store / "shards" / "1-of-2" / "catalog.duckdb").exists()
