"""Rows of the stored layer weights as vectors (the views `neurons` and `circuits`): the
streams that name them, one a weight array (handles.py), and the reader that serves a
stream's rows to the tensor functions, each read on first use.

- neurons: per (model, layer, expert) three streams, `W_in`, `W_gate` (gated MLPs only) and
  `W_out`, row n the neuron's. The input rows are folded with the gain of the norm whose output
  the MLP reads (the model computes W_in[n] . (gain * z + bias)), so a row is the direction
  the neuron reads in the norm's normalized input z; the output row is what it writes.
- circuits: per (model, layer, circuit) two streams, `u` and `v`, row h * d_head + rank - 1
  (their gain fold was made at ingest, ingestion/circuits.py).

A weight row is a direction in the residual stream, not a norm's input: the views that replay
a norm (`normalized`, `normed`) and the functions that read a norm's output of it
(`rotation_angle`, the head and neuron functions) refuse it; the logit lens reads it through
the final norm as it would a residual vector.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import QueryError
from ..lazy import lazy_module
from ..store.layer_weights import array_name, read_manifest
from ..store.records import ModelRecord, SiteRecord
from ..store.store import Store
from .handles import Stream

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

ROLE = "weights"  # the role of a weight row's stand-in site (never a stored site's)
NO_WEIGHTS = ("was stored without its layer weights (ingested with --weights none, or by an "
              "actdb before 0.3)")
_CACHE_BYTES = 512 << 20  # whole weight arrays kept, least recently used out first


@dataclass(frozen=True, kw_only=True)
class WeightSpec:
    """What one weight stream's rows are."""

    model_id: int
    array: str  # under models/{model_id}/
    label: str  # its name in errors: blocks.3.mlp.W_in, blocks.3.circuits.OV.u
    layer: int
    module: str
    fold: str | None  # the site whose gain multiplies each row (None: none)
    n_rows: int


@dataclass(frozen=True, kw_only=True)
class WeightPlan:
    """The weight streams of a store (numbered from `base`) and the views' rows of them."""

    streams: list[Stream]
    specs: dict[int, WeightSpec]  # stream index -> spec
    # (model, layer, expert, n_neurons, w_in, w_gate, w_out): stream indices (w_gate None)
    neurons: list[tuple[Any, ...]]
    # (model, layer, circuit, n_heads, d_head, u, v, rotary)
    circuits: list[tuple[Any, ...]]
    without: list[str]  # models stored without layer weights


class WeightRows:
    """The store's layer weights as rows, on one device: manifests, streams and arrays."""

    def __init__(self, store: Store, models: dict[int, ModelRecord],
                 gain: Callable[[ModelRecord, SiteRecord], torch.Tensor | None],
                 sites: dict[tuple[int, int], SiteRecord],
                 device: Callable[[], torch.device]) -> None:
        self.store, self.models, self._gain, self.sites = store, models, gain, sites
        self._device = device
        self._lock = threading.Lock()
        self._manifests: dict[int, dict[str, Any] | None] = {}
        self._arrays: OrderedDict[tuple[int, str, str | None], torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.mlps: dict[tuple[int, str], Any] = {}  # neuron_kernels.layer_mlp's, by site

    def manifest(self, model: ModelRecord) -> dict[str, Any] | None:
        """The model's layer-weight manifest (None: stored without), read once."""
        with self._lock:
            if model.model_id not in self._manifests:
                self._manifests[model.model_id] = read_manifest(self.store.arrays,
                                                                model.model_id)
            return self._manifests[model.model_id]

    def require(self, model: ModelRecord, what: str) -> dict[str, Any]:
        found = self.manifest(model)
        if found is None:
            raise QueryError(f"{what}: model {model.model!r} {NO_WEIGHTS}; ingest it again "
                             "into a new store to read its weights")
        return found

    def plan(self, base: int) -> WeightPlan:
        """Every model's weight streams, numbered from `base`, in (model_id, layer, part)
        order: the same store gives the same numbers."""
        streams: list[Stream] = []
        specs: dict[int, WeightSpec] = {}
        neurons: list[tuple[Any, ...]] = []
        circuits: list[tuple[Any, ...]] = []
        without: list[str] = []

        def add(spec: WeightSpec) -> int:
            at = base + len(streams)
            streams.append(Stream(model_id=spec.model_id, site_id=-1, head=-1,
                                  n_rows=spec.n_rows, kind=ROLE, array=spec.array))
            specs[at] = spec
            return at

        for mid in sorted(self.models):
            model = self.models[mid]
            manifest = self.manifest(model)
            if manifest is None:
                without.append(model.model)
                continue
            rotary = manifest.get("rotary") is not None
            for entry in manifest.get("layers", []):
                layer = int(entry["layer"])
                attn = entry.get("attn")
                if attn:
                    heads, dh = int(attn["n_heads"]), int(attn["d_head"])
                    for circuit in ("OV", "QK"):
                        part = f"circuits/{circuit}"
                        uv = [add(WeightSpec(
                            model_id=mid, array=array_name(layer, part, name),
                            label=f"blocks.{layer}.circuits.{circuit}.{name}", layer=layer,
                            module=str(attn.get("module", "")), fold=None,
                            n_rows=heads * dh)) for name in ("u", "v")]
                        circuits.append((model.model, layer, circuit, heads, dh, *uv,
                                         rotary and circuit == "QK"))
                for mlp in entry.get("mlp", []):
                    expert = mlp.get("expert")
                    part = "mlp" if expert is None else f"mlp.{expert}"
                    n = int(mlp["n_neurons"])
                    rows: list[int | None] = []
                    for name in ("W_in", "W_gate", "W_out"):
                        if name not in mlp["arrays"]:
                            rows.append(None)
                            continue
                        rows.append(add(WeightSpec(
                            model_id=mid, array=array_name(layer, part, name),
                            label=f"blocks.{layer}.{part}.{name}", layer=layer,
                            module=str(mlp.get("module", "")),
                            fold=mlp.get("reads") if name != "W_out" else None, n_rows=n)))
                    neurons.append((model.model, layer, expert, n, *rows))
        return WeightPlan(streams=streams, specs=specs, neurons=neurons, circuits=circuits,
                          without=without)

    def site(self, spec: WeightSpec, d: int) -> SiteRecord:
        """A stand-in site for a weight stream's rows: the tensor functions name it in errors
        and read its width; its role is none of a stored site's."""
        return SiteRecord(site=spec.label, site_id=-1, layer=spec.layer, role=ROLE,
                          kind=ROLE, d=d, n_heads=None, eps=0.0, module=spec.module,
                          has_gain=False, has_bias=False)

    def width(self, spec: WeightSpec) -> int:
        return int(self.array(spec).shape[-1])

    def array(self, spec: WeightSpec) -> torch.Tensor:
        """float32 [n_rows, d] on the device: the stream's rows, gain folded where it is."""
        key = (spec.model_id, spec.array, spec.fold)
        with self._lock:
            got = self._arrays.get(key)
            if got is not None:
                self._arrays.move_to_end(key)
                return got
        w = self.store.arrays.weight(spec.model_id, spec.array)
        assert w is not None  # the manifest names it: a missing one is damage, raised there
        rows = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(self._device())
        if spec.fold is not None:
            gain = self._fold_gain(spec)
            if gain is not None:
                rows = rows * gain.to(rows.device, torch.float32)  # [n, d] * [d]
        self._keep(key, rows)
        return rows

    def _keep(self, key: tuple[int, str, str | None], value: torch.Tensor) -> None:
        """Keep an array, the least recently used ones out past _CACHE_BYTES."""
        with self._lock:
            old = self._arrays.pop(key, None)
            self._bytes -= 0 if old is None else old.numel() * 4
            self._arrays[key] = value
            self._bytes += value.numel() * 4
            while self._bytes > _CACHE_BYTES and len(self._arrays) > 1:
                _, gone = self._arrays.popitem(last=False)
                self._bytes -= gone.numel() * 4

    def _fold_gain(self, spec: WeightSpec) -> torch.Tensor | None:
        model = self.models[spec.model_id]
        site = next((s for (mid, _), s in self.sites.items()
                     if mid == spec.model_id and s.site == spec.fold), None)
        if site is None:
            raise QueryError(f"{spec.label} of model {model.model!r}: the MLP reads site "
                             f"{spec.fold!r}, which the store does not hold")
        return self._gain(model, site)

    def rows(self, spec: WeightSpec, rows: np.ndarray) -> torch.Tensor:
        """float32 [len(rows), d]: the stream's rows `rows`."""
        w = self.array(spec)
        return w[torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(w.device)]

    def sigma(self, spec: WeightSpec, rows: np.ndarray) -> np.ndarray:
        """float64: the singular value of each circuit row (h * d_head + rank - 1)."""
        name = spec.array.rsplit("/", 1)[0] + "/sigma"
        key = (spec.model_id, name, None)
        with self._lock:
            got = self._arrays.get(key)
        if got is None:
            s = self.store.arrays.weight(spec.model_id, name)
            assert s is not None
            got = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32).reshape(-1))
            self._keep(key, got)
        return got.double().numpy()[np.asarray(rows, dtype=np.int64)]


def label_list(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)
