"""A store: one directory holding the DuckDB catalog and the Zarr tensors.

This module owns the rules that touch both halves: opening and creating (with the format and
writability checks, in one place), and the commit protocol (tensors first, then the catalog
rows that make them visible, in one transaction).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import (
    StoreBusyError,
    StoreFormatError,
    StoreNotFoundError,
    StoreNotWritableError,
)
from . import durable
from .arrays import ACT_FIELDS, Arrays
from .catalog import FORMAT_VERSION, Catalog
from .faults import fault
from .records import ModelRecord, SiteRecord

CATALOG_NAME = "catalog.duckdb"
TENSORS_NAME = "tensors.zarr"
TOKENIZERS_NAME = "tokenizers"
LOCK_NAME = "ingest.lock"  # held (flock) by the one ingest writing the store
_BUILDING = ".creating-"  # a store being created: `.{name}.creating-{pid}-{random}`


@dataclass(frozen=True, kw_only=True)
class ActBatch:
    """The vectors of one ingest batch for one site: rows in token order."""

    direction: np.ndarray  # float16 [n, d] or [n, heads, d]
    norm: np.ndarray  # float32 [n] or [n, heads]
    mean: np.ndarray  # float32 [n] or [n, heads]


class Store:
    """Open a store for reading (`read_only=True`), for writing, or for an ingest
    (`ingest=True`: the store's ingest lock is taken, the catalog is opened only for each
    commit so that readers can follow, and dead temporary files are removed)."""

    def __init__(
        self, path: str | os.PathLike[str], *, read_only: bool = True, ingest: bool = False
    ) -> None:
        self.path = Path(path)
        self.read_only = read_only and not ingest
        self._check_is_store()
        if not self.read_only:
            self._check_writable(self.path)
        self._lock_fd = self._take_ingest_lock() if ingest else None
        self._writers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="actdb-write")
        try:
            self.catalog = Catalog(self.path / CATALOG_NAME, read_only=self.read_only,
                                   hold=not ingest)
        except BaseException:
            self._release_ingest_lock()
            raise
        try:
            self.format_version = self.catalog.format_version()
            self._check_version(self.format_version)
            self.arrays = Arrays(self.path / TENSORS_NAME, read_only=self.read_only)
            self._check_version(self.arrays.format_version())
            if ingest:
                durable.remove_partials(self.path / TENSORS_NAME)
        except BaseException:
            self.catalog.close()
            self._release_ingest_lock()
            raise

    @property
    def has_checksums(self) -> bool:
        """Format 1 stores were written without chunk checksums."""
        return self.format_version >= 2

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open_or_create(cls, path: str | os.PathLike[str]) -> Store:
        """Open a store for an ingest, creating it if the directory is absent or empty."""
        p = Path(path)
        if p.exists() and not p.is_dir():
            raise StoreFormatError(f"store path {str(p)!r} is a regular file, not a directory")
        if not p.exists() or (p.is_dir() and not any(p.iterdir())):
            cls._create(p)
        with durable.full_disk_as_error(p, "the store's lock file"):
            return cls(p, ingest=True)

    @classmethod
    def _create(cls, p: Path) -> None:
        """Build the store in a sibling folder and rename it into place: a kill at any
        moment leaves either no store or a whole one. Of two processes creating the same
        store at once, the first rename wins and the other opens what it made."""
        parent = p.absolute().parent
        if not parent.is_dir():
            raise StoreNotFoundError(
                f"cannot create store {str(p)!r}: its parent folder {str(parent)!r} "
                "does not exist"
            )
        cls._check_writable(parent)
        _remove_dead_builds(p)
        tmp = parent / f".{p.name}{_BUILDING}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with durable.full_disk_as_error(p, "a new store"):
                tmp.mkdir()
                Arrays.create(tmp / TENSORS_NAME)
                fault("create_before_catalog")
                Catalog.create(tmp / CATALOG_NAME).close()
                fault("create_after_catalog")
                durable.sync_tree(tmp)
                try:
                    os.rename(tmp, p)  # onto nothing, or onto an empty folder
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    return  # another process created it first: use theirs
                durable.fsync_dir(parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _take_ingest_lock(self) -> int:
        """One ingest at a time: an flock on `ingest.lock`, released by the kernel however
        the process ends, so a killed ingest never leaves the store locked."""
        lock = self.path / LOCK_NAME
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            who = f" (PID {holder})" if holder.isdigit() else ""
            raise StoreBusyError(
                f"store {str(self.path)!r} is being written by another ingest{who}; "
                "run this one again when it has finished (it will skip what is stored)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _release_ingest_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _check_is_store(self) -> None:
        p = self.path
        if not p.exists():
            raise StoreNotFoundError(f"no store at {str(p)!r}")
        if not p.is_dir():
            raise StoreFormatError(f"store path {str(p)!r} is a regular file, not a directory")
        if not (p / CATALOG_NAME).is_file() or not (p / TENSORS_NAME).is_dir():
            raise StoreFormatError(
                f"{str(p)!r} is not an actdb store (no {CATALOG_NAME} and {TENSORS_NAME} in it)"
            )

    @staticmethod
    def _check_writable(path: Path) -> None:
        """The one place that decides whether we may write into a store directory."""
        targets = [path]
        if (path / TENSORS_NAME).exists():
            targets.append(path / TENSORS_NAME)
        for t in targets:
            # The mode bits count too: root passes os.access on a directory made read-only.
            if not os.access(t, os.W_OK | os.X_OK) or not t.stat().st_mode & 0o222:
                raise StoreNotWritableError(f"store directory {str(t)!r} is not writable")

    def _check_version(self, version: int) -> None:
        if version > FORMAT_VERSION:
            raise StoreFormatError(
                f"store {str(self.path)!r} was written by format version {version}; this actdb "
                f"reads versions up to {FORMAT_VERSION}: upgrade actdb"
            )
        if version < 1:
            raise StoreFormatError(f"store {str(self.path)!r} has no valid format version")

    def close(self) -> None:
        self._writers.shutdown()
        self.catalog.close()
        self._release_ingest_lock()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------

    def register_model(
        self,
        model: ModelRecord,
        sites: list[SiteRecord],
        *,
        embed: np.ndarray,
        lm_head: np.ndarray | None,
        lm_head_bias: np.ndarray | None,
        site_params: dict[str, tuple[np.ndarray | None, np.ndarray | None]],
        vocab: pa.Table,
    ) -> None:
        """Weights first, then the catalog rows: an interrupted registration leaves no model."""
        with durable.full_disk_as_error(self.path, f"the weights of model {model.model!r}"):
            self.arrays.write_weights(
                model.model_id, embed=embed, lm_head=lm_head, lm_head_bias=lm_head_bias,
                site_params=site_params,
            )
        fault("weights_written")
        with durable.full_disk_as_error(self.path, "the catalog"):
            self.catalog.insert_model(model, sites, vocab)

    def save_tokenizer(self, model_id: int, save: Callable[[str], object]) -> None:
        """`save(folder)` writes a model's tokenizer (its `save_pretrained`) into the store."""
        with durable.full_disk_as_error(self.path, "a tokenizer"):
            save(str(self.tokenizer_dir(model_id)))

    def reserve_rows(self, model: ModelRecord, sites: list[SiteRecord], rows: int) -> None:
        """Make every site's arrays at least `rows` long (rows past n_rows stay invisible)."""
        with durable.full_disk_as_error(self.path, "array metadata"):
            for s in sites:
                inner = (s.n_heads, s.d) if s.n_heads else (s.d,)
                self.arrays.ensure_act_arrays(
                    model.model_id, s.site, inner=inner, rows=rows,
                    chunk_tokens=model.chunk_tokens,
                )

    def commit_batch(
        self,
        model: ModelRecord,
        *,
        start: int,
        acts: dict[str, ActBatch],
        new_prompts: pa.Table,
        prompt_runs: pa.Table,
        tokens: pa.Table,
        site_errors: dict[str, float],
        logit_error: float | None = None,
    ) -> int:
        """Write one batch: tensors into rows [start, start + n), then the catalog rows.

        Returns the new committed row count. A crash before the catalog commit leaves rows
        past `n_rows` that no reader sees and the next ingest overwrites.
        """
        n = tokens.num_rows
        for site, batch in acts.items():
            assert batch.direction.shape[0] == n, (site, batch.direction.shape, n)
        # Arrays are independent files: write them concurrently, make the renames durable,
        # then commit the catalog.
        with durable.full_disk_as_error(self.path, f"vectors of model {model.model!r}"):
            list(self._writers.map(
                lambda item: self.arrays.write_rows(model.model_id, item[0], start, {
                    "direction": item[1].direction, "norm": item[1].norm,
                    "mean": item[1].mean}),
                acts.items(),
            ))
            self.arrays.sync()
        fault("tensors_written")
        with durable.full_disk_as_error(self.path, "the catalog"):
            self.catalog.commit_batch(
                model=model.model, new_prompts=new_prompts, prompt_runs=prompt_runs,
                tokens=tokens, site_errors=site_errors, n_rows=start + n,
                logit_error=logit_error,
            )
        return start + n

    # -- reading ---------------------------------------------------------------------------

    def tokenizer_dir(self, model_id: int) -> Path:
        """Where a model's tokenizer is saved (by `save_pretrained`), for token lookups."""
        return self.path / TOKENIZERS_NAME / str(model_id)

    def disk_bytes(self) -> dict[str, int]:
        """Bytes on disk of the catalog, the tensors, and both."""
        def size(p: Path) -> int:
            # A running ingest renames and removes files (chunk temporaries, the catalog's
            # log) while this walks: one that vanished between listing and stat counts 0.
            if not p.is_dir():
                with suppress(FileNotFoundError):
                    return p.stat().st_size
                return 0
            total = 0
            for folder, _, files in os.walk(p):  # os.walk skips folders it cannot list
                for name in files:
                    with suppress(FileNotFoundError):
                        total += os.stat(os.path.join(folder, name)).st_size
            return total

        cat = sum(size(f) for f in self.path.glob(CATALOG_NAME + "*"))
        ten = size(self.path / TENSORS_NAME)
        tok = size(self.path / TOKENIZERS_NAME) if (self.path / TOKENIZERS_NAME).exists() else 0
        return {"catalog": cat, "tensors": ten, "tokenizers": tok, "total": cat + ten + tok}


def _remove_dead_builds(p: Path) -> None:
    """Remove the half-built copies of this store left by creators that were killed."""
    for build in p.absolute().parent.glob(f".{p.name}{_BUILDING}*"):
        pid = build.name.rsplit(_BUILDING, 1)[-1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(build, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["ACT_FIELDS", "ActBatch", "Store"]
