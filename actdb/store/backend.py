"""Where a store lives: the small interface a local directory and an S3 prefix both implement.

The Store (store.py) keeps the rules that are the same everywhere (format checks, the commit
protocol's order); a backend does what differs: whether a store is there and how one is
created atomically, who may write it (an flock, or a lease object), how the catalog is opened
and made visible (the file itself, or a local working copy published per commit), where the
tensors' Zarr group is, and where tokenizers and byte counts come from.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from .arrays import Arrays
from .catalog import Catalog

CATALOG_NAME = "catalog.duckdb"
TENSORS_NAME = "tensors.zarr"
TOKENIZERS_NAME = "tokenizers"
SHARDS_NAME = "shards"  # shard ingests' own catalogs, `shards/{i}-of-{N}/`, until merged


class Backend(Protocol):
    """One store's home. `location` is what the user named, for messages."""

    location: str
    remote: bool
    storage_options: dict[str, Any]
    readers: int  # chunk reads worth keeping in flight: 1 for a disk, more for a network

    def needs_create(self) -> bool:
        """True when no store is there yet and one may be created (nothing, or empty)."""

    def create(self) -> None:
        """Create an empty store atomically: a kill leaves no store or a whole one; of two
        creators, one wins and the other opens its store."""

    def check_is_store(self) -> None:
        """StoreNotFoundError / StoreFormatError unless a store is there."""

    def check_writable(self) -> None:
        """StoreNotWritableError when this process may not write the store."""

    def lock(self, shard: str | None = None) -> None:
        """Become the one ingest (or merge) writing the store, or with `shard` one of the
        shard ingests writing it side by side; else StoreBusyError in one sentence."""

    def registering(self) -> AbstractContextManager[None]:
        """Held by one shard ingest at a time (waiting for it): registering a model, sizing
        arrays and creating its shard catalog."""

    def shard_names(self) -> list[str]:
        """The shard catalogs in the store (`{i}-of-{N}`), sorted."""

    def open_shard_catalog(self, name: str, *, create: Callable[[Path], None] | None = None,
                           read_only: bool = False) -> Catalog:
        """A shard's catalog for its ingest (created by `create(file)` when absent), or a
        reader's snapshot of it."""

    def remove_shards(self, names: list[str]) -> None:
        """Remove those shard catalogs (after a merge)."""

    def unlock(self) -> None:
        """Let another ingest write (safe to call when not locked)."""

    def open_catalog(self, *, read_only: bool, ingest: bool) -> Catalog:
        """The catalog: a reader's snapshot, the ingest's per-commit writer, or a holder."""

    def open_arrays(self, *, read_only: bool) -> Arrays:
        """The tensors' Zarr group."""

    def clean_partials(self) -> None:
        """Remove what writes killed midway left (only ever called under the lock)."""

    def tokenizer_dir(self, model_id: int) -> Path:
        """A local folder holding the model's saved tokenizer (it may not exist)."""

    def save_tokenizer(self, model_id: int, save: Callable[[str], object]) -> None:
        """`save(folder)` writes the tokenizer; the backend stores what it wrote."""

    def disk_bytes(self) -> dict[str, int]:
        """Bytes stored of the catalog, the tensors, the tokenizers, and all."""

    def writing(self, what: str) -> AbstractContextManager[None]:
        """Around a write: storage-specific failures (a full disk) as one sentence."""

    def close(self) -> None:
        """Release what the backend holds (working copies, downloaded files)."""
