"""Attention weights (`ingest --attention`): per model and prompt, every head's attention
weights from the model's own forward pass, one array a prompt (docs/FORMAT.md, "Attention").

    models/{model_id}/attention/{prompt_id}   float32 [layers, heads, n, n]   chunk: one layer

`[l, h, q, k]` is the weight query position q gives key position k in head h of layer l (the
model's `output_attentions`; a causal model's keys past q are 0). Written whole before the
commit that makes the prompt visible, each chunk's digest recorded in that commit; which
prompts have attention is which have a digest for chunk 0 of their array, so a prompt whose
commit never came has none, and the next ingest writes its array again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np

from . import durable
from .array_group import ArrayGroup
from .chunk_reads import ChunkReader
from .chunks import raw_layout
from .digests import TABLE, Digest, weight_digests
from .weights import create_weight_array
from .write_sync import WriteSync

GROUP = "attention"


def array_name(prompt_id: int) -> str:
    """The prompt's array under `models/{model_id}/`."""
    return f"{GROUP}/{int(prompt_id)}"


def stored_prompts(query: Callable[[str, list[Any]], list[tuple[Any, ...]]]
                   ) -> list[tuple[str, int]]:
    """(model, prompt_id) of every prompt with committed attention weights, from the
    catalog's digests (`query` runs SQL on the catalog)."""
    rows = query(f"SELECT model, path FROM {TABLE} WHERE chunk = 0 AND starts_with(path, ?) "
                 "ORDER BY model, path", [f"{GROUP}/"])
    return sorted((str(m), int(str(p).rsplit("/", 1)[1])) for m, p in rows)


class AttentionArrays:
    """The attention weights of the models in `group`."""

    def __init__(self, group: ArrayGroup, reader: ChunkReader, durability: WriteSync) -> None:
        self.group, self.reader, self.durability = group, reader, durability

    def write(self, model_id: int, weights: dict[int, np.ndarray],
              pool: Executor | None = None) -> list[Digest]:
        """Write each prompt's array ({prompt_id: float32 [layers, heads, n, n]}), replacing
        what an interrupted ingest left, durable before this returns; their digests."""
        if not weights:
            return []
        g = self.group.model_group(model_id).require_group(GROUP)
        self.group.forget(f"models/{model_id}/{GROUP}/")
        fs = self.durability.file_system_sync() if self.group.path is not None else None
        digests: list[Digest] = []
        for pid, value in weights.items():
            value = np.ascontiguousarray(value, dtype=np.float32)
            arr = create_weight_array(g, str(int(pid)), value.shape, chunk_rows=1,
                                      dims=("layer", "head", "query", "key"))
            raw = raw_layout(arr, self.group.zstore) if self.group.objects is None else None
            if raw is None:
                arr[...] = value
            else:
                def one(layer: int, raw: Any = raw, value: np.ndarray = value) -> None:
                    os.makedirs(os.path.dirname(raw.path(layer)), exist_ok=True)
                    raw.write(layer, value[layer : layer + 1], point="attention_write",
                              sync=fs is None)
                list((pool.map if pool else map)(one, range(value.shape[0])))
            digests += weight_digests(f"models/{model_id}/{array_name(pid)}", value, 1)
        path = self.group.path
        if path is not None:
            folder = Path(path) / "models" / str(model_id) / GROUP
            if fs is not None:
                fs.sync()
            else:
                durable.sync_tree(folder)
            durable.fsync_dir(folder.parent)
        return digests

    def shape(self, model_id: int, prompt_id: int) -> tuple[int, ...]:
        info = self.group.info(f"models/{model_id}/{array_name(prompt_id)}", required=True)
        assert info is not None
        return tuple(info.shape)

    def layer(self, model_id: int, prompt_id: int, layer: int) -> np.ndarray:
        """float32 [heads, n, n]: one layer of a prompt's weights, its chunk checked."""
        label = f"models/{model_id}/{array_name(prompt_id)}"
        info = self.group.info(label, required=True)
        assert info is not None
        return self.reader.chunk(label, info, int(layer))[0]


__all__ = ["GROUP", "AttentionArrays", "array_name", "stored_prompts"]
