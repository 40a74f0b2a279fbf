"""The Zarr v3 group of a store's tensors: where it lives (a local folder, or a prefix on
object storage), its root's format version, and each group's and array's metadata: opened,
cached, checked, and written whole (a temporary file renamed, or one PUT)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StoreCorruptError
from ..lazy import lazy_module, load
from . import durable
from .chunks import RawLayout, local_info, raw_layout
from .object_chunks import ObjectChunks, ShardedChunks, object_layout

if TYPE_CHECKING:
    import zarr
    import zarr.codecs

    from .objects import Objects  # obstore: imported by a remote store alone
else:
    # imported when the group is first opened: a query that reads no vector (`SELECT 1`,
    # `actdb info`) never pays for it
    zarr = lazy_module("zarr")

# How a chunk is read straight from storage: a local file, an object, or a range of a shard.
Layout = RawLayout | ObjectChunks | ShardedChunks


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What reading an array needs from its metadata (`ArrayGroup.info`): its shape, its
    chunks' shape and dtype, and how a chunk is read straight from storage (None: through
    zarr)."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype[Any]
    raw: Layout | None


def create_group(path: Path | None, version: int, store: Any = None) -> None:
    """An empty root group recording the format `version` (zarr's LocalStore at `path`, or
    `store`)."""
    load(zarr)
    zarr.open_group(store if store is not None else zarr.storage.LocalStore(str(path)),
                    mode="w", zarr_format=3, attributes={"actdb_format_version": version})


class ArrayGroup:
    """The tensors' root group and the metadata of what it holds."""

    def __init__(self, path: Path | None, *, read_only: bool, store: Any = None,
                 objects: Objects | None = None) -> None:
        """`path`: the local `tensors.zarr` folder; or None with `objects`, the group's prefix
        on object storage (then `store` is zarr's ObjectStore over it)."""
        self.path = path
        self.objects = objects
        self.label = str(path) if path is not None else objects.where("") if objects else "?"
        self.read_only = read_only
        self._zstore = store
        self._group: zarr.Group | None = None
        # Opening an array reads its metadata file: keep the handles (and raw chunk paths).
        self._infos: dict[str, ArrayInfo] = {}  # by label (`info`)
        self._opened: dict[str, zarr.Array] = {}  # by label: arrays opened through zarr
        self._group_json: bytes | None = None
        if path is None or not read_only:
            self.group  # noqa: B018 - writers and object storage open the group now

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
                    f"the root metadata of {self.label!r} cannot be read ({first_line(e)}): "
                    "the store is damaged"
                ) from None
        return self._group

    @property
    def sharded(self) -> bool:
        """Vectors go in shards of inner chunks (object storage: fewer, larger objects)."""
        return self.objects is not None

    def model_group(self, model_id: int) -> zarr.Group:
        return self.group.require_group(f"models/{model_id}")

    # -- the format version ------------------------------------------------------------------

    def format_version(self) -> int:
        attrs = self.group.attrs if self._group is not None else self._root_attributes()
        v = attrs.get("actdb_format_version", -1)
        return int(v) if isinstance(v, int | float | str) else -1

    def set_format_version(self, version: int) -> None:
        """Record `version` in the root group's attributes (its `zarr.json` replaced whole)."""
        attrs = dict(self.group.attrs)
        attrs["actdb_format_version"] = version
        staged: dict[str, Any] = {}
        zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3,
                        attributes=attrs)
        self.put_metadata("", {"zarr.json": staged["zarr.json"].to_bytes()})
        if self.path is not None:
            durable.fsync_file(self.path / "zarr.json")
            durable.fsync_dir(self.path)
        self._group = None

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
                f"the root metadata of {self.label!r} cannot be read ({first_line(e)}): "
                "the store is damaged"
            ) from None
        return attrs

    # -- opening arrays ----------------------------------------------------------------------

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
                f"({first_line(e)}): the store is damaged"
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

    def zarr_array(self, label: str) -> zarr.Array:
        """The array at `label` opened through zarr, kept until it is grown or rewritten here
        (opening reads its metadata file: a round trip on object storage)."""
        arr = self._opened.get(label)
        if arr is None:
            found = self.open_array(label, required=True)
            assert found is not None
            arr = self._opened[label] = found
        return arr

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
                found = self.info_of(arr)
            self._infos[label] = found
        return found

    def info_of(self, arr: zarr.Array) -> ArrayInfo:
        return ArrayInfo(shape=tuple(arr.shape), chunks=tuple(arr.chunks),
                         dtype=np.dtype(arr.dtype), raw=self.raw_layout(arr))

    def forget(self, prefix: str) -> None:
        """Drop what is kept of the arrays under `prefix` (grown or rewritten)."""
        for cache in (self._infos, self._opened):
            for label in [k for k in cache if k.startswith(prefix)]:
                cache.pop(label, None)

    def raw_layout(self, arr: zarr.Array) -> Layout | None:
        if self.objects is not None:
            return object_layout(arr, self.objects)
        return raw_layout(arr, self.zstore)

    # -- metadata ----------------------------------------------------------------------------

    def exists(self, label: str) -> bool:
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

    def check_group(self, label: str) -> None:
        """verify's check of the group `label` ("": the root): its `zarr.json` is there and
        is a Zarr v3 group's metadata, or a StoreCorruptError says what is wrong with it."""
        key = f"{label}/zarr.json" if label else "zarr.json"
        name = label or "/"
        try:
            if self.objects is not None:
                data = bytes(self.objects.get(key)[0])
            else:
                assert self.path is not None
                data = (self.path / key).read_bytes()
        except FileNotFoundError:
            raise StoreCorruptError(f"the metadata of group {name!r} in {self.label!r} is "
                                    "missing: the store is damaged") from None
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get(
                    "node_type") != "group":
                raise ValueError("not the metadata of a Zarr v3 group")
        except ValueError as e:
            raise StoreCorruptError(
                f"the metadata of group {name!r} in {self.label!r} cannot be read "
                f"({first_line(e)}): the store is damaged") from None

    def group_metadata(self) -> bytes:
        """An empty group's `zarr.json`, as zarr writes it."""
        if self._group_json is None:
            staged: dict[str, Any] = {}
            zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
            self._group_json = staged["zarr.json"].to_bytes()
        return self._group_json

    def put_metadata(self, label: str, files: dict[str, bytes]) -> None:
        """Write metadata files under `label`: objects PUT, or local files each written whole
        (a temporary file renamed; made durable by the caller's sync_tree)."""
        if self.objects is not None:
            for key, data in files.items():
                self.objects.put(f"{label}/{key}" if label else key, data)
            return
        assert self.path is not None
        for key, data in files.items():
            target = self.path / label / key
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{os.getpid()}{durable.PARTIAL_SUFFIX}")
            tmp.write_bytes(data)
            os.replace(tmp, target)

    @contextmanager
    def staged(self, label: str, pool: Executor | None) -> Iterator[zarr.Group]:
        """The group `label` to create arrays in, built in memory; when the block ends its
        metadata (and any chunk written through zarr) goes to storage: objects PUT
        concurrently with `pool`, or local files each written whole (a temporary file
        renamed). zarr creating arrays in place costs tens of round trips on object storage,
        and a store's many small metadata files add up on a local disk."""
        staged: dict[str, Any] = {}
        root = zarr.open_group(zarr.storage.MemoryStore(staged), mode="w", zarr_format=3)
        yield root.require_group(label)
        items = [(k, v.to_bytes()) for k, v in staged.items() if k.startswith(label + "/")]
        if self.objects is not None:
            objects = self.objects
            list((pool.map if pool else map)(lambda kv: objects.put(kv[0], kv[1]), items))
            return
        self.put_metadata(label, {k.removeprefix(label + "/"): v for k, v in items})


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["ArrayGroup", "ArrayInfo", "Layout", "create_group", "first_line"]
