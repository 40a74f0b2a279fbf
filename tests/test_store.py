"""The store's own contract: the raw chunk reader agrees with zarr-python, byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr

from actdb.errors import StoreCorruptError
from actdb.store.arrays import Arrays
from actdb.store.store import Store


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
    """A new site's arrays are made from metadata built once per shape (Arrays._site_metadata):
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
        Arrays._create_act_arrays(st.arrays, plain.require_group(site), inner=inner, rows=rows,
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
    (Arrays._param_metadata) and chunk files written straight: every file under the model's
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
                Arrays._create_whole(sg, name, value.shape)[...] = value
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


def test_commit_makes_every_chunk_folder_durable_before_the_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit fsyncs the folder of every chunk file it renamed into place (concurrently, on
    the writer threads) before the catalog commit that makes the rows visible."""
    import threading

    import pyarrow as pa

    from actdb.store import durable
    from actdb.store.catalog import Catalog
    from actdb.store.records import ModelRecord, SiteRecord
    from actdb.store.store import ActBatch

    synced: list[str] = []
    lock = threading.Lock()
    real_fsync_dir = durable.fsync_dir

    def recording(path: str) -> None:
        real_fsync_dir(path)
        with lock:
            synced.append(str(Path(path)))

    at_commit: list[set[str]] = []
    real_commit = Catalog.commit_batch

    def commit(self: Catalog, **kw: object) -> None:
        with lock:
            at_commit.append(set(synced))
        real_commit(self, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(durable, "fsync_dir", recording)
    monkeypatch.setattr(Catalog, "commit_batch", commit)
    sites = [SiteRecord(site=f"s{i}", site_id=i, layer=i, role="pre_attn", kind="rmsnorm", d=4,
                        n_heads=None, eps=1e-5, module=f"m{i}", has_gain=False, has_bias=False)
             for i in range(3)]
    model = ModelRecord(model="m", model_id=0, source="test", revision=None, architecture="X",
                        d_model=4, n_layers=3, vocab_size=2, n_sites=3, has_lm_head=False,
                        has_lm_head_bias=False, tied_embeddings=False, final_site=None,
                        dtype="float32", max_length=None, sites_glob=None, chunk_tokens=8)
    n = 40  # five direction chunks a site, files in their array's folder
    with Store.open_or_create(tmp_path / "s.actdb") as st:
        st.register_model(model, sites, embed=np.ones((2, 4), np.float32), lm_head=None,
                          lm_head_bias=None, site_params={s.site: (None, None) for s in sites},
                          vocab=pa.table({"token_id": pa.array([0, 1], pa.int32()),
                                          "token": ["a", "b"], "piece": ["a", "b"]}))
        st.reserve_rows(model, sites, n)
        synced.clear()
        st.commit_batch(
            model, start=0,
            acts={s.site: ActBatch(direction=np.ones((n, 4), np.float16),
                                   norm=np.ones(n, np.float32), mean=np.zeros(n, np.float32))
                  for s in sites},
            new_prompts=pa.table({"prompt_id": pa.array([0], pa.int64()), "text": ["p"]}),
            prompt_runs=pa.table({"prompt_id": pa.array([0], pa.int64()),
                                  "row_start": pa.array([0], pa.int64()),
                                  "n_tokens": pa.array([n], pa.int32()),
                                  "truncated": [False]}),
            tokens=pa.table({"prompt_id": pa.array([0] * n, pa.int64()),
                             "position": pa.array(range(n), pa.int32()),
                             "token_id": pa.array([0] * n, pa.int32())}),
            site_errors={s.site: 0.0 for s in sites},
        )
        chunks = [p for p in (tmp_path / "s.actdb" / "tensors.zarr").rglob("*")
                  if p.is_file() and p.name.startswith("c.") and "/acts/" in str(p)]
        chunk_folders = {str(p.parent) for p in chunks}
    # a local store's chunk keys use the separator ".": no folder a chunk (each one made and
    # fsynced cost as much CPU as writing the chunk's file)
    assert len(chunks) == 3 * (5 + 1 + 1) and len(chunk_folders) == 3 * 3, sorted(chunks)
    assert at_commit and chunk_folders <= at_commit[0], sorted(chunk_folders - at_commit[0])[:3]


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
