"""A model's registration in a store: its catalog record, and for a new model the weights,
vocabulary and tokenizer written once; for a model already stored, the proof that the
model brought now is the stored one (a digest of every parameter)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from ..errors import IngestError
from ..store.arrays import default_chunk_tokens
from ..store.records import ModelRecord, SiteRecord
from ..store.store import Store
from .heads import ClassifierHead, find_classifier, label_names, vocab_of
from .labels import LabelsHead
from .load import LoadedModel
from .logits import LogitTransform
from .sites import FoundSite
from .weight_arrays import weight_arrays
from .weights import ModelWeights, Refusal
from .weights import extract as extract_weights


def vocab_table(tok: Any, size: int) -> pa.Table:
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


def _weights(model: Any
             ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, bool]:
    """(embedding, untied LM head, its bias, whether the head is the embedding), float32 on
    the host, as a new model's registration stores them. An image model has no embedding;
    an image classifier's head is its classification head."""
    tensors = {name: t for _, name, t in model_weights(model)}

    def host(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.detach().float().cpu().numpy()

    embed = host(tensors.get("embed"))
    tied = "lm_head" in tensors and tensors["lm_head"] is None and embed is not None
    return embed, host(tensors.get("lm_head")), host(tensors.get("lm_head_bias")), tied


@dataclass(frozen=True, kw_only=True)
class Registration:
    record: ModelRecord
    # Each token id decoded alone; a new model's are filled in by `write`, which decodes the
    # vocabulary on the commit thread, before any batch's token rows are made there.
    token_str: list[str | None]
    weight_bytes: int = 0
    write: Callable[[], None] | None = None  # a new model's weights, tokenizer and rows


def check_same_weights(st: Store, existing: ModelRecord, loaded: LoadedModel,
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
    for what, name, value in model_weights(loaded.model):
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
            if not same_values(block, rows):
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
                    and same_values(stored_part, site_value.float().numpy())))
            if not same:
                raise refuse(f"the {part} of site {f.record.site!r}")
    if digest is not None:  # it differs, and not in the parts compared above
        raise refuse("a parameter beyond the embedding, head and norms")


def _check_same_labels(st: Store, existing: ModelRecord, zero_shot: LabelsHead | None,
                       known: list[str | None]) -> None:
    """A contrastive model's rows go with its labels: a resume brings the same (and the same
    template: the stored anchors are compared), or none where it was stored without."""
    have = existing.head_kind == "labels"
    if zero_shot is None and not have:
        return
    same = zero_shot is not None and have and known == zero_shot.labels
    if same and zero_shot is not None:
        stored = st.arrays.weight(existing.model_id, "lm_head", required=False)
        same = stored is not None and stored.shape == tuple(zero_shot.weight.shape) and (
            same_values(stored, zero_shot.weight.float().numpy()))
    if not same:
        told = ("with labels " + repr([k for k in known if k is not None])
                if have else "without labels")
        raise IngestError(
            f"model {existing.model!r} is already in the store {told}, and these images "
            "come with other labels (or another template): give the same --labels and "
            "--label-template, or --name to store this one under another name")


def params_digest(model: nn.Module) -> str:
    """A digest of every parameter's name, dtype, shape and bytes (a CRC-32C of each tensor's
    bytes, a tensor at a time on the host): what a resume under a stored name
    must bring again. Another checkpoint (a merged LoRA changes attention and MLP weights
    alone) or dtype gives another digest."""
    import hashlib

    import crc32c

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        data = p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
        h.update(f"{name}\0{p.dtype}\0{tuple(p.shape)}\0{crc32c.crc32c(data.data)}\n".encode())
    return h.hexdigest()


def model_weights(model: Any) -> list[tuple[str, str, torch.Tensor | None]]:
    """(what it is, its array's name, the model's tensor) of the weights `_weights` stores:
    the embedding (where the model has a token embedding), and an untied LM head (or a
    classifier's head) and its bias."""
    try:
        emb: Any = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        emb = None
    # A linear layer is a patch embedding (Siglip2's over flattened patches), no table of
    # token rows: its weight's rows are output features, not tokens.
    ew = None if isinstance(emb, torch.nn.Linear) else getattr(emb, "weight", None)
    ew = ew if isinstance(ew, torch.Tensor) and ew.dim() == 2 else None
    head: Any = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    w = getattr(head, "weight", None)
    what = "LM head"
    if not isinstance(w, torch.Tensor):
        head = find_classifier(model)
        w = None if head is None else head.weight
        what = "classification head"
    out: list[tuple[str, str, torch.Tensor | None]] = (
        [] if ew is None else [("embedding", "embed", ew)])
    if not isinstance(w, torch.Tensor):
        return out
    b = getattr(head, "bias", None)
    return [*out,
            (what, "lm_head", None if ew is not None and w.data_ptr() == ew.data_ptr() else w),
            (f"{what}'s bias", "lm_head_bias", b if isinstance(b, torch.Tensor) else None)]


def same_values(stored: np.ndarray, value: np.ndarray) -> bool:
    """The same weight up to a float32 round trip (exact first: the usual case, and cheap)."""
    return bool(np.array_equal(stored, value) or np.allclose(stored, value, rtol=1e-4,
                                                             atol=1e-6))


def register(
    st: Store, loaded: LoadedModel, found: list[FoundSite], n_layers: int, name: str,
    sites_glob: str | None, limit: int | None, chunk_tokens: int | None,
    transform: LogitTransform | None, classifier: ClassifierHead | None = None,
    towers: dict[str, int] | None = None, *, weights_from: list[int] | None = None,
    zero_shot: LabelsHead | None = None, contrastive: bool = False,
    lens: int | None = None, lens_default: int = 0, head_note: str | None = None,
) -> Registration:
    """The model's catalog record, and for a new model the work of registering it: that
    runs first on the commit thread, overlapping the first forward passes. `weights_from`:
    token ids to find a new model's layer weights with (None: none stored). `contrastive`:
    a contrastive model over images, whose head is `zero_shot`'s labels (or none);
    `classifier`, a classification head proven (its rows the anchors: a head that averages its
    positions, composed with the linear layers before its mean); `head_note`, why a
    classifier's head is not stored. `lens`:
    the K of the materialized lens the ingest was told (None: not told, and a new model gets
    `lens_default`; 0: none), which a model in the store must already have."""
    records = [f.record for f in found]
    # What the catalog says, read on one connection (each open of the file replays its
    # log); the comparisons below run with the file closed, since readers in other
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
        if lens is not None and lens != (existing.lens_k or 0):
            raise IngestError(
                f"model {name!r} is already in the store with a materialized lens of "
                f"{existing.lens_k or 0} tokens (0: none), not {lens}: resume it with "
                f"--lens {existing.lens_k or 0}, or pass --name to store this one")
        check_same_weights(st, existing, loaded, found, stored)
        if contrastive:
            _check_same_labels(st, existing, zero_shot, known)
        # a model stored without a vocabulary (no tokenizer, no labels) has none to read, as
        # `write` leaves a new one's
        return Registration(record=existing, token_str=known or [None])
    model = loaded.model
    embed, lm_head, lm_bias, tied = _weights(model)
    projection = None
    if contrastive:  # its text tower's embedding is no anchor of the vision tower's sites
        embed = lm_head = lm_bias = None
        tied = False
    if classifier is not None:
        lm_head = classifier.module.weight.detach().float().cpu().numpy()
        cb = classifier.module.bias
        lm_bias = None if cb is None else cb.detach().float().cpu().numpy()
    if zero_shot is not None:
        lm_head = zero_shot.weight.float().numpy()
        head_bias = zero_shot.head().bias
        lm_bias = None if head_bias is None else head_bias.detach().numpy()
        if zero_shot.position is not None:
            projection = zero_shot.projection.float().numpy()
    config = getattr(model, "config", None)
    d_model = int(getattr(config, "hidden_size", 0)
                  or (embed.shape[1] if embed is not None else records[-1].d))
    vocab_size = (lm_head.shape[0] if lm_head is not None
                  else embed.shape[0] if embed is not None else 0)
    if lm_head is not None and embed is None and classifier is None and zero_shot is None:
        lm_head = lm_bias = None  # a classification head not proven: no anchors of it
        vocab_size = 0
    final = (classifier.final.record.site if classifier is not None  # the site it reads
             else next((s.site for s in reversed(records) if s.role == "final"), None))
    widest = max(s.d * (s.n_heads or 1) for s in records)
    record = ModelRecord(
        model=name, model_id=model_id, source=loaded.source,
        revision=loaded.revision,
        architecture=(getattr(config, "architectures", None) or [type(model).__name__])[0],
        d_model=d_model, n_layers=n_layers, vocab_size=int(vocab_size), n_sites=len(records),
        has_lm_head=lm_head is not None or tied, has_lm_head_bias=lm_bias is not None,
        has_embed=embed is not None,
        head_kind=("classifier" if classifier is not None else "labels" if zero_shot
                   else "contrastive" if contrastive
                   else "lm" if lm_head is not None or tied else None),
        head_position=(classifier.position if classifier is not None
                       else zero_shot.position if zero_shot is not None else None),
        head_pool=classifier.pool if classifier is not None else None,
        head_note=head_note,
        towers=dict(towers or {}),
        tied_embeddings=tied, final_site=final, dtype=str(loaded.dtype).removeprefix("torch."),
        max_length=limit, sites_glob=sites_glob,
        chunk_tokens=chunk_tokens or default_chunk_tokens(widest), n_rows=0,
        logit_softcap=transform.softcap if transform else None,
        # labels without a lens: no batch is checked, the proof on the sample is the record
        logit_max_rel_error=(zero_shot.error if zero_shot is not None
                             and zero_shot.position is None else None),
        logit_scale=(zero_shot.scale if zero_shot is not None
                     else transform.scale if transform else None),
        config=config.to_dict() if config is not None and hasattr(config, "to_dict") else {},
        lens_k=(lens_default if lens is None else lens) or None,
    )
    params = {
        f.record.site: (
            f.gain.float().numpy() if f.gain is not None else None,
            f.bias.float().numpy() if f.bias is not None else None,
        )
        for f in found
    }
    token_str: list[str | None] = []
    layer_arrays, manifest = (None, None) if weights_from is None else _layer_weights(
        loaded, found, weights_from)

    def write() -> None:
        if classifier is not None:  # the head's labels are its vocabulary
            vocab = vocab_of(label_names(model, vocab_size))
        elif zero_shot is not None:  # the labels, each piece the text its tower read
            vocab = vocab_of(zero_shot.labels, pieces=zero_shot.texts)
        elif contrastive:
            vocab = vocab_of([])
        elif loaded.tokenizer is None:
            vocab = vocab_of([])
        else:
            vocab = vocab_table(loaded.tokenizer, max(vocab_size, len(loaded.tokenizer)))
        token_str[:] = vocab.column("token").to_pylist() or [None]
        if loaded.tokenizer is not None and not contrastive:  # its labels are its tokens
            st.save_tokenizer(record.model_id, loaded.tokenizer.save_pretrained)
        digested = dataclasses.replace(record, params_digest=params_digest(model))
        st.register_model(digested, records, embed=embed, lm_head=lm_head,
                          lm_head_bias=lm_bias, site_params=params, vocab=vocab,
                          layer_weights=layer_arrays, weights_manifest=manifest,
                          projection=projection)

    weight_bytes = sum(a.nbytes for a in (embed, lm_head, lm_bias, projection)
                       if a is not None)
    weight_bytes += sum(a.nbytes for pair in params.values() for a in pair if a is not None)
    weight_bytes += sum(a.nbytes for a in (layer_arrays or {}).values())
    return Registration(record=record, token_str=token_str,
                         weight_bytes=weight_bytes, write=write)


def _layer_weights(loaded: LoadedModel, found: list[FoundSite], tokens: list[int]
                   ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A new model's blocks' matrices and circuits, and their manifest. Its probe passes hook
    the model: run here, before the ingest's own passes start on the commit thread."""
    if tokens:
        extracted = extract_weights(loaded.model, found, tokens, device=loaded.device)
    else:  # the probe passes run on token ids
        extracted = ModelWeights(attention=[], mlps=[], refused=[Refusal(
            layer=-1, part="model", module="", reason="layer weights are found with passes "
            "over token ids, and this ingest's inputs are media")])
    gains = {f.record.site: f.gain.numpy() if f.gain is not None and f.gain.dim() == 1
             else None for f in found}
    return weight_arrays(extracted, gains)
