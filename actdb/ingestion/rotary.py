"""What turns a head's query and key dot product into the model's attention score: its scale
and its rotary position embedding, read from the modules that compute them.

A rotary module (any module with an `inv_freq` buffer: LlamaRotaryEmbedding, GPTNeoX's, ...)
makes, at position p, `cos(p * inv_freq)` and `sin(p * inv_freq)` (each half repeated,
times its `attention_scaling`), and the attention turns dims i and i + r/2 of each query and
key by them (`rotate_half`, r = 2 * len(inv_freq); partial rotary leaves dims past r as they
are). Forms that cannot be applied from these numbers are stated with the reason: interleaved
pairs (GPT-J, CodeGen, and any family whose own `rotate_half` pairs dims 2i and 2i + 1: Helium,
GLM), a table that changes with the sequence length (dynamic, LongRoPE), several tables
(Gemma 3's local and global layers).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .weight_records import Rotary

# Families that rotate interleaved pairs (rotate_every_two), not halves.
_INTERLEAVED = frozenset({"gptj", "codegen", "cohere", "cohere2"})
# Rotary tables that change with the input's length or position range.
_DYNAMIC = frozenset({"dynamic", "longrope"})


def attention_scale(attn: nn.Module) -> float | None:
    """The factor the attention multiplies q . k by (its `scaling`), or None."""
    for m in attn.modules():
        v = getattr(m, "scaling", None)
        if isinstance(v, float | int) and not isinstance(v, bool):
            return float(v)
    return None


def _rotates_pairs(model: nn.Module) -> bool:
    """Whether a `rotate_half` of the model's own modeling modules turns interleaved pairs of
    dims (2i, 2i + 1: Helium, GLM, ERNIE 4.5) rather than halves, asked of the function."""
    x = torch.arange(4.0).reshape(1, 4)
    for name in {type(m).__module__ for m in model.modules()}:
        fn = getattr(sys.modules.get(name), "rotate_half", None)
        if not callable(fn):
            continue
        try:
            out = fn(x)
        except Exception:  # a rotate_half of another signature: not this form
            continue
        if isinstance(out, torch.Tensor) and out.tolist() == [[-1.0, 0.0, -3.0, 2.0]]:
            return True
    return False


def find_rotary(model: nn.Module) -> Rotary | None:
    """The model's rotary embedding (None: it has none)."""
    found = [t for m in model.modules()
             if isinstance(t := getattr(m, "inv_freq", None), torch.Tensor)]
    modules = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None),
                                                        torch.Tensor)]
    if not found:
        return None
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", "")
    if kind in _INTERLEAVED or _rotates_pairs(model):
        return Rotary(reason=f"{kind} rotates interleaved pairs of dims, which qk_score "
                             "does not apply")
    tables = {tuple(float(f) for f in t.detach().float().cpu().tolist()) for t in found}
    if len(tables) > 1:
        return Rotary(reason=f"the model has {len(tables)} rotary tables (layers of "
                             "different kinds), which qk_score does not tell apart")
    rope = next((getattr(m, "rope_type", None) for m in modules), None)
    if rope in _DYNAMIC:
        return Rotary(reason=f"its rotary table ({rope}) changes with the input's length")
    scaling = getattr(modules[0], "attention_scaling", 1.0)
    return Rotary(inv_freq=tables.pop(), scaling=float(scaling or 1.0))
