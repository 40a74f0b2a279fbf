"""The store's own contract: the raw chunk reader agrees with zarr-python, byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr

from actdb.errors import StoreCorruptError
from actdb.store.arrays import Arrays
from actdb.store.chunks import local_info, raw_layout
from actdb.store.records import ModelRecord, SiteRecord
from actdb.store.store import Store
from actdb.store.weights import create_weight_array


def test_raw_chunk_reads_equal_zarr_reads(family_store: Callable[[str], Path]) -> None:
    path = family_store("qwen3")  # plain sites and per-head sites, chunks of 8 rows
    group = zarr.open_group(str(path / "tensors.zarr"), mode="r")
    with Store(path) as st:
        model = st.catalog.models()[0]
        sites = st.catalog.sites(model.model)
        for s in sites:
            for field in ("direction", "norm", "mean"):
                arr = group[f"models/{model.model_id}/acts/{s.site}/{field}"]
                c = arr.chunks[0]
                n_chunks = -(-arr.shape[0] // c)
                raw = st.arrays.raw_layout(st.arrays.act_array(model.model_id, s.site, field))
                assert raw is not None and raw.crc
                for chunk in range(n_chunks):
                    raw = st.arrays.read_chunk(model.model_id, s.site, field, chunk)
                    lo, hi = chunk * c, min(chunk * c + c, arr.shape[0])
                    np.testing.assert_array_equal(raw[: hi - lo], np.asarray(arr[lo:hi]))
                    assert raw.shape == (c, *arr.shape[1:])


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_arrays_read_from_their_metadata_file_are_what_zarr_opens(
    family_store: Callable[[str], Path], family: str
) -> None:
    """`chunks.local_info` reads each array of a local store from its `zarr.json` alone (no
    zarr import on a query's path): for every array of an ingested store (vectors of plain and
    per-head sites, weights, norm gains and biases), its shape, chunks, dtype and chunk files
    are what zarr-python opens, and a chunk read through them is zarr's chunk."""
    path = family_store(family)
    root = path / "tensors.zarr"
    group = zarr.open_group(str(root), mode="r")
    labels = sorted(str(f.parent.relative_to(root)) for f in root.rglob("zarr.json")
                    if f.parent != root)
    arrays = [label for label in labels if isinstance(group[label], zarr.Array)]
    assert any("/acts/" in a for a in arrays) and any(a.endswith("/embed") for a in arrays)
    with Store(path) as st:
        for label in arrays:
            arr = group[label]
            found = local_info(root, label)
            assert found is not None, label
            shape, chunks_, raw = found
            assert (shape, chunks_, raw.dtype) == (arr.shape, arr.chunks, arr.dtype), label
            assert raw == raw_layout(arr, zarr.storage.LocalStore(str(root))), label
            c = arr.chunks[0]
            last = -(-arr.shape[0] // c) - 1
            np.testing.assert_array_equal(raw.read(last)[: arr.shape[0] - last * c],
                                          np.asarray(arr[last * c :]))
            info = st.arrays.info(label)
            assert info is not None and info.raw == raw and info.shape == arr.shape
        # absent (an untied head that is not there), optional and required, as zarr says
        assert st.arrays.info("models/0/nothing", required=False) is None
        with pytest.raises(StoreCorruptError, match="is missing"):
            st.arrays.info("models/0/nothing")


def test_an_array_that_is_not_raw_is_opened_through_zarr(tmp_path: Path) -> None:
    """Metadata `local_info` does not take (another codec, a sharded array, damage) leaves the
    array to zarr: its answer, or its error."""
    arrays = Arrays.create(tmp_path / "t.zarr")
    g = zarr.open_group(str(tmp_path / "t.zarr"), mode="r+")
    value = np.arange(40, dtype=np.float32).reshape(10, 4)
    g.create_array("zstd", shape=(10, 4), chunks=(4, 4), dtype="float32",
                   compressors=[zarr.codecs.ZstdCodec()])[...] = value
    g.create_array("sharded", shape=(10, 4), chunks=(2, 4), shards=(4, 4),
                   dtype="float32")[...] = value
    g.create_array("plain", shape=(10, 4), chunks=(4, 4), dtype="float32",
                   compressors=None)[...] = value
    root = tmp_path / "t.zarr"
    assert local_info(root, "zstd") is None and local_info(root, "sharded") is None
    assert local_info(root, "plain") is not None  # bytes alone: raw, no checksum
    for name in ("zstd", "sharded", "plain"):
        info = arrays.info(name)
        assert info is not None and info.shape == (10, 4)
        assert (info.raw is None) == (name != "plain"), name
        np.testing.assert_array_equal(arrays.reader.whole(name, info), value)
    (root / "plain" / "zarr.json").write_text("{not json")
    fresh = Arrays(root, read_only=True)
    with pytest.raises(StoreCorruptError, match="cannot be read"):
        fresh.info("plain")


def test_missing_chunk_is_an_error_naming_it(tmp_path: Path) -> None:
    st = Store.open_or_create(tmp_path / "s.actdb")
    try:
        st.arrays.ensure_act_arrays(0, "x", inner=(4,), rows=32, chunk_tokens=8)
        st.arrays.write_rows(0, "x", 0, {"direction": np.ones((8, 4), np.float16),
                                         "norm": np.ones(8, np.float32),
                                         "mean": np.ones(8, np.float32)})
        assert (st.arrays.read_chunk(0, "x", "direction", 0) == 1).all()
        with pytest.raises(StoreCorruptError, match=r"chunk 2 of array 'models/0/acts/x/"
                                                    r"direction' is missing"):
            st.arrays.read_chunk(0, "x", "direction", 2)
    finally:
        st.close()


def test_new_sites_metadata_is_what_zarr_writes(tmp_path: Path) -> None:
    """A new site's arrays are made from metadata built once per shape (ActArrays._site_metadata):
    every site's files equal, byte for byte, those zarr writes when it creates the same arrays
    in place, and zarr opens them as arrays of the right shape, dtype and chunks."""
    import zarr

    st = Store.open_or_create(tmp_path / "s.actdb")
    shapes = {"a.ln1": ((8,), 48), "b.ln2": ((8,), 48), "c.q_norm": ((2, 4), 48),
              "d.ln1": ((8,), 80)}
    try:
        st.arrays.ensure_act_groups(0)
        for site, (inner, rows) in shapes.items():
            st.arrays.ensure_act_arrays(0, site, inner=inner, rows=rows, chunk_tokens=16)
    finally:
        st.close()
    ours = tmp_path / "s.actdb" / "tensors.zarr" / "models" / "0" / "acts"
    plain = zarr.open_group(str(tmp_path / "plain.zarr"), mode="w", zarr_format=3)
    for site, (inner, rows) in shapes.items():
        st.arrays.acts.create_arrays(plain.require_group(site), inner=inner, rows=rows,
                                     chunk_tokens=16)
        for name in ("zarr.json", "direction/zarr.json", "norm/zarr.json", "mean/zarr.json"):
            want = (tmp_path / "plain.zarr" / site / name).read_bytes()
            assert (ours / site / name).read_bytes() == want, (site, name)
    group = zarr.open_group(str(tmp_path / "s.actdb" / "tensors.zarr"), mode="r")
    arr = group["models/0/acts/c.q_norm/direction"]
    assert (arr.shape, str(arr.dtype), arr.chunks) == ((48, 2, 4), "float16", (16, 2, 4))
    assert group["models/0/acts/b.ln2/norm"].shape == (48,)
    assert group["models/0/acts/d.ln1/mean"].shape == (80,)


def test_site_parameters_are_what_zarr_writes(tmp_path: Path) -> None:
    """A local store's norm gains and biases are written from metadata built once per shape
    (Weights._param_metadata) and chunk files written straight: every file under the model's
    `sites` folder (groups, arrays, chunks) equals, byte for byte, what zarr writes when it
    creates the same arrays in place with the same values, and zarr reads the values back."""
    import zarr

    rng = np.random.default_rng(3)
    params: dict[str, tuple[np.ndarray | None, np.ndarray | None]] = {
        "blocks.0.ln1": (rng.standard_normal(8).astype(np.float32),
                         rng.standard_normal(8).astype(np.float32)),
        "blocks.0.ln2": (rng.standard_normal(8).astype(np.float32), None),  # RMSNorm: no bias
        "blocks.0.q_norm": (rng.standard_normal((2, 4)).astype(np.float32), None),  # per head
        "final": (rng.standard_normal(8).astype(np.float32), np.zeros(8, np.float32)),
        "embed": (None, None),  # no parameters: a group of its own, as zarr makes it
    }
    st = Store.open_or_create(tmp_path / "s.actdb")
    try:
        st.arrays.write_weights(0, embed=np.ones((4, 8), np.float32), lm_head=None,
                                lm_head_bias=None, site_params=params)
    finally:
        st.close()
    ours = tmp_path / "s.actdb" / "tensors.zarr" / "models" / "0" / "sites"
    plain = zarr.open_group(str(tmp_path / "plain.zarr"), mode="w", zarr_format=3)
    for site, pair in params.items():
        sg = plain.require_group(f"sites/{site}")
        for name, value in zip(("gain", "bias"), pair, strict=True):
            if value is not None:
                create_weight_array(sg, name, value.shape)[...] = value
    want = {p.relative_to(tmp_path / "plain.zarr" / "sites"): p.read_bytes()
            for p in (tmp_path / "plain.zarr" / "sites").rglob("*") if p.is_file()}
    got = {p.relative_to(ours): p.read_bytes() for p in ours.rglob("*") if p.is_file()}
    assert sorted(map(str, got)) == sorted(map(str, want))
    for path, data in want.items():
        assert got[path] == data, path
    group = zarr.open_group(str(tmp_path / "s.actdb" / "tensors.zarr"), mode="r")
    for site, pair in params.items():
        for name, value in zip(("gain", "bias"), pair, strict=True):
            if value is not None:
                assert np.array_equal(group[f"models/0/sites/{site}/{name}"][...], value)


def test_store_held_by_another_process_is_one_sentence(
    family_store: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain duckdb writer holding the catalog past the lock wait: one sentence naming it
    (an ingest never holds it that long: it opens the file only to commit)."""
    import shutil
    import subprocess
    import sys

    from click.testing import CliRunner

    from actdb.cli import cli

    monkeypatch.setenv("ACTDB_LOCK_WAIT_S", "0.5")
    path = tmp_path / "busy.actdb"
    shutil.copytree(family_store("gpt2"), path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; "
         "c = duckdb.connect(sys.argv[1]); print('held', flush=True); time.sleep(60)",
         str(path / "catalog.duckdb")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = CliRunner().invoke(cli, ["query", str(path), "SELECT count(*) FROM tokens"])
        assert result.exit_code == 1
        assert "held open by another process" in result.stderr
        assert f"PID {holder.pid}" in result.stderr
    finally:
        holder.kill()
        holder.wait()


def _small_model(n_sites: int = 3) -> tuple[ModelRecord, list[SiteRecord]]:
    sites = [SiteRecord(site=f"s{i}", site_id=i, layer=i, role="pre_attn", kind="rmsnorm", d=4,
                        n_heads=None, eps=1e-5, module=f"m{i}", has_gain=False, has_bias=False)
             for i in range(n_sites)]
    model = ModelRecord(model="m", model_id=0, source="test", revision=None, architecture="X",
                        d_model=4, n_layers=n_sites, vocab_size=2, n_sites=n_sites,
                        has_lm_head=False, has_lm_head_bias=False, tied_embeddings=False,
                        final_site=None, dtype="float32", max_length=None, sites_glob=None,
                        chunk_tokens=8)
    return model, sites


def _register(st: Store, model: ModelRecord, sites: list[SiteRecord], rows: int) -> None:
    import pyarrow as pa

    st.register_model(model, sites, embed=np.ones((2, 4), np.float32),
                      lm_head=None, lm_head_bias=None,
                      site_params={s.site: (None, None) for s in sites},
                      vocab=pa.table({"token_id": pa.array([0, 1], pa.int32()),
                                      "token": ["a", "b"], "piece": ["a", "b"]}))
    st.reserve_rows(model, sites, rows)


def _commit(st: Store, model: ModelRecord, sites: list[SiteRecord], start: int, n: int,
            prompt_id: int) -> None:
    import pyarrow as pa

    from actdb.store.store import ActBatch

    rng = np.random.default_rng(start)
    st.commit_batch(
        model, start=start,
        acts={s.site: ActBatch(
            direction=rng.standard_normal((n, 4)).astype(np.float16),
            norm=rng.random(n).astype(np.float32), mean=rng.random(n).astype(np.float32))
            for s in sites},
        new_prompts=pa.table({"prompt_id": pa.array([prompt_id], pa.int64()), "text": ["p"]}),
        prompt_runs=pa.table({"prompt_id": pa.array([prompt_id], pa.int64()),
                              "row_start": pa.array([start], pa.int64()),
                              "n_tokens": pa.array([n], pa.int32()), "truncated": [False]}),
        tokens=pa.table({"prompt_id": pa.array([prompt_id] * n, pa.int64()),
                         "position": pa.array(range(n), pa.int32()),
                         "token_id": pa.array([0] * n, pa.int32())}),
        site_errors={s.site: 0.0 for s in sites},
    )


@pytest.mark.parametrize("mode", ["files", "auto"])
def test_commit_makes_every_chunk_durable_before_the_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """What a commit writes is durable before the catalog commit that makes its rows visible.

    With an fsync a file (`ACTDB_SYNC=files`): every chunk file, then the folders holding the
    renames (concurrently, on the writer threads). With one syncfs (Linux 5.17 on, a local file
    system): a chunk
    holding committed rows (one partly filled, patched) is fsynced before its rename, a chunk
    written from its first row is not, and the syncfs runs once every chunk file is in place,
    before the catalog commit."""
    import os
    import re
    import threading

    from actdb.store import durable
    from actdb.store.catalog import Catalog

    monkeypatch.setenv("ACTDB_SYNC", mode)
    if mode == "auto" and not durable.batch_sync_available(tmp_path):
        pytest.skip("syncfs with its write errors needs Linux 5.17 and a local file system")
    lock = threading.Lock()
    events: list[tuple[str, object]] = []  # in order: ("fsync", chunk), ("dir", folder), ...
    real_fsync, real_fsync_dir = os.fsync, durable.fsync_dir
    real_syncfs, real_commit = durable.FileSystemSync.sync, Catalog.commit_batch
    tmp_suffix = re.compile(r"\.\d+\.\d+\.partial$")

    def fsync(fd: int) -> None:
        real_fsync(fd)
        name = os.readlink(f"/proc/self/fd/{fd}")
        with lock:
            events.append(("fsync", tmp_suffix.sub("", name)))

    def fsync_dir(path: str) -> None:
        real_fsync_dir(path)
        with lock:
            events.append(("dir", str(Path(path))))

    def syncfs(self: durable.FileSystemSync) -> None:
        on_disk = set(chunk_files())
        real_syncfs(self)
        with lock:
            events.append(("syncfs", on_disk))

    def commit(self: Catalog, **kw: object) -> None:
        with lock:
            events.append(("catalog", set(chunk_files())))
        real_commit(self, **kw)  # type: ignore[arg-type]

    root = tmp_path / "s.actdb"

    def chunk_files() -> list[str]:
        return [str(p) for p in (root / "tensors.zarr").rglob("c.*")
                if "/acts/" in str(p) and not p.name.endswith(".partial")]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(durable, "fsync_dir", fsync_dir)
    monkeypatch.setattr(durable.FileSystemSync, "sync", syncfs)
    monkeypatch.setattr(Catalog, "commit_batch", commit)
    model, sites = _small_model()
    with Store.open_or_create(root) as st:
        _register(st, model, sites, 48)
        # rows [0, 37): direction chunks 0-3 whole, 4 begun; norm and mean chunk 0 begun
        # rows [37, 48): direction chunk 4 and norm and mean chunk 0 patched, chunk 5 whole
        for start, n, prompt in ((0, 37, 0), (37, 11, 1)):
            events.clear()
            _commit(st, model, sites, start, n, prompt)
            assert events[-1][0] == "catalog"
            written = {f for f in chunk_files()
                       if any(f.endswith(f"/{field}/c.{i}.0") or f.endswith(f"/{field}/c.{i}")
                              for field, first, last in (("direction", start // 8,
                                                          (start + n - 1) // 8),
                                                         ("norm", 0, 0), ("mean", 0, 0))
                              for i in range(first, last + 1))}
            assert len(written) == 3 * ((start + n - 1) // 8 - start // 8 + 1 + 2), written
            patched = {f for f in written if start > 0 and (
                "/norm/" in f or "/mean/" in f or f.endswith(f"/direction/c.{start // 8}.0"))}
            fsynced = {e[1] for e in events if e[0] == "fsync"}
            if mode == "files":
                assert written <= fsynced, sorted(written - fsynced)[:3]
                folders = {e[1] for e in events if e[0] == "dir"}
                assert {str(Path(f).parent) for f in written} <= folders
                assert not any(e[0] == "syncfs" for e in events)
            else:
                assert patched <= fsynced, sorted(patched - fsynced)[:3]
                assert not (written - patched) & fsynced, sorted((written - patched) & fsynced)
                syncs = [e[1] for e in events if e[0] == "syncfs"]
                assert len(syncs) == 1 and written <= syncs[0], sorted(written - syncs[0])[:3]
                assert not any(e[0] == "dir" for e in events)
            assert written <= events[-1][1]


@pytest.mark.parametrize("mode", ["files", "auto"])
def test_a_new_models_files_are_durable_before_the_catalog_names_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A model's weights (embedding, norm gains and biases, their metadata) are durable before
    its catalog row, and its sites' new arrays before `reserve_rows` returns: each file and
    folder fsynced (`ACTDB_SYNC=files`), or one syncfs once all are in place."""
    import os
    import re
    import threading

    from actdb.store import durable
    from actdb.store.catalog import Catalog

    monkeypatch.setenv("ACTDB_SYNC", mode)
    if mode == "auto" and not durable.batch_sync_available(tmp_path):
        pytest.skip("syncfs with its write errors needs Linux 5.17 and a local file system")
    root = tmp_path / "s.actdb"
    lock = threading.Lock()
    events: list[tuple[str, object]] = []
    real_fsync, real_syncfs = os.fsync, durable.FileSystemSync.sync
    real_insert = Catalog.insert_model
    tmp_suffix = re.compile(r"\.\d+(\.\d+)?\.partial$")

    def files() -> set[str]:
        return {str(p) for p in (root / "tensors.zarr" / "models").rglob("*")
                if p.is_file() and not p.name.endswith(".partial")}

    def fsync(fd: int) -> None:
        real_fsync(fd)
        with lock:
            events.append(("fsync", tmp_suffix.sub("", os.readlink(f"/proc/self/fd/{fd}"))))

    def syncfs(self: durable.FileSystemSync) -> None:
        on_disk = files()
        real_syncfs(self)
        with lock:
            events.append(("syncfs", on_disk))

    def insert(self: Catalog, *a: object) -> None:
        events.append(("catalog", files()))
        real_insert(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(durable.FileSystemSync, "sync", syncfs)
    monkeypatch.setattr(Catalog, "insert_model", insert)
    model, sites = _small_model()
    gains = {s.site: (np.full(4, i + 1.0, np.float32), np.zeros(4, np.float32) if i else None)
             for i, s in enumerate(sites)}
    with Store.open_or_create(root) as st:
        import pyarrow as pa

        events.clear()
        st.save_tokenizer(0, lambda folder: (Path(folder).mkdir(parents=True),
                                             (Path(folder) / "tokenizer.json").write_text("{}")))
        tokenizer = {e[1] for e in events if e[0] == "fsync"}
        assert str(root / "tokenizers" / "0" / "tokenizer.json") in tokenizer, tokenizer
        st.register_model(model, sites, embed=np.ones((2, 4), np.float32),
                          lm_head=None, lm_head_bias=None, site_params=gains,
                          vocab=pa.table({"token_id": pa.array([0, 1], pa.int32()),
                                          "token": ["a", "b"], "piece": ["a", "b"]}))
        at = [i for i, e in enumerate(events) if e[0] == "catalog"][0]
        weights = events[at][1]
        assert isinstance(weights, set) and len(weights) >= 1 + 3 + 1 + 3 + 2 * 2, weights
        before = events[:at]
        if mode == "files":
            assert weights <= {e[1] for e in before if e[0] == "fsync"}
        else:
            assert any(e[0] == "syncfs" and weights <= e[1] for e in before)  # type: ignore
        events.clear()
        st.reserve_rows(model, sites, 40)
        arrays = files() - weights
        assert len(arrays) == 1 + 3 * 4, sorted(arrays)  # acts, a group and three arrays a site
        if mode == "files":
            assert arrays <= {e[1] for e in events if e[0] == "fsync"}
        else:
            assert any(e[0] == "syncfs" and arrays <= e[1] for e in events)  # type: ignore
            assert not arrays & {e[1] for e in events if e[0] == "fsync"}


def test_a_write_finishing_beside_a_sync_is_made_durable_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last batch's chunks are written ahead on the writer threads, and may be done while
    the commit before it runs its sync: a file renamed into place after that sync read what
    it had to make durable is made durable by the next sync, never left to chance."""
    import os

    from actdb.store import durable

    monkeypatch.delenv("ACTDB_SYNC", raising=False)
    if not durable.batch_sync_available(tmp_path):
        pytest.skip("syncfs with its write errors needs Linux 5.17 and a local file system")
    calls: list[int] = []
    real_syncfs, real_replace = durable.FileSystemSync.sync, os.replace
    model, sites = _small_model(1)
    with Store.open_or_create(tmp_path / "s.actdb") as st:
        _register(st, model, sites, 32)
        monkeypatch.setattr(durable.FileSystemSync, "sync",
                            lambda self: (calls.append(1), real_syncfs(self))[1])
        _commit(st, model, sites, 0, 8, 0)
        assert len(calls) == 1
        beside = [True]

        def replace(src: str, dst: str) -> None:
            if beside[0] and "/direction/c." in str(dst):
                beside[0] = False
                st.arrays.sync()  # a commit's sync, between the write and the rename
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        rows = np.ones((8, 4), np.float16)
        assert st.arrays.write_whole_chunks(0, "s0", 8, rows) == (8, 16)  # the write ahead
        assert not beside[0]
        before = len(calls)
        st.arrays.sync()
        assert len(calls) == before + 1, "the chunk renamed beside a sync was left unsynced"
        st.arrays.sync()
        assert len(calls) == before + 1  # nothing written since
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert str(tmp_path / "s.actdb" / "tensors.zarr") not in held  # closed with the store


def test_syncfs_reports_failure_once_and_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FileSystemSync: a real syncfs on the store's file system; a failure (the kernel's
    errno) raises, and so does every later call, since the kernel reports an error once and
    what it lost is not written again; a call after close raises instead of syncing whatever
    file now has the descriptor's number."""
    import ctypes
    import errno

    from actdb.errors import ActdbError
    from actdb.store import durable

    monkeypatch.delenv("ACTDB_SYNC", raising=False)
    if not durable.batch_sync_available(tmp_path):
        pytest.skip("syncfs with its write errors needs Linux 5.17 and a local file system")
    fs = durable.FileSystemSync(tmp_path)
    fs.sync()  # the real system call
    fs.sync()

    class Failing:
        def syncfs(self, fd: int) -> int:
            ctypes.set_errno(errno.EIO)
            return -1

    monkeypatch.setattr(durable, "_syncfs", lambda: Failing())
    with pytest.raises(OSError, match="Input/output error") as first:
        fs.sync()
    assert first.value.errno == errno.EIO and "nothing was committed" in str(first.value)
    monkeypatch.undo()
    with pytest.raises(OSError, match="Input/output error"):
        fs.sync()  # the real call again: still the failure
    other = durable.FileSystemSync(tmp_path)
    other.close()
    with pytest.raises(OSError) as closed:
        other.sync()
    assert closed.value.errno == errno.EBADF
    monkeypatch.setattr(durable, "file_system_type", lambda path: "fuse.sshfs")
    assert not durable.batch_sync_available(tmp_path)
    monkeypatch.setenv("ACTDB_SYNC", "fast")
    with pytest.raises(ActdbError, match="ACTDB_SYNC='fast' is not a sync mode"):
        durable.batch_sync_available(tmp_path)
    fs.close()


def test_file_system_type_reads_the_longest_mount_above_a_path(tmp_path: Path) -> None:
    """Mount points in /proc/self/mounts escape blanks as octal; a path's file system is its
    longest mount point's, and a sibling whose name merely starts the same is not above it."""
    from actdb.store import durable

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "fuse /data/my\\040disk fuse.sshfs rw 0 0\n"
        "srv:/x /data/n\u00e4he nfs4 rw 0 0\n"
        "tmpfs /data/my tmpfs rw 0 0\n", encoding="utf-8")
    assert durable.file_system_type("/data/my disk/s.actdb", mounts=str(mounts)) == "fuse.sshfs"
    assert durable.file_system_type("/data/n\u00e4he/s.actdb", mounts=str(mounts)) == "nfs4"
    assert durable.file_system_type("/data/my/s.actdb", mounts=str(mounts)) == "tmpfs"
    assert durable.file_system_type("/data/mystore", mounts=str(mounts)) == "ext4"
    assert durable.file_system_type("/x", mounts=str(tmp_path / "absent")) is None


def test_new_chunks_on_another_file_system_are_fsynced_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk folder on another file system than the one the syncfs runs on (a disk mounted
    inside the store) is not covered by it: its new files are fsynced each."""
    import os
    import re

    from actdb.store import durable

    monkeypatch.delenv("ACTDB_SYNC", raising=False)
    if not durable.batch_sync_available(tmp_path):
        pytest.skip("syncfs with its write errors needs Linux 5.17 and a local file system")
    fsynced: list[str] = []
    real_fsync = os.fsync
    tmp_suffix = re.compile(r"\.\d+\.\d+\.partial$")

    def fsync(fd: int) -> None:
        real_fsync(fd)
        fsynced.append(tmp_suffix.sub("", os.readlink(f"/proc/self/fd/{fd}")))

    model, sites = _small_model(1)
    with Store.open_or_create(tmp_path / "s.actdb") as st:
        _register(st, model, sites, 32)
        fs = st.arrays.durability.file_system_sync()
        assert fs is not None
        monkeypatch.setattr(fs, "device", -1)  # every folder is elsewhere
        monkeypatch.setattr(os, "fsync", fsync)
        _commit(st, model, sites, 0, 16, 0)
    written = [p for p in fsynced if "/direction/c." in p]
    assert sorted(set(written)) == sorted(
        str(tmp_path / "s.actdb" / "tensors.zarr" / "models/0/acts/s0/direction" / f"c.{i}.0")
        for i in (0, 1)), fsynced


def test_a_failed_syncfs_fails_the_commit_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write error that syncfs reports fails the commit before the catalog's: the rows stay
    invisible, the store opens with what it had, and the next commit syncs again."""
    import errno

    from actdb.store import durable

    monkeypatch.delenv("ACTDB_SYNC", raising=False)
    if not durable.batch_sync_available(tmp_path):
        pytest.skip("syncfs with its write errors needs Linux 5.17 and a local file system")
    real_syncfs = durable.FileSystemSync.sync
    failing = [False]

    def syncfs(self: durable.FileSystemSync) -> None:
        if failing[0]:
            raise OSError(errno.EIO, "syncfs failed: Input/output error", self.path)
        real_syncfs(self)

    monkeypatch.setattr(durable.FileSystemSync, "sync", syncfs)
    model, sites = _small_model(1)
    root = tmp_path / "s.actdb"
    with Store.open_or_create(root) as st:
        _register(st, model, sites, 32)
        _commit(st, model, sites, 0, 8, 0)
        failing[0] = True
        with pytest.raises(OSError, match="Input/output error"):
            _commit(st, model, sites, 8, 8, 1)
    with Store(root) as st:
        assert st.catalog.one("SELECT n_rows FROM models")[0] == 8  # type: ignore[index]
        assert st.catalog.one("SELECT count(*) FROM prompts")[0] == 1  # type: ignore[index]
    failing[0] = False
    calls: list[int] = []
    monkeypatch.setattr(durable.FileSystemSync, "sync",
                        lambda self: (calls.append(1), real_syncfs(self))[1])
    with Store(root, ingest=True) as st:
        _commit(st, model, sites, 8, 8, 1)
        assert calls == [1]
        assert st.catalog.one("SELECT n_rows FROM models")[0] == 16  # type: ignore[index]


def _takes_o_direct(folder: Path) -> bool:
    import errno
    import os

    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(folder / "probe")
    return True


@pytest.mark.parametrize("n_floats", [1, 2047, 2048, 4096, 5000, 6143])
def test_weight_chunks_written_past_the_page_cache_are_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_floats: int) -> None:
    """Large weight chunks are written with O_DIRECT through a page-aligned buffer of pieces
    (here 8 KiB: 2,048 float32): the file is the values then their CRC-32C, byte for byte, at
    every place the values and the checksum can end against a piece (the checksum alone in the
    last piece, split across two, the file exactly one piece). The reference is the values'
    own bytes and the `crc32c` package."""
    import crc32c

    from actdb.store import chunks

    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system takes no O_DIRECT")
    monkeypatch.setattr(chunks, "_DIRECT_PIECE", 8192)
    data = np.random.default_rng(n_floats).standard_normal(n_floats).astype(np.float32)
    tmp = str(tmp_path / "chunk.partial")
    assert chunks.write_direct(tmp, data, crc32c.crc32c(data.tobytes()), "weight_write")
    want = data.tobytes() + crc32c.crc32c(data.tobytes()).to_bytes(4, "little")
    assert Path(tmp).read_bytes() == want


def test_a_large_weight_is_written_direct_and_read_back_by_zarr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's weights of 4 MiB chunks or more go through `write_direct` (counted), and
    both actdb's checked read and a plain zarr-python read give the values back."""
    import zarr

    from actdb.store import chunks

    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system takes no O_DIRECT")
    calls: list[int] = []
    real = chunks.write_direct

    def counted(tmp: str, data: np.ndarray, crc: int | None, point: str) -> bool:
        calls.append(data.nbytes)
        return real(tmp, data, crc, point)

    monkeypatch.setattr(chunks, "write_direct", counted)
    embed = np.random.default_rng(0).standard_normal((9000, 160)).astype(np.float32)
    gain = np.linspace(0.5, 1.5, 160, dtype=np.float32)
    st = Store.open_or_create(tmp_path / "s.actdb")
    try:
        st.arrays.write_weights(0, embed=embed, lm_head=None, lm_head_bias=None,
                                site_params={"final": (gain, None)})
        got = st.arrays.weight(0, "embed")
        assert got is not None and np.array_equal(got, embed)
    finally:
        st.close()
    # two chunks of 8,192 rows (5.2 MB, the second padded to full size); the gain is small
    assert calls == [8192 * 160 * 4] * 2, calls
    group = zarr.open_group(str(tmp_path / "s.actdb" / "tensors.zarr"), mode="r")
    assert np.array_equal(group["models/0/embed"][...], embed)
    assert np.array_equal(group["models/0/sites/final/gain"][...], gain)
