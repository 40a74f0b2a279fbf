"""A model's weights as query functions need them: norm gains and biases, the LM head, and
unit anchor vectors, each read once and kept; single rows read alone while few are asked for."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import norms
from ..errors import QueryError
from ..lazy import lazy_module
from ..store.records import ModelRecord, SiteRecord
from ..store.store import Store
from .dots import tree_sum, unit_rows

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

ANCHOR_SETS = ("unembed", "embed", "unembed_folded")
# The names an anchor set may be given by: a classifier's head rows, and a contrastive model's
# labels, are its 'unembed' set.
ANCHOR_NAMES = (*ANCHOR_SETS, "classifier", "labels")
_ANCHOR_BLOCK = 8192  # rows of the vocabulary normalized at a time (float64 scratch)
# Rows of a weight a connection reads alone (a chunk each) before it reads the whole weight.
_ROWS_ALONE = 4


class ModelWeights:
    """The weights of a store's models on one device, read on first use and kept."""

    def __init__(self, store: Store, sites: dict[tuple[int, int], SiteRecord],
                 device: Callable[[], torch.device]) -> None:
        """`sites`: (model_id, site_id) -> site; `device()`: where the weights go (resolved on
        first use: VectorSource.device)."""
        self.store, self.sites, self._device = store, sites, device
        self._weights: dict[tuple[object, ...], torch.Tensor | None] = {}
        self._rows_alone: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # _rows_of
        self._shapes: dict[tuple[int, str], tuple[int, ...]] = {}  # weights' shapes
        self._lock = threading.RLock()  # anchors() builds on cached weights under the lock

    def final_site(self, model: ModelRecord) -> SiteRecord:
        final = next((s for (mid, _), s in self.sites.items()
                      if mid == model.model_id and s.site == model.final_site), None)
        if final is None:
            raise QueryError(f"model {model.model!r} has no final norm site, so no final_norm")
        return final

    @staticmethod
    def centered(site: SiteRecord) -> bool:
        """Whether the site centres; version-1 stores say it by kind."""
        return site.centered if site.centered is not None else norms.legacy_centered(site.kind)

    def gain(self, model: ModelRecord, site: SiteRecord) -> torch.Tensor | None:
        """The effective gain (version-1 stores kept Gemma's raw weight: add its 1 back)."""
        g = self.param(model, site, "gain")
        return g if site.centered is not None else norms.legacy_gain(site.kind, g)

    def _cached(self, key: tuple[object, ...], make: Callable[[], torch.Tensor | None]
                ) -> torch.Tensor | None:
        with self._lock:
            if key not in self._weights:
                self._weights[key] = make()
            return self._weights[key]

    def _weight(self, model_id: int, name: str, *, required: bool = True
                ) -> torch.Tensor | None:
        """A weight; absent only where the catalog says the model has none (`required`
        False), since a weight deleted from a store must be an error, not a default."""
        def make() -> torch.Tensor | None:
            w = self.store.arrays.weight(model_id, name, required=required)
            return None if w is None else torch.from_numpy(w).to(self._device())
        return self._cached(("w", model_id, name), make)

    def param(self, model: ModelRecord, site: SiteRecord, name: str) -> torch.Tensor | None:
        has = site.has_gain if name == "gain" else site.has_bias
        return self._weight(model.model_id, f"sites/{site.site}/{name}", required=has)

    def _head(self, model: ModelRecord) -> str:
        """The name of the weight that is the model's LM head (W_U), which it must have."""
        if model.head_kind == "contrastive":
            raise QueryError(f"model {model.model!r} is a contrastive model stored without "
                             "labels, so no logits (ingest its images with --labels FILE)")
        if not model.has_lm_head:
            raise QueryError(f"model {model.model!r} has no LM head, so no logits")
        return "embed" if model.tied_embeddings else "lm_head"

    def head_input(self, model: ModelRecord, hn: torch.Tensor) -> torch.Tensor:
        """What the LM head is applied to, given final-normed rows hn [n, d]: hn itself; for a
        contrastive model's labels, hn / ||P hn|| (its image embedding P hn is made unit
        before the cosine with each label's), so that the logit is scale * (W . that + b).
        Its logits read one position (the class token); a model that pools its positions
        with an attention head (SigLIP) has no lens."""
        if model.head_kind != "labels":
            return hn
        if model.head_position is None:
            raise QueryError(
                f"model {model.model!r} pools every position into its image embedding (an "
                "attention head, as SigLIP's), so no one position's vector gives its label "
                "logits: the logit functions are not defined on it; cosine_to_anchor(vec, "
                "label, 'labels') compares with the labels' text embeddings")
        p = self._weight(model.model_id, "projection")
        assert p is not None
        length = torch.linalg.vector_norm(hn @ p.to(hn.dtype).T, dim=-1, keepdim=True)
        return hn / torch.where(length > 0, length, torch.ones_like(length))

    def unembed(self, model: ModelRecord) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W_U [V, d] and b_U [V] (or None)."""
        w = self._weight(model.model_id, self._head(model))
        assert w is not None
        return w, self._weight(model.model_id, "lm_head_bias", required=model.has_lm_head_bias)

    def unembed_width(self, model: ModelRecord) -> int:
        """The LM head's width, from its array's metadata (no weights read)."""
        return int(self._weight_shape(model.model_id, self._head(model))[1])

    def unembed_row(self, model: ModelRecord, tid: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row `tid` of W_U [d] and of b_U (a 0-d tensor, or None): the rows of `unembed`,
        read alone while few have been (one chunk of the weights each), else from it."""
        w = self._rows_of(model, self._head(model), tid)
        b = self._rows_of(model, "lm_head_bias", tid) if model.has_lm_head_bias else None
        return w, b

    def _weight_shape(self, model_id: int, name: str) -> tuple[int, ...]:
        """A weight's shape, from its array's metadata, read once (a scan asks once per call,
        and opening the array reads its metadata)."""
        with self._lock:
            if (model_id, name) not in self._shapes:
                info = self.store.arrays.info(f"models/{model_id}/{name}", required=True)
                assert info is not None
                self._shapes[(model_id, name)] = info.shape
            return self._shapes[(model_id, name)]

    def _rows_of(self, model: ModelRecord, name: str, tid: int) -> torch.Tensor:
        """Row `tid` of weight `name`: from the cached whole; else, for the first
        `_ROWS_ALONE` rows a query asks of it, read alone (and kept); past that, the whole
        weight is read once (a column of many tokens must not read a chunk per token)."""
        mid = model.model_id
        rows = self._weight_shape(mid, name)[0]
        if not 0 <= tid < rows:
            raise QueryError(f"token id {tid} has no row in the {name} weights of model "
                             f"{model.model!r} ({rows} rows)")
        with self._lock:
            whole = self._weights.get(("w", mid, name))
            kept = self._rows_alone.setdefault((mid, name), {})
            if whole is None and tid not in kept and len(kept) >= _ROWS_ALONE:
                whole = self._weight(mid, name)
            if whole is not None:
                return whole[tid]
            if tid not in kept:
                got = self.store.arrays.weight_rows(mid, name, [tid])
                kept[tid] = torch.from_numpy(got).to(self._device())[0]
            return kept[tid]

    def anchor_set(self, model: ModelRecord, anchor_set: str | None) -> str:
        """The anchor set's name (None: the model's default), checked: a known set, and
        an LM head where the set is made of it."""
        name = anchor_set or ("unembed" if model.has_lm_head else "embed")
        if name not in ANCHOR_NAMES:
            raise QueryError(f"unknown anchor set {name!r}; anchor sets are {list(ANCHOR_NAMES)}")
        # A classification head is stored where an LM head is, its labels as the vocabulary:
        # 'classifier' names its rows, and only a classifier's store has them.
        if model.head_kind == "contrastive":
            raise QueryError(f"model {model.model!r} is a contrastive model stored without "
                             "labels: it has no anchors (ingest its images with --labels FILE "
                             "for the anchor set 'labels')")
        classifier = model.head_kind == "classifier"
        if name == "classifier" and not classifier:
            raise QueryError(f"model {model.model!r} has no classification head: anchor set "
                             "'classifier' is for image classifiers")
        if name == "labels" and model.head_kind != "labels":
            raise QueryError(f"model {model.model!r} has no labels: anchor set 'labels' is a "
                             "contrastive model's (CLIP, SigLIP) ingested with --labels")
        if name in ("classifier", "labels"):
            name = "unembed"
        if name == "embed" and model.has_embed is False:
            raise QueryError(f"model {model.model!r} has no token embedding (it reads images): "
                             "anchor set 'embed' does not exist for it")
        if name != "embed":
            self._head(model)  # the set is made of the LM head: the model must have one
        if name == "unembed_folded":
            self.final_site(model)  # the fold needs it: its absence is said here
        return name

    def anchor_width(self, model: ModelRecord, anchor_set: str | None) -> int:
        """The width of an anchor set's vectors, from its weight's metadata (no weights read):
        the embedding's for 'embed', the LM head's otherwise. Models with factorized
        embeddings (ALBERT) have anchors narrower than d_model."""
        name = self.anchor_set(model, anchor_set)
        weight = "embed" if name == "embed" else self._head(model)
        return int(self._weight_shape(model.model_id, weight)[1])

    def _unit_anchors(self, model: ModelRecord, name: str, w: torch.Tensor) -> torch.Tensor:
        """Rows of `name`'s weight (`w`, [n, d]) -> their unit anchors, each row computed on
        its own (unit_rows): a row made alone equals its row of the whole set bit for bit."""
        if name == "unembed_folded":
            final = self.final_site(model)
            g = self.gain(model, final)
            w64 = w.double() * g.double() if g is not None else w.double()
            if self.centered(final):
                w64 = w64 - (tree_sum(w64) / w64.shape[-1]).unsqueeze(-1)
            return unit_rows(w64)
        return unit_rows(w)

    def anchors(self, model: ModelRecord, anchor_set: str | None) -> torch.Tensor:
        """Unit anchor directions [V, d] (zero rows stay zero)."""
        name = self.anchor_set(model, anchor_set)

        def make() -> torch.Tensor:
            if name == "embed":
                w = self._weight(model.model_id, "embed")
                assert w is not None
            else:
                w, _ = self.unembed(model)
            out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
            for lo in range(0, w.shape[0], _ANCHOR_BLOCK):  # float64 scratch a block at a time
                out[lo : lo + _ANCHOR_BLOCK] = self._unit_anchors(
                    model, name, w[lo : lo + _ANCHOR_BLOCK])
            return out

        out = self._cached(("anchors", model.model_id, name), make)
        assert out is not None
        return out

    def anchor(self, model: ModelRecord, anchor_set: str | None, tid: int) -> torch.Tensor:
        """Unit anchor `tid` [d]: row `tid` of `anchors`, bit for bit, made alone from one
        row of the weights while the whole set is not made and few rows have been read alone
        (a fresh process's `cosine_to_anchor(vec, ' Paris')` reads one chunk of the
        vocabulary, not all of it); else from the whole set, made once."""
        name = self.anchor_set(model, anchor_set)
        weight = "embed" if name == "embed" else self._head(model)
        with self._lock:
            whole = self._weights.get(("anchors", model.model_id, name))
            alone = (whole is None and len(self._rows_alone.get((model.model_id, weight), {}))
                     < _ROWS_ALONE)
        if not alone:
            return (whole if whole is not None else self.anchors(model, name))[tid]
        key = ("anchor", model.model_id, name, tid)
        with self._lock:
            made = self._weights.get(key)
        if made is None:  # made once: a scan asks for the same anchor in every call
            w = self._rows_of(model, weight, tid)
            made = self._cached(key, lambda: self._unit_anchors(model, name, w.unsqueeze(0))[0])
        assert made is not None
        return made
