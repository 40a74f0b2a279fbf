"""What an ingest is asked to do (`IngestOptions`), what it plans (`IngestPlan`) and what it
did (`IngestSummary`): the records passed between the ingest's modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import IngestError
from .lens import check_lens_k
from .prompts import PromptsLike


@dataclass(frozen=True, kw_only=True)
class IngestPlan:
    """What an ingest is about to do, known before the first forward pass."""

    model: str
    prompts_total: int
    prompts_todo: int
    prompts_truncated: int
    tokens_todo: int
    sites: int
    bytes_estimate: int


@dataclass(frozen=True, kw_only=True)
class IngestSummary:
    model: str
    store: str
    prompts_total: int
    prompts_new: int
    prompts_skipped: int
    prompts_truncated: int
    tokens_written: int
    sites: int
    bytes_stored: int  # what the store grew by on disk (vectors, weights, catalog rows)
    seconds: float
    store_bytes: int = 0  # the whole store on disk afterwards, as `actdb info` counts it
    max_rel_error: dict[str, float] = field(default_factory=dict)
    note: str | None = None  # a shard with nothing to do says so (and wrote nothing)
    # what of the input the store does not hold (prompt fields it kept its own for), said
    warnings: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_written / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class IngestOptions:
    """`actdb.ingest`'s arguments, checked (see its docstring for each). `shard` is
    `(i, N)` once parsed; a cluster ingest gives each worker these options with its shard."""

    store: str | os.PathLike[str]
    model: str | os.PathLike[str] | nn.Module
    prompts: PromptsLike | None = None
    inputs: PromptsLike | None = None  # media inputs (inputs.py), instead of prompts
    images: str | os.PathLike[str] | None = None  # a folder of images, instead of prompts
    processor: Any = None
    prompts_format: str | None = None
    tokenizer: Any = None
    batch_size: int = 8
    max_length: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    sites: str | None = None
    name: str | None = None
    revision: str | None = None
    device_map: str | dict[str, Any] | None = None
    chunk_tokens: int | None = None
    progress: bool = False
    on_plan: Callable[[IngestPlan], None] | None = None
    storage_options: Mapping[str, Any] | None = None
    chat_template: bool = False
    shard: tuple[int, int] | None = None
    weights: str = "all"
    # a contrastive model's labels (a file, one a line, or a list) and their prompt template
    labels: str | os.PathLike[str] | Sequence[str] | None = None
    label_template: str | None = None
    attention: bool = False  # store every head's attention weights per prompt
    # K of the materialized lens (lens.py); None: the device's default, or a resumed model's
    lens: int | None = None

    def __post_init__(self) -> None:
        if self.lens is not None:
            check_lens_k(self.lens)
        if self.weights not in ("all", "none"):
            raise IngestError(f"weights must be 'all' or 'none', got {self.weights!r}")
        if self.batch_size < 1:
            raise IngestError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.max_length is not None and self.max_length < 1:
            raise IngestError(f"max_length must be at least 1, got {self.max_length}")
