"""find_rotary (ingestion/rotary.py) against each family's own rotary function: a model whose
`rotate_half` turns interleaved pairs of dims (dims 2i, 2i + 1), not halves, gets a reason,
never the halves' table, which would make qk_score's positional scores silently wrong."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers as T

from actdb.ingestion.rotary import find_rotary

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, head_dim=8, pad_token_id=0)


def _interleaved(model_type: str) -> bool:
    """Whether the family's own rotate_half pairs dims 2i and 2i + 1 (the reference)."""
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    x = torch.arange(8.0).reshape(1, 8)
    return mod.rotate_half(x).tolist() == [[-1.0, 0.0, -3.0, 2.0, -5.0, 4.0, -7.0, 6.0]]


@pytest.mark.parametrize(("model_type", "config", "causal"), [
    ("helium", "HeliumConfig", "HeliumForCausalLM"),
    ("glm", "GlmConfig", "GlmForCausalLM"),
    ("llama", "LlamaConfig", "LlamaForCausalLM"),
])
def test_interleaved_rotary_is_refused_with_its_reason(model_type: str, config: str,
                                                       causal: str) -> None:
    model = getattr(T, causal)(getattr(T, config)(**SMALL))
    got = find_rotary(model)
    assert got is not None
    if _interleaved(model_type):
        assert not got.inv_freq and got.reason and "interleaved" in got.reason
    else:
        assert got.reason is None and got.inv_freq
