"""A store under an S3 prefix (format 3): tensors through Zarr's ObjectStore over obstore,
vectors in shards read by range, the catalog published per commit (published.py), one
ingest at a time by a lease object (lease.py). Layout and protocol: docs/FORMAT.md."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import zarr.storage

from ..errors import ActdbError, StoreBusyError
from . import published
from .arrays import Arrays
from .backend import CATALOG_NAME, SHARDS_NAME, TENSORS_NAME, TOKENIZERS_NAME
from .catalog import FORMAT_VERSION, LOCAL_FORMAT_VERSION, Catalog
from .durable import full_disk_as_error
from .faults import fault
from .lease import LEASE_KEY, Lease, live_holder
from .objects import Objects, parse_url
from .pids import alive

# Stores on object storage are created at the newest format, as local ones (docs/FORMAT.md).
REMOTE_FORMAT_VERSION = LOCAL_FORMAT_VERSION
SHARD_LEASE = "shard.lease"  # each running shard ingest's own lease, beside its catalog
REGISTER_LEASE = "register.lease"  # one shard ingest at a time registers and plans

# Local working folders are named for their process: one whose process is gone (killed,
# so it never closed its store) is removed by the next process that makes one.
_WORK_PREFIX = "actdb-s3-"


def _sweep_orphans() -> None:
    for folder in Path(tempfile.gettempdir()).glob(f"{_WORK_PREFIX}*"):
        pid = folder.name[len(_WORK_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
            continue
        if not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


class S3Backend:
    remote = True
    readers = 8

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        self.url = parse_url(url)
        self.location = str(self.url)
        self.storage_options = dict(storage_options or {})
        self.objects = Objects(self.url, storage_options)
        self._lease: Lease | None = None
        self._work: Path | None = None  # local working copies and downloads, removed at close
        self._publisher: published.Publisher | None = None

    def _workdir(self) -> Path:
        if self._work is None:
            _sweep_orphans()
            self._work = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}{os.getpid()}-"))
        return self._work

    def needs_create(self) -> bool:
        return not self.objects.exists(published.POINTER_KEY)

    def create(self) -> None:
        """Tensors' root group first, then the first catalog object, then the pointer with
        a create-if-absent write: the pointer makes the store exist, so a kill before it
        leaves no store, and of two creators the second finds the pointer and opens theirs."""
        work = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}{os.getpid()}-create-"))
        try:
            Arrays.create(None, version=REMOTE_FORMAT_VERSION, store=self._zarr_store(False),
                          objects=self._tensor_objects())
            fault("create_before_catalog")
            local = work / CATALOG_NAME
            Catalog.create(local, version=REMOTE_FORMAT_VERSION).close(strict=True)
            fault("create_after_catalog")
            published.create(self.objects, local, REMOTE_FORMAT_VERSION)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def check_is_store(self) -> None:
        pointer, _ = published.read_pointer(self.objects)
        published.check_version(pointer, self.location, FORMAT_VERSION)

    def check_writable(self) -> None:
        """Object storage says whether a write is allowed only by refusing it: the first
        write (the lease) reports it as one sentence."""

    def lock(self, shard: str | None = None) -> None:
        """Exclusive: the `ingest.lease`, then no live shard lease may exist. Shared: the
        shard's own `shards/{i}-of-{N}/shard.lease`, then no live `ingest.lease` may exist.
        Each side writes its lease before looking for the other's, so of an ingest and a
        shard starting together at least one sees the other and gives way."""
        key = f"{SHARDS_NAME}/{shard}/{SHARD_LEASE}" if shard else LEASE_KEY
        self._lease = Lease(self.objects, self.location, key)
        self._lease.acquire()
        if shard:
            busy = live_holder(self.objects, LEASE_KEY) is not None
        else:
            busy = any(key.endswith("/" + SHARD_LEASE) and live_holder(self.objects, key)
                       for key, _ in self.objects.list(SHARDS_NAME))
        if busy:
            self.unlock()
            raise StoreBusyError(
                f"store {self.location!r} is being written by shard ingests (--shard); run "
                "this one when they have finished and `actdb merge` has run"
                if not shard else
                f"store {self.location!r} is being written by another ingest (an ingest or a "
                "merge writes it alone); run this shard ingest again when it has finished"
            )

    @contextmanager
    def registering(self) -> Iterator[None]:
        """Among shard ingests, one at a time: `shards/register.lease`, waited for as long
        as its holder renews it (a first registration uploads the model's weights, which may
        take minutes); a lease its holder stopped renewing runs out and is taken over."""
        lease = Lease(self.objects, self.location, f"{SHARDS_NAME}/{REGISTER_LEASE}")
        lease.acquire_waiting(None)
        try:
            yield
        finally:
            lease.release()

    def shard_names(self) -> list[str]:
        suffix = "/" + published.POINTER_KEY
        return sorted(key.split("/")[1] for key, _ in self.objects.list(SHARDS_NAME)
                      if key.endswith(suffix) and key.count("/") == 2)

    def open_shard_catalog(self, name: str, *, create: Callable[[Path], None] | None = None,
                           read_only: bool = False) -> Catalog:
        """Like the main catalog: a working copy published per commit under the shard's
        prefix (its own pointer and catalog objects), or a reader's snapshot."""
        objects = self.objects.child(f"{SHARDS_NAME}/{name}")
        folder = self._workdir() / SHARDS_NAME / name
        folder.mkdir(parents=True, exist_ok=True)
        local = folder / CATALOG_NAME
        if create is not None and not objects.exists(published.POINTER_KEY):
            local.unlink(missing_ok=True)
            create(local)
            published.create(objects, local, REMOTE_FORMAT_VERSION)
        if read_only:
            try:
                published.download(objects, local)
                return Catalog(local, read_only=True, store=self.location)
            finally:
                local.unlink(missing_ok=True)
        publisher = published.Publisher(objects, local, self.location)

        def publish() -> None:
            if self._lease is not None:
                self._lease.check()
            publisher.publish()

        return Catalog(local, read_only=False, hold=False, store=self.location, publish=publish)

    def remove_shards(self, names: list[str]) -> None:
        """Remove merged shards' objects, each one's pointer and then its current catalog
        last: a merge killed meanwhile leaves a shard that the next merge still lists and
        recognises as merged. Then the objects a killed removal left without a pointer
        (nothing else writes there while a merge holds the store alone, but the transient
        leases of shards giving way, which are left alone)."""
        pointer_tail = "/" + published.POINTER_KEY
        for name in names:
            prefix = f"{SHARDS_NAME}/{name}"
            try:
                pointer, _ = published.read_pointer(self.objects.child(prefix))
                current: str | None = f"{prefix}/{pointer['catalog']}"
            except FileNotFoundError:
                current = None
            last = [f"{prefix}{pointer_tail}", current]
            for key, _ in self.objects.list(prefix):
                if key not in last:
                    self.objects.delete(key)
            fault("shard_removal")
            for last_key in last:
                if last_key is not None:
                    self.objects.delete(last_key)
        listed = [key for key, _ in self.objects.list(SHARDS_NAME) if key.count("/") >= 2]
        named = {key.split("/")[1] for key in listed if key.endswith(pointer_tail)
                 and key.count("/") == 2}
        for key in listed:
            if key.split("/")[1] not in named and not key.endswith("/" + SHARD_LEASE):
                self.objects.delete(key)

    def unlock(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def open_catalog(self, *, read_only: bool, ingest: bool) -> Catalog:
        if ingest:
            local = self._workdir() / CATALOG_NAME
            self._publisher = published.Publisher(self.objects, local, self.location)
            return Catalog(local, read_only=False, hold=False, store=self.location,
                           publish=self._publish)
        # Readers (read_only=False changes nothing here: queries never write a store, and
        # no process holds a catalog on object storage open) take a snapshot of a download.
        download = self._workdir() / f"read-{CATALOG_NAME}"
        try:
            published.download(self.objects, download)
            return Catalog(download, read_only=True, store=self.location)
        finally:
            download.unlink(missing_ok=True)

    def _publish(self) -> None:
        assert self._publisher is not None
        if self._lease is not None:
            self._lease.check()
        self._publisher.publish()

    def _tensor_objects(self) -> Objects:
        return self.objects.child(TENSORS_NAME)

    def _zarr_store(self, read_only: bool) -> zarr.storage.ObjectStore:
        return zarr.storage.ObjectStore(self._tensor_objects().store, read_only=read_only)

    def open_arrays(self, *, read_only: bool) -> Arrays:
        return Arrays(None, read_only=read_only, store=self._zarr_store(read_only),
                      objects=self._tensor_objects())

    def clean_partials(self) -> None:
        """Nothing: an object PUT is whole or absent, never partial."""

    def tokenizer_dir(self, model_id: int) -> Path:
        folder = self._workdir() / TOKENIZERS_NAME / str(model_id)
        if not folder.is_dir():
            sub = f"{TOKENIZERS_NAME}/{model_id}"
            listed = self.objects.list(sub)
            for key, _ in listed:
                data, _ = self.objects.get(key)
                target = self._workdir() / key
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        return folder

    def save_tokenizer(self, model_id: int, save: Callable[[str], object]) -> None:
        folder = self._workdir() / "saving" / str(model_id)
        save(str(folder))
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = f"{TOKENIZERS_NAME}/{model_id}/{path.relative_to(folder).as_posix()}"
            self.objects.put(key, path.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)

    @contextmanager
    def writing(self, what: str) -> Iterator[None]:
        # The working copy of the catalog is a local file: a full local disk says so.
        with full_disk_as_error(self._workdir(), what):
            yield

    def disk_bytes(self) -> dict[str, int]:
        listed = self.objects.list()
        pointer, _ = published.read_pointer(self.objects)
        cat = sum(size for key, size in listed if key == pointer["catalog"])
        ten = sum(size for key, size in listed if key.startswith(TENSORS_NAME + "/"))
        tok = sum(size for key, size in listed if key.startswith(TOKENIZERS_NAME + "/"))
        return {"catalog": cat, "tensors": ten, "tokenizers": tok, "total": cat + ten + tok}

    def close(self) -> None:
        try:
            if self._publisher is not None and self._lease is not None:
                # A finished store keeps one catalog object, compact. Best effort: the last
                # publication stands when this fails (another writer took over, a network
                # error), so a store is never the worse for it.
                with suppress(ActdbError):
                    self._lease.check()
                    self._publisher.finish()
        finally:
            self._publisher = None
            self.unlock()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None


__all__ = ["REMOTE_FORMAT_VERSION", "S3Backend"]
