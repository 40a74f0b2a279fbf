"""Tiny random-weight transformer models and tokenizers, built entirely offline for tests.

Every model is built from a hand-written config (no hub access), gets random non-trivial
normalization weights/biases, and is saved with ``save_pretrained`` together with a tokenizer
trained deterministically on a small built-in English corpus.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from support.tiny_tokenizers import CORPUS, MAX_POSITIONS, build_tokenizer

__all__ = [
    "BOS_FAMILIES",
    "CORPUS",
    "FAMILIES",
    "build_config",
    "build_family_tokenizer",
    "build_tiny_model",
    "build_tokenizer",
    "is_norm_module",
    "load_tiny_model",
    "make_tiny_model",
    "norm_modules",
    "randomize_norms",
]

FAMILIES: tuple[str, ...] = (
    "gpt2",
    "gpt_neox",
    "opt",
    "bloom",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "phi3",
    "olmo2",
    "bert",
)

# Families whose real tokenizers prepend a BOS token to every encoded sequence.
BOS_FAMILIES: frozenset[str] = frozenset({"opt", "llama", "mistral", "gemma", "gemma2"})

# Norm classes that scale by ``(1 + weight)`` instead of ``weight``.
_ONE_PLUS_WEIGHT_NORMS: frozenset[str] = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm"})

HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
INTERMEDIATE_SIZE = 128


def build_family_tokenizer(
    family: str, path: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerFast:
    """Build the tokenizer ``build_tiny_model`` uses for ``family`` (optionally saving it)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if family == "bert":
        return build_tokenizer(path, kind="wordpiece")
    kind = "qwen_bpe" if family in ("qwen2", "qwen3") else "bpe"
    return build_tokenizer(path, kind=kind, add_bos=family in BOS_FAMILIES)


def build_config(family: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Return a tiny config of ``family`` whose vocab and special ids match ``tokenizer``."""
    vocab = len(tokenizer)
    ids: dict[str, Any] = {
        "vocab_size": vocab,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    # Fields shared by the Llama-like (rotary, RMSNorm, gated MLP) families.
    llama_like: dict[str, Any] = {
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
    }
    kwargs: dict[str, Any]
    if family == "gpt2":
        kwargs = {
            "n_embd": HIDDEN_SIZE,
            "n_layer": NUM_LAYERS,
            "n_head": NUM_HEADS,
            "n_inner": INTERMEDIATE_SIZE,
            "n_positions": MAX_POSITIONS,
            "tie_word_embeddings": True,
        }
    elif family == "gpt_neox":
        kwargs = {
            "hidden_size": HIDDEN_SIZE,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": NUM_HEADS,
            "intermediate_size": INTERMEDIATE_SIZE,
            "max_position_embeddings": MAX_POSITIONS,
            "use_parallel_residual": True,  # Pythia style; rotary_pct defaults to 0.25
            "tie_word_embeddings": False,
        }
    elif family == "opt":
        kwargs = {
            "hidden_size": HIDDEN_SIZE,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": NUM_HEADS,
            "ffn_dim": INTERMEDIATE_SIZE,
            "max_position_embeddings": MAX_POSITIONS,
            "do_layer_norm_before": True,
            "word_embed_proj_dim": HIDDEN_SIZE,
            "tie_word_embeddings": True,
        }
    elif family == "bloom":
        kwargs = {
            "hidden_size": HIDDEN_SIZE,
            "n_layer": NUM_LAYERS,
            "n_head": NUM_HEADS,
            "tie_word_embeddings": True,
        }
    elif family == "llama":
        kwargs = dict(llama_like)
    elif family == "mistral":
        # GQA; the sliding window is longer than MAX_POSITIONS, so it never kicks in.
        kwargs = {**llama_like, "num_key_value_heads": 2, "sliding_window": 4096}
    elif family == "qwen2":
        kwargs = {**llama_like, "num_key_value_heads": 2}
    elif family == "qwen3":
        kwargs = {**llama_like, "num_key_value_heads": 2, "head_dim": HEAD_DIM}
    elif family == "gemma":
        kwargs = {
            **llama_like,
            "num_key_value_heads": 1,
            "head_dim": HEAD_DIM,
            "tie_word_embeddings": True,
        }
    elif family == "gemma2":
        kwargs = {
            **llama_like,
            "num_key_value_heads": 2,
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "tie_word_embeddings": True,
        }
    elif family == "phi3":
        kwargs = {**llama_like, "original_max_position_embeddings": MAX_POSITIONS}
    elif family == "olmo2":
        kwargs = dict(llama_like)
    elif family == "bert":
        kwargs = {
            "hidden_size": HIDDEN_SIZE,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": NUM_HEADS,
            "intermediate_size": INTERMEDIATE_SIZE,
            "max_position_embeddings": MAX_POSITIONS,
        }
        ids = {"vocab_size": vocab, "pad_token_id": tokenizer.pad_token_id}
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    config = AutoConfig.for_model(family, **kwargs, **ids)
    config._attn_implementation = "eager"
    return config


def is_norm_module(module: torch.nn.Module) -> bool:
    """Return True for ``nn.LayerNorm`` or any module whose class name ends in RMSNorm/LayerNorm."""
    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith(
        ("RMSNorm", "LayerNorm")
    )


def norm_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Return ``(qualified_name, module)`` for every normalization module in ``model``."""
    return [(name, module) for name, module in model.named_modules() if is_norm_module(module)]


@torch.no_grad()
def randomize_norms(model: torch.nn.Module, *, seed: int = 0) -> int:
    """Give every norm weight/bias random non-trivial values; return how many norms changed.

    Standard norms get ``weight = 1 + 0.2 * randn``; ``(1 + weight)``-style Gemma norms get
    ``weight = 0.2 * randn``. Biases get ``0.1 * randn``. Norms without a weight are skipped.
    """
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    for _, module in norm_modules(model):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        noise = 0.2 * torch.randn(weight.shape, generator=gen, dtype=torch.float32)
        offset = 0.0 if type(module).__name__ in _ONE_PLUS_WEIGHT_NORMS else 1.0
        weight.copy_(offset + noise)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(0.1 * torch.randn(bias.shape, generator=gen, dtype=torch.float32))
        changed += 1
    return changed


def _model_class(family: str) -> type[AutoModel] | type[AutoModelForCausalLM]:
    """Return the auto class used to build/load ``family`` (BERT has no LM head)."""
    return AutoModel if family == "bert" else AutoModelForCausalLM


def make_tiny_model(
    family: str, *, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build (without saving) the tiny ``family`` model and its tokenizer, in eval mode.

    Weights are initialized under ``torch.manual_seed(seed)``; norm weights/biases are then
    randomized from a generator seeded with ``seed + 1``, so the result depends only on ``seed``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    tokenizer = build_family_tokenizer(family)
    config = build_config(family, tokenizer)
    torch.manual_seed(seed)
    model = _model_class(family).from_config(config, attn_implementation="eager")
    model = model.to(torch.float32)
    if randomize_norms(model, seed=seed + 1) == 0:
        raise RuntimeError(f"{family}: found no normalization module with a weight")
    model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer


def build_tiny_model(family: str, path: str | os.PathLike[str], *, seed: int = 0) -> pathlib.Path:
    """Build a tiny random-weight ``family`` model and save it with its tokenizer to ``path``.

    The model is built from a config under ``torch.manual_seed(seed)``, its norm weights/biases
    get random non-trivial values, and model (float32 safetensors) + tokenizer are written with
    ``save_pretrained``. Returns ``path`` as a ``pathlib.Path``.
    """
    model, tokenizer = make_tiny_model(family, seed=seed)
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_tiny_model(
    family: str, path: str | os.PathLike[str]
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model saved by ``build_tiny_model`` (eager attention, float32, eval mode)."""
    model: PreTrainedModel = _model_class(family).from_pretrained(
        os.fspath(path), attn_implementation="eager"
    )
    model.float().eval()
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(path))
    return model, tokenizer
