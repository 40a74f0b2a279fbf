"""The store's own contract: the raw chunk reader agrees with zarr-python, byte for byte."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr

from actdb.errors import StoreCorruptError
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
