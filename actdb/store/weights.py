"""A model's weights in the group: the embedding, the LM head and its bias, and each site's
effective gain and bias, written once at registration (durable before the catalog row that
names them) and read back chunk by chunk, every chunk checked (chunk_reads.py)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from . import durable
from .array_group import ArrayGroup
from .chunk_reads import ChunkReader, n_chunks
from .chunks import RawLayout, raw_layout
from .digests import Digest, weight_digests
from .layer_weights import GROUP as LAYER_WEIGHTS_GROUP
from .layer_weights import MANIFEST as LAYER_WEIGHTS_MANIFEST
from .write_sync import WriteSync

if TYPE_CHECKING:
    import zarr
    import zarr.codecs
else:
    from ..lazy import lazy_module

    zarr = lazy_module("zarr")

# Zarr v3 dimension names, so xarray.open_zarr and other tools label the axes. Names are
# unique within a group where sizes can differ (an LM head may have more rows than W_E).
_WEIGHT_DIMS = {"embed": ("embed_token", "dim"), "lm_head": ("vocab", "dim"),
                "projection": ("embed_dim", "dim"),
                "lm_head_bias": ("vocab",), "gain": ("dim",), "bias": ("dim",)}
SiteParams = dict[str, tuple[np.ndarray | None, np.ndarray | None]]


def weight_chunk_rows(shape: tuple[int, ...]) -> int:
    """Rows a chunk of a weight array of `shape` (a matrix: up to 8,192 rows a chunk; a
    vector: one chunk)."""
    return min(shape[0], 8192) if len(shape) == 2 else shape[0]


class Weights:
    """The weights of the models in `group`."""

    def __init__(self, group: ArrayGroup, reader: ChunkReader, durability: WriteSync) -> None:
        self.group = group
        self.reader = reader
        self.durability = durability
        # (gain or bias, shape) -> a site parameter's metadata and chunk layout (_param_metadata)
        self._param_templates: dict[tuple[object, ...], tuple[bytes, RawLayout]] = {}

    # -- writing -----------------------------------------------------------------------------

    def write(self, model_id: int, *, embed: np.ndarray | None, lm_head: np.ndarray | None,
              lm_head_bias: np.ndarray | None, site_params: SiteParams,
              layer_weights: Mapping[str, np.ndarray] | None = None,
              weights_manifest: Mapping[str, Any] | None = None,
              pool: Executor | None = None, projection: np.ndarray | None = None) -> None:
        """Write a model's weights, replacing any left by an interrupted earlier ingest,
        and make them durable before the catalog row that makes them visible.
        `layer_weights`: arrays named as layer_weights.array_name says, with the manifest
        that describes them (layer_weights.py). `projection`: a contrastive model's projection
        from the final norm's output to its image embedding (the labels lens divides by
        the length of that embedding)."""
        path = self.group.path
        self.group.model_group(model_id)  # its parents exist, on object storage too
        self.group.forget(f"models/{model_id}/")
        fs = self.durability.file_system_sync()  # before the writes: syncfs reports theirs
        if path is not None:  # weights an interrupted registration left are replaced
            for name in ("embed", "lm_head", "lm_head_bias", "projection", "sites",
                         LAYER_WEIGHTS_GROUP):
                shutil.rmtree(path / "models" / str(model_id) / name, ignore_errors=True)
        with self.group.staged(f"models/{model_id}", pool) as g:
            named = {"embed": embed, "lm_head": lm_head, "lm_head_bias": lm_head_bias,
                     "projection": projection}
            for name, value in named.items():
                if value is not None:
                    self._write_whole(g, name, value, pool)
            if weights_manifest is not None:
                g.require_group(LAYER_WEIGHTS_GROUP).attrs[LAYER_WEIGHTS_MANIFEST] = dict(
                    weights_manifest)
            for name, value in (layer_weights or {}).items():
                folder, _, leaf = name.rpartition("/")
                self._write_whole(g.require_group(folder), leaf, value, pool)
            if path is None:  # object storage: each array staged, then PUT with the rest
                for site, (gain, bias) in site_params.items():
                    sg = g.require_group(f"sites/{site}")
                    for name, value in (("gain", gain), ("bias", bias)):
                        if value is not None:
                            self._write_whole(sg, name, value, pool)
        if path is not None:  # an object PUT is durable when it returns
            self._write_site_params(model_id, site_params, pool, sync=fs is None)
            if fs is not None:  # every file here is new: one syncfs for them all
                fs.sync()
            else:
                durable.sync_tree(path / "models" / str(model_id), skip="acts")
                durable.fsync_file(path / "models" / "zarr.json")  # zarr's, at the first
                durable.fsync_dir(path / "models")
                durable.fsync_dir(path)

    def _write_site_params(self, model_id: int, site_params: SiteParams,
                           pool: Executor | None, *, sync: bool = True) -> None:
        """A local store's norm gains and biases (`sites/{site}/{gain,bias}`), each a chunk
        file beside the metadata zarr would write for it. The metadata holds no name, so zarr
        builds it once per shape (`_param_metadata`) rather than once per array."""
        path = self.group.path
        assert path is not None
        label = f"models/{model_id}/sites"
        files: dict[str, bytes] = {}
        writes: list[tuple[RawLayout, np.ndarray]] = []
        for site, pair in site_params.items():
            files[f"{site}/zarr.json"] = self.group.group_metadata()
            for name, value in zip(("gain", "bias"), pair, strict=True):
                if value is None:
                    continue
                value = np.ascontiguousarray(value, dtype=np.float32)
                meta, layout = self._param_metadata(name, value.shape)
                files[f"{site}/{name}/zarr.json"] = meta
                # the template's chunk folder, moved to this array's (chunk keys "c/0")
                folder = path / label / site / name
                writes.append((dataclasses.replace(
                    layout, label=f"{label}/{site}/{name}",
                    folder=str(folder / "c") if layout.prefix == "" else str(folder)), value))
        if not files:
            return
        files["zarr.json"] = self.group.group_metadata()
        self.group.put_metadata(label, files)

        def one(item: tuple[RawLayout, np.ndarray]) -> None:
            layout, value = item
            os.makedirs(os.path.dirname(layout.path(0)), exist_ok=True)
            layout.write(0, value, point="weight_write", sync=sync)

        list((pool.map if pool else map)(one, writes))

    def _param_metadata(self, name: str, shape: tuple[int, ...]) -> tuple[bytes, RawLayout]:
        """The metadata of a site's `gain` or `bias` array of `shape`, built by zarr once per
        shape (as `_write_whole` creates it), and its chunk files' layout on a local disk."""
        key = (name, shape)
        made = self._param_templates.get(key)
        if made is None:
            staged: dict[str, Any] = {}
            root = zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
            layout = raw_layout(create_weight_array(root, name, shape), self.group.zstore)
            if layout is None:  # pragma: no cover - create_weight_array's codecs are stored raw
                raise RuntimeError(f"a site's {name} array is not stored raw")
            made = self._param_templates[key] = (staged[f"{name}/zarr.json"].to_bytes(), layout)
        return made

    def _write_whole(self, group: zarr.Group, name: str, value: np.ndarray,
                     pool: Executor | None) -> None:
        value = np.ascontiguousarray(value, dtype=np.float32)
        arr = create_weight_array(group, name, value.shape)
        # `group` is staged in memory (ArrayGroup.staged); its path is the array's path in
        # the store.
        raw = raw_layout(arr, self.group.zstore) if self.group.objects is None else None
        if raw is None:
            arr[...] = value
            return
        # On a local disk the chunk files are written straight, as the vectors' are, past
        # zarr's per-chunk overhead.
        step = raw.shape[0]
        n = -(-value.shape[0] // step)

        def one(chunk: int) -> None:
            part = value[chunk * step : (chunk + 1) * step]
            if part.shape[0] < step:  # the edge chunk is stored whole, padded with the fill
                part = np.concatenate([part, np.zeros((step - part.shape[0], *part.shape[1:]),
                                                      dtype=part.dtype)])
            os.makedirs(os.path.dirname(raw.path(chunk)), exist_ok=True)
            raw.write(chunk, part, point="weight_write", direct=True)

        list((pool.map if pool else map)(one, range(n)))

    @staticmethod
    def digests(model_id: int, weights: dict[str, np.ndarray | None]) -> list[Digest]:
        """The digests of a model's weights (by their names under the model: `embed`,
        `sites/{site}/gain`, ...), as `write` chunks them."""
        out: list[Digest] = []
        for name, value in weights.items():
            if value is not None:
                out += weight_digests(f"models/{model_id}/{name}", value,
                                      weight_chunk_rows(value.shape))
        return out

    # -- reading -----------------------------------------------------------------------------

    def read(self, model_id: int, name: str, *, required: bool = True) -> np.ndarray | None:
        """A weight array whole, every chunk present and checked; None when absent and not
        `required` (the catalog says whether a model has it: then its absence is damage)."""
        label = f"models/{model_id}/{name}"
        info = self.group.info(label, required=required)
        if info is None:
            return None
        return self.reader.whole(label, info)

    def blocks(self, model_id: int, name: str
               ) -> tuple[tuple[int, ...], Iterator[tuple[int, np.ndarray]]] | None:
        """A weight array's shape and its rows chunk by chunk, as (first row, rows), each
        chunk checked as `read` checks it; None when absent. Memory stays one chunk (a
        large vocabulary's embedding is gigabytes)."""
        label = f"models/{model_id}/{name}"
        info = self.group.info(label, required=False)
        if info is None:
            return None
        return info.shape, self.reader.blocks(label, info)

    def check(self, model_id: int, name: str, *, required: bool, full: bool) -> None:
        """verify's check of one weight array: structure, or (`full`) every byte."""
        arr = self.group.open_array(f"models/{model_id}/{name}", required=required)
        if arr is None:
            return
        if full:
            self.reader.whole(arr.path, self.group.info_of(arr))
            return
        raw = self.group.raw_layout(arr)
        if raw is not None:
            for i in range(n_chunks(arr)):
                raw.stat(i)

    def rows(self, model_id: int, name: str, rows: list[int]) -> np.ndarray:
        """Rows of a weight array [len(rows), ...], reading only the chunks that hold them,
        each checked as `read` checks it (a query about one token of a 128k vocabulary
        reads one chunk of 8,192 rows, not the whole matrix)."""
        label = f"models/{model_id}/{name}"
        info = self.group.info(label, required=True)
        assert info is not None
        c = info.chunks[0]
        out = np.empty((len(rows), *info.shape[1:]), dtype=info.dtype)
        chunks: dict[int, np.ndarray] = {}
        for j, r in enumerate(rows):
            if not 0 <= r < info.shape[0]:
                raise IndexError(f"row {r} of {label!r}, which has {info.shape[0]}")
            i = r // c
            if i not in chunks:
                chunks[i] = self.reader.chunk(label, info, i)
            out[j] = chunks[i][r - i * c]
        return out


def create_weight_array(group: zarr.Group, name: str, shape: tuple[int, ...], *,
                        chunk_rows: int | None = None,
                        dims: tuple[str, ...] | None = None) -> zarr.Array:
    """A weight array `name` of `shape` (float32) in `group`, chunked along its rows
    (`chunk_rows` a chunk: weight_chunk_rows by default); `dims`: its dimension names."""
    chunks = (chunk_rows or weight_chunk_rows(shape), *shape[1:])
    return group.create_array(
        name, shape=shape, dtype="float32", chunks=chunks,
        compressors=[zarr.codecs.Crc32cCodec()], overwrite=True,
        # a chunk equal to the fill value (an all-zero bias) is still written: a missing
        # chunk is damage, never zeros
        config={"write_empty_chunks": True},
        # per-head sites' gain and bias are [heads, d]
        dimension_names=dims or weight_dims(name, shape),
    )


def weight_dims(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The array's dimension names (xarray needs them, and one size per name in a group): a
    per-head site's gain and bias are [head, dim]; a layer's matrices (W_Q, u, ...) are rows
    of the residual width; any other array's axes are named for the array alone."""
    if name in ("gain", "bias") and len(shape) == 2:
        return ("head", "dim")
    if name in _WEIGHT_DIMS:
        return _WEIGHT_DIMS[name]
    if len(shape) == 2 and (name.startswith("W_") or name in ("u", "v")):
        return (f"{name}_row", "dim")
    return tuple(f"{name}_{axis}" for axis in range(len(shape)))


__all__ = ["Weights", "create_weight_array", "weight_chunk_rows"]
