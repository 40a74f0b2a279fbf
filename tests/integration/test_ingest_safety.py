"""Safety of data: re-runs add nothing, models share prompts, JSONL fields become columns.
Kills and faults at every point of the commit protocol are in test_faults.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from support.snapshots import assert_same, snapshot

import actdb

KILL_PROMPTS = [f"Prompt number {i}: the quick brown fox jumps over {i % 7} lazy dogs."
                for i in range(8)]


def test_rerun_adds_nothing(tmp_path: Path, model_dir: Callable[[str], Path]) -> None:
    store = tmp_path / "s.actdb"
    kw = {"model": str(model_dir("gpt2")), "prompts": KILL_PROMPTS[:5], "device": "cpu",
          "name": "m"}
    first = actdb.ingest(store, **kw)
    before = snapshot(store, "m")
    again = actdb.ingest(store, **kw)
    assert first.prompts_new == 5 and again.prompts_new == 0 and again.prompts_skipped == 5
    assert_same(before, snapshot(store, "m"))


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


def test_resume_refuses_another_checkpoint_under_the_same_name(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Rows added under a name are read with that name's stored weights: a model whose norm
    weights, LM head or embedding differ (another checkpoint) is refused, and nothing is
    added."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = tmp_path / "s.actdb"
    path = model_dir("llama")
    actdb.ingest(store, model=str(path), prompts=["one prompt here"], name="x", device="cpu")
    other = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        other.model.norm.weight.mul_(1.5)
    with pytest.raises(actdb.IngestError, match="other weights"):
        actdb.ingest(store, model=other, tokenizer=AutoTokenizer.from_pretrained(path),
                     prompts=["another prompt"], name="x", device="cpu")
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(1,)]
    # Norms the same, the head or the embedding another checkpoint's: refused by name.
    for part, what in (("lm_head", "LM head"), ("model.embed_tokens", "embedding")):
        other = AutoModelForCausalLM.from_pretrained(path)
        assert not other.config.tie_word_embeddings
        with torch.no_grad():
            other.get_submodule(part).weight[7].add_(0.01)
        with pytest.raises(actdb.IngestError, match=f"other weights \\(its {what} differs"):
            actdb.ingest(store, model=other, tokenizer=AutoTokenizer.from_pretrained(path),
                         prompts=["another prompt"], name="x", device="cpu")
    # ... or only an MLP weight (a merged LoRA): the digest of every parameter tells
    other = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight[3, 5] += 1e-3
    with pytest.raises(actdb.IngestError, match="a parameter beyond the embedding, head and "
                                                "norms differs"):
        actdb.ingest(store, model=other, tokenizer=AutoTokenizer.from_pretrained(path),
                     prompts=["another prompt"], name="x", device="cpu")
    # ... or the same weights in another dtype: said with the dtype to pass
    with pytest.raises(actdb.IngestError, match="loaded as bfloat16, the stored rows came from "
                                                "float32: pass --dtype float32"):
        actdb.ingest(store, model=str(path), prompts=["another prompt"], name="x",
                     device="cpu", dtype="bfloat16")
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(1,)]
        digest = db.sql("SELECT params_digest FROM models").fetchall()[0][0]
    assert len(digest) == 64
    # the same weights resume as before
    same = AutoModelForCausalLM.from_pretrained(path)
    actdb.ingest(store, model=same, tokenizer=AutoTokenizer.from_pretrained(path),
                 prompts=["another prompt"], name="x", device="cpu")
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(2,)]


@pytest.mark.parametrize("name", ["ingest.lock", "catalog.duckdb.wal", "shards.lock",
                                  "catalog.duckdb.log", "dangling"])
def test_links_in_a_stores_folder_never_redirect_a_write(
        name: str, model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """A store received from elsewhere holding a symbolic link named like one of its files:
    the ingest truncated the lock's target and wrote its process id there, and DuckDB wrote
    its log through a linked .wal (review finding). The ingest refuses in one sentence, the
    file pointed to is untouched (a dangling link's target not made), nothing is added, and
    the store answers as before; a linked tensors folder (another disk) stays allowed."""
    import shutil

    store = tmp_path / "s.actdb"
    path = str(model_dir("gpt2"))
    actdb.ingest(store, model=path, prompts=["one prompt here"], device="cpu")
    victim = tmp_path / "victim.txt"
    victim.write_text("important data\n")
    target = tmp_path / "nowhere.txt" if name == "dangling" else victim
    link = store / ("catalog.duckdb.wal" if name == "dangling" else name)
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    with pytest.raises(actdb.StoreFormatError, match="is a symbolic link"):
        actdb.ingest(store, model=path, prompts=["another prompt"], device="cpu")
    assert victim.read_text() == "important data\n" and not (tmp_path / "nowhere.txt").exists()
    link.unlink()
    with actdb.connect(store) as db:
        assert db.sql("SELECT text FROM prompts").fetchall() == [("one prompt here",)]
    moved = tmp_path / "elsewhere" / "tensors.zarr"
    moved.parent.mkdir()
    shutil.move(store / "tensors.zarr", moved)
    (store / "tensors.zarr").symlink_to(moved, target_is_directory=True)
    actdb.ingest(store, model=path, prompts=["another prompt"], device="cpu")
    with actdb.connect(store) as db:
        assert db.sql("SELECT count(*) FROM prompts").fetchall() == [(2,)]
        assert db.verify(full=True) == []


def test_second_ctrl_c_waits_for_the_commit_being_written() -> None:
    """Ctrl-C twice while a commit is being written: the ingest waits for that commit before
    it lets go of the store (its lock is released right after), whatever the user presses."""
    import os
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from actdb.ingestion.run import drained as _drained

    started, second_sent, finished = threading.Event(), threading.Event(), threading.Event()

    def commit() -> None:
        started.set()
        second_sent.wait(30)  # the commit lasts until the second Ctrl-C has come
        time.sleep(0.2)
        finished.set()

    def second_ctrl_c() -> None:
        started.wait(30)
        time.sleep(0.3)  # by now the first Ctrl-C has the ingest waiting for its commit
        os.kill(os.getpid(), signal.SIGINT)
        second_sent.set()

    threading.Thread(target=second_ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        with _drained(ThreadPoolExecutor(max_workers=1)) as committer:
            committer.submit(commit)
            started.wait(30)
            raise KeyboardInterrupt  # the first Ctrl-C, during the forward passes
    assert finished.is_set(), "the ingest let go of the store while a commit was written"


def test_a_groups_host_buffers_are_separate_aligned_and_on_huge_pages_where_offered() -> None:
    """The sink's host buffers of one commit group (fields._host_buffers): every array its
    own bytes (values written into each survive the others' writes), writable, cache-line
    aligned, of its shape and dtype; on Linux with transparent huge pages, one mapping advised
    for them (VmFlags `hg`), so the batches that first fill it take a fault a 2 MiB, not 4 KiB."""
    import mmap
    import os
    import sys

    import numpy as np

    from actdb.ingestion import fields

    specs = [((3071, 768), np.float16), ((3071,), np.float32), ((3071,), np.float32),
             ((3071, 4, 64), np.float16), ((3071, 4), np.float32), ((3071, 4), np.float32),
             ((3071, 768), np.float16), ((3071,), np.float32), ((3071,), np.float32)]
    arrays = fields._host_buffers(specs)  # 11 MB: one mapping, not the heap
    assert [(a.shape, a.dtype) for a in arrays] == [(s, np.dtype(d)) for s, d in specs]
    for i, a in enumerate(arrays):
        assert a.flags.writeable and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0
        a[...] = i + 1
    for i, a in enumerate(arrays):
        assert np.all(a == i + 1), i
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.path.exists(thp) and "[never]" not in open(thp).read()):
        return
    start = arrays[0].ctypes.data
    fields_of: dict[str, str] = {}
    with open("/proc/self/smaps") as f:
        region = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                region = lo <= start < hi
            elif region:
                fields_of[head.rstrip(":")] = " ".join(line.split()[1:])
    flags = fields_of["VmFlags"].split()
    # advised, and private: a shared anonymous mapping is shmem, whose huge pages follow
    # shmem_enabled ("never" by default), so the advice would change nothing
    # (whether the kernel then finds free 2 MiB pages depends on the machine's memory, so
    # AnonHugePages is not asserted: on this VM an ingest's mappings were all huge pages)
    assert "hg" in flags and "sh" not in flags, flags
    small = fields._host_buffers([((8, 4), np.float16)])  # below the size: the heap
    assert small[0].base is None
