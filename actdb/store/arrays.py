"""The Zarr side of a store: the tensors' group, holding each model's weights and vectors.

Layout (see docs/FORMAT.md):
    models/{model_id}/embed           float32 [V, d]
    models/{model_id}/lm_head         float32 [V, d]   (absent when tied to embed or no head)
    models/{model_id}/lm_head_bias    float32 [V]
    models/{model_id}/sites/{site}/gain, bias            float32 [d]
    models/{model_id}/acts/{site}/direction   float16 [rows, d] or [rows, heads, d]
    models/{model_id}/acts/{site}/norm, mean  float32 [rows] or [rows, heads]
    models/{model_id}/acts/{site}/lens_ids, lens_logits, lens_stats   the materialized lens
                                              (lens_layout.py), at lens sites of a lens model

Every chunk ends with its CRC-32C (Zarr's `crc32c` codec), checked on every read, here and by
a plain `zarr.open_group`; format 5 also checks each chunk against the digest the catalog
recorded for its place (digests.py). On object storage the vectors are sharded: each object
holds SHARD_CHUNKS inner chunks, each with its own CRC-32C (object_chunks.py).

`Arrays` holds one object per job: the group and its metadata (array_group.py), checked chunk
reads (chunk_reads.py), the weights (weights.py), the vectors (act_arrays.py) and what a batch
of writes leaves to make durable (write_sync.py); its methods are the store's entry points.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .act_arrays import (
    ACT_FIELDS,
    SCALAR_CHUNK_FACTOR,
    SHARD_CHUNKS,
    ActArrays,
    default_chunk_tokens,
    write_alignment,
)
from .array_group import ArrayGroup, ArrayInfo, Layout, create_group
from .attention import AttentionArrays
from .catalog import LOCAL_FORMAT_VERSION
from .chunk_reads import ChunkReader
from .chunks import crc32c
from .digests import Digest, WrittenDigests
from .weights import SiteParams, Weights, weight_chunk_rows
from .write_sync import WriteSync

if TYPE_CHECKING:
    import zarr

    from .digests import ChunkDigests
    from .objects import Objects  # obstore: imported by a remote store alone


class Arrays:
    """The tensors of a store: `group` (metadata), `reader` (checked chunk reads), `weights`,
    `acts` (the vectors), `durability` (what writes left to make durable), `written` (the
    digests of chunks written, until their commit)."""

    def __init__(self, path: Path | None, *, read_only: bool, store: Any = None,
                 objects: Objects | None = None) -> None:
        """`path`: the local `tensors.zarr` folder; or None with `objects`, the group's prefix
        on object storage (then `store` is zarr's ObjectStore over it)."""
        self.group = ArrayGroup(path, read_only=read_only, store=store, objects=objects)
        self.reader = ChunkReader(self.group)
        self.durability = WriteSync(path, read_only=read_only)
        self.written = WrittenDigests()
        self.weights = Weights(self.group, self.reader, self.durability)
        self.acts = ActArrays(self.group, self.reader, self.durability, self.written)
        self.attention = AttentionArrays(self.group, self.reader, self.durability)

    @classmethod
    def create(cls, path: Path | None, *, version: int = LOCAL_FORMAT_VERSION,
               store: Any = None, objects: Objects | None = None) -> Arrays:
        create_group(path, version, store)
        return cls(path, read_only=False, store=store, objects=objects)

    # -- checks --------------------------------------------------------------------------------

    @property
    def check_checksums(self) -> bool:
        """Off only to measure what checking costs (benchmarks/); never off for users."""
        return self.reader.check_checksums

    @check_checksums.setter
    def check_checksums(self, on: bool) -> None:
        self.reader.check_checksums = on

    @property
    def expected(self) -> ChunkDigests | None:
        """The digests recorded for chunks' places (format 5; None: an older store)."""
        return self.reader.expected

    @expected.setter
    def expected(self, digests: ChunkDigests | None) -> None:
        self.reader.expected = digests

    # -- the group -----------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return self.group.sharded

    def format_version(self) -> int:
        return self.group.format_version()

    def set_format_version(self, version: int) -> None:
        self.group.set_format_version(version)

    def info(self, label: str, *, required: bool = True) -> ArrayInfo | None:
        return self.group.info(label, required=required)

    def raw_layout(self, arr: zarr.Array) -> Layout | None:
        return self.group.raw_layout(arr)

    def check_group(self, label: str) -> None:
        self.group.check_group(label)

    def open_group(self, label: str) -> zarr.Group | None:
        return self.group.open_group(label)

    def has_model(self, model_id: int) -> bool:
        return f"models/{model_id}" in self.group.group

    # -- weights -------------------------------------------------------------------------------

    def write_weights(self, model_id: int, *, embed: np.ndarray | None,
                      lm_head: np.ndarray | None,
                      lm_head_bias: np.ndarray | None, site_params: SiteParams,
                      layer_weights: Mapping[str, np.ndarray] | None = None,
                      weights_manifest: Mapping[str, Any] | None = None,
                      pool: Executor | None = None,
                      projection: np.ndarray | None = None) -> None:
        self.weights.write(model_id, embed=embed, lm_head=lm_head, lm_head_bias=lm_head_bias,
                           site_params=site_params, layer_weights=layer_weights,
                           weights_manifest=weights_manifest, pool=pool,
                           projection=projection)

    def weight_digests(self, model_id: int, weights: dict[str, np.ndarray | None]
                       ) -> list[Digest]:
        return self.weights.digests(model_id, weights)

    def weight(self, model_id: int, name: str, *, required: bool = True) -> np.ndarray | None:
        return self.weights.read(model_id, name, required=required)

    def weight_blocks(self, model_id: int, name: str
                      ) -> tuple[tuple[int, ...], Iterator[tuple[int, np.ndarray]]] | None:
        return self.weights.blocks(model_id, name)

    def weight_rows(self, model_id: int, name: str, rows: list[int]) -> np.ndarray:
        return self.weights.rows(model_id, name, rows)

    def check_weight(self, model_id: int, name: str, *, required: bool, full: bool) -> None:
        self.weights.check(model_id, name, required=required, full=full)

    # -- vectors -------------------------------------------------------------------------------

    def ensure_act_groups(self, model_id: int) -> None:
        self.acts.ensure_groups(model_id)

    def ensure_act_arrays(self, model_id: int, site: str, *, inner: tuple[int, ...], rows: int,
                          chunk_tokens: int, lens: int = 0) -> None:
        self.acts.ensure_arrays(model_id, site, inner=inner, rows=rows,
                                chunk_tokens=chunk_tokens, lens=lens)

    def act_array(self, model_id: int, site: str, field: str) -> zarr.Array:
        return self.acts.array(model_id, site, field)

    def act_info(self, model_id: int, site: str, field: str) -> ArrayInfo:
        return self.acts.info(model_id, site, field)

    def act_layout(self, model_id: int, site: str, field: str) -> Layout | None:
        return self.acts.layout(model_id, site, field)

    def read_chunk(self, model_id: int, site: str, field: str, chunk: int) -> np.ndarray:
        return self.acts.read_chunk(model_id, site, field, chunk)

    def read_chunk_dots(self, model_id: int, site: str, field: str, chunk: int,
                        v: np.ndarray, into: np.ndarray | None = None
                        ) -> tuple[np.ndarray, np.ndarray | None]:
        return self.acts.read_chunk_dots(model_id, site, field, chunk, v, into)

    def read_chunks(self, model_id: int, site: str, field: str, first: int,
                    count: int) -> np.ndarray:
        return self.acts.read_chunks(model_id, site, field, first, count)

    def read_dots(self, model_id: int, site: str, field: str, first: int, count: int,
                  v: np.ndarray) -> np.ndarray:
        return self.acts.read_dots(model_id, site, field, first, count, v)

    def write_whole_chunks(self, model_id: int, site: str, start: int,
                           direction: np.ndarray) -> tuple[int, int]:
        return self.acts.write_whole_chunks(model_id, site, start, direction)

    def write_rows(self, model_id: int, site: str, start: int, values: dict[str, np.ndarray],
                   *, done: tuple[int, int] | None = None) -> None:
        self.acts.write_rows(model_id, site, start, values, done=done)

    # -- durability ----------------------------------------------------------------------------

    def sync(self, pool: Executor | None = None) -> None:
        """Make the writes since the last call durable (write_sync.py)."""
        self.durability.sync(pool)

    def close(self) -> None:
        """Let go of the file system's descriptor (`sync`'s); reads need nothing closed."""
        self.durability.close()


__all__ = ["ACT_FIELDS", "SCALAR_CHUNK_FACTOR", "SHARD_CHUNKS", "ArrayInfo", "Arrays", "crc32c",
           "default_chunk_tokens", "weight_chunk_rows", "write_alignment"]
