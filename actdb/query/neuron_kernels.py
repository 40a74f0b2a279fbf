"""neuron_pre, neuron_act and active_fraction: a row of the site an MLP reads, read through the
MLP's stored neurons (store/layer_weights.py).

The MLP's input is that site's output y = gain * z + bias (`normed(v)`), so the norm's gain and
bias are applied exactly as the model applies them. A neuron n of a gated MLP computes
act(W_gate[n] . y + b_gate[n]) * (W_in[n] . y + b_in[n]); of an ungated one act(W_in[n] . y +
b_in[n]); either value multiplies its row W_out[n] in the MLP's output.

- neuron_pre(v, n): the input of the activation, W_gate[n] . y + b_gate[n] (gated) or
  W_in[n] . y + b_in[n] (ungated): the neuron's pre-activation.
- neuron_act(v, n): act(neuron_pre(v, n)) times, in a gated MLP, the up projection
  W_in[n] . y + b_in[n]: the value that multiplies W_out[n].
- active_fraction(v): the share of the layer's neurons whose act(neuron_pre) > 0. For ReLU
  that is exactly the neurons with a non-zero activation; for GELU, SiLU and the like (never
  exactly zero) it is the neurons past the activation's zero, those with a positive
  pre-activation, whatever the up projection of a gated MLP does with them.

`act` is the formula identified at ingest by calling the model's own activation module
(activations.py, the manifest's `act`), never guessed from a name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import activations
from ..errors import QueryError
from ..lazy import lazy_module
from ..store.layer_weights import array_name
from ..store.records import ModelRecord, SiteRecord
from .kernels import Arg, _per_value
from .vectors import Group, VectorSource
from .weight_rows import ROLE as WEIGHT_ROLE
from .weight_rows import WeightSpec

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

_BLOCK = 256  # rows per product with a whole layer of neurons (active_fraction)


@dataclass(frozen=True, kw_only=True)
class LayerMlp:
    """The MLP reading one site, as the neuron functions read it ([neurons, d] rows)."""

    model: str
    layer: int
    w_in: torch.Tensor
    w_gate: torch.Tensor | None
    b_in: torch.Tensor | None
    b_gate: torch.Tensor | None
    act: str | None  # activations.NAMES; None: the module matches none of them
    activation: str  # the module's class, for messages

    @property
    def n(self) -> int:
        return int(self.w_in.shape[0])

    def reader(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows (and bias) whose product is the activation's input."""
        if self.w_gate is not None:
            return self.w_gate, self.b_gate
        return self.w_in, self.b_in

    def formula(self, what: str) -> str:
        if self.act is None:
            raise QueryError(
                f"{what}: the activation of the MLP of layer {self.layer} of model "
                f"{self.model!r} ({self.activation}) matches none of the formulas actdb "
                f"computes ({', '.join(activations.NAMES)}), so its activations are not "
                "known here")
        return self.act


_LOCK = threading.Lock()


def layer_mlp(src: VectorSource, model: ModelRecord, site: SiteRecord, what: str) -> LayerMlp:
    """The dense MLP that reads `site`'s output; a QueryError naming the sites MLPs read when
    none reads this one, or when it is a mixture of experts."""
    cache = src.weight_rows.mlps
    with _LOCK:
        got = cache.get((model.model_id, site.site))
    if got is not None:
        return got
    manifest = src.weight_rows.require(model, what)
    found = [(int(e["layer"]), m) for e in manifest.get("layers", []) for m in e.get("mlp", [])
             if m.get("reads") == site.site]
    if not found:
        sites = sorted({str(m.get("reads")) for e in manifest.get("layers", [])
                       for m in e.get("mlp", []) if m.get("reads")})
        raise QueryError(
            f"{what} reads rows of a site whose output an MLP reads (the pre-MLP norm: "
            f"{', '.join(sites) or 'none in this model'}); site {site.site!r} of model "
            f"{model.model!r} is read by no stored MLP")
    layer, mlp = found[0]
    if len(found) > 1 or mlp.get("expert") is not None:
        raise QueryError(
            f"{what}: the MLP of layer {layer} of model {model.model!r} is a mixture of "
            f"{len(found)} experts, and which ones a token uses is the router's choice; read "
            "each expert's neurons through the view neurons")
    if "act" not in mlp:
        raise QueryError(f"{what}: model {model.model!r} had its layer weights stored before "
                         "actdb recorded the MLP's activation; ingest it again into a new store")
    part = "mlp"

    def read(name: str) -> torch.Tensor | None:
        if name not in mlp["arrays"]:
            return None
        return src.weight_rows.array(WeightSpec(
            model_id=model.model_id, array=array_name(layer, part, name),
            label=f"blocks.{layer}.{part}.{name}", layer=layer, module=str(mlp["module"]),
            fold=None, n_rows=int(mlp["n_neurons"])))

    w_in = read("W_in")
    assert w_in is not None
    got = LayerMlp(model=model.model, layer=layer, w_in=w_in, w_gate=read("W_gate"),
                   b_in=read("b_in"), b_gate=read("b_gate"), act=mlp.get("act"),
                   activation=str(mlp.get("activation")))
    with _LOCK:
        cache[(model.model_id, site.site)] = got
    return got


def _input(src: VectorSource, g: Group, what: str) -> torch.Tensor:
    """float64 [n, d]: the MLP's input y for the group's rows (a raw vec's site output, or a
    normed view as it is)."""
    if g.site.role == WEIGHT_ROLE:
        raise QueryError(f"{what} reads a vec of acts (a row of the norm an MLP reads), not a "
                         f"weight row ({g.site.site!r})")
    if g.view not in ("raw", "normed"):
        raise QueryError(f"{what} reads a vec (or normed(vec)): the MLP's input is the norm's "
                         f"output; got a {g.view} view")
    y = g.x if g.view == "normed" else src.site_output(g.model, g.site, g.x, g.mean, g.heads)
    return y.double()


def _neuron(mlp: LayerMlp, value: Any, what: str) -> int:
    n = int(value)
    if not 0 <= n < mlp.n:
        raise QueryError(f"{what}: neuron {n} is out of range for the MLP of layer {mlp.layer} "
                         f"of model {mlp.model!r} ({mlp.n} neurons: 0..{mlp.n - 1})")
    return n


def _dot(y: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int) -> torch.Tensor:
    """y [m, d] . w[n] + b[n], in float64."""
    out = y @ w[n].double()
    return out + float(b[n]) if b is not None else out


def _per_neuron(src: VectorSource, h: np.ndarray, out: np.ndarray, neuron: Arg, what: str,
                gated_up: bool) -> None:
    for g in src.groups(h):
        y = _input(src, g, what)
        mlp = layer_mlp(src, g.model, g.site, what)
        act = mlp.formula(what) if gated_up else None
        for (nv,), pos in _per_value([neuron], g.index).items():
            n = _neuron(mlp, nv, what)
            rows = torch.from_numpy(pos).to(y.device)
            w, b = mlp.reader()
            pre = _dot(y[rows], w, b, n)
            if act is not None:
                pre = activations.apply(act, pre)
                if mlp.w_gate is not None:
                    pre = pre * _dot(y[rows], mlp.w_in, mlp.b_in, n)
            out[g.index[pos]] = pre.cpu().numpy()


def neuron_pre(src: VectorSource, h: np.ndarray, out: np.ndarray, neuron: Arg) -> None:
    _per_neuron(src, h, out, neuron, "neuron_pre", gated_up=False)


def neuron_act(src: VectorSource, h: np.ndarray, out: np.ndarray, neuron: Arg) -> None:
    _per_neuron(src, h, out, neuron, "neuron_act", gated_up=True)


def active_fraction(src: VectorSource, h: np.ndarray, out: np.ndarray) -> None:
    for g in src.groups(h):
        y = _input(src, g, "active_fraction").float()
        mlp = layer_mlp(src, g.model, g.site, "active_fraction")
        act = mlp.formula("active_fraction")
        w, b = mlp.reader()
        for lo in range(0, len(y), _BLOCK):
            pre = y[lo : lo + _BLOCK] @ w.T  # [block, neurons]
            if b is not None:
                pre = pre + b
            on = activations.apply(act, pre) > 0
            out[g.index[lo : lo + _BLOCK]] = on.double().mean(-1).cpu().numpy()
