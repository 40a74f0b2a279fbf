"""The scan workloads' data: a synthetic store (generate.py, fixed seed) and the same vectors
as a float16 NumPy memory map and a DuckDB FLOAT[d] table, the baselines' copies; and the
query every scan workload times on an open actdb connection."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_model
import duckdb
import numpy as np
import pyarrow as pa
from generate import Shape, generate

import actdb
from actdb.store.store import Store

TOKEN = "w123"


@dataclass
class ScanData:
    scale: Any
    store: Path
    n_vectors: int
    npy: Path
    baseline_db: Path
    anchor: np.ndarray  # float32 [d], unit: the TOKEN's anchor
    generate_seconds: float
    scan_bytes: int = 0  # the store's size on disk before workload 6 grows it

    @classmethod
    def build(cls, scale: Any, work: Path) -> ScanData:
        shape = Shape(d=scale.d, vocab=scale.vocab, n_sites=scale.scan_sites,
                      prompt_tokens=min(128, scale.scan_tokens // 16))
        store = work / "scan.actdb"
        t = time.perf_counter()
        generate(store, tokens=scale.scan_tokens, shape=shape)
        seconds = time.perf_counter() - t
        with Store(store) as st:
            embed = st.arrays.weight(0, "embed")
            sites = [s.site for s in st.catalog.sites("synthetic")]
        assert embed is not None
        a = embed[int(TOKEN[1:])]
        data = cls(scale=scale, store=store, n_vectors=scale.scan_tokens * len(sites),
                   npy=work / "vectors.npy", baseline_db=work / "baseline.duckdb",
                   anchor=(a / np.linalg.norm(a)).astype(np.float32), generate_seconds=seconds)
        data._write_baselines(sites)
        with Store(store) as st:
            data.scan_bytes = st.disk_bytes()["total"]
        # Every file just written (about 1.6 GB at medium scale) to disk before anything is
        # timed: the kernel writing them back during a timed read made the first workload's
        # scan 30% slower than the same scan a minute later (1.14x DuckDB against 1.41-1.49x).
        os.sync()
        return data

    def blocks(self, sites: list[str], rows: int = 65536) -> Any:
        """The stored vectors x = direction * norm (float32), block by block."""
        group = self._group()
        for s in sites:
            d16, norm = group[f"models/0/acts/{s}/direction"], group[f"models/0/acts/{s}/norm"]
            for lo in range(0, self.scale.scan_tokens, rows):
                hi = min(lo + rows, self.scale.scan_tokens)
                yield np.asarray(d16[lo:hi], np.float32) * np.asarray(norm[lo:hi])[:, None]

    def _group(self) -> Any:
        import zarr

        return zarr.open_group(str(self.store / "tensors.zarr"), mode="r")

    def sites(self) -> list[str]:
        return [k for k in self._group()["models/0/acts"].group_keys()]

    def _write_baselines(self, sites: list[str]) -> None:
        d = self.scale.d
        mm = np.lib.format.open_memmap(self.npy, mode="w+", dtype=np.float16,
                                       shape=(self.n_vectors, d))
        con = duckdb.connect(str(self.baseline_db))
        con.execute(f"CREATE TABLE vecs (v FLOAT[{d}])")
        at = 0
        for x in self.blocks(sites):
            mm[at : at + len(x)] = x.astype(np.float16)
            at += len(x)
            arr = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), d)
            batch = pa.table({"v": arr})
            con.register("batch", batch)
            con.execute("INSERT INTO vecs SELECT v FROM batch")
            con.unregister("batch")
        mm.flush()
        del mm
        con.close()


class ActdbScan:
    """The query on one open connection; every run starts with no chunk cached (the page
    cache stays warm, as it does for the baselines), and counts what it reads."""

    def __init__(self, store: Path, where: str = "", params: dict[str, Any] | None = None):
        self.db = actdb.connect(store, device=bench_model.DEVICE)
        self.query = f"SELECT avg(cosine_to_anchor(vec, '{TOKEN}')) FROM acts {where}"
        self.params = params
        self.stats: dict[str, int] = {}

    def __call__(self) -> Any:
        self.db.drop_caches()
        before = self.db.stats
        out = self.db.sql(self.query, params=self.params).fetchall()[0][0]
        self.stats = {k: v - before[k] for k, v in self.db.stats.items()}
        return out

    def close(self) -> None:
        self.db.close()


def numpy_cosines(scan: ScanData) -> float:
    """The full scan's answer from the float16 memory map, 65,536 rows a block."""
    mm = np.load(scan.npy, mmap_mode="r")
    total = 0.0
    for lo in range(0, len(mm), 65536):
        x = np.asarray(mm[lo : lo + 65536], dtype=np.float32)
        total += float((x @ scan.anchor / np.linalg.norm(x, axis=1)).sum())
    return total / len(mm)
