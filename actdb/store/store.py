"""A store: one directory holding the DuckDB catalog and the Zarr tensors.

This module owns the rules that touch both halves: opening and creating (with the format and
writability checks, in one place), and the commit protocol (tensors first, then the catalog
rows that make them visible, in one transaction).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import StoreFormatError, StoreNotFoundError, StoreNotWritableError
from .arrays import ACT_FIELDS, Arrays
from .catalog import FORMAT_VERSION, Catalog
from .records import ModelRecord, SiteRecord

CATALOG_NAME = "catalog.duckdb"
TENSORS_NAME = "tensors.zarr"
TOKENIZERS_NAME = "tokenizers"


@dataclass(frozen=True, kw_only=True)
class ActBatch:
    """The vectors of one ingest batch for one site: rows in token order."""

    direction: np.ndarray  # float16 [n, d] or [n, heads, d]
    norm: np.ndarray  # float32 [n] or [n, heads]
    mean: np.ndarray  # float32 [n] or [n, heads]


class Store:
    """Open a store for reading (`read_only=True`) or ingesting into it."""

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = True) -> None:
        self.path = Path(path)
        self.read_only = read_only
        self._check_is_store()
        if not read_only:
            self._check_writable(self.path)
        self._writers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="actdb-write")
        self.catalog = Catalog(self.path / CATALOG_NAME, read_only=read_only)
        try:
            self._check_version(self.catalog.format_version())
            self.arrays = Arrays(self.path / TENSORS_NAME, read_only=read_only)
            self._check_version(self.arrays.format_version())
        except BaseException:
            self.catalog.close()
            raise

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open_or_create(cls, path: str | os.PathLike[str]) -> Store:
        """Open a store for writing, creating it if the directory is absent or empty."""
        p = Path(path)
        if p.exists() and not p.is_dir():
            raise StoreFormatError(f"store path {str(p)!r} is a regular file, not a directory")
        if not p.exists() or (p.is_dir() and not any(p.iterdir())):
            parent = p.parent if not p.exists() else p
            cls._check_writable(parent)
            p.mkdir(parents=True, exist_ok=True)
            # Tensors first: a directory with a catalog is a store, so the catalog comes last.
            Arrays.create(p / TENSORS_NAME)
            Catalog.create(p / CATALOG_NAME).close()
        return cls(p, read_only=False)

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
        self.arrays.write_weights(
            model.model_id, embed=embed, lm_head=lm_head, lm_head_bias=lm_head_bias,
            site_params=site_params,
        )
        self.catalog.insert_model(model, sites, vocab)

    def reserve_rows(self, model: ModelRecord, sites: list[SiteRecord], rows: int) -> None:
        """Make every site's arrays at least `rows` long (rows past n_rows stay invisible)."""
        for s in sites:
            inner = (s.n_heads, s.d) if s.n_heads else (s.d,)
            self.arrays.ensure_act_arrays(
                model.model_id, s.site, inner=inner, rows=rows, chunk_tokens=model.chunk_tokens
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
        # Arrays are independent files: write them concurrently, then commit the catalog.
        list(self._writers.map(
            lambda item: self.arrays.write_rows(model.model_id, item[0], start, {
                "direction": item[1].direction, "norm": item[1].norm, "mean": item[1].mean}),
            acts.items(),
        ))
        self.catalog.commit_batch(
            model=model.model, new_prompts=new_prompts, prompt_runs=prompt_runs,
            tokens=tokens, site_errors=site_errors, n_rows=start + n, logit_error=logit_error,
        )
        return start + n

    # -- reading ---------------------------------------------------------------------------

    def tokenizer_dir(self, model_id: int) -> Path:
        """Where a model's tokenizer is saved (by `save_pretrained`), for token lookups."""
        return self.path / TOKENIZERS_NAME / str(model_id)

    def disk_bytes(self) -> dict[str, int]:
        """Bytes on disk of the catalog, the tensors, and both."""
        def size(p: Path) -> int:
            if p.is_file():
                return p.stat().st_size
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

        cat = sum(size(f) for f in self.path.glob(CATALOG_NAME + "*"))
        ten = size(self.path / TENSORS_NAME)
        tok = size(self.path / TOKENIZERS_NAME) if (self.path / TOKENIZERS_NAME).exists() else 0
        return {"catalog": cat, "tensors": ten, "tokenizers": tok, "total": cat + ten + tok}


__all__ = ["ACT_FIELDS", "ActBatch", "Store"]
