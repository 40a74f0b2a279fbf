"""A store: the DuckDB catalog and the Zarr tensors, in a local directory or under an S3
prefix (backend.py says which).

This module owns the rules that touch both halves, wherever they live: opening and creating
(with the format and writability checks, in one place), and the commit protocol (tensors
first, then the catalog rows that make them visible, in one transaction).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StoreFormatError
from ..lazy import lazy_module
from . import upgrade
from .arrays import ACT_FIELDS
from .backend import CATALOG_NAME, TENSORS_NAME, TOKENIZERS_NAME, Backend
from .catalog import FORMAT_VERSION, Catalog
from .digests import DIGESTS_VERSION, ChunkDigests, digests_table, find_with, load_with
from .faults import fault
from .lens_layout import is_lens_site
from .location import is_remote
from .records import ModelRecord, SiteRecord

if TYPE_CHECKING:
    import pyarrow as pa
else:
    pa = lazy_module("pyarrow")  # imported when Arrow data is first made or read

StoreLocation = str | os.PathLike[str]


@dataclass(frozen=True, kw_only=True)
class ActBatch:
    """The vectors of one ingest batch for one site: rows in token order."""

    direction: np.ndarray  # float16 [n, d] or [n, heads, d]
    norm: np.ndarray  # float32 [n] or [n, heads]
    mean: np.ndarray  # float32 [n] or [n, heads]
    # the materialized lens of the rows, by array name (lens_layout.py), at a lens site
    lens: Mapping[str, np.ndarray] | None = None

    def fields(self) -> dict[str, np.ndarray]:
        """Every array's rows, by array name."""
        return {"direction": self.direction, "norm": self.norm, "mean": self.mean,
                **(self.lens or {})}


def open_backend(location: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None) -> Backend:
    """The backend for a store location: `s3://bucket/prefix` or a local path."""
    if is_remote(location):
        from .remote import S3Backend  # obstore: imported by a remote store alone

        return S3Backend(str(location), storage_options)
    if storage_options:
        raise StoreFormatError(
            f"storage_options are for stores on object storage (s3://...), not for the local "
            f"store {os.fspath(location)!r}"
        )
    from .local import LocalBackend

    return LocalBackend(Path(location))


class Store:
    """Open a store for reading (`read_only=True`), for writing, or for an ingest
    (`ingest=True`: the store's ingest lock (or lease) is taken, the catalog is opened only
    for each commit so that readers can follow, and dead temporary files are removed).
    `path` is a local directory or `s3://bucket/prefix` (`storage_options` configure the
    object storage client beyond the AWS environment variables)."""

    def __init__(
        self, path: StoreLocation | Backend, *, read_only: bool = True, ingest: bool = False,
        storage_options: Mapping[str, Any] | None = None, shard: str | None = None,
    ) -> None:
        if isinstance(path, str | os.PathLike):
            self.backend: Backend = open_backend(path, storage_options)
        else:
            self.backend = path
        self.location = self.backend.location
        self.read_only = read_only and not ingest
        self.backend.check_is_store()
        if not self.read_only:
            self.backend.check_writable()
        self.shard = shard
        self._registering: AbstractContextManager[None] | None = None
        if ingest:
            self.backend.lock(shard)
        if shard:
            # A shard reads the main catalog, and may register a model in it, only while
            # no other shard does: it lets go once its own catalog exists (open_shard).
            # Waiting can end in an error (Ctrl-C, a task cancelled, storage unreachable):
            # the lock or lease taken above is released then, not left to a long-lived
            # process (a Dask worker) that would keep every later ingest out.
            registering = self.backend.registering()
            try:
                registering.__enter__()
            except BaseException:
                self.backend.close()
                raise
            self._registering = registering
        self._writers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="actdb-write")
        try:
            self.catalog = self.backend.open_catalog(read_only=self.read_only, ingest=ingest)
        except BaseException:
            self._writers.shutdown()
            self._end_registering()
            self.backend.close()
            raise
        # Where an ingest's batches are committed: the main catalog, or the shard's own.
        self.commits = self.catalog
        self._names: dict[int, str] = {}
        try:
            self.format_version = self.catalog.format_version()
            self._check_version(self.format_version)
            self.arrays = self.backend.open_arrays(read_only=self.read_only)
            self._check_version(self.arrays.format_version())
            if ingest and not shard:  # shards running beside this one have writes in flight
                self.backend.clean_partials()
            if not self.read_only and self.format_version >= 2:
                with self.backend.writing("the upgrade to format 5"):
                    self.format_version = upgrade.to_digests(self.catalog, self.arrays,
                                                             self.format_version)
            if self.format_version >= DIGESTS_VERSION:
                self.arrays.expected = self._chunk_digests()
        except BaseException:
            self._writers.shutdown()
            self.catalog.close()
            self._end_registering()
            self.backend.close()
            raise

    @property
    def path(self) -> Path:
        """The store's directory (local stores only; `location` names any store)."""
        if self.backend.remote:
            raise StoreFormatError(f"store {self.location!r} is on object storage: it has no "
                                   "local path")
        return Path(self.location)

    @property
    def storage_options(self) -> dict[str, Any]:
        return dict(self.backend.storage_options)

    @property
    def readers(self) -> int:
        """How many chunk reads are worth keeping in flight (read-ahead threads)."""
        return self.backend.readers

    @property
    def has_checksums(self) -> bool:
        """Format 1 stores were written without chunk checksums."""
        return self.format_version >= 2

    @property
    def has_digests(self) -> bool:
        """Each chunk's digest is recorded under its place (format 5): a valid chunk moved,
        copied or swapped is damage. Older stores check each chunk's own checksum only."""
        return self.format_version >= DIGESTS_VERSION

    def model_names(self) -> dict[int, str]:
        """model_id -> model name, of the models when the store was opened and those this
        process registered since (an ingest reads them when it first needs them)."""
        if not self._names and self.catalog.connection.held is None:
            self._names.update({m.model_id: m.model for m in self.catalog.models()})
        return self._names

    def _chunk_digests(self) -> ChunkDigests:
        """The digests recorded for chunks' places: weights' in the main catalog, vectors'
        in the catalog this process commits to (a shard's own) over the main one's."""
        main = self.catalog.digest_query()
        load_main = load_with(main)

        def load(model: str, array: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            chunks, rows, crc = load_main(model, array)
            if self.commits is self.catalog or not array.startswith("acts/"):
                return chunks, rows, crc
            own = load_with(lambda sql, params: self.commits.all(sql, params))(model, array)
            return (np.concatenate([chunks, own[0]]), np.concatenate([rows, own[1]]),
                    np.concatenate([crc, own[2]]))  # later entries win

        if self.catalog.connection.held is not None:
            # read now: a reader's (or holder's) chunks are read inside queries on the
            # catalog's connection, which cannot run another query then
            self._names.update({m.model_id: m.model for m in self.catalog.models()})
        return ChunkDigests(load, find_with(main), self.model_names)

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open_or_create(cls, path: StoreLocation, *,
                       storage_options: Mapping[str, Any] | None = None,
                       shard: str | None = None) -> Store:
        """Open a store for an ingest (`shard`: a shard ingest, by its name), creating it if
        absent (or an empty directory)."""
        backend = open_backend(path, storage_options)
        if backend.needs_create():
            backend.create()
        return cls(backend, ingest=True, shard=shard)

    def _check_version(self, version: int) -> None:
        if version > FORMAT_VERSION:
            raise StoreFormatError(
                f"store {self.location!r} was written by format version {version}; this actdb "
                f"reads versions up to {FORMAT_VERSION}: upgrade actdb"
            )
        if version < 1:
            raise StoreFormatError(f"store {self.location!r} has no valid format version")

    def open_shard(self, create: Callable[[Path], None]) -> Catalog:
        """A shard ingest's own catalog (made by `create(file)` when absent), where its
        batches are committed from now on; other shards may then register and plan."""
        assert self.shard is not None
        try:
            self.commits = self.backend.open_shard_catalog(self.shard, create=create)
        finally:
            self._end_registering()
        return self.commits

    def _end_registering(self) -> None:
        if self._registering is not None:
            reg, self._registering = self._registering, None
            reg.__exit__(None, None, None)

    def close(self) -> None:
        # Every step runs however the ones before it ended (a catalog whose last write fails
        # on a full disk or a file-size limit): the store's locks are released whatever
        # happens, or a long-lived process (a Dask worker) would keep every later ingest out.
        with ExitStack() as steps:  # run last to first
            steps.callback(self.backend.close)
            steps.callback(self._end_registering)
            steps.callback(self.catalog.close)
            if self.commits is not self.catalog:
                steps.callback(self.commits.close)
            steps.callback(self.arrays.close)
            steps.callback(self._writers.shutdown)

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
        embed: np.ndarray | None,
        lm_head: np.ndarray | None,
        lm_head_bias: np.ndarray | None,
        site_params: dict[str, tuple[np.ndarray | None, np.ndarray | None]],
        vocab: pa.Table,
        layer_weights: Mapping[str, np.ndarray] | None = None,
        weights_manifest: Mapping[str, Any] | None = None,
        projection: np.ndarray | None = None,
    ) -> None:
        """Weights first, then the catalog rows: an interrupted registration leaves no model.
        `layer_weights` and `weights_manifest`: the blocks' matrices (layer_weights.py);
        `projection`: a contrastive model's image projection (its labels lens)."""
        with self.backend.writing(f"the weights of model {model.model!r}"):
            self.arrays.write_weights(
                model.model_id, embed=embed, lm_head=lm_head, lm_head_bias=lm_head_bias,
                site_params=site_params, layer_weights=layer_weights,
                weights_manifest=weights_manifest, pool=self._writers, projection=projection,
            )
        fault("weights_written")
        digests = None
        if self.has_digests:
            weights: dict[str, np.ndarray | None] = {
                "embed": embed, "lm_head": lm_head, "lm_head_bias": lm_head_bias,
                "projection": projection}
            for site, (gain, bias) in site_params.items():
                weights[f"sites/{site}/gain"] = gain
                weights[f"sites/{site}/bias"] = bias
            weights.update(layer_weights or {})
            digests = digests_table(self.arrays.weight_digests(model.model_id, weights),
                                    {model.model_id: model.model})
        with self.backend.writing("the catalog"):
            self.catalog.insert_model(model, sites, vocab, digests)
        self._names[model.model_id] = model.model
        if self.arrays.expected is not None:
            self.arrays.expected.forget()  # an interrupted registration's may have been read

    def save_tokenizer(self, model_id: int, save: Callable[[str], object]) -> None:
        """`save(folder)` writes a model's tokenizer (its `save_pretrained`) into the store."""
        with self.backend.writing("a tokenizer"):
            self.backend.save_tokenizer(model_id, save)

    def reserve_rows(self, model: ModelRecord, sites: list[SiteRecord], rows: int) -> None:
        """Make every site's arrays at least `rows` long (rows past n_rows stay invisible)."""
        def ensure(s: SiteRecord) -> None:
            inner = (s.n_heads, s.d) if s.n_heads else (s.d,)
            self.arrays.ensure_act_arrays(
                model.model_id, s.site, inner=inner, rows=rows, chunk_tokens=model.chunk_tokens,
                lens=(model.lens_k or 0) if is_lens_site(model, s) else 0)

        with self.backend.writing("array metadata"):
            self.arrays.ensure_act_groups(model.model_id)
            # Sites are independent arrays: sized concurrently (round trips on object storage)
            list(self._writers.map(ensure, sites))
            self.arrays.sync(self._writers)  # new sites' files, where they wait for one syncfs

    def write_ahead(self, model: ModelRecord, site: str, start: int,
                    direction: np.ndarray) -> Future[tuple[int, int]]:
        """Start writing, on the writer threads, the direction chunks that rows
        [start, start + n) of one site fill whole, before the `commit_batch` of these rows
        (pass it the future in `ahead`): the ingest writes its last batch's chunks while the
        batch's forward pass still runs. Rows past the committed count are invisible, so what
        is written ahead of a commit that never comes is overwritten by the next ingest."""
        return self._writers.submit(self.arrays.write_whole_chunks, model.model_id, site,
                                    start, direction)

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
        ahead: Mapping[str, Future[tuple[int, int]]] | None = None,
        attention: Mapping[int, np.ndarray] | None = None,
    ) -> int:
        """Write one batch: tensors into rows [start, start + n), then the catalog rows.
        `ahead`: per site, the chunks `write_ahead` is writing of these rows. `attention`:
        the batch's prompts' attention weights by prompt id (attention.py), written with the
        vectors and committed with them.

        Returns the new committed row count. A crash before the catalog commit leaves rows
        past `n_rows` that no reader sees and the next ingest overwrites.
        """
        n = tokens.num_rows
        for site, batch in acts.items():
            assert batch.direction.shape[0] == n, (site, batch.direction.shape, n)
        # Arrays are independent files: write them concurrently, make the renames durable,
        # then commit the catalog.
        with self.backend.writing(f"vectors of model {model.model!r}"):
            done = {site: f.result() for site, f in (ahead or {}).items()}
            list(self._writers.map(
                lambda item: self.arrays.write_rows(model.model_id, item[0], start,
                                                    item[1].fields(), done=done.get(item[0])),
                acts.items(),
            ))
            self.arrays.sync(self._writers)
            attended = self.arrays.attention.write(model.model_id, dict(attention or {}),
                                                   self._writers)
        fault("tensors_written")
        written = self.arrays.written.take(model.model_id, start + n) + attended
        digests = (digests_table(written, {model.model_id: model.model})
                   if self.has_digests else None)
        with self.backend.writing("the catalog"):
            self.commits.commit_batch(
                model=model.model, new_prompts=new_prompts, prompt_runs=prompt_runs,
                tokens=tokens, site_errors=site_errors, n_rows=start + n,
                logit_error=logit_error, digests=digests,
            )
        if self.arrays.expected is not None:
            self.arrays.expected.committed(written)
        return start + n

    # -- reading ---------------------------------------------------------------------------

    def tokenizer_dir(self, model_id: int) -> Path:
        """A local folder with a model's tokenizer (by `save_pretrained`), for token lookups
        (downloaded on first use for a store on object storage)."""
        return self.backend.tokenizer_dir(model_id)

    def disk_bytes(self) -> dict[str, int]:
        """Bytes stored of the catalog, the tensors, and both."""
        return self.backend.disk_bytes()


__all__ = ["ACT_FIELDS", "CATALOG_NAME", "TENSORS_NAME", "TOKENIZERS_NAME", "ActBatch", "Store",
           "open_backend"]
