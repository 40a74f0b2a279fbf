"""The ingest: prompts -> tokens -> one forward pass per batch with hooks -> store."""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from ..errors import IngestError
from ..store.arrays import default_chunk_tokens, write_alignment
from ..store.records import ModelRecord, SiteRecord
from ..store.sharding import (
    create_shard_catalog,
    mark_finished,
    other_plans,
    pending_shards,
    shard_name,
)
from ..store.store import ActBatch, Store
from .capture import on_norm_io
from .fields import SiteSink
from .load import LoadedModel, load
from .logits import (
    LOGIT_LIMIT,
    LogitCheck,
    LogitFit,
    LogitTransform,
    measure_logits,
    model_logits,
)
from .progress import progress_bar
from .prompts import (
    Prompt,
    PromptsLike,
    apply_chat_template,
    column_value,
    extra_columns,
    read_prompts,
)
from .rows import Work, batch_tables
from .shards import nothing_to_do, parse_shard, plan_shard
from .sites import FoundSite, find_sites, forward_module, outside_base

# Batches are buffered to at least this many token rows before a write and commit: fewer
# DuckDB transactions and partial-chunk rewrites (a crash loses at most this much work).
_FLUSH_TOKENS = 2048
# About one batch in this many, logits are recomputed from the store and compared with the
# model's: the LM head runs on a few positions only, so the ingest stays fast. The sample is
# chosen by prompt id (see `_logit_sampled`), so a killed ingest that is resumed, or an ingest
# split into shards, records the same worst error as one uninterrupted run.
_LOGIT_CHECK_EVERY = 16


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
    bytes_stored: int  # vectors (2d + 8 bytes each) and, for a new model, its weights
    seconds: float
    max_rel_error: dict[str, float] = field(default_factory=dict)
    note: str | None = None  # a shard with nothing to do says so (and wrote nothing)
    # what of the input the store does not hold (prompt fields it kept its own for), said
    warnings: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_written / self.seconds if self.seconds > 0 else 0.0


def ingest(
    store: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | nn.Module,
    prompts: PromptsLike,
    prompts_format: str | None = None,
    tokenizer: Any = None,
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

    With `shard=(i, N)` (or `"i/N"`), this is worker i (from 0) of N ingesting its share of
    the prompts into the same store, side by side with the others: its catalog rows go to
    the store's `shards/{i}-of-{N}` catalog until `actdb.merge` moves them all into the main
    catalog. Run again with the same arguments, a killed shard resumes. With `cluster`
    (`"local:N"`, a Dask scheduler address or client), one shard per worker runs on the
    cluster and they are merged at the end (the workers must reach the store and model).
    """
    if cluster is not None:
        if shard is not None:
            raise IngestError("pass either shard or cluster, not both: a cluster ingest runs "
                              "the shards itself")
        from .cluster import ingest_on_cluster

        return ingest_on_cluster(
            store, cluster=cluster, model=model, prompts=prompts,
            prompts_format=prompts_format, tokenizer=tokenizer,
            batch_size=batch_size, max_length=max_length, device=device, dtype=dtype,
            sites=sites, name=name, revision=revision, device_map=device_map,
            chunk_tokens=chunk_tokens, storage_options=storage_options,
            chat_template=chat_template)
    shard_of = parse_shard(shard) if shard is not None else None
    if batch_size < 1:
        raise IngestError(f"batch_size must be at least 1, got {batch_size}")
    if max_length is not None and max_length < 1:
        raise IngestError(f"max_length must be at least 1, got {max_length}")
    prompt_list = read_prompts(prompts, format=prompts_format)
    # A model object is the caller's: moved to the ingest's device for it, and back after.
    home = _device_of(model) if isinstance(model, nn.Module) and not device_map else None
    frozen = False
    try:
        loaded = load(model, tokenizer, device=device, dtype=dtype, revision=revision,
                      device_map=device_map)
        # The cyclic garbage collector skips what exists by now (torch, transformers and the
        # model: about 400k objects for GPT-2 small), which each full collection would walk
        # again, 0.2 s apiece; what the ingest allocates is collected as usual. A process
        # that froze objects itself keeps its own arrangement.
        frozen = not gc.get_freeze_count()
        if frozen:
            gc.freeze()
        model_name = name or loaded.default_name
        if chat_template:
            prompt_list = apply_chat_template(prompt_list, loaded.tokenizer, model_name)
        limit = _length_limit(loaded, max_length)
        ids, truncated = _tokenize(loaded.tokenizer, [p.text for p in prompt_list], limit,
                                   special=not chat_template)
        sample, sample_alt = _probe_batch(loaded, ids, 11), _probe_batch(loaded, ids, 7)
        head = _lm_head(loaded.model)
        # The logit fit rides on the site-finding's second pass, hooked on the final norm.
        fit = None if head is None else LogitFit(
            head, sample_alt, _forward_kwargs(loaded.model), getattr(loaded.model, "config", None))
        found, n_layers = find_sites(loaded.model, sample, sample_alt, sites_glob=sites,
                                     final_probe=fit)
        # The final site whose output the LM head reads: the last of them (sites._final_path).
        final = next((f for f in reversed(found) if f.record.role == "final"), None)
        transform = None
        if fit is not None and final is not None:
            if fit.ready and fit.path == final.record.module:
                transform = fit.transform(final, model_name)
            else:  # the site filter left out the norm the fit rode on: a pass of its own
                try:
                    transform = measure_logits(loaded.model, sample, final, fit.head,
                                               fit.kwargs, model_name)
                except IngestError as e:
                    if not sites or fit.path is None or fit.path == final.record.module:
                        raise  # not the filter's doing
                    raise IngestError(
                        f"model {model_name!r}: --sites keeps the final site "
                        f"{final.record.site!r} ({final.record.module}) but leaves out "
                        f"{fit.path!r}, the norm whose output the LM head reads, and the "
                        f"logits cannot be recomputed from the site kept: add {fit.path!r} "
                        "to --sites") from e

        started = time.perf_counter()
        shard_label = shard_name(*shard_of) if shard_of else None
        with Store.open_or_create(store, storage_options=storage_options, shard=shard_label) as st:
            if shard_of is None and pending_shards(st):
                raise IngestError(
                    f"store {st.location!r} has shard ingests not merged yet "
                    f"({', '.join(pending_shards(st))}): finish them and run `actdb merge`, "
                    "then ingest"
                )
            reg = _register(st, loaded, found, n_layers, model_name, sites, limit, chunk_tokens,
                            transform)
            # The model's very first batch is part of the recorded sample; a resumed run (its
            # first batch committed, the error with it) or a later shard does not add its own.
            first_recorded = reg.record.logit_max_rel_error is None and (
                shard_of is None or shard_of[0] == 0)
            work, known = _plan_work(st, reg.record.model, prompt_list, ids, truncated)
            warnings = _fields_not_stored(st, prompt_list, known)
            records = [f.record for f in found]
            if shard_of is not None:
                if not work:  # no shard catalog: an empty one would block unsharded ingests
                    return IngestSummary(
                        model=reg.record.model, store=os.fspath(store),
                        prompts_total=len(prompt_list), prompts_new=0,
                        prompts_skipped=len(prompt_list), prompts_truncated=0,
                        tokens_written=0, sites=len(found), bytes_stored=0, seconds=0.0,
                        note=nothing_to_do(st.location, reg.record.model, shard_of))
                reg, work = _enter_shard(st, reg, records, work, shard_of)
                first_recorded = first_recorded and reg.record.logit_max_rel_error is None
            record = reg.record
            per_token = sum(_bytes_per_token(s) for s in records)
            tokens_todo = sum(len(w.ids) for w in work)
            n_truncated = sum(w.truncated for w in work)  # of the prompts this run stores
            plan = IngestPlan(
                model=record.model, prompts_total=len(prompt_list), prompts_todo=len(work),
                prompts_truncated=n_truncated, tokens_todo=tokens_todo, sites=len(found),
                bytes_estimate=per_token * tokens_todo + reg.weight_bytes,
            )
            if on_plan:
                on_plan(plan)
            check = None
            # A model already in the store keeps the final site its logit transform was fitted
            # on (stores written before the last final site was chosen may name an earlier one).
            final = next((f for f in found if f.record.site == reg.record.final_site), final)
            if head is not None and final is not None and reg.record.has_lm_head:
                recorded = LogitTransform(scale=reg.record.logit_scale,
                                          softcap=reg.record.logit_softcap, error=0.0)
                check = LogitCheck(final, head, recorded, loaded.device)
            errors = _run(st, loaded, reg, found, work, batch_size, progress, check,
                          first_recorded)
            if shard_of is not None:
                with st.backend.writing("the shard catalog"):
                    mark_finished(st.commits)
        return IngestSummary(
            model=record.model, store=os.fspath(store), prompts_total=len(prompt_list),
            prompts_new=len(work), prompts_skipped=len(prompt_list) - len(work),
            prompts_truncated=n_truncated, tokens_written=tokens_todo, sites=len(found),
            bytes_stored=plan.bytes_estimate,
            seconds=time.perf_counter() - started, max_rel_error=errors, warnings=warnings,
        )
    finally:  # also when the ingest failed, load's move included
        if frozen:
            gc.unfreeze()
        if home is not None and isinstance(model, nn.Module) and _device_of(model) != home:
            model.to(home)


def _device_of(model: nn.Module) -> torch.device | None:
    """Where a model's first weight lives (None for a model without weights)."""
    return next((p.device for p in model.parameters()), None)


def _logit_sampled(batch: list[Work], batch_size: int) -> bool:
    """Whether `batch` is in the logit check's recorded sample: it holds a prompt whose id
    is a multiple of `_LOGIT_CHECK_EVERY * batch_size` (about one batch in
    `_LOGIT_CHECK_EVERY` when ids run in order), whichever run or shard meets it."""
    every = _LOGIT_CHECK_EVERY * batch_size
    return any(w.prompt_id % every == 0 for w in batch)


def _enter_shard(st: Store, reg: _Registration, records: list[SiteRecord], work: list[Work],
                 shard_of: tuple[int, int]) -> tuple[_Registration, list[Work]]:
    """Under the shards' registration lock: plan, refuse beside shards of another plan,
    register a new model now, size the arrays to the plan's end, open (or create) this
    shard's catalog; then this shard's registration
    (its own committed rows) and the prompts it has still to run."""
    record = reg.record
    align = write_alignment(record.chunk_tokens, sharded=st.arrays.sharded)
    plan, mine = plan_shard(work, model=record.model, shard=shard_of[0], n_shards=shard_of[1],
                            base=record.n_rows, align=align)
    # Before anything is written: shards of another plan (another N, prompts file or store
    # state) own rows this plan would overwrite.
    others = other_plans(st, plan.fingerprint)
    if others:
        raise IngestError(
            f"store {st.location!r} has shard ingests of another plan ({', '.join(others)}: "
            "another shard count, prompts file or model); finish them and run `actdb merge`, "
            f"or rerun this shard with their arguments"
        )
    if reg.write is not None:
        reg.write()
    st.reserve_rows(record, records, plan.total_end)  # only ever grows: racing shards agree
    # Its own catalog, if it exists, was among those checked: it follows this plan.
    cat = st.open_shard(lambda path: create_shard_catalog(path, st.catalog, record, plan))
    mine_record = cat.model(record.model)
    assert mine_record is not None
    done = cat.ingested_prompt_ids(record.model)
    return (replace(reg, record=mine_record, write=None),
            [w for w in mine if w.prompt_id not in done])


def _length_limit(loaded: LoadedModel, max_length: int | None) -> int | None:
    if max_length is not None:
        return max_length
    config = getattr(loaded.model, "config", None)
    limits = [getattr(config, "max_position_embeddings", None),
              getattr(loaded.tokenizer, "model_max_length", None)]
    sane = [int(v) for v in limits if isinstance(v, int) and 0 < v < 1_000_000]
    return min(sane) if sane else None


def _tokenize(tok: Any, texts: list[str], limit: int | None, *, special: bool = True
              ) -> tuple[list[list[int]], list[bool]]:
    full = tok(texts, add_special_tokens=special, verbose=False)["input_ids"]
    truncated = [limit is not None and len(f) > limit for f in full]
    if any(truncated):
        cut = tok(texts, add_special_tokens=special, truncation=True,
                  max_length=limit)["input_ids"]
        full = [c if t else f for f, c, t in zip(full, cut, truncated, strict=True)]
    return [list(map(int, f)) for f in full], truncated


def _pad(loaded: LoadedModel, ids: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(len(i) for i in ids)
    pad = loaded.tokenizer.pad_token_id or 0
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, row in enumerate(ids):
        input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = 1
    return {"input_ids": input_ids.to(loaded.device), "attention_mask": mask.to(loaded.device)}


def _probe_batch(loaded: LoadedModel, ids: list[list[int]], length: int
                 ) -> dict[str, torch.Tensor]:
    """3 unpadded rows of `length` real tokens (the prompts' own, cycled): sizes chosen so
    that batch, length and a head count are unlikely to collide, and two lengths tell apart
    the token axis where they do."""
    pool = [t for row in ids for t in row] or [int(loaded.tokenizer.eos_token_id or 0)]
    rows = [[pool[(r * length + j) % len(pool)] for j in range(length)] for r in range(3)]
    return _pad(loaded, rows)


def _lm_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(getattr(head, "weight", None), torch.Tensor) else None


def _bytes_per_token(s: SiteRecord) -> int:
    heads = s.n_heads or 1
    return heads * (2 * s.d + 8)


def _vocab_table(tok: Any, size: int) -> pa.Table:
    n = min(size, len(tok))
    pieces = tok.convert_ids_to_tokens(list(range(n)))
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer decodes the whole vocabulary in one call
        texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    else:
        texts = tok.batch_decode([[i] for i in range(n)], clean_up_tokenization_spaces=False)
    pad = size - n
    return pa.table({
        "token_id": pa.array(range(size), pa.int32()),
        "token": pa.array(list(texts) + [None] * pad, pa.string()),
        "piece": pa.array([str(p) for p in pieces] + [None] * pad, pa.string()),
    })


def _weights(model: Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, bool]:
    """(embedding, untied LM head, its bias, whether the head is the embedding), float32 on
    the host, as a new model's registration stores them."""
    tensors = {name: t for _, name, t in _model_weights(model)}

    def host(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.detach().float().cpu().numpy()

    embed = host(tensors["embed"])
    assert embed is not None
    tied = "lm_head" in tensors and tensors["lm_head"] is None
    return embed, host(tensors.get("lm_head")), host(tensors.get("lm_head_bias")), tied


@dataclass(frozen=True, kw_only=True)
class _Registration:
    record: ModelRecord
    # Each token id decoded alone; a new model's are filled in by `write`, which decodes the
    # vocabulary on the commit thread, before any batch's token rows are made there.
    token_str: list[str | None]
    weight_bytes: int = 0
    write: Callable[[], None] | None = None  # a new model's weights, tokenizer and rows


def _check_same_weights(st: Store, existing: ModelRecord, loaded: LoadedModel,
                        found: list[FoundSite], sites: list[SiteRecord]) -> None:
    """Resuming adds rows read with the stored weights: refuse a model whose parameters
    differ from the stored model's digest, or (in stores from before the digest, and to
    name the part) whose embedding, LM head or measured norm gains and biases differ from
    the stored ones (another checkpoint under the same name), which would otherwise give
    silently wrong answers (its logits read with the first checkpoint's head). Version-1
    sites stored raw weights: their norms not compared."""
    dtype = str(loaded.dtype).removeprefix("torch.")

    def refuse(what: str) -> IngestError:
        if dtype != existing.dtype:  # the same checkpoint, most likely, in another dtype
            return IngestError(
                f"model {existing.model!r} is already in the store with other weights ({what} "
                f"differs): it is loaded as {dtype}, the stored rows came from "
                f"{existing.dtype}: pass --dtype {existing.dtype}, or --name to store this one "
                "under another name")
        return IngestError(
            f"model {existing.model!r} is already in the store with other weights ({what} "
            "differs): pass --name to store this one under another name")

    digest = None if existing.params_digest is None else params_digest(loaded.model)
    if digest is not None and digest == existing.params_digest:
        return  # every parameter as stored: the weights and norms compared below among them
    # A store without the digest, or another model: the parts said by name where they differ.
    for what, name, value in _model_weights(loaded.model):
        stored = st.arrays.weight_blocks(existing.model_id, name)
        if (stored is None) != (value is None):
            raise refuse(f"its {what}")
        if stored is None or value is None:
            continue
        shape, blocks = stored
        if shape != tuple(value.shape):
            raise refuse(f"its {what}")
        for lo, block in blocks:  # a chunk at a time: a large vocabulary's are gigabytes
            rows = value[lo:lo + len(block)].detach().float().cpu().numpy()
            if not _same_values(block, rows):
                raise refuse(f"its {what}")
    stored_sites = {s.site: s for s in sites}
    for f in found:
        if stored_sites[f.record.site].centered is None:
            continue
        for part, site_value in (("gain", f.gain), ("bias", f.bias)):
            stored_part = st.arrays.weight(existing.model_id, f"sites/{f.record.site}/{part}",
                                           required=False)
            same = (site_value is None) == (stored_part is None) and (
                site_value is None or stored_part is None or (
                    stored_part.shape == tuple(site_value.shape)
                    and _same_values(stored_part, site_value.float().numpy())))
            if not same:
                raise refuse(f"the {part} of site {f.record.site!r}")
    if digest is not None:  # it differs, and not in the parts compared above
        raise refuse("a parameter beyond the embedding, head and norms")


def params_digest(model: nn.Module) -> str:
    """A digest of every parameter's name, dtype, shape and bytes (a CRC-32C of each tensor's
    bytes, about 14 GB/s, a tensor at a time on the host): what a resume under a stored name
    must bring again. Another checkpoint (a merged LoRA changes attention and MLP weights
    alone) or dtype gives another digest."""
    import hashlib

    import crc32c

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        data = p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
        h.update(f"{name}\0{p.dtype}\0{tuple(p.shape)}\0{crc32c.crc32c(data.data)}\n".encode())
    return h.hexdigest()


def _model_weights(model: Any) -> list[tuple[str, str, torch.Tensor | None]]:
    """(what it is, its array's name, the model's tensor) of the weights `_weights` stores:
    the embedding, and an untied LM head and its bias."""
    emb: Any = model.get_input_embeddings()
    head: Any = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor):
        return [("embedding", "embed", emb.weight)]
    b = getattr(head, "bias", None)
    return [("embedding", "embed", emb.weight),
            ("LM head", "lm_head", None if w.data_ptr() == emb.weight.data_ptr() else w),
            ("LM head's bias", "lm_head_bias", b if isinstance(b, torch.Tensor) else None)]


def _same_values(stored: np.ndarray, value: np.ndarray) -> bool:
    """The same weight up to a float32 round trip (exact first: the usual case, and cheap)."""
    return bool(np.array_equal(stored, value) or np.allclose(stored, value, rtol=1e-4,
                                                             atol=1e-6))


def _register(
    st: Store, loaded: LoadedModel, found: list[FoundSite], n_layers: int, name: str,
    sites_glob: str | None, limit: int | None, chunk_tokens: int | None,
    transform: LogitTransform | None,
) -> _Registration:
    """The model's catalog record, and for a new model the work of registering it: that
    runs first on the commit thread, overlapping the first forward passes."""
    records = [f.record for f in found]
    # What the catalog says, read on one connection (each open of the file replays its log:
    # 25-80 ms); the comparisons below run with the file closed, since readers in other
    # processes wait while it is open. A new model's vocabulary is decoded on the commit
    # thread (`write`).
    with st.catalog.session():
        existing = st.catalog.model(name)
        stored = st.catalog.sites(name) if existing is not None else []
        known = st.catalog.token_strings(name) if existing is not None else []
        model_id = st.catalog.next_model_id() if existing is None else -1
    if existing is not None:
        # Sites are the same modules; their names are the store's (a store written before the
        # final sites were renamed keeps `final` and `final_2` where a new one says `final_1`
        # and `final`).
        have = [(s.module, s.d, s.n_heads) for s in stored]
        want = [(s.module, s.d, s.n_heads) for s in records]
        if have != want:
            renamed = "" if existing.final_site in (None, "final") else (
                f" (the store names the norm its LM head reads {existing.final_site!r}, as "
                "versions before the final sites were renamed did; --sites now names it "
                "'final', and the final sites before it 'final_1', 'final_2', ...)")
            raise IngestError(
                f"model {name!r} is already in the store with other sites{renamed}; "
                "pass --name to store this one under another name"
            )
        found[:] = [dataclasses.replace(f, record=dataclasses.replace(
            f.record, site=s.site, site_id=s.site_id, role=s.role, layer=s.layer))
            for f, s in zip(found, stored, strict=True)]
        _check_same_weights(st, existing, loaded, found, stored)
        return _Registration(record=existing, token_str=known)
    model = loaded.model
    embed, lm_head, lm_bias, tied = _weights(model)
    config = getattr(model, "config", None)
    d_model = int(getattr(config, "hidden_size", 0) or embed.shape[1])
    vocab_size = (lm_head.shape[0] if lm_head is not None else embed.shape[0])
    final = next((s.site for s in reversed(records) if s.role == "final"), None)
    widest = max(s.d * (s.n_heads or 1) for s in records)
    record = ModelRecord(
        model=name, model_id=model_id, source=loaded.source,
        revision=loaded.revision,
        architecture=(getattr(config, "architectures", None) or [type(model).__name__])[0],
        d_model=d_model, n_layers=n_layers, vocab_size=int(vocab_size), n_sites=len(records),
        has_lm_head=lm_head is not None or tied, has_lm_head_bias=lm_bias is not None,
        tied_embeddings=tied, final_site=final, dtype=str(loaded.dtype).removeprefix("torch."),
        max_length=limit, sites_glob=sites_glob,
        chunk_tokens=chunk_tokens or default_chunk_tokens(widest), n_rows=0,
        logit_softcap=transform.softcap if transform else None,
        logit_scale=transform.scale if transform else None,
        config=config.to_dict() if config is not None and hasattr(config, "to_dict") else {},
    )
    params = {
        f.record.site: (
            f.gain.float().numpy() if f.gain is not None else None,
            f.bias.float().numpy() if f.bias is not None else None,
        )
        for f in found
    }
    token_str: list[str | None] = []

    def write() -> None:
        vocab = _vocab_table(loaded.tokenizer, max(vocab_size, len(loaded.tokenizer)))
        token_str[:] = vocab.column("token").to_pylist()
        st.save_tokenizer(record.model_id, loaded.tokenizer.save_pretrained)
        digested = dataclasses.replace(record, params_digest=params_digest(model))
        st.register_model(digested, records, embed=embed, lm_head=lm_head,
                          lm_head_bias=lm_bias, site_params=params, vocab=vocab)

    weight_bytes = sum(a.nbytes for a in (embed, lm_head, lm_bias) if a is not None)
    weight_bytes += sum(a.nbytes for pair in params.values() for a in pair if a is not None)
    return _Registration(record=record, token_str=token_str,
                         weight_bytes=weight_bytes, write=write)


def _plan_work(
    st: Store, model: str, prompts: list[Prompt], ids: list[list[int]], truncated: list[bool]
) -> tuple[list[Work], dict[str, int]]:
    """The prompts still to run, and the ids of those texts the store already holds."""
    with st.catalog.session():  # three reads, one open of the file
        known = st.catalog.prompt_ids([p.text for p in prompts])
        done = st.catalog.ingested_prompt_ids(model)
        next_id = st.catalog.next_prompt_id()
    assigned: dict[str, int] = {}
    work = []
    for p, i, t in zip(prompts, ids, truncated, strict=True):
        if p.text in assigned:
            continue  # the same text twice in one input is one prompt
        pid = known.get(p.text)
        if pid is None:
            pid, next_id = next_id, next_id + 1
        assigned[p.text] = pid
        if pid not in done and len(i) > 0:
            work.append(Work(prompt_id=pid, prompt=p, ids=i, truncated=t,
                              new_prompt=p.text not in known))
    columns = extra_columns([w.prompt for w in work if w.new_prompt])
    if columns:
        st.catalog.add_prompt_columns(columns)
    return work, known


def _same_field(a: Any, b: Any) -> bool:
    """Whether two values of a prompt field are the same: NaN is NaN (a missing value of a
    DataFrame's records), and numbers compare as numbers."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return bool(a == b)


def _fields_not_stored(st: Store, prompts: list[Prompt], known: dict[str, int]) -> list[str]:
    """Sentences on the input's prompt fields that the store will not hold, each text being
    one prompt: fields of a text repeated in the input that differ from its first
    occurrence's, and fields of a prompt already stored (`known`: text -> id, from
    `_plan_work`) that differ from its stored ones (the stored prompt keeps its own). Called
    after `_plan_work`, so new prompts' columns exist."""
    first: dict[str, Prompt] = {}
    repeated = []
    for p in prompts:
        f = first.setdefault(p.text, p)
        if f is not p and (p.extra.keys() != f.extra.keys() or not all(
                _same_field(v, f.extra[k]) for k, v in p.extra.items())):
            repeated.append(p)
    out = []
    if repeated:
        out.append(f"{len(repeated)} prompts repeat an earlier prompt's text with other fields "
                   f"(first: {repeated[0].text[:40]!r}): a text is one prompt, stored with the "
                   "fields it first came with")
    with_fields = [p for p in first.values() if p.extra and p.text in known]
    if not with_fields:
        return out
    with st.catalog.session():
        names = sorted({k for p in with_fields for k in p.extra})
        types = {k.lower(): v for k, v in st.catalog.prompt_columns().items()}
        stored = st.catalog.prompt_fields(sorted({known[p.text] for p in with_fields}), names)
    differ: dict[str, int] = {}
    for p in with_fields:
        have = {k.lower(): v for k, v in stored.get(known[p.text], {}).items()}
        for k, v in p.extra.items():
            new = column_value(v, types.get(k.lower(), ""))  # as the column holds it
            if new is not None and not _same_field(new, have.get(k.lower())):
                differ[k] = differ.get(k, 0) + 1
    if differ:
        fields = ", ".join(f"{k} ({n} prompt{'s' if n > 1 else ''})"
                           for k, n in sorted(differ.items()))
        out.append("prompts already in the store keep the fields they were stored with; this "
                   f"input gives other values for {fields}: to attach new fields, join a table "
                   "(actdb query --table, db.register)")
    return out


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


@contextmanager
def _drained(committer: ThreadPoolExecutor, also: Callable[[], list[Future[Any]]] = list
             ) -> Iterator[ThreadPoolExecutor]:
    """The commit thread, and the writes `also` names, waited for on the way out however the
    ingest ends: a second Ctrl-C while a commit is being written is ignored until it has
    finished, since the store's lock is released once this returns and nothing may write
    after that."""
    try:
        yield committer
    finally:
        # Commits run one at a time in order, so a no-op queued last is done when they are.
        # Waiting on its future, not on the thread: a join interrupted by Ctrl-C marks the
        # thread as ended while it still runs (CPython bpo-45274), and a second join returns.
        last = committer.submit(lambda: None)
        while True:
            try:
                wait([last, *also()])
                break
            except KeyboardInterrupt:
                continue
        committer.shutdown(wait=False)


def _write_ahead(st: Store, record: ModelRecord, start: int,
                 ahead: dict[str, Future[tuple[int, int]]], site: str,
                 direction: np.ndarray) -> None:
    ahead[site] = st.write_ahead(record, site, start, direction)


def _run(
    st: Store, loaded: LoadedModel, reg: _Registration, found: list[FoundSite],
    work: list[Work], batch_size: int, progress: bool, check: LogitCheck | None,
    first_recorded: bool,
) -> dict[str, float]:
    record, token_str = reg.record, reg.token_str
    records = [f.record for f in found]
    start = record.n_rows
    # The base model alone where every site is inside it; the whole model where a site is in
    # the LM head (BERT- and RoBERTa-style causal LMs), whose norm must then see every position.
    paths = [p for f in found for p, _ in f.hooks]
    backbone = forward_module(loaded.model, paths)
    extra = _forward_kwargs(backbone)
    total = sum(len(w.ids) for w in work)
    group_rows = max(record.chunk_tokens, _FLUSH_TOKENS)
    # A group is flushed once it holds group_rows rows: at most group_rows - 1 and a batch.
    largest = max((sum(len(w.ids) for w in work[i : i + batch_size])
                   for i in range(0, len(work), batch_size)), default=0)
    sink = SiteSink(found, loaded.device, rows=min(group_rows - 1 + largest, total))
    worst: dict[str, float] = {}
    # Batches are buffered up to one chunk of rows (in the sink), then written and committed
    # together: fewer partial-chunk rewrites, and each commit is still all-or-nothing.
    pending: list[tuple[list[Work], dict[str, float], float | None]] = []
    full_extra = _forward_kwargs(loaded.model)
    # The checked batches' logits at their few positions only, unless a site's norm follows
    # the cut (in the LM head): it must see every position, as the other batches' runs do.
    keeps = (not outside_base(loaded.model, paths)
             and "logits_to_keep" in inspect.signature(loaded.model.forward).parameters)

    def commit(works: list[Work], acts: dict[str, ActBatch], errors: dict[str, float],
               logit_error: float | None, start: int,
               ahead: dict[str, Future[tuple[int, int]]]) -> None:
        # On the commit thread: the token strings of a new model are known there, once its
        # registration (the first job) has decoded the vocabulary.
        if not token_str:  # rows of missing token strings would be stored silently
            raise RuntimeError("a batch was committed before its model's vocabulary was read")
        new_prompts, runs, tokens = batch_tables(works, start, token_str)
        st.commit_batch(record, start=start, acts=acts, new_prompts=new_prompts,
                        prompt_runs=runs, tokens=tokens, site_errors=errors,
                        logit_error=logit_error, ahead=ahead)

    def flush(ahead: dict[str, Future[tuple[int, int]]]) -> int:
        works = [w for p in pending for w in p[0]]
        errors: dict[str, float] = {}
        logit_errors = [p[2] for p in pending if p[2] is not None]
        for p in pending:
            for k, v in p[1].items():
                errors[k] = max(errors.get(k, 0.0), v)
        pending.clear()
        for k, v in errors.items():
            worst[k] = max(worst.get(k, 0.0), v)
        # Writes and commit run in the background while the next batches go through the
        # model; one flush at a time, in order, so commits keep the protocol's order. The
        # sink's other buffers, which the next batches fill, are the ones the previous commit
        # wrote: it must be done first.
        acts = sink.take()
        if in_flight:
            in_flight.pop().result()
        in_flight.append(committer.submit(
            commit, works, acts, errors, max(logit_errors) if logit_errors else None, start,
            ahead))
        return start + sum(len(w.ids) for w in works)

    in_flight: list[Future[Any]] = []
    committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actdb-commit")
    bar = progress_bar(total, f"ingest {record.model}", enabled=progress)
    # Registering a new model and sizing its arrays only need to be done before the first
    # write: they run first on the commit thread, alongside the first forward passes.
    def prepare() -> None:
        if reg.write is not None:
            reg.write()
        st.reserve_rows(record, records, start + total)

    in_flight.append(committer.submit(prepare))
    ahead: dict[str, Future[tuple[int, int]]] = {}  # the last batch's writes ahead (below)
    hooks = {p: m for f in found for p, m in f.hooks}
    with _drained(committer, lambda: list(ahead.values())), bar, on_norm_io(hooks, sink):
        buffered = 0
        for i in range(0, len(work), batch_size):
            batch = work[i : i + batch_size]
            inputs = _pad(loaded, [w.ids for w in batch])
            mask = inputs["attention_mask"].bool()
            sink.start(mask)
            # The last batch is committed alone (below) and nothing overlaps that commit: the
            # direction chunks it fills whole are written while its forward pass still runs,
            # each site's once its hook has stored and checked them. The arrays exist: the
            # flush before it waited for `prepare`.
            ahead = {}
            if i > 0 and i + batch_size >= len(work) and buffered == 0:
                sink.on_site = functools.partial(_write_ahead, st, record, start, ahead)
            logit_error = None
            # The first batch of every run (a guard before anything is stored) and a sample
            # also run the LM head, at a few positions, so that logits recomputed from the
            # store are compared with the model's own. Only the sample (and the model's very
            # first batch) is recorded: what a run checks beyond it must not change the store.
            recorded = _logit_sampled(batch, batch_size) or (i == 0 and first_recorded)
            checked = check is not None and (i == 0 or recorded)
            with torch.no_grad():
                if check is not None and checked:
                    positions = check.positions(mask.shape[1])
                    kw = {"logits_to_keep": positions.to(loaded.device)} if keeps else {}
                    out = loaded.model(**inputs, **full_extra, **kw)
                    real = model_logits(out)
                    real = real if keeps else real[:, positions.to(real.device)]
                else:
                    backbone(**inputs, **extra)
            missing = [s.site for s in records if s.site not in sink.out]
            if missing:
                raise IngestError(f"sites {missing} did not run in the forward pass")
            if check is not None and checked:
                logit_error = check.error(real, sink.out[check.final.record.site], mask,
                                          positions)
                if not logit_error <= LOGIT_LIMIT:
                    raise IngestError(
                        f"model {record.model!r}: logits recomputed from the stored final-site "
                        f"fields differ from the model's own by {logit_error:.3g} (relative), "
                        f"more than {LOGIT_LIMIT}; nothing of this batch was committed"
                    )
            pending.append((batch, sink.errors, logit_error if recorded else None))
            n = sum(len(w.ids) for w in batch)
            buffered += n
            # Flushed before the last batch as well as after it: the last batch is a group of
            # its own, since its commit is the one that nothing overlaps.
            if buffered >= group_rows or i + 2 * batch_size >= len(work):
                start = flush(ahead)
                buffered = 0
            bar.update(n)
        if in_flight:
            in_flight.pop().result()
    return worst
