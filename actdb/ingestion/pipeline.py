"""`actdb.ingest`: run a model over prompts and store every norm site's input.

The work is split by job: `process` runs one process's ingest (`batches` plans and pads the
batches, `register` puts the model in the store, `run` is the loop of forward passes and
commits), `shards` plans a sharded ingest, and `cluster` runs the shards on Dask workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from ..errors import IngestError
from .options import IngestOptions, IngestPlan, IngestSummary
from .process import ingest_here
from .prompts import PromptsLike
from .shards import parse_shard

__all__ = ["IngestPlan", "IngestSummary", "ingest"]


def ingest(
    store: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | nn.Module,
    prompts: PromptsLike | None = None,
    prompts_format: str | None = None,
    tokenizer: Any = None,
    inputs: PromptsLike | None = None,
    images: str | os.PathLike[str] | None = None,
    processor: Any = None,
    batch_size: int = 8,
    max_length: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    sites: str | None = None,
    name: str | None = None,
    revision: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    chunk_tokens: int | None = None,
    progress: bool = False,
    on_plan: Callable[[IngestPlan], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    chat_template: bool = False,
    shard: str | tuple[int, int] | None = None,
    cluster: Any = None,
    weights: str = "all",
    labels: str | os.PathLike[str] | Sequence[str] | None = None,
    label_template: str | None = None,
    attention: bool = False,
    lens: int | None = None,
) -> IngestSummary:
    """Run `model` once over `prompts` and store every norm site's input in `store`.

    Safe to re-run: prompts the model already has in the store are skipped, so an
    interrupted ingest resumes where it stopped. `store` may be `s3://bucket/prefix`, with
    `storage_options` overriding the AWS environment variables (see `actdb.connect`). With
    `chat_template`, each prompt is wrapped as a user turn by the tokenizer's chat template
    (assistant turn opened); the templated text is the stored prompt's text, tokenized as is
    (the template places any special tokens itself).

    A model object (`model=`) is moved to `device` for the ingest and back to where it was
    after, so a caller's CPU model stays usable on CPU inputs; with `dtype="auto"` it keeps
    its own dtype, and another `dtype` casts it in place, as `model.to(dtype)` would.

    `prompts_format` ('txt' or 'jsonl') reads a prompts file or `-` in that format,
    whatever its suffix (standard input is otherwise JSON Lines when its first line starts
    with '{').

    Instead of `prompts`, `images` (a folder: its image files, sorted by name) or `inputs`
    (a JSON Lines file or a list of dicts with `text`, `image`, `video`, `audio` and extra
    fields; an image may be a PIL image, a sound an `(array, sampling rate)` pair) give
    inputs that the model's processor prepares: its own (saved with it), or `processor` (an
    object or a folder). Each norm's positions (class token, registers, patches, a sound's
    frames) are rows, with their patch row, column and frame. An encoder-decoder's decoder
    reads each input's `target` field (teacher forcing: shifted right by the model's own
    function), or its start token alone; its rows are the tokens it read.

    With `shard=(i, N)` (or `"i/N"`), this is worker i (from 0) of N ingesting its share of
    the prompts into the same store, side by side with the others: its catalog rows go to
    the store's `shards/{i}-of-{N}` catalog until `actdb.merge` moves them all into the main
    catalog. Run again with the same arguments, a killed shard resumes. Each shard runs
    whole batches of the one batch plan a one-process ingest runs, so the merged store holds
    the same bytes as a one-process ingest at any `batch_size`. With `cluster`
    (`"local:N"`, a Dask scheduler address or client), one shard per worker runs on the
    cluster and they are merged at the end (the workers must reach the store and model).

    `weights` ('all', the default, or 'none'): whether a new model's blocks' attention and
    MLP matrices, and each head's OV and QK circuits, are stored beside its embedding and
    head (docs/FORMAT.md, "Layer weights").

    `labels` (a file, one label a line, or a list of strings), for a contrastive model (CLIP,
    SigLIP) over images: each label, put in `label_template` (default "a photo of a {}"),
    is embedded by the model's own text tower; the anchor set 'labels' is those embeddings
    read back through the vision tower's final norm and projection, and the logit functions
    read the class token as the model's zero-shot classifier does (proven at ingest against
    its logits_per_image).

    `attention` (off by default): also store every head's attention weights for each prompt
    ingested, from a second forward pass of each batch with eager attention (the stored
    vectors come from the first, with the model's own attention implementation, unchanged),
    queried as the view `attention` (docs/FORMAT.md, "Attention weights").

    `lens` (K): store the materialized logit lens of every row of every site the lens
    functions read: its top K tokens and logits, the log-sum-exp and entropy of its logits
    over the vocabulary, and the rank and logit of the model's own prediction there, computed
    in the same pass on the ingest's device and proven against the model's logits. `top_logits`
    (k <= K), `entropy`, and `prob`, `logprob` and `token_rank` of those tokens then read them
    instead of multiplying by the vocabulary. Default (None): 10 on a GPU, 0 (none) on a CPU,
    where the products cost more than the forward pass; a model already in the store keeps
    its own K, and another one is an error.
    """
    if cluster is not None and (inputs is not None or images is not None):
        raise IngestError("a cluster ingest takes prompts only; ingest images and other "
                          "inputs without --cluster")
    if cluster is not None and labels is not None:
        raise IngestError("a cluster ingest takes prompts only; ingest with labels without "
                          "--cluster")
    if cluster is not None and shard is not None:
        raise IngestError("pass either shard or cluster, not both: a cluster ingest runs "
                          "the shards itself")
    opts = IngestOptions(
        store=store, model=model, prompts=prompts, inputs=inputs, images=images,
        processor=processor, prompts_format=prompts_format,
        tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, device=device,
        dtype=dtype, sites=sites, name=name, revision=revision, device_map=device_map,
        chunk_tokens=chunk_tokens, progress=progress, on_plan=on_plan,
        storage_options=storage_options, chat_template=chat_template,
        shard=parse_shard(shard) if shard is not None else None, weights=weights,
        labels=labels, label_template=label_template, attention=attention, lens=lens)
    if cluster is not None:
        from .cluster import ingest_on_cluster  # dask: imported by cluster ingests alone

        return ingest_on_cluster(opts, cluster=cluster)
    return ingest_here(opts)
