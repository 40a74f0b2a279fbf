"""The run loop: each batch of the plan through the model with hooks on its norm sites, the
rows buffered in the sink and committed in groups on a commit thread, in order."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import IngestError
from ..store.lens_layout import LENS_FIELDS
from ..store.records import ModelRecord
from ..store.store import ActBatch, Store
from .attention_pass import batch_attention
from .batches import Batch, pad, to_device
from .capture import on_norm_io
from .fields import SiteSink
from .grids import GridPlan
from .inputs import prepare_inputs
from .lens import LensMaker, LensRows
from .load import LoadedModel
from .logits import LOGIT_LIMIT, LogitCheck
from .multimodal import rows_mask
from .progress import progress_bar
from .register import Registration
from .rows import Work, batch_tables
from .seq2seq import decoder_batch
from .sites import FoundSite, forward_module, outside_base

# Batches are buffered to at least this many token rows before a write and commit: fewer
# DuckDB transactions and partial-chunk rewrites (a crash loses at most this much work).
FLUSH_TOKENS = 2048
# About one batch in this many, logits are recomputed from the store and compared with the
# model's: the LM head runs on a few positions only. The sample is chosen by prompt id (see
# `logit_sampled`), so a killed ingest that is resumed, or an ingest split into shards,
# records the same worst error as one uninterrupted run.
LOGIT_CHECK_EVERY = 16

Ahead = dict[str, Future[tuple[int, int]]]


def logit_sampled(batch: list[Work], batch_size: int) -> bool:
    """Whether `batch` is in the logit check's recorded sample: it holds a prompt whose id
    is a multiple of `LOGIT_CHECK_EVERY * batch_size` (about one batch in
    `LOGIT_CHECK_EVERY` when ids run in order), whichever run or shard meets it."""
    every = LOGIT_CHECK_EVERY * batch_size
    return any(w.prompt_id % every == 0 for w in batch)


def forward_kwargs(model: nn.Module) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


@contextmanager
def drained(committer: ThreadPoolExecutor, also: Callable[[], list[Future[Any]]] = list
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


def _write_ahead(st: Store, record: ModelRecord, start: int, ahead: Ahead, site: str,
                 direction: np.ndarray) -> None:
    ahead[site] = st.write_ahead(record, site, start, direction)


class BatchRunner:
    """One run over a plan's batches into a store, from the model's row `reg.record.n_rows`.

    Batches are buffered up to a group of rows in the sink, then written and committed
    together on the commit thread while the next batches go through the model: fewer
    partial-chunk rewrites, and each commit is still all-or-nothing. One group is in flight
    at a time, so commits keep the protocol's order."""

    def __init__(self, st: Store, loaded: LoadedModel, reg: Registration,
                 found: list[FoundSite], batches: list[Batch], *, batch_size: int,
                 progress: bool, check: LogitCheck | None, first_recorded: bool,
                 grids: GridPlan | None = None,
                 backbone: nn.Module | None = None, attention: bool = False,
                 lens: LensMaker | None = None) -> None:
        """`backbone`: the module the batches run through where it is not the model's
        base (a contrastive model's vision tower); the logit check runs the whole model.
        `attention`: also each prompt's attention weights (attention_pass.py). `lens`: what
        computes the materialized lens of each batch's rows (lens.py)."""
        self.st, self.loaded, self.reg, self.found = st, loaded, reg, found
        self.attention = attention
        self._attending = False  # the attention pass runs: the sink takes nothing
        self.batches, self.batch_size, self.progress = batches, batch_size, progress
        self.check, self.first_recorded = check, first_recorded
        self.lens = lens
        self.lens_pending: list[dict[str, LensRows]] = []  # each pending batch's lens rows
        self.record = reg.record
        self.records = [f.record for f in found]
        self.start = self.record.n_rows  # the next group's first row
        self.total = sum(w.n_rows for b in batches for w in b)
        self.group_rows = max(self.record.chunk_tokens, FLUSH_TOKENS)
        # A group is flushed once it holds group_rows rows: at most group_rows - 1 and a batch.
        largest = max((sum(w.n_rows for w in b) for b in batches), default=0)
        self.grids = grids
        self.sink = SiteSink(found, loaded.device, grids=grids,
                             rows=min(self.group_rows - 1 + largest, self.total))
        self.worst: dict[str, float] = {}
        self.pending: list[tuple[list[Work], dict[str, float], float | None,
                                 dict[int, np.ndarray]]] = []
        self.in_flight: list[Future[Any]] = []
        self.committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actdb-commit")
        # The base model alone where every site is inside it; the whole model where a site is
        # in the LM head (BERT- and RoBERTa-style causal LMs), whose norm must then see every
        # position.
        paths = [p for f in found for p, _ in f.hooks]
        self.backbone = backbone or forward_module(loaded.model, paths)
        self.extra = forward_kwargs(self.backbone)
        self.full_extra = forward_kwargs(loaded.model)
        # The checked batches' logits at their few positions only, unless a site's norm
        # follows the cut (in the LM head): it must see every position, as the other
        # batches' runs do.
        self.keeps = (not outside_base(loaded.model, paths)
                      and "logits_to_keep" in inspect.signature(loaded.model.forward).parameters)

    def run(self) -> dict[str, float]:
        """Run every batch and commit it; the worst faithfulness error per site."""
        bar = progress_bar(self.total, f"ingest {self.record.model}", enabled=self.progress)
        # Registering a new model and sizing its arrays only need to be done before the first
        # write: they run first on the commit thread, alongside the first forward passes.
        self.in_flight.append(self.committer.submit(self._prepare))
        ahead: Ahead = {}  # the last batch's writes ahead (below)
        hooks = {p: m for f in self.found for p, m in f.hooks}
        n_batches = len(self.batches)
        with drained(self.committer, lambda: list(ahead.values())), bar, \
                on_norm_io(hooks, self._capture):
            buffered = 0
            for k, batch in enumerate(self.batches):
                # The last batch is committed alone (below) and nothing overlaps that commit:
                # the direction chunks it fills whole are written while its forward pass still
                # runs, each site's once its hook has stored and checked them. The arrays
                # exist: the flush before it waited for `_prepare`.
                ahead = {}
                write_ahead = k > 0 and k == n_batches - 1 and buffered == 0
                self._forward(k, batch, ahead if write_ahead else None)
                n = sum(w.n_rows for w in batch)
                buffered += n
                # Flushed before the last batch as well as after it: the last batch is a group
                # of its own, since its commit is the one that nothing overlaps.
                if buffered >= self.group_rows or k + 2 >= n_batches:
                    self._flush(ahead)
                    buffered = 0
                bar.update(n)
            if self.in_flight:
                self.in_flight.pop().result()
        return self.worst

    def _capture(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if not self._attending:  # the attention pass reruns the batch: its norms are seen
            self.sink(name, x, y)

    def _attention(self, batch: Batch, inputs: dict[str, torch.Tensor]
                   ) -> dict[int, np.ndarray]:
        """The batch's prompts' attention weights, by prompt id (a second pass)."""
        if not self.attention:
            return {}
        self._attending = True
        try:
            got = batch_attention(self.loaded.model, self.backbone, inputs, self.extra,
                                  [len(w.ids) for w in batch], self.record.model)
        finally:
            self._attending = False
        return {w.prompt_id: a for w, a in zip(batch, got, strict=True)}

    def _prepare(self) -> None:
        if self.reg.write is not None:
            self.reg.write()
        self.st.reserve_rows(self.record, self.records, self.start + self.total)

    def _forward(self, k: int, batch: Batch, ahead: Ahead | None) -> None:
        """One batch through the model; its rows stay in the sink, pending a flush."""
        loaded, sink, check, record = self.loaded, self.sink, self.check, self.record
        tokens = None
        if batch[0].positions is not None:  # media: every input gives as many positions
            inputs = to_device(loaded, prepare_inputs(
                loaded.processor, [w.prompt for w in batch], self.reg.record.model,
                loaded.model))
            mask = rows_mask([len(w.ids) for w in batch], loaded.device)
            if self.grids is not None and self.grids.tokens:  # text and images together
                tokens = inputs["attention_mask"].bool()
                made = [int(n) + self.grids.per_input for n in tokens.sum(dim=1).tolist()]
                if made != [len(w.ids) for w in batch]:
                    raise IngestError(
                        f"model {record.model!r}: its processor made other sequences for "
                        "these inputs than it did when they were planned")
        else:
            inputs = pad(loaded, [w.ids for w in batch])
            mask = inputs["attention_mask"].bool()
        towers: list[tuple[str | None, torch.Tensor]] | None = None
        if batch[0].decoder is not None:  # an encoder-decoder: its encoder's rows, then its
            # decoder's; the LM head reads the decoder's
            config = getattr(loaded.model, "config", None)
            decoder = decoder_batch([w.decoder or [] for w in batch],
                                    int(getattr(config, "pad_token_id", None) or 0),
                                    loaded.device)
            inputs = {**inputs, **decoder}
            towers = [("encoder", mask), ("decoder", decoder["decoder_attention_mask"].bool())]
            mask = towers[1][1]
        sink.start(mask, towers, tokens)
        sink.on_site = (None if ahead is None else
                        functools.partial(_write_ahead, self.st, record, self.start, ahead))
        logit_error = None
        # The first batch of every run (a guard before anything is stored) and a sample also
        # run the LM head, at a few positions, so that logits recomputed from the store are
        # compared with the model's own. Only the sample (and the model's very first batch)
        # is recorded: what a run checks beyond it must not change the store.
        recorded = logit_sampled(batch, self.batch_size) or (k == 0 and self.first_recorded)
        checked = check is not None and (k == 0 or recorded)
        with torch.no_grad():
            if check is not None and checked:
                positions = check.positions((mask if tokens is None else tokens).shape[1])
                kw = {"logits_to_keep": positions.to(loaded.device)} if self.keeps else {}
                out = loaded.model(**inputs, **check.inputs, **self.full_extra, **kw)
                real = check.read(out)
                if real.dim() == 2:  # a classifier's logits: one row an input
                    real = real.unsqueeze(1)
                else:
                    real = real if self.keeps else real[:, positions.to(real.device)]
            else:
                self.backbone(**inputs, **self.extra)
        missing = [s.site for s in self.records if s.site not in sink.out]
        if missing:
            raise IngestError(f"sites {missing} did not run in the forward pass")
        if check is not None and checked:
            final = check.final.record.site
            logit_error = check.error(real, sink.out[final], sink.mask_of(final), positions)
            if not logit_error <= LOGIT_LIMIT:
                raise IngestError(
                    f"model {record.model!r}: logits recomputed from the stored final-site "
                    f"fields differ from the model's own by {logit_error:.3g} (relative), "
                    f"more than {LOGIT_LIMIT}; nothing of this batch was committed"
                )
        if self.lens is not None:
            lens_rows = self.lens.batch(sink.out)
            if check is not None and checked:
                final = check.final.record.site
                self.lens.check(self.lens.error(real, lens_rows[final], sink.mask_of(final),
                                                positions), record.model)
            self.lens_pending.append(lens_rows)
        self.pending.append((batch, sink.errors, logit_error if recorded else None,
                             self._attention(batch, inputs)))

    def _flush(self, ahead: Ahead) -> None:
        """Hand the pending batches' rows to the commit thread."""
        batches = [p[0] for p in self.pending]
        works = [w for b in batches for w in b]
        errors: dict[str, float] = {}
        logit_errors = [p[2] for p in self.pending if p[2] is not None]
        attention = {pid: a for p in self.pending for pid, a in p[3].items()}
        for p in self.pending:
            for k, v in p[1].items():
                errors[k] = max(errors.get(k, 0.0), v)
        self.pending.clear()
        for k, v in errors.items():
            self.worst[k] = max(self.worst.get(k, 0.0), v)
        # The sink's other buffers, which the next batches fill, are the ones the previous
        # commit wrote: it must be done first.
        acts = self.sink.take()
        if self.lens_pending:  # each lens site's rows of the group, beside its vectors
            acts = {site: dataclasses.replace(a, lens={
                name: np.concatenate([b[site][name] for b in self.lens_pending])
                for name in LENS_FIELDS}) if site in self.lens_pending[0] else a
                for site, a in acts.items()}
            self.lens_pending = []
        if self.in_flight:
            self.in_flight.pop().result()
        self.in_flight.append(self.committer.submit(
            self._commit, batches, acts, errors, max(logit_errors) if logit_errors else None,
            self.start, ahead, attention))
        self.start += sum(w.n_rows for w in works)

    def _commit(self, batches: list[Batch], acts: dict[str, ActBatch], errors: dict[str, float],
                logit_error: float | None, start: int, ahead: Ahead,
                attention: dict[int, np.ndarray]) -> None:
        """On the commit thread: the token strings of a new model are known there, once its
        registration (the first job) has decoded the vocabulary."""
        token_str = self.reg.token_str
        if not token_str:  # rows of missing token strings would be stored silently
            raise RuntimeError("a batch was committed before its model's vocabulary was read")
        new_prompts, runs, tokens = batch_tables(batches, start, token_str)
        self.st.commit_batch(self.record, start=start, acts=acts, new_prompts=new_prompts,
                             prompt_runs=runs, tokens=tokens, site_errors=errors,
                             logit_error=logit_error, ahead=ahead, attention=attention)
