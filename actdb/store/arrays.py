"""The Zarr v3 group: stored vectors (chunked along the token axis) and model weights.

Layout (see docs/FORMAT.md):
    models/{model_id}/embed           float32 [V, d]
    models/{model_id}/lm_head         float32 [V, d]   (absent when tied to embed or no head)
    models/{model_id}/lm_head_bias    float32 [V]
    models/{model_id}/sites/{site}/gain, bias            float32 [d]
    models/{model_id}/acts/{site}/direction   float16 [rows, d] or [rows, heads, d]
    models/{model_id}/acts/{site}/norm, mean  float32 [rows] or [rows, heads]

Every chunk ends with its CRC-32C (Zarr's `crc32c` codec, format 2): checked on every read,
here and by a plain `zarr.open_group`. On object storage (format 3) the vectors are sharded:
each object holds SHARD_CHUNKS inner chunks, each still with its own CRC-32C (shards.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StoreCorruptError
from ..lazy import lazy_module, load
from . import durable
from .catalog import LOCAL_FORMAT_VERSION
from .chunks import RawLayout, crc32c, local_info, raw_layout
from .layer_weights import GROUP as layer_weights_group
from .layer_weights import MANIFEST as LAYER_WEIGHTS_MANIFEST
from .shards import ObjectChunks, ShardedChunks, object_layout

if TYPE_CHECKING:
    import zarr
    import zarr.codecs

    from .objects import Objects  # obstore: imported by a remote store alone
else:
    # imported when the group is first opened: a query that reads no vector (`SELECT 1`,
    # `actdb info`) never pays for it (0.3 s of CPU)
    zarr = lazy_module("zarr")

# How a chunk is read straight from storage: a local file, an object, or a range of a shard.
Layout = RawLayout | ObjectChunks | ShardedChunks


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What reading an array needs from its metadata (`Arrays.info`): its shape, its chunks'
    shape and dtype, and how a chunk is read straight from storage (None: through zarr)."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype[Any]
    raw: Layout | None

ACT_FIELDS = ("direction", "norm", "mean")
# Small direction chunks keep selective queries from reading much they do not need (a
# 128-token prompt of a d=768 model is one chunk); chunk files are read raw, so many small
# chunks cost a full scan little. norm and mean are 4 bytes a row: their chunks hold more rows.
_TARGET_CHUNK_BYTES = 256 << 10
SCALAR_CHUNK_FACTOR = 32
# Inner chunks per shard on object storage: a direction shard of 16 chunks of about 256 KiB
# (3 MiB at d = 768; one PUT per shard an ingest batch touches), read back by range one inner
# chunk at a time.
SHARD_CHUNKS = 16


def write_alignment(chunk_tokens: int, *, sharded: bool) -> int:
    """Rows at which one writer's range may start without sharing a file with another's:
    a whole norm/mean chunk (SCALAR_CHUNK_FACTOR direction chunks), or on object storage a
    whole shard object of those."""
    return chunk_tokens * SCALAR_CHUNK_FACTOR * (SHARD_CHUNKS if sharded else 1)


def default_chunk_tokens(width: int) -> int:
    """Token rows per direction chunk: about 256 KiB, a power of two, at least 64."""
    rows = max(_TARGET_CHUNK_BYTES // (2 * max(width, 1)), 64)
    return int(2 ** round(np.log2(rows)))


class Arrays:
    """The Zarr side of a store."""

    def __init__(self, path: Path | None, *, read_only: bool, store: Any = None,
                 objects: Objects | None = None) -> None:
        """`path`: the local `tensors.zarr` folder; or None with `objects`, the group's prefix
        on object storage (then `store` is zarr's ObjectStore over it)."""
        self.path = path
        self.objects = objects
        self.label = str(path) if path is not None else objects.where("") if objects else "?"
        self.read_only = read_only
        # Off only to measure what checking costs (benchmarks/); never off for users.
        self.check_checksums = True
        self._zstore = store
        self._group: zarr.Group | None = None
        if path is None or not read_only:
            self.group  # noqa: B018 - writers and object storage open the group now
        # Opening an array reads its metadata file: keep the handles (and raw chunk paths).
        self._infos: dict[str, ArrayInfo] = {}  # by label (`info`)
        self._opened: dict[str, zarr.Array] = {}  # by label: arrays opened through zarr
        self._made: set[str] = set()  # chunk folders known to exist
        self._dirty: set[str] = set()  # folders with renames not yet fsynced
        self._dirty_lock = threading.Lock()
        # New chunk files are written without an fsync each and made durable by one syncfs
        # in `sync` (durable.FileSystemSync); `_unsynced`: some were written since.
        self._batch_sync = (path is not None and not read_only
                            and durable.batch_sync_available(path))
        self._fs_sync: durable.FileSystemSync | None = None  # opened before the first such file
        self._on_device: dict[str, bool] = {}  # chunk folder -> on the descriptor's file system
        self._unsynced = False
        # (inner shape, rows, chunk rows, sharded) -> a new site's metadata files (_site_metadata)
        self._site_templates: dict[tuple[object, ...], dict[str, bytes]] = {}
        # (gain or bias, shape) -> a site parameter's metadata and chunk layout (_param_metadata)
        self._param_templates: dict[tuple[object, ...], tuple[bytes, RawLayout]] = {}
        self._group_json: bytes | None = None

    @property
    def zstore(self) -> Any:
        """zarr's store under the group (a LocalStore for a local store)."""
        if self._zstore is None:
            load(zarr)
            self._zstore = zarr.storage.LocalStore(str(self.path), read_only=self.read_only)
        return self._zstore

    @property
    def group(self) -> zarr.Group:
        """The root group, opened on first use (a local store's version is read without it)."""
        if self._group is None:
            try:
                self._group = zarr.open_group(self.zstore, mode="r" if self.read_only else "r+")
            except Exception as e:
                raise StoreCorruptError(
                    f"the root metadata of {self.label!r} cannot be read ({_first_line(e)}): "
                    "the store is damaged"
                ) from None
        return self._group

    @classmethod
    def create(cls, path: Path | None, *, version: int = LOCAL_FORMAT_VERSION,
               store: Any = None, objects: Objects | None = None) -> Arrays:
        load(zarr)
        zarr.open_group(
            store if store is not None else zarr.storage.LocalStore(str(path)),
            mode="w",
            zarr_format=3,
            attributes={"actdb_format_version": version},
        )
        return cls(path, read_only=False, store=store, objects=objects)

    @property
    def sharded(self) -> bool:
        """Vectors go in shards of inner chunks (object storage: fewer, larger objects)."""
        return self.objects is not None

    def format_version(self) -> int:
        attrs = self.group.attrs if self._group is not None else self._root_attributes()
        v = attrs.get("actdb_format_version", -1)
        return int(v) if isinstance(v, int | float | str) else -1

    def _root_attributes(self) -> dict[str, Any]:
        """The root group's attributes read from its `zarr.json` (Zarr v3's group metadata),
        damage reported as opening the group reports it."""
        assert self.path is not None
        try:
            doc = json.loads((self.path / "zarr.json").read_bytes())
            if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
                raise ValueError("not the metadata of a Zarr v3 group")
            attrs = doc.get("attributes", {})
            if not isinstance(attrs, dict):
                raise ValueError("its attributes are not an object")
        except Exception as e:  # noqa: BLE001 - any failure is damage, as zarr.open_group's
            raise StoreCorruptError(
                f"the root metadata of {self.label!r} cannot be read ({_first_line(e)}): "
                "the store is damaged"
            ) from None
        return attrs

    # -- opening arrays --------------------------------------------------------------------

    def open_array(self, label: str, *, required: bool = True) -> zarr.Array | None:
        """The array at `label`; a missing required one or damaged metadata is an error."""
        try:
            found = self.group[label]
        except KeyError:
            if required:
                raise StoreCorruptError(
                    f"array {label!r} is missing from {self.label!r}: the store is damaged"
                ) from None
            return None
        except Exception as e:
            raise StoreCorruptError(
                f"the metadata of array {label!r} in {self.label!r} cannot be read "
                f"({_first_line(e)}): the store is damaged"
            ) from None
        if not isinstance(found, zarr.Array):
            raise StoreCorruptError(f"{label!r} in {self.label!r} is not an array")
        return found

    def open_group(self, label: str) -> zarr.Group | None:
        """The group at `label`, or None where there is none."""
        try:
            found = self.group[label]
        except KeyError:
            return None
        return found if isinstance(found, zarr.Group) else None

    def info(self, label: str, *, required: bool = True) -> ArrayInfo | None:
        """The shape, chunks, dtype and chunk layout of the array at `label`: on a local disk
        from its metadata file alone where it is a raw array (`chunks.local_info`: no zarr
        import, no round trip through its event loop), else through zarr, which reports a
        missing or damaged array; None when absent and not `required`. Kept until the array
        is grown or rewritten here."""
        found = self._infos.get(label)
        if found is None:
            local = local_info(self.path, label) if self.path is not None else None
            if local is not None:
                shape, chunks, raw = local
                found = ArrayInfo(shape=shape, chunks=chunks, dtype=raw.dtype, raw=raw)
            elif (not required and self.path is not None
                  and not (self.path / label / "zarr.json").exists()):
                return None  # a Zarr v3 node is its metadata file: absent, as zarr would say
            else:
                arr = self.open_array(label, required=required)
                if arr is None:
                    return None
                found = self._info_of(arr)
            self._infos[label] = found
        return found

    def _info_of(self, arr: zarr.Array) -> ArrayInfo:
        return ArrayInfo(shape=tuple(arr.shape), chunks=tuple(arr.chunks),
                         dtype=np.dtype(arr.dtype), raw=self.raw_layout(arr))

    def _forget_arrays(self, prefix: str) -> None:
        for cache in (self._infos, self._opened):
            for label in [k for k in cache if k.startswith(prefix)]:
                cache.pop(label, None)

    def raw_layout(self, arr: zarr.Array) -> Layout | None:
        if self.objects is not None:
            return object_layout(arr, self.objects)
        return raw_layout(arr, self.zstore)

    def read_raw(self, raw: Layout, chunk: int) -> np.ndarray:
        """One chunk file, its size and checksum checked."""
        return raw.read(chunk, check=self.check_checksums)

    # -- weights ---------------------------------------------------------------------------

    def _model_group(self, model_id: int) -> zarr.Group:
        return self.group.require_group(f"models/{model_id}")

    def write_weights(
        self,
        model_id: int,
        *,
        embed: np.ndarray | None,
        lm_head: np.ndarray | None,
        lm_head_bias: np.ndarray | None,
        site_params: dict[str, tuple[np.ndarray | None, np.ndarray | None]],
        layer_weights: Mapping[str, np.ndarray] | None = None,
        weights_manifest: Mapping[str, Any] | None = None,
        pool: Executor | None = None,
    ) -> None:
        """Write a model's weights, replacing any left by an interrupted earlier ingest,
        and make them durable before the catalog row that makes them visible.
        `layer_weights`: arrays named as layer_weights.array_name says, with the manifest
        that describes them (layer_weights.py)."""
        self._model_group(model_id)  # its parents exist, on object storage too
        self._forget_arrays(f"models/{model_id}/")
        fs = self._file_system_sync()  # before the writes: its syncfs reports their errors
        if self.path is not None:  # weights an interrupted registration left are replaced
            for name in ("embed", "lm_head", "lm_head_bias", "sites", layer_weights_group):
                shutil.rmtree(self.path / "models" / str(model_id) / name, ignore_errors=True)
        with self._staged(f"models/{model_id}", pool) as g:
            named = {"embed": embed, "lm_head": lm_head, "lm_head_bias": lm_head_bias}
            for name, value in named.items():
                if value is not None:
                    self._write_whole(g, name, value, pool)
            if weights_manifest is not None:
                g.require_group(layer_weights_group).attrs[LAYER_WEIGHTS_MANIFEST] = dict(
                    weights_manifest)
            for name, value in (layer_weights or {}).items():
                folder, _, leaf = name.rpartition("/")
                self._write_whole(g.require_group(folder), leaf, value, pool)
            if self.path is None:  # object storage: each array staged, then PUT with the rest
                for site, (gain, bias) in site_params.items():
                    sg = g.require_group(f"sites/{site}")
                    for name, value in (("gain", gain), ("bias", bias)):
                        if value is not None:
                            self._write_whole(sg, name, value, pool)
        if self.path is not None:  # an object PUT is durable when it returns
            self._write_site_params(model_id, site_params, pool, sync=fs is None)
            if fs is not None:  # every file here is new: one syncfs for them all
                fs.sync()
            else:
                durable.sync_tree(self.path / "models" / str(model_id), skip="acts")
                durable.fsync_file(self.path / "models" / "zarr.json")  # zarr's, at the first
                durable.fsync_dir(self.path / "models")
                durable.fsync_dir(self.path)

    @contextmanager
    def _staged(self, label: str, pool: Executor | None) -> Iterator[zarr.Group]:
        """The group `label` to create arrays in, built in memory; when the block ends its
        metadata (and any chunk written through zarr) goes to storage: objects PUT
        concurrently with `pool`, or local files each written whole (a temporary file
        renamed). zarr creating arrays in place costs tens of round trips on object storage,
        and 10 ms an array on a local disk (0.8 s for a 25-site model's 75 arrays)."""
        staged: dict[str, Any] = {}
        root = zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
        yield root.require_group(label)
        items = [(k, v.to_bytes()) for k, v in staged.items() if k.startswith(label + "/")]
        if self.objects is not None:
            objects = self.objects
            list((pool.map if pool else map)(lambda kv: objects.put(kv[0], kv[1]), items))
            return
        self._put_metadata(label, {k.removeprefix(label + "/"): v for k, v in items})

    def _write_site_params(self, model_id: int, site_params: dict[
            str, tuple[np.ndarray | None, np.ndarray | None]], pool: Executor | None,
            *, sync: bool = True) -> None:
        """A local store's norm gains and biases (`sites/{site}/{gain,bias}`), each a chunk
        file beside the metadata zarr would write for it. The metadata holds no name, so zarr
        builds it once per shape (`_param_metadata`): building each array through zarr cost
        about 2.5 ms of its event loop, 0.12 s of CPU for a 25-site model's 50 arrays, on the
        commit thread beside the first forward pass."""
        assert self.path is not None
        label = f"models/{model_id}/sites"
        files: dict[str, bytes] = {}
        writes: list[tuple[RawLayout, np.ndarray]] = []
        for site, pair in site_params.items():
            files[f"{site}/zarr.json"] = self._group_metadata()
            for name, value in zip(("gain", "bias"), pair, strict=True):
                if value is None:
                    continue
                value = np.ascontiguousarray(value, dtype=np.float32)
                meta, layout = self._param_metadata(name, value.shape)
                files[f"{site}/{name}/zarr.json"] = meta
                # the template's chunk folder, moved to this array's (chunk keys "c/0")
                folder = self.path / label / site / name
                writes.append((dataclasses.replace(
                    layout, label=f"{label}/{site}/{name}",
                    folder=str(folder / "c") if layout.prefix == "" else str(folder)), value))
        if not files:
            return
        files["zarr.json"] = self._group_metadata()
        self._put_metadata(label, files)

        def one(item: tuple[RawLayout, np.ndarray]) -> None:
            layout, value = item
            os.makedirs(os.path.dirname(layout.path(0)), exist_ok=True)
            layout.write(0, value, point="weight_write", sync=sync)

        list((pool.map if pool else map)(one, writes))

    def _group_metadata(self) -> bytes:
        """An empty group's `zarr.json`, as zarr writes it."""
        if self._group_json is None:
            staged: dict[str, Any] = {}
            zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
            self._group_json = staged["zarr.json"].to_bytes()
        return self._group_json

    def _param_metadata(self, name: str, shape: tuple[int, ...]) -> tuple[bytes, RawLayout]:
        """The metadata of a site's `gain` or `bias` array of `shape`, built by zarr once per
        shape (as `_write_whole` creates it), and its chunk files' layout on a local disk."""
        key = (name, shape)
        made = self._param_templates.get(key)
        if made is None:
            staged: dict[str, Any] = {}
            root = zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
            layout = raw_layout(self._create_whole(root, name, shape), self.zstore)
            if layout is None:  # pragma: no cover - _create_whole's codecs are stored raw
                raise RuntimeError(f"a site's {name} array is not stored raw")
            made = self._param_templates[key] = (staged[f"{name}/zarr.json"].to_bytes(), layout)
        return made

    # Zarr v3 dimension names, so xarray.open_zarr and other tools label the axes. Names are
    # unique within a group where sizes can differ (an LM head may have more rows than W_E).
    _WEIGHT_DIMS = {"embed": ("embed_token", "dim"), "lm_head": ("vocab", "dim"),
                    "lm_head_bias": ("vocab",), "gain": ("dim",), "bias": ("dim",)}

    @staticmethod
    def _create_whole(group: zarr.Group, name: str, shape: tuple[int, ...]) -> zarr.Array:
        """A weight array `name` of `shape` (float32) in `group`, chunked along its rows."""
        chunks = (min(shape[0], 8192), *shape[1:]) if len(shape) == 2 else shape
        return group.create_array(
            name, shape=shape, dtype="float32", chunks=chunks,
            compressors=[zarr.codecs.Crc32cCodec()], overwrite=True,
            # a chunk equal to the fill value (an all-zero bias) is still written: a missing
            # chunk is damage, never zeros
            config={"write_empty_chunks": True},
            # per-head sites' gain and bias are [heads, d]
            dimension_names=("head", "dim") if name in ("gain", "bias") and len(shape) == 2
            else Arrays._WEIGHT_DIMS.get(name),
        )

    def _write_whole(self, group: zarr.Group, name: str, value: np.ndarray,
                     pool: Executor | None) -> None:
        value = np.ascontiguousarray(value, dtype=np.float32)
        arr = self._create_whole(group, name, value.shape)
        # `group` is staged in memory (_staged); its path is the array's path in the store.
        raw = raw_layout(arr, self.zstore) if self.objects is None else None
        if raw is None:
            arr[...] = value
            return
        # On a local disk the chunk files are written straight, as the vectors' are: zarr's
        # own write of a 154 MB embedding cost an ingest 1.6 s, this about 0.2 s.
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

    def weight(self, model_id: int, name: str, *, required: bool = True) -> np.ndarray | None:
        """A weight array whole, every chunk present and checked; None when absent and not
        `required` (the catalog says whether a model has it: then its absence is damage)."""
        label = f"models/{model_id}/{name}"
        info = self.info(label, required=required)
        if info is None:
            return None
        return self._read_checked(label, info)

    def weight_blocks(self, model_id: int, name: str
                      ) -> tuple[tuple[int, ...], Iterator[tuple[int, np.ndarray]]] | None:
        """A weight array's shape and its rows chunk by chunk, as (first row, rows), each
        chunk checked as `weight` checks it; None when absent. Memory stays one chunk (a
        large vocabulary's embedding is gigabytes)."""
        label = f"models/{model_id}/{name}"
        info = self.info(label, required=False)
        if info is None:
            return None
        return info.shape, self._checked_blocks(label, info)

    def check_weight(self, model_id: int, name: str, *, required: bool, full: bool) -> None:
        """verify's check of one weight array: structure, or (`full`) every byte."""
        arr = self.open_array(f"models/{model_id}/{name}", required=required)
        if arr is None:
            return
        if full:
            self._read_checked(arr.path, self._info_of(arr))
            return
        raw = self.raw_layout(arr)
        if raw is not None:
            for i in range(_n_chunks(arr)):
                raw.stat(i)

    def weight_rows(self, model_id: int, name: str, rows: list[int]) -> np.ndarray:
        """Rows of a weight array [len(rows), ...], reading only the chunks that hold them,
        each checked as `weight` checks it (a query about one token of a 128k vocabulary
        reads one chunk of 8,192 rows, not the whole matrix)."""
        label = f"models/{model_id}/{name}"
        info = self.info(label, required=True)
        assert info is not None
        c = info.chunks[0]
        out = np.empty((len(rows), *info.shape[1:]), dtype=info.dtype)
        chunks: dict[int, np.ndarray] = {}
        for j, r in enumerate(rows):
            if not 0 <= r < info.shape[0]:
                raise IndexError(f"row {r} of {label!r}, which has {info.shape[0]}")
            i = r // c
            if i not in chunks:
                chunks[i] = self._checked_chunk(label, info, i)
            out[j] = chunks[i][r - i * c]
        return out

    def _read_checked(self, label: str, info: ArrayInfo) -> np.ndarray:
        """All of the array at `label`, chunk by chunk, so that a damaged or missing one is
        named (zarr itself would read a missing chunk as its fill value)."""
        out = np.empty(info.shape, dtype=info.dtype)
        for lo, block in self._checked_blocks(label, info):
            out[lo:lo + len(block)] = block
        return out

    def _checked_blocks(self, label: str, info: ArrayInfo) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, rows) of each chunk of the array at `label`, checked, in order."""
        c = info.chunks[0]
        for i in range(_n_chunks(info)):
            yield i * c, self._checked_chunk(label, info, i)

    def _checked_chunk(self, label: str, info: ArrayInfo, i: int) -> np.ndarray:
        """Chunk `i` of the array at `label` (its rows within the array), checksum checked."""
        c = info.chunks[0]
        lo, hi = i * c, min(info.shape[0], i * c + c)
        if info.raw is not None:
            return self.read_raw(info.raw, i)[: hi - lo]
        arr = self._zarr_array(label)  # opened once for all its chunks
        try:
            return np.asarray(arr[lo:hi])
        except Exception as e:
            raise StoreCorruptError(
                f"chunk {i} of array {arr.path!r} cannot be read ({_first_line(e)}): "
                "the store is damaged"
            ) from None

    # -- vectors ---------------------------------------------------------------------------

    def ensure_act_groups(self, model_id: int) -> None:
        """The model's `acts` group, made before sites' arrays are made concurrently."""
        label = f"models/{model_id}/acts"
        if self.path is None:
            self._model_group(model_id).require_group("acts")
            return
        if self._exists(label):
            return
        fs = self._file_system_sync()
        # Written whole, not through zarr: zarr would read a file a power cut left empty.
        self._put_metadata(label, {"zarr.json": self._group_metadata()})
        if fs is not None:  # with the sites' files, by `sync`
            self._mark_unsynced()
        else:
            durable.fsync_file(self.path / "models" / str(model_id) / "acts" / "zarr.json")
            durable.fsync_dir(self.path / "models" / str(model_id))

    def ensure_act_arrays(
        self, model_id: int, site: str, *, inner: tuple[int, ...], rows: int, chunk_tokens: int
    ) -> None:
        """Create the site's arrays or grow them to at least `rows` token rows."""
        label = f"models/{model_id}/acts/{site}"
        self._forget_arrays(f"{label}/")
        if not self._site_exists(label):
            # New, or metadata a power cut lost (written, not yet synced, when it came: no
            # row of the site can be committed then): the site's files, whole.
            fs = self._file_system_sync()
            self._put_metadata(label, self._site_metadata(inner, rows, chunk_tokens))
            if fs is not None:  # new files: one syncfs for every site's (`sync`)
                self._mark_unsynced()
            elif self.path is not None:
                durable.sync_tree(self.path / label, skip="c")
                durable.fsync_dir((self.path / label).parent)
            return
        g = self._model_group(model_id).require_group(f"acts/{site}")
        self._create_act_arrays(g, inner=inner, rows=rows, chunk_tokens=chunk_tokens)
        if self.path is not None:
            # the metadata zarr rewrote (grown arrays), not the chunk files beside it: those
            # are already durable, and a shard ingest running beside this one renames its own
            folder = self.path / "models" / str(model_id) / "acts" / site
            for name in ACT_FIELDS:
                durable.fsync_file(folder / name / "zarr.json")
                durable.fsync_dir(folder / name)
            durable.fsync_file(folder / "zarr.json")
            durable.fsync_dir(folder)

    def _exists(self, label: str) -> bool:
        """Whether the group or array `label` exists (a local store: its metadata file, no
        round trip through zarr's event loop). A local metadata file that is empty or not
        JSON, as a power cut can leave one written but not yet synced, is not there."""
        if self.path is not None:
            try:
                meta = json.loads((self.path / label / "zarr.json").read_bytes())
            except (OSError, ValueError):
                return False
            return isinstance(meta, dict) and "zarr_format" in meta
        return label in self.group

    def _site_exists(self, label: str) -> bool:
        """Whether the site `label` and its arrays exist (on object storage, a PUT is whole:
        the site's group is enough)."""
        if self.path is None:
            return self._exists(label)
        return all(self._exists(f"{label}/{name}") for name in ("", *ACT_FIELDS))

    def _site_metadata(self, inner: tuple[int, ...], rows: int, chunk_tokens: int
                       ) -> dict[str, bytes]:
        """A new site's metadata files (its group's and its three arrays'), by path under the
        site's folder. They hold no name, so sites of one shape share them: zarr builds them
        once per shape (each array built through zarr costs a dozen round trips through its
        event loop: 0.5 s for a 25-site model's 75 arrays, on the commit thread beside the
        first forward passes)."""
        key = (inner, rows, chunk_tokens, self.sharded, self.objects is None)
        made = self._site_templates.get(key)
        if made is None:  # two threads at once build the same bytes
            staged: dict[str, Any] = {}
            root = zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
            self._create_act_arrays(root.require_group("site"), inner=inner, rows=rows,
                                    chunk_tokens=chunk_tokens)
            made = self._site_templates[key] = {
                k.removeprefix("site/"): v.to_bytes() for k, v in staged.items()
                if k.startswith("site/")}
        return made

    def _put_metadata(self, label: str, files: dict[str, bytes]) -> None:
        """Write metadata files under `label`: objects PUT, or local files each written whole
        (a temporary file renamed; made durable by the caller's sync_tree)."""
        if self.objects is not None:
            for key, data in files.items():
                self.objects.put(f"{label}/{key}", data)
            return
        assert self.path is not None
        for key, data in files.items():
            target = self.path / label / key
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{os.getpid()}{durable.PARTIAL_SUFFIX}")
            tmp.write_bytes(data)
            os.replace(tmp, target)

    def _create_act_arrays(self, g: zarr.Group, *, inner: tuple[int, ...], rows: int,
                           chunk_tokens: int) -> None:
        """In the site's group `g`: each field's array, created, or grown to `rows`."""
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
                shards = (step * SHARD_CHUNKS, *tail) if self.sharded else None
                # On a local disk the chunk files lie in the array's folder (`c.{i}.0`), not
                # each in a folder of its own (`c/{i}/0`): a folder made and fsynced per
                # chunk cost about 0.7 ms of CPU a chunk file (192 KiB) on this VM's ext4,
                # half of what writing one costs. Object storage keeps zarr's default keys.
                separator = "." if self.objects is None else "/"
                g.create_array(
                    name, shape=(rows, *tail), dtype=dtype, chunks=(step, *tail), shards=shards,
                    chunk_key_encoding={"name": "default", "separator": separator},
                    compressors=[zarr.codecs.Crc32cCodec()], fill_value=0,
                    config={"write_empty_chunks": True},  # missing is damage, never zeros
                    dimension_names=(("row", "head", "dim") if len(tail) == 2 else ("row", "dim"))
                    if name == "direction" else ("row", "head")[: 1 + len(tail)],
                )

    def act_array(self, model_id: int, site: str, field: str) -> zarr.Array:
        return self._zarr_array(f"models/{model_id}/acts/{site}/{field}")

    def _zarr_array(self, label: str) -> zarr.Array:
        """The array at `label` opened through zarr, kept until it is grown or rewritten here
        (opening reads its metadata file: a round trip on object storage)."""
        arr = self._opened.get(label)
        if arr is None:
            found = self.open_array(label, required=True)
            assert found is not None
            arr = self._opened[label] = found
        return arr

    def act_info(self, model_id: int, site: str, field: str) -> ArrayInfo:
        info = self.info(f"models/{model_id}/acts/{site}/{field}")
        assert info is not None
        return info

    def act_layout(self, model_id: int, site: str, field: str) -> Layout | None:
        return self.act_info(model_id, site, field).raw

    def read_chunk(self, model_id: int, site: str, field: str, chunk: int) -> np.ndarray:
        """One whole chunk of a site's field (the rows chunk * C .. chunk * C + C - 1),
        checked: a missing, short or damaged chunk is a StoreCorruptError naming it.

        Chunks are stored raw (no compression), so where the array is laid out as this
        format writes it, the chunk file is read straight into memory: about 20x less
        overhead per chunk than going through zarr-python. Anything else goes through zarr.
        """
        raw = self.act_layout(model_id, site, field)
        if raw is not None:
            return self.read_raw(raw, chunk)
        arr = self.act_array(model_id, site, field)
        c = arr.chunks[0]
        try:
            return np.asarray(arr[chunk * c : min(chunk * c + c, arr.shape[0])])
        except Exception as e:
            raise StoreCorruptError(
                f"chunk {chunk} of array {arr.path!r} cannot be read ({_first_line(e)}): "
                "the store is damaged"
            ) from None

    def read_chunks(self, model_id: int, site: str, field: str, first: int,
                    count: int) -> np.ndarray:
        """Chunks `first` .. `first + count - 1` of a site's field as one array of their rows
        in order, each checked as `read_chunk` checks it (one buffer, no joining copy, where
        the chunk files are read raw)."""
        raw = self.act_layout(model_id, site, field)
        if isinstance(raw, RawLayout):
            return raw.read_run(first, count, check=self.check_checksums)
        parts = [self.read_chunk(model_id, site, field, first + i) for i in range(count)]
        return parts[0] if count == 1 else np.concatenate(parts)

    def write_whole_chunks(self, model_id: int, site: str, start: int,
                           direction: np.ndarray) -> tuple[int, int]:
        """Write the direction chunks that rows [start, start + n) fill whole, where the array
        is stored raw on a local disk; returns the rows written, [a, b) (empty: none). No other
        rows share those chunks, so no other write touches their files: this may run beside
        the commit of earlier rows (`write_rows` with `done` then writes the rest)."""
        raw = self.act_layout(model_id, site, "direction")
        if not isinstance(raw, RawLayout):
            return start, start
        c, stop = raw.shape[0], start + direction.shape[0]
        a, b = -(-start // c) * c, stop // c * c
        if a >= b:
            return start, start
        self._write_raw(raw, a, direction[a - start : b - start])
        return a, b

    def write_rows(
        self, model_id: int, site: str, start: int, values: dict[str, np.ndarray],
        *, done: tuple[int, int] | None = None,
    ) -> None:
        """Write token rows [start, start + n) of a site's direction, norm and mean; the
        direction's rows `done` ([a, b), by `write_whole_chunks`) are written already."""
        for name in ACT_FIELDS:
            value = values[name]
            if name == "direction" and done is not None and done[0] < done[1]:
                a, b = done
                if a > start:
                    self._write_field(model_id, site, name, start, value[: a - start])
                if b < start + value.shape[0]:
                    self._write_field(model_id, site, name, b, value[b - start :])
                continue
            self._write_field(model_id, site, name, start, value)

    def _write_field(self, model_id: int, site: str, name: str, start: int,
                     value: np.ndarray) -> None:
        """Write token rows [start, start + n) of one field of a site."""
        raw = self.act_layout(model_id, site, name)
        if isinstance(raw, ShardedChunks):
            raw.write_rows(start, value)
        elif isinstance(raw, RawLayout):
            self._write_raw(raw, start, value)
        else:
            self.act_array(model_id, site, name)[start : start + value.shape[0]] = value

    def _write_raw(self, raw: RawLayout, start: int, value: np.ndarray) -> None:
        """Write rows straight into raw chunk files, each replaced whole and atomically (a
        temporary file renamed over it), as zarr's local store would, minus its per-chunk
        overhead. A chunk only partly covered is read (checked), patched, fsynced and
        replaced: its rows below `start` are committed. The others hold no committed row and,
        where the file system allows it, wait for `sync`'s one syncfs instead of an fsync
        each."""
        c, stop = raw.shape[0], start + value.shape[0]
        value = np.ascontiguousarray(value, dtype=raw.dtype)
        for chunk in range(start // c, (stop - 1) // c + 1):
            lo = chunk * c
            a, b = max(start, lo), min(stop, lo + c)
            path = raw.path(chunk)
            # Rows are written from the committed count on: a chunk written from its first
            # row holds none committed, and its file may wait for the commit's one syncfs.
            fresh = a == lo
            if fresh and b == lo + c:
                data = value[a - start : b - start]
            elif fresh:  # a chunk's first rows: what follows them is not committed
                data = np.zeros(raw.shape, dtype=raw.dtype)
                data[: b - a] = value[a - start : b - start]
            else:
                data = self.read_raw(raw, chunk)  # a fresh buffer of our own
                data[a - lo : b - lo] = value[a - start : b - start]
            parent = os.path.dirname(path)
            if parent not in self._made:
                os.makedirs(parent, exist_ok=True)
                self._made.add(parent)
                self._mark_dirty(os.path.dirname(parent), os.path.dirname(raw.folder))
            defer = fresh and self._syncs_with(parent)
            raw.write(chunk, data, sync=not defer)
            with self._dirty_lock:
                self._dirty.add(parent)
                # Set once the file is in place: a `sync` that read the flag before then
                # leaves it to the next one (a write ahead may finish beside a commit's sync).
                self._unsynced = self._unsynced or defer

    def _file_system_sync(self) -> durable.FileSystemSync | None:
        """The descriptor `sync`'s syncfs runs on, where new files may wait for it: opened
        before the first such file is written (syncfs reports the errors since then)."""
        if not self._batch_sync:
            return None
        if self._fs_sync is None:
            with self._dirty_lock:
                if self._fs_sync is None:
                    assert self.path is not None
                    self._fs_sync = durable.FileSystemSync(self.path)
        return self._fs_sync

    def _syncs_with(self, folder: str) -> bool:
        """Whether a new file in `folder` may wait for `sync`'s syncfs: batch sync is on and
        the folder is on the same file system (not another disk mounted inside the store)."""
        fs = self._file_system_sync()
        if fs is None:
            return False
        same = self._on_device.get(folder)
        if same is None:
            same = self._on_device[folder] = os.stat(folder).st_dev == fs.device
        return same

    def _mark_unsynced(self) -> None:
        """New files were written that the next `sync`'s syncfs makes durable."""
        with self._dirty_lock:
            self._unsynced = True

    def _mark_dirty(self, *folders: str) -> None:
        with self._dirty_lock:
            self._dirty.update(folders)

    def sync(self, pool: Executor | None = None) -> None:
        """fsync the folders whose entries changed since the last call: the renames of
        the chunks written become durable (before the catalog commit refers to them).

        With `pool`, the folders are synced concurrently on its threads: a batch of 2,048
        tokens of a 25-site model changed about 500 folders (one a chunk, before chunk keys
        used "."), and syncing them one after another cost 0.17 s of every commit, the last
        of which nothing overlaps. Their order does not matter: nothing refers to the chunks
        until all have returned.

        Where new chunk files were written without an fsync each (`_write_raw`), one syncfs
        of the file system makes them, and every folder's entries, durable instead."""
        with self._dirty_lock:
            folders, self._dirty = sorted(self._dirty, key=len, reverse=True), set()
            whole, self._unsynced = self._unsynced, False
        if whole:
            # A failure fails the commit; the next one starts at the same rows again.
            assert self._fs_sync is not None
            self._fs_sync.sync()
            return
        list((pool.map if pool else map)(durable.fsync_dir, folders))

    def close(self) -> None:
        """Let go of the file system's descriptor (`sync`'s); reads need nothing closed."""
        with self._dirty_lock:
            fs, self._fs_sync = self._fs_sync, None
        if fs is not None:
            fs.close()

    def has_model(self, model_id: int) -> bool:
        return f"models/{model_id}" in self.group


__all__ = ["ACT_FIELDS", "Arrays", "crc32c", "default_chunk_tokens", "write_alignment"]


def _n_chunks(arr: zarr.Array | ArrayInfo) -> int:
    return -(-arr.shape[0] // arr.chunks[0]) if len(arr.shape) else 1


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
