"""One process's ingest, a whole ingest or one shard of a sharded one: load the model, find
its norm sites and logit transform, register it in the store, plan the batches, run them."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import IngestError
from ..store.lens_layout import lens_sites
from ..store.records import ModelRecord, SiteRecord
from ..store.shard_catalogs import mark_finished, pending_shards, shard_name
from ..store.store import Store
from .batches import cycled, length_limit, plan_batches, probe_batch, to_device, tokenize
from .grids import GridPlan, grid_positions, plan_grids
from .heads import ClassifierHead, find_classifier, prove_head
from .inputs import Positions, check_inputs, prepare_inputs, read_inputs
from .labels import (
    DEFAULT_TEMPLATE,
    Contrastive,
    LabelsHead,
    check_template,
    find_contrastive,
    labels_logits,
    prove_labels,
    read_labels,
)
from .lens import LensMaker, lens_default
from .load import LoadedModel, load
from .logits import LogitCheck, LogitFit, LogitTransform, measure_logits
from .multimodal import mixed_rows
from .options import IngestOptions, IngestPlan, IngestSummary
from .padding import depends_on_padding, padding_change
from .prompts import Prompt, apply_chat_template
from .register import register
from .run import BatchRunner, forward_kwargs
from .seq2seq import decoder_ids, is_encoder_decoder, probe_decoder, target_limit
from .shards import enter_shard, nothing_to_do
from .sites import FoundSite, find_sites, norm_modules_of
from .work import fields_not_stored, plan_work

_HEAD_SITES = 3  # sites a classification head's proof tries, from the last


@dataclass(frozen=True, kw_only=True)
class ModelSetup:
    """What an ingest knows of its model and prompts before it opens the store."""

    loaded: LoadedModel
    name: str  # the model's name in the store
    prompts: list[Prompt]
    ids: list[list[int]]  # each prompt's token ids
    truncated: list[bool]
    limit: int | None  # the most tokens a prompt keeps
    found: list[FoundSite]
    n_layers: int
    head: nn.Module | None  # the LM head
    transform: LogitTransform | None
    final: FoundSite | None  # the final site the LM head reads
    classifier: ClassifierHead | None = None  # an image classifier's head, proven
    head_note: str | None = None  # why a classifier's head is not stored as anchors
    # what each position of a media input is (each input's where text and images go together)
    labels: Positions | list[Positions] | None = None
    grids: GridPlan | None = None  # where each site's rows lie among a media input's
    towers: dict[str, int] = dataclasses.field(default_factory=dict)  # each tower's depth
    # an encoder-decoder's: the tokens each prompt's decoder reads (`ids` its encoder's)
    decoders: list[list[int]] | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    contrastive: Contrastive | None = None  # a contrastive model over images: its vision tower
    zero_shot: LabelsHead | None = None  # its labels' anchors, proven
    # batches of one prompt length only: the model's activations depend on padding
    by_length: bool = False


def ingest_here(opts: IngestOptions) -> IngestSummary:
    """Run `opts` in this process (`opts.shard`: as that shard); see `actdb.ingest`."""
    prompts = read_inputs(opts.prompts, opts.inputs, opts.images, opts.prompts_format)
    model = opts.model
    # A model object is the caller's: moved to the ingest's device for it, and back after.
    home = _device_of(model) if isinstance(model, nn.Module) and not opts.device_map else None
    frozen = False
    try:
        loaded = load(model, opts.tokenizer, device=opts.device, dtype=opts.dtype,
                      revision=opts.revision, device_map=opts.device_map,
                      processor=opts.processor)
        # The cyclic garbage collector skips what exists by now (torch, transformers and the
        # model: hundreds of thousands of objects), which each full collection would walk
        # again; what the ingest allocates is collected as usual. A process that froze
        # objects itself keeps its own arrangement.
        frozen = not gc.get_freeze_count()
        if frozen:
            gc.freeze()
        return _into_store(opts, set_up(loaded, opts, prompts))
    finally:  # also when the ingest failed, load's move included
        if frozen:
            gc.unfreeze()
        if home is not None and isinstance(model, nn.Module) and _device_of(model) != home:
            model.to(home)


def set_up(loaded: LoadedModel, opts: IngestOptions, prompts: list[Prompt]) -> ModelSetup:
    """Tokenize the prompts, find the model's norm sites and fit its logit transform."""
    name = opts.name or loaded.default_name
    norm_modules_of(loaded.model)  # a model without norms is said first, whatever it reads
    seq2seq = is_encoder_decoder(loaded.model)
    check_inputs(prompts, loaded.model, name)
    media = any(p.media is not None for p in prompts)
    if seq2seq and opts.attention:
        raise IngestError(f"model {name!r} is an encoder-decoder: --attention stores one "
                          "stack's self-attention over a prompt's tokens, and does not yet "
                          "store an encoder-decoder's three kinds; ingest without it")
    if media and opts.attention:
        raise IngestError("--attention stores attention over a prompt's tokens: it is for "
                          "text prompts, not images or other media")
    if media and (opts.chat_template or any(p.media is None for p in prompts)):
        raise IngestError("inputs of text alone and inputs with media go to separate "
                          "ingests (and --chat-template is for text)")
    if opts.chat_template:
        prompts = apply_chat_template(prompts, loaded.tokenizer, name)
    limit = None if media else length_limit(loaded, opts.max_length)
    # Text and images in one input (a multimodal decoder): its text tokens are a grid of their
    # own, as long as each input's sequence (multimodal.py).
    mixed = media and any(p.text for p in prompts)
    if media:  # an input's positions are known once the sites are found (below)
        ids: list[list[int]] = []
        truncated = [False] * len(prompts)
        sample, sample_alt = (
            to_device(loaded, prepare_inputs(loaded.processor, cycled(prompts, n), name,
                                             loaded.model))
            for n in (3, 2))
    else:
        ids, truncated = tokenize(loaded.tokenizer, [p.text for p in prompts], limit,
                                  special=not opts.chat_template)
        sample, sample_alt = probe_batch(loaded, ids, 11), probe_batch(loaded, ids, 7)
    decoders = None
    if seq2seq:  # the decoder reads each input's target, shifted, or its start token
        decoders, cut = decoder_ids(loaded.model, loaded.tokenizer, prompts,
                                    target_limit(loaded.model) if opts.max_length is None
                                    else opts.max_length, name)
        truncated = [a or b for a, b in zip(truncated, cut, strict=True)]
        sample, sample_alt = (probe_decoder(s, decoders, n, loaded.device)
                              for s, n in ((sample, 11), (sample_alt, 7)))
    # A contrastive model reads images with its vision tower alone (its text tower reads the
    # labels, once): the tower is what runs, and its norms are the sites.
    contrastive = find_contrastive(loaded.model) if media else None
    labels, template = _labels_asked(opts, contrastive, media, loaded.model, name)
    head = None if contrastive is not None else _lm_head(loaded.model)
    classifier_module = find_classifier(loaded.model) if head is None else None
    # The logit fit rides on the site-finding's second pass, hooked on the final norm.
    fit = None if head is None else LogitFit(
        head, sample_alt, forward_kwargs(loaded.model), getattr(loaded.model, "config", None))
    towers: dict[str, int] = {}
    found, n_layers = find_sites(
        loaded.model if contrastive is None else contrastive.vision, sample, sample_alt,
        sites_glob=opts.sites, final_probe=fit, depths=towers,
        fixed_towers=("vision", "audio", "projector") if mixed else ())
    if contrastive is not None:  # module paths from the model, as the model's other sites'
        found = [dataclasses.replace(f, record=dataclasses.replace(
            f.record, module=f"{contrastive.vision_path}.{f.record.module}")) for f in found]
    media_positions: Positions | list[Positions] | None = None
    grids = None
    if mixed:
        grids = plan_grids([(f.record.site, f.positions, f.shape, f.layout) for f in found],
                           name,
                           tokens=True)
        found = [dataclasses.replace(f, record=dataclasses.replace(
            f.record, grid=grids.of_site[f.record.site])) for f in found]
        ids, media_positions = mixed_rows(loaded.model, loaded.processor, prompts, grids, name)
    elif media:
        # Sites that see different numbers of positions (stages, a pooled head's norm) each
        # store their rows on their own grid of an input's rows (grids.py).
        # (an encoder-decoder's decoder rows are the tokens it read: the input's positions
        # are its encoder's)
        grids = plan_grids([(f.record.site, f.positions, f.shape, f.layout) for f in found
                            if not (seq2seq and f.record.tower == "decoder")], name)
        if grids.several:
            found = [dataclasses.replace(f, record=dataclasses.replace(
                f.record, grid=grids.of_site[f.record.site])) for f in found]
        media_positions = grid_positions(loaded.model, sample, grids)
        ids = [[-1] * grids.per_input for _ in prompts]
    # The final site whose output the LM head reads: the last of them (sites._final_path).
    final = next((f for f in reversed(found) if f.record.role == "final"), None)
    warnings: list[str] = []
    by_length = False
    if not media and not seq2seq and opts.batch_size > 1:  # text batches are padded
        change = padding_change(loaded, found, ids)
        by_length = depends_on_padding(loaded, change)
        if by_length:
            warnings.append(
                f"model {name!r}: its activations depend on the batch's padding (a prompt's "
                f"norm inputs in a padded batch differ from those it gives alone by "
                f"{change:.2g}, relative): its prompts are batched only with prompts of their "
                "own length, unpadded")
    classifier = None
    head_note = None
    if classifier_module is not None:
        classifier, head_note = _classifier(loaded.model, classifier_module, found, sample)
        if classifier is None and head_note:
            warnings.append(f"model {name!r}: {head_note}")
        elif classifier is not None:
            final = classifier.final  # the site its logits read
    zero_shot = None
    if contrastive is not None and labels is None:
        warnings.append(f"model {name!r} is a contrastive model ingested without --labels: "
                        "it has no anchors (give --labels FILE for a zero-shot lens)")
    elif contrastive is not None and labels is not None:
        tokenizer = loaded.tokenizer or getattr(loaded.processor, "tokenizer", None)
        zero_shot = prove_labels(loaded.model, contrastive, final, sample, tokenizer, labels,
                                 template, name)
        if zero_shot.position is None:
            warnings.append(
                f"model {name!r} pools its image embedding from every position (an attention "
                "head, as SigLIP's): its 'labels' anchors are stored, but no one position's "
                "vector gives its logits, so the logit functions are refused on it")
    transform = None
    if fit is not None and final is not None:
        if fit.ready and fit.path == final.record.module:
            transform = fit.transform(final, name)
        else:  # the site filter left out the norm the fit rode on: a pass of its own
            try:
                transform = measure_logits(loaded.model, sample, final, fit.head, fit.kwargs,
                                           name)
            except IngestError as e:
                if not opts.sites or fit.path is None or fit.path == final.record.module:
                    raise  # not the filter's doing
                raise IngestError(
                    f"model {name!r}: --sites keeps the final site {final.record.site!r} "
                    f"({final.record.module}) but leaves out {fit.path!r}, the norm whose "
                    "output the LM head reads, and the logits cannot be recomputed from the "
                    f"site kept: add {fit.path!r} to --sites") from e
    return ModelSetup(loaded=loaded, name=name, prompts=prompts, ids=ids, truncated=truncated,
                      limit=limit, found=found, n_layers=n_layers, head=head,
                      transform=transform, final=final, classifier=classifier,
                      head_note=head_note,
                      labels=media_positions, towers=towers, warnings=warnings, grids=grids,
                      contrastive=contrastive, zero_shot=zero_shot, decoders=decoders,
                      by_length=by_length)


def _classifier(model: nn.Module, module: nn.Linear, found: list[FoundSite],
                sample: Mapping[str, torch.Tensor]) -> tuple[ClassifierHead | None, str | None]:
    """The classification head, proven on the site its logits read: the final site, else an
    earlier final site (SigLIP's classifier averages `post_layernorm`'s rows, beside its
    attention head's own norm), else, in a post-norm tower without one, the last site (the
    last block's norm gives the last hidden state); or None and the note that says why not
    (None where there is no site to read)."""
    finals = [f for f in reversed(found) if f.record.role == "final"]
    candidates = (finals or found[-1:])[:_HEAD_SITES]
    why = None
    for site in candidates:
        head, reason = prove_head(model, module, site, sample)
        if head is not None:
            return head, None
        why = why or reason  # the last final site's reason: where a head is expected
    return None, None if why is None else f"{why}; stored without the 'classifier' anchors"


def _into_store(opts: IngestOptions, m: ModelSetup) -> IngestSummary:
    """Register the model, plan its batches and run them; the summary."""
    started = time.perf_counter()
    shard_of = opts.shard
    shard_label = shard_name(*shard_of) if shard_of else None
    found, location = m.found, os.fspath(opts.store)
    with Store.open_or_create(opts.store, storage_options=opts.storage_options,
                              shard=shard_label) as st:
        before = st.disk_bytes()["total"]
        if shard_of is None and pending_shards(st):
            raise IngestError(
                f"store {st.location!r} has shard ingests not merged yet "
                f"({', '.join(pending_shards(st))}): finish them and run `actdb merge`, "
                "then ingest"
            )
        if opts.attention and not st.has_digests:
            raise IngestError(f"store {st.location!r} is of format {st.format_version}, "
                              "which records no chunk digests: --attention needs format 5 "
                              "or later (ingest into a new store)")
        reg = register(st, m.loaded, found, m.n_layers, m.name, opts.sites, m.limit,
                       opts.chunk_tokens, m.transform, m.classifier, m.towers,
                       zero_shot=m.zero_shot, contrastive=m.contrastive is not None,
                       head_note=m.head_note,
                       lens=_lens_asked(opts, m),
                       lens_default=lens_default(m.loaded.device) if _has_lens(m) else 0,
                       # the weights' probe passes read token ids alone: not media's
                       weights_from=([t for row in m.ids for t in row if t >= 0]
                                     if m.labels is None else [])
                       if opts.weights == "all" else None)
        # The model's very first batch is part of the recorded sample; a resumed run (its
        # first batch committed, the error with it) or a later shard does not add its own.
        first_recorded = reg.record.logit_max_rel_error is None and (
            shard_of is None or shard_of[0] == 0)
        work, known = plan_work(st, reg.record.model, m.prompts, m.ids, m.truncated, m.labels,
                                m.decoders)
        warnings = m.warnings + fields_not_stored(st, m.prompts, known)
        records = [f.record for f in found]
        # The plan: which prompts share a forward pass, the same for every shard and run.
        batches = plan_batches(work, opts.batch_size, by_length=m.by_length)
        if shard_of is not None:
            if not work:  # no shard catalog: an empty one would block unsharded ingests
                return IngestSummary(
                    model=reg.record.model, store=location, prompts_total=len(m.prompts),
                    prompts_new=0, prompts_skipped=len(m.prompts), prompts_truncated=0,
                    tokens_written=0, sites=len(found), bytes_stored=0, store_bytes=before,
                    seconds=0.0,
                    note=nothing_to_do(st.location, reg.record.model, shard_of))
            reg, batches = enter_shard(st, reg, records, batches, shard_of)
            first_recorded = first_recorded and reg.record.logit_max_rel_error is None
        mine = [w for b in batches for w in b]
        tokens_todo = sum(w.n_rows for w in mine)
        n_truncated = sum(w.truncated for w in mine)  # of the prompts this run stores
        plan = IngestPlan(
            model=reg.record.model, prompts_total=len(m.prompts), prompts_todo=len(mine),
            prompts_truncated=n_truncated, tokens_todo=tokens_todo, sites=len(found),
            bytes_estimate=sum(_bytes_per_token(s) for s in records) * tokens_todo
            + reg.weight_bytes,
        )
        if opts.on_plan:
            opts.on_plan(plan)
        errors = BatchRunner(st, m.loaded, reg, found, batches, batch_size=opts.batch_size,
                             progress=opts.progress, check=_logit_check(m, reg.record),
                             lens=_lens_maker(m, reg.record),
                             first_recorded=first_recorded, grids=m.grids,
                             backbone=m.contrastive.vision if m.contrastive else None,
                             attention=opts.attention).run()
        if shard_of is not None:
            with st.backend.writing("the shard catalog"):
                mark_finished(st.commits)
    # Counted as `actdb info` counts them, once the store is closed (a local catalog's log is
    # folded into its file at close), so that the two say the same.
    after = st.disk_bytes()["total"]
    return IngestSummary(
        model=reg.record.model, store=location, prompts_total=len(m.prompts),
        prompts_new=len(mine), prompts_skipped=len(m.prompts) - len(mine),
        prompts_truncated=n_truncated, tokens_written=tokens_todo, sites=len(found),
        bytes_stored=after - before, store_bytes=after,
        seconds=time.perf_counter() - started,
        max_rel_error=errors, warnings=warnings,
    )


def _logit_check(m: ModelSetup, record: ModelRecord) -> LogitCheck | None:
    """The check of logits recomputed from the store against the model's, if it has a head.
    A model already in the store keeps the final site its logit transform was fitted on
    (stores written before the last final site was chosen may name an earlier one)."""
    final = next((f for f in m.found if f.record.site == record.final_site), m.final)
    z = m.zero_shot
    if z is not None and final is not None and record.head_kind == "labels":
        if z.position is None:
            return None  # no lens: the anchors were proven on the model's own embeddings
        return LogitCheck(final, z.head(), LogitTransform(scale=z.scale, softcap=None,
                                                          error=0.0),
                          m.loaded.device, position=z.position, projection=z.projection,
                          inputs=z.text_inputs, read=labels_logits)
    if m.classifier is not None and final is not None and record.head_kind == "classifier":
        return LogitCheck(final, m.classifier.module, LogitTransform(
            scale=None, softcap=None, error=0.0), m.loaded.device,
            position=record.head_position, pooled=record.head_pool == "mean")
    if m.head is None or final is None or not record.has_lm_head:
        return None
    recorded = LogitTransform(scale=record.logit_scale, softcap=record.logit_softcap, error=0.0)
    return LogitCheck(final, m.head, recorded, m.loaded.device)


def _has_lens(m: ModelSetup) -> bool:
    """Whether the model has logits a materialized lens can store: an LM head, proven, over
    text inputs (not yet: an encoder-decoder, whose rows are each one tower's, and inputs with
    media, whose rows are on several grids)."""
    config = getattr(m.loaded.model, "config", None)
    return (m.head is not None and m.transform is not None and m.final is not None
            and m.labels is None and not getattr(config, "is_encoder_decoder", False))


def _lens_asked(opts: IngestOptions, m: ModelSetup) -> int | None:
    """The K of the materialized lens the ingest was told (None: not told)."""
    if opts.lens and not _has_lens(m):
        raise IngestError(f"model {m.name!r} has no LM head over one stack whose logits the "
                          "materialized lens could store (or --sites leaves out its final "
                          "norm; the lens of an encoder-decoder, or of inputs with media, is "
                          "not stored yet); ingest it without --lens")
    return opts.lens


def _lens_maker(m: ModelSetup, record: ModelRecord) -> LensMaker | None:
    """What computes the rows of the model's materialized lens, if it stores one."""
    if not record.lens_k or m.head is None:
        return None
    final = next((f for f in m.found if f.record.site == record.final_site), m.final)
    assert final is not None
    return LensMaker(record, final, m.head, lens_sites(record, [f.record for f in m.found]),
                     m.loaded.device)


def _labels_asked(opts: IngestOptions, contrastive: Contrastive | None, media: bool,
                  model: nn.Module, name: str) -> tuple[list[str] | None, str]:
    """The labels and template asked for, checked against what the model is."""
    if opts.labels is None:
        if opts.label_template is not None:
            raise IngestError("a label template goes with labels (--labels FILE, labels=[...])")
        return None, DEFAULT_TEMPLATE
    if not media:
        raise IngestError("labels are for a contrastive model's image inputs (--images DIR "
                          "or --inputs FILE.jsonl with 'image'), not for text prompts")
    if contrastive is None:
        raise IngestError(
            f"labels need a contrastive model (text and image towers and a logit scale, as "
            f"CLIPModel and SiglipModel have); model {name!r} ({type(model).__name__}) is not "
            "one")
    return read_labels(opts.labels), check_template(opts.label_template or DEFAULT_TEMPLATE)


def _device_of(model: nn.Module) -> torch.device | None:
    """Where a model's first weight lives (None for a model without weights)."""
    return next((p.device for p in model.parameters()), None)


def _lm_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(getattr(head, "weight", None), torch.Tensor) else None


def _bytes_per_token(s: SiteRecord) -> int:
    heads = s.n_heads or 1
    return heads * (2 * s.d + 8)
