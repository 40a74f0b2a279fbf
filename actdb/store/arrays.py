"""The Zarr v3 group: stored vectors (chunked along the token axis) and model weights.

Layout (see docs/FORMAT.md):
    models/{model_id}/embed           float32 [V, d]
    models/{model_id}/lm_head         float32 [V, d]   (absent when tied to embed or no head)
    models/{model_id}/lm_head_bias    float32 [V]
    models/{model_id}/sites/{site}/gain, bias            float32 [d]
    models/{model_id}/acts/{site}/direction   float16 [rows, d] or [rows, heads, d]
    models/{model_id}/acts/{site}/norm, mean  float32 [rows] or [rows, heads]
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zarr.storage

from .catalog import FORMAT_VERSION

ACT_FIELDS = ("direction", "norm", "mean")
# Small direction chunks keep selective queries from reading much they do not need (a
# 128-token prompt of a d=768 model is one chunk); chunk files are read raw, so many small
# chunks cost a full scan little. norm and mean are 4 bytes a row: their chunks hold more rows.
_TARGET_CHUNK_BYTES = 256 << 10
SCALAR_CHUNK_FACTOR = 32


def default_chunk_tokens(width: int) -> int:
    """Token rows per direction chunk: about 256 KiB, a power of two, at least 64."""
    rows = max(_TARGET_CHUNK_BYTES // (2 * max(width, 1)), 64)
    return int(2 ** round(np.log2(rows)))


class Arrays:
    """The Zarr side of a store."""

    def __init__(self, path: Path, *, read_only: bool, store: Any = None) -> None:
        self.path = path
        self.read_only = read_only
        self.zstore = store if store is not None else zarr.storage.LocalStore(
            str(path), read_only=read_only
        )
        self.group = zarr.open_group(self.zstore, mode="r" if read_only else "r+")
        # Opening an array reads its metadata file: keep the handles (and raw chunk paths).
        self._handles: dict[tuple[int, str, str], zarr.Array] = {}
        self._raw: dict[tuple[int, str, str], Any] = {}
        self._made: set[str] = set()  # chunk folders known to exist

    @classmethod
    def create(cls, path: Path) -> Arrays:
        zarr.open_group(
            zarr.storage.LocalStore(str(path)),
            mode="w",
            zarr_format=3,
            attributes={"actdb_format_version": FORMAT_VERSION},
        )
        return cls(path, read_only=False)

    def format_version(self) -> int:
        v = self.group.attrs.get("actdb_format_version", -1)
        return int(v) if isinstance(v, int | float | str) else -1

    # -- weights ---------------------------------------------------------------------------

    def _model_group(self, model_id: int) -> zarr.Group:
        return self.group.require_group(f"models/{model_id}")

    def write_weights(
        self,
        model_id: int,
        *,
        embed: np.ndarray,
        lm_head: np.ndarray | None,
        lm_head_bias: np.ndarray | None,
        site_params: dict[str, tuple[np.ndarray | None, np.ndarray | None]],
    ) -> None:
        """Write a model's weights, replacing any left by an interrupted earlier ingest."""
        g = self._model_group(model_id)
        named = {"embed": embed, "lm_head": lm_head, "lm_head_bias": lm_head_bias}
        for name, value in named.items():
            if value is not None:
                self._write_whole(g, name, value)
        for site, (gain, bias) in site_params.items():
            sg = g.require_group(f"sites/{site}")
            for name, value in (("gain", gain), ("bias", bias)):
                if value is not None:
                    self._write_whole(sg, name, value)

    # Zarr v3 dimension names, so xarray.open_zarr and other tools label the axes. Names are
    # unique within a group where sizes can differ (an LM head may have more rows than W_E).
    _WEIGHT_DIMS = {"embed": ("embed_token", "dim"), "lm_head": ("vocab", "dim"),
                    "lm_head_bias": ("vocab",), "gain": ("dim",), "bias": ("dim",)}

    @staticmethod
    def _write_whole(group: zarr.Group, name: str, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value, dtype=np.float32)
        chunks = (min(value.shape[0], 8192), *value.shape[1:]) if value.ndim == 2 else value.shape
        arr = group.create_array(
            name, shape=value.shape, dtype="float32", chunks=chunks, compressors=None,
            overwrite=True,
            # per-head sites' gain and bias are [heads, d]
            dimension_names=("head", "dim") if name in ("gain", "bias") and value.ndim == 2
            else Arrays._WEIGHT_DIMS.get(name),
        )
        arr[...] = value

    def weight(self, model_id: int, name: str) -> np.ndarray | None:
        key = f"models/{model_id}/{name}"
        try:
            arr = self.group[key]
        except KeyError:
            return None
        assert isinstance(arr, zarr.Array)
        return np.asarray(arr[...])

    # -- vectors ---------------------------------------------------------------------------

    def ensure_act_arrays(
        self, model_id: int, site: str, *, inner: tuple[int, ...], rows: int, chunk_tokens: int
    ) -> None:
        """Create the site's arrays or grow them to at least `rows` token rows."""
        g = self._model_group(model_id).require_group(f"acts/{site}")
        for name in ACT_FIELDS:
            self._handles.pop((model_id, site, name), None)
        specs = {
            "direction": ((*inner,), "float16"),
            "norm": (inner[:-1], "float32"),
            "mean": (inner[:-1], "float32"),
        }
        for name, (tail, dtype) in specs.items():
            if name in g:
                arr = g[name]
                assert isinstance(arr, zarr.Array)
                if arr.shape[0] < rows:
                    arr.resize((rows, *tail))
            else:
                step = chunk_tokens * (1 if name == "direction" else SCALAR_CHUNK_FACTOR)
                g.create_array(
                    name, shape=(rows, *tail), dtype=dtype, chunks=(step, *tail),
                    compressors=None, fill_value=0,
                    dimension_names=(("row", "head", "dim") if len(tail) == 2 else ("row", "dim"))
                    if name == "direction" else ("row", "head")[: 1 + len(tail)],
                )

    def act_array(self, model_id: int, site: str, field: str) -> zarr.Array:
        key = (model_id, site, field)
        arr = self._handles.get(key)
        if arr is None:
            found = self.group[f"models/{model_id}/acts/{site}/{field}"]
            assert isinstance(found, zarr.Array)
            arr = self._handles[key] = found
        return arr

    def read_chunk(self, model_id: int, site: str, field: str, chunk: int) -> np.ndarray:
        """One whole chunk of a site's field (the rows chunk * C .. chunk * C + C - 1).

        Chunks are stored raw (no compression), so where the array is laid out as this
        format writes it, the chunk file is read straight into memory: about 20x less
        overhead per chunk than going through zarr-python. Anything else goes through zarr.
        """
        key = (model_id, site, field)
        layout = self._layout(key)
        if layout:
            folder, tail, shape, dtype = layout
            out = np.empty(shape, dtype=dtype)
            try:
                # readinto releases the GIL for the read itself, so a read-ahead thread
                # reads while the query's thread computes (np.fromfile holds it).
                with open(f"{folder}/{chunk}{tail}", "rb", buffering=0) as f:
                    f.readinto(out.data.cast("B"))
            except FileNotFoundError:  # never written: the fill value
                out[...] = 0
            return out
        arr = self.act_array(*key)
        c = arr.chunks[0]
        return np.asarray(arr[chunk * c : min(chunk * c + c, arr.shape[0])])

    def _raw_layout(self, arr: zarr.Array) -> tuple[Any, ...]:
        """(folder, key tail, chunk shape, dtype) of chunk files `c/{i}/0...` when the array
        is stored raw; () when it must be read through zarr."""
        meta: Any = arr.metadata
        codecs: tuple[Any, ...] = tuple(getattr(meta, "codecs", ()))
        encoding: Any = getattr(meta, "chunk_key_encoding", None)
        raw = (
            isinstance(self.zstore, zarr.storage.LocalStore)
            and len(codecs) == 1 and type(codecs[0]).__name__ == "BytesCodec"
            and str(getattr(codecs[0], "endian", "little")).endswith("little")
            and np.little_endian and getattr(meta, "fill_value", None) == 0
            and all(s == c for s, c in zip(arr.shape[1:], arr.chunks[1:], strict=True))
            and type(encoding).__name__ == "DefaultChunkKeyEncoding"
            and getattr(encoding, "separator", None) == "/"
        )
        if not raw:
            return ()
        folder = str(Path(str(self.zstore.root)) / arr.path / "c")
        return folder, "/0" * (arr.ndim - 1), (arr.chunks[0], *arr.shape[1:]), arr.dtype

    def write_rows(
        self, model_id: int, site: str, start: int, values: dict[str, np.ndarray]
    ) -> None:
        """Write token rows [start, start + n) of a site's direction, norm and mean."""
        for name in ACT_FIELDS:
            value = values[name]
            layout = self._layout((model_id, site, name))
            if layout:
                self._write_raw(layout, start, value)
            else:
                self.act_array(model_id, site, name)[start : start + value.shape[0]] = value

    def _write_raw(self, layout: tuple[Any, ...], start: int, value: np.ndarray) -> None:
        """Write rows straight into raw chunk files, each replaced whole and atomically
        (a temporary file renamed over it), as zarr's local store would, minus its
        per-chunk overhead. A chunk only partly covered is read, patched and replaced."""
        folder, tail, shape, dtype = layout
        c, stop = shape[0], start + value.shape[0]
        value = np.ascontiguousarray(value, dtype=dtype)
        for chunk in range(start // c, (stop - 1) // c + 1):
            lo = chunk * c
            a, b = max(start, lo), min(stop, lo + c)
            path = f"{folder}/{chunk}{tail}"
            if a == lo and b == lo + c:
                data = value[a - start : b - start]
            else:
                try:
                    data = np.fromfile(path, dtype=dtype).reshape(shape)
                except FileNotFoundError:
                    data = np.zeros(shape, dtype=dtype)
                data[a - lo : b - lo] = value[a - start : b - start]
            parent = os.path.dirname(path)
            if parent not in self._made:
                os.makedirs(parent, exist_ok=True)
                self._made.add(parent)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
            data.tofile(tmp)
            os.replace(tmp, path)

    def _layout(self, key: tuple[int, str, str]) -> tuple[Any, ...]:
        layout = self._raw.get(key)
        if layout is None:
            layout = self._raw[key] = self._raw_layout(self.act_array(*key))
        return layout

    def has_model(self, model_id: int) -> bool:
        return f"models/{model_id}" in self.group
