"""Metadata records shared by the catalog, the ingest and the query layer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class SiteRecord:
    """One normalization site of a model, as found at ingest.

    The stored fields are replayed with one formula, measured by probing the module:
    y = gain * z + bias, z = w / sqrt(mean(w^2) + eps), w = x - mean(x) if `centered` else x,
    with the *effective* gain and bias (a Gemma-style 1 + weight already added in).
    `kind` is for information: layernorm or rmsnorm, `_1p` where the gain is 1 + weight.
    Version-1 stores have no `centered` (None): their kinds fix the formula, and their
    `rmsnorm_1p` gain is the raw weight (see norms.legacy_gain).
    """

    site: str  # canonical name: blocks.3.ln1, final, embed
    site_id: int  # index within the model, stable across runs
    layer: int  # block index; -1 for embed, n_layers for final
    role: str  # embed, pre_attn, pre_mlp, post_attn, post_mlp, final, inner, q_norm, k_norm, other
    kind: str
    d: int  # width of one stored vector
    n_heads: int | None  # set where the input is [.., heads, d] (per-head q/k norms)
    eps: float
    module: str  # module path in the model
    has_gain: bool
    has_bias: bool
    max_rel_error: float | None = None  # faithfulness: worst |y_recomputed - y| / |y| so far
    centered: bool | None = None  # None in version-1 stores: read from `kind`
    # the part of the model it is in: text, vision, audio, encoder, decoder, projector (None in
    # stores from before towers: one text stack)
    tower: str | None = None
    # where positions sit in the norm's input: btd, bthd, bhtd, list, bktd or kbtd (an
    # input's k lists of positions, batch or lists outermost), or a feature map bhwc or bchw
    # (None in older stores: btd)
    layout: str | None = None
    # the grid of positions it sees, where a model's sites see different ones (a hierarchical
    # image model's stages, a pooled head's norm): its rows are the tokens of that grid; None
    # where every site sees every position
    grid: int | None = None


@dataclass(frozen=True, kw_only=True)
class ModelRecord:
    """One model in a store."""

    model: str  # name users query by
    model_id: int  # small integer used in array paths and handles
    source: str  # hub name or path it was loaded from ("<object>" for a model object)
    revision: str | None
    architecture: str
    d_model: int
    n_layers: int
    vocab_size: int
    n_sites: int
    has_lm_head: bool
    has_lm_head_bias: bool
    tied_embeddings: bool
    final_site: str | None
    dtype: str
    max_length: int | None
    sites_glob: str | None
    chunk_tokens: int
    n_rows: int = 0  # token rows committed
    logit_softcap: float | None = None  # logit = cap * tanh(scale * pre / cap)
    logit_scale: float | None = None  # logit = scale * (W_U . final_norm(x) + b_U); None: 1
    logit_max_rel_error: float | None = None  # worst error of recomputed vs the model's logits
    # every parameter's name, dtype, shape and bytes, digested (ingestion/register.py
    # params_digest): a resume under this name must bring the same; None in older stores
    params_digest: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    # whether the model has a token embedding (an image model has none); None: older stores, all do
    has_embed: bool | None = None
    # what the head anchors are: 'lm' (an LM head over the vocabulary), 'classifier' (a
    # classification head; the vocabulary is its label names), 'labels' (a contrastive model's
    # text embeddings of the labels given at ingest, read back through its projection; the
    # vocabulary is the labels), 'contrastive' (a contrastive model ingested without labels:
    # no anchors), None: older stores ('lm'), or a model without a head
    head_kind: str | None = None
    # the position whose final-site vector a classifier or a contrastive model's projection
    # reads (0: the class token); None for labels read from a pooled output no site holds
    head_position: int | None = None
    # 'mean' where a classifier's logits are the mean over an input's final-site rows of each
    # row's logits (a head that averages its positions: Swin's; head_position is then None);
    # None: the head reads one position
    head_pool: str | None = None
    # why the model's head is not stored as anchors (a classifier whose logits no site's rows
    # give: an attention pool, the class token beside the patches' mean); None otherwise
    head_note: str | None = None
    # each tower's depth in blocks ({'text': 4, 'vision': 6}); empty in older stores
    towers: dict[str, int] = field(default_factory=dict)
    # K of the materialized lens stored at its lens sites (lens_layout.py); None or 0: none
    lens_k: int | None = None

    @property
    def row_towers(self) -> bool:
        """Whether its rows each belong to one tower (`tokens.tower`): an encoder-decoder's
        encoder reads the input and its decoder other tokens, so no row is seen by both."""
        return "encoder" in self.towers and "decoder" in self.towers


def prompt_key(text: str, image: str | None = None, video: str | None = None,
               audio: str | None = None, target: str | None = None) -> str:
    """What makes two inputs one prompt: the text alone; with media, the text and the media
    paths; with a decoder's target (an encoder-decoder's input), the target too."""
    if target is not None:
        return "\0" + json.dumps([text, image, video, audio, target])
    if image is None and video is None and audio is None:
        return text
    return "\0" + json.dumps([text, image, video, audio])
