"""What the weight finder returns: a block's attention and MLP matrices, and the layers it
refused with their reasons."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class AttentionWeights:
    """One block's attention, per head; rows are directions in the residual stream (d).

    `w_q[h, i]` is the direction whose dot product with the attention's input gives query
    dimension i of head h (before bias, rotary and scaling); `w_o[h, i]` what value dimension
    i of head h writes. Keys and values are per key-value head; `kv_of_head[h]` maps.
    """

    layer: int
    module: str
    w_q: torch.Tensor  # [H, dh, d]
    w_k: torch.Tensor  # [Hkv, dh, d]
    w_v: torch.Tensor  # [Hkv, dh, d]
    w_o: torch.Tensor  # [H, dh, d]
    b_q: torch.Tensor | None  # [H, dh]
    b_k: torch.Tensor | None  # [Hkv, dh]
    b_v: torch.Tensor | None  # [Hkv, dh]
    b_o: torch.Tensor | None  # [d]
    kv_of_head: tuple[int, ...]
    reads: str | None = None  # the site whose output the attention reads (its gain folds in)
    # what the model multiplies q . k by before the softmax (its module's `scaling`); None:
    # the module states none
    scale: float | None = None

    @property
    def n_heads(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def n_kv_heads(self) -> int:
        return int(self.w_k.shape[0])

    @property
    def d_head(self) -> int:
        return int(self.w_q.shape[1])


@dataclass(frozen=True, kw_only=True)
class MlpWeights:
    """One MLP (or one expert of a mixture): neuron n reads `w_in[n]` (and `w_gate[n]`),
    and writes `w_out[n]`: out = sum_n act(w_gate[n] . x) * (w_in[n] . x) * w_out[n]
    (ungated: act(w_in[n] . x + b_in[n]))."""

    layer: int
    expert: int | None
    module: str
    w_in: torch.Tensor  # [n, d]
    w_gate: torch.Tensor | None  # [n, d]
    w_out: torch.Tensor  # [n, d]
    b_in: torch.Tensor | None
    b_gate: torch.Tensor | None
    b_out: torch.Tensor | None  # [d]
    activation: str  # the activation module's class name (e.g. SiLUActivation, NewGELU...)
    reads: str | None = None  # the site whose output the MLP reads
    shared: bool = False  # a mixture's shared expert (numbered after the routed ones)
    act_fn: Any = field(default=None, compare=False, repr=False)  # the model's own callable


@dataclass(frozen=True, kw_only=True)
class Refusal:
    layer: int
    part: str  # "attn" or "mlp"
    module: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Rotary:
    """The model's rotary position embedding, as its rotary module computes it (rotary.py):
    at position p, dims i and i + dims/2 of a query or key (i < dims/2) turn by the angle
    p * inv_freq[i], cos and sin scaled by `scaling`; dims past `dims` are left as they are.
    `reason`: why it cannot be applied from these (then the rest is empty)."""

    inv_freq: tuple[float, ...] = ()
    scaling: float = 1.0
    reason: str | None = None

    @property
    def dims(self) -> int:
        return 2 * len(self.inv_freq)


@dataclass(frozen=True, kw_only=True)
class ModelWeights:
    attention: list[AttentionWeights]
    mlps: list[MlpWeights]
    refused: list[Refusal]
    rotary: Rotary | None = None  # None: no rotary position embedding
