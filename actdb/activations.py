"""The MLP activations the query layer computes, and the probe that tells which one a model's
own activation module is.

A model's activation is never looked up by the name of its class or config key: at ingest the
module itself is called on a grid of inputs and compared with each formula here
(`identify`); the one that reproduces it (to float64 rounding) is recorded in the layer-weight
manifest, with the worst difference seen. A module that matches none is recorded with no
formula, and the functions that need it (`neuron_act`, `active_fraction`) say so.

>>> import torch
>>> identify(torch.nn.SiLU())[0]
'silu'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a formula is first used

# The largest difference from the module, relative to max(1, |y|), for a formula to be it:
# float64 rounding of the same formula written differently (tanh-GELU's cube, SiLU's sigmoid)
# is far below; the nearest other formula (tanh-GELU against erf-GELU) differs by ~5e-4.
MATCH = 1e-9


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


def _formulas() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    f = torch.nn.functional
    return {
        "relu": torch.relu,
        "gelu": f.gelu,  # the erf form
        "gelu_tanh": lambda x: f.gelu(x, approximate="tanh"),
        "silu": f.silu,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "relu2": _relu2,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
    }


NAMES = ("relu", "gelu", "gelu_tanh", "silu", "quick_gelu", "relu2", "tanh", "sigmoid")

# The largest |act'(x)| over all x, for the float16 error bounds (docs of neuron_act):
# GELU's is 1.1289 (at x = 2.4), SiLU's 1.0998 (x = 2.4), quick GELU's the same as SiLU's;
# relu2's grows with x (2x), so it has none here.
SLOPE = {"relu": 1.0, "gelu": 1.129, "gelu_tanh": 1.13, "silu": 1.1, "quick_gelu": 1.1,
         "tanh": 1.0, "sigmoid": 0.25, "relu2": math.inf}


def apply(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation `name` (one of NAMES) of x."""
    return _formulas()[name](x)


def identify(fn: Any) -> tuple[str | None, float]:
    """(the formula the callable `fn` computes, or None; the worst relative difference of the
    best formula over the probe grid): `fn` is called on float64 inputs from -12 to 12 and a few
    large ones, as the model's MLP calls it."""
    x = torch.cat([torch.linspace(-12.0, 12.0, 4801, dtype=torch.float64),
                   torch.tensor([-1e4, -300.0, -40.0, 40.0, 300.0, 1e4], dtype=torch.float64)])
    try:
        with torch.no_grad():
            y = fn(x.clone())
    except (RuntimeError, TypeError, ValueError):
        return None, math.inf
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None, math.inf
    y = y.double()
    best, err = None, math.inf
    for name, formula in _formulas().items():
        want = formula(x)
        scale = torch.clamp(want.abs(), min=1.0)
        e = float(((y - want).abs() / scale).max())
        if e < err:
            best, err = name, e
    return (best if err <= MATCH else None), err
