"""A layer's attention weights as head_write and qk_score read them: each head's factors from
the store's layer weights (store/layer_weights.py), read once per (model, layer) and kept, with
the attention's scale and the model's rotary embedding from the manifest."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import QueryError
from ..lazy import lazy_module
from ..store.layer_weights import array_name, read_manifest
from ..store.records import ModelRecord
from ..store.store import Store

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)


@dataclass(frozen=True, kw_only=True)
class LayerAttention:
    """One layer's attention, per head ([heads, d_head, d] as AttentionWeights stores it)."""

    layer: int
    reads: str | None  # the site whose output the attention reads
    w_q: torch.Tensor  # [H, dh, d]
    w_k: torch.Tensor  # [Hkv, dh, d]
    w_v: torch.Tensor  # [Hkv, dh, d]
    w_o: torch.Tensor  # [H, dh, d]
    b_q: torch.Tensor | None  # [H, dh]
    b_k: torch.Tensor | None  # [Hkv, dh]
    b_v: torch.Tensor | None  # [Hkv, dh]
    kv_of_head: tuple[int, ...]
    scale: float | None

    @property
    def n_heads(self) -> int:
        return int(self.w_q.shape[0])


@dataclass(frozen=True, kw_only=True)
class RotaryTable:
    inv_freq: torch.Tensor | None  # float32 [dims / 2]; None with a reason
    scaling: float
    reason: str | None


class HeadWeights:
    """The attention weights of a store's models on one device, read on first use."""

    def __init__(self, store: Store, device: Callable[[], torch.device]) -> None:
        self.store, self._device = store, device
        self._lock = threading.Lock()
        self._manifests: dict[int, dict[str, Any] | None] = {}
        self._layers: dict[tuple[int, int], LayerAttention] = {}

    def manifest(self, model: ModelRecord) -> dict[str, Any]:
        """The model's layer-weight manifest; a QueryError for a store without weights."""
        with self._lock:
            if model.model_id not in self._manifests:
                self._manifests[model.model_id] = read_manifest(self.store.arrays,
                                                                model.model_id)
        found = self._manifests[model.model_id]
        if found is None:
            raise QueryError(f"model {model.model!r} was stored without its layer weights "
                             "(ingested with --weights none, or before actdb 0.3): head_write "
                             "and qk_score need them; ingest it again into a new store")
        return found

    def layer(self, model: ModelRecord, layer: int, what: str) -> LayerAttention:
        """Layer `layer`'s attention; a QueryError naming `what` asked when there is none."""
        key = (model.model_id, int(layer))
        with self._lock:
            got = self._layers.get(key)
        if got is not None:
            return got
        manifest = self.manifest(model)
        entry = next((e for e in manifest.get("layers", []) if int(e["layer"]) == layer), None)
        attn = None if entry is None else entry.get("attn")
        if attn is None:
            why = next((r["reason"] for r in manifest.get("refused", [])
                        if int(r["layer"]) == layer and r["part"] == "attn"), None)
            layers = sorted(int(e["layer"]) for e in manifest.get("layers", []) if e.get("attn"))
            raise QueryError(
                f"{what}: model {model.model!r} has no stored attention at layer {layer}"
                + (f" ({why})" if why else f"; layers with attention are {layers}"))

        def read(name: str) -> torch.Tensor | None:
            if name not in attn["arrays"]:
                return None
            w = self.store.arrays.weight(model.model_id, array_name(layer, "attn", name))
            assert w is not None
            return torch.from_numpy(w).to(self._device())

        heads, kv, dh = int(attn["n_heads"]), int(attn["n_kv_heads"]), int(attn["d_head"])

        def per_head(name: str, n: int) -> torch.Tensor | None:
            w = read(name)
            if w is None:
                return None
            return w.reshape(n, dh, -1) if name.startswith("W_") else w.reshape(n, dh)

        w_q, w_k, w_v, w_o = (per_head(n, c) for n, c in
                              (("W_Q", heads), ("W_K", kv), ("W_V", kv), ("W_O", heads)))
        assert w_q is not None and w_k is not None and w_v is not None and w_o is not None
        got = LayerAttention(
            layer=layer, reads=attn.get("reads"), w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o,
            b_q=per_head("b_Q", heads), b_k=per_head("b_K", kv), b_v=per_head("b_V", kv),
            kv_of_head=tuple(int(k) for k in attn["kv_of_head"]),
            scale=None if attn.get("scale") is None else float(attn["scale"]))
        with self._lock:
            self._layers[key] = got
        return got

    def head(self, model: ModelRecord, layer: int, head: int, what: str) -> LayerAttention:
        """The layer's attention, with `head` checked against its heads."""
        got = self.layer(model, layer, what)
        if not 0 <= head < got.n_heads:
            raise QueryError(f"{what}: head {head} is out of range for layer {layer} of model "
                             f"{model.model!r} ({got.n_heads} heads: 0..{got.n_heads - 1})")
        return got

    def rotary(self, model: ModelRecord) -> RotaryTable | None:
        """The model's rotary table (None: it has none)."""
        manifest = self.manifest(model)
        if "rotary" not in manifest:
            raise QueryError(f"model {model.model!r}: its layer weights were stored before "
                             "actdb recorded the rotary table, which qk_score needs; ingest it "
                             "again into a new store")
        entry = manifest["rotary"]
        if entry is None:
            return None
        inv = entry.get("inv_freq") or []
        return RotaryTable(
            inv_freq=torch.tensor(inv, dtype=torch.float32, device=self._device())
            if inv else None,
            scaling=float(entry.get("scaling") or 1.0), reason=entry.get("reason"))
