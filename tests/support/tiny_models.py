"""Tiny random-weight transformer models and tokenizers, built entirely offline for tests.

Every model is built from a hand-written config (no hub access), gets random non-trivial
normalization weights/biases, and is saved with ``save_pretrained`` together with a tokenizer
trained deterministically on a small built-in English corpus.
"""

from __future__ import annotations

import functools
import os
import pathlib
import string
from typing import Any

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.trainers import BpeTrainer
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
MAX_POSITIONS = 256
BPE_VOCAB_SIZE = 400
WORDPIECE_VOCAB_SIZE = 400

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
BPE_SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
BERT_SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "The cat sat on the mat and looked out of the window.",
    "She sells sea shells by the sea shore every summer.",
    "In the beginning, the universe was hot, dense and very small.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "The weather today is sunny with a chance of rain in the evening.",
    "He opened the door, walked into the room, and sat down quietly.",
    "Machine learning models learn patterns from large amounts of data.",
    "Transformers use attention to mix information between tokens.",
    "The river flows through the valley toward the distant ocean.",
    "My favourite colours are blue, green, red and a little yellow.",
    "They played football in the park until the sun went down.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The library was quiet except for the sound of turning pages.",
    "Please remember to buy milk, eggs, bread and cheese.",
    "The old man told the children a story about the mountains.",
    "Numbers like 1, 2, 3, 42 and 2024 appear in many texts.",
    "When the music started, everyone began to dance and sing.",
    "The scientist measured the temperature of the sample twice.",
    "Birds fly south for the winter because the north is cold.",
    "It was the best of times, it was the worst of times.",
    "Do you know where the train station is? I think it is near.",
    "The teacher wrote the answer on the board for the class.",
    "Coffee and tea are popular drinks in the morning.",
    "The computer program printed hello world on the screen.",
    "A small boat drifted slowly across the calm blue lake.",
    "The king and the queen lived in a large stone castle.",
    "Every morning the baker makes fresh bread and sweet cakes.",
    "The children laughed when the dog chased its own tail.",
    "Stars shine brightly in the dark night sky above the hills.",
    "The company announced its new product at the conference.",
    "Reading books is a great way to learn new words and ideas.",
    "The doctor said that the patient should rest for a week.",
    "Snow covered the streets, and the city was silent and white.",
    "What time is it? It is half past seven in the evening.",
    "The garden is full of roses, tulips and tall sunflowers.",
    "Neural networks have layers, weights, biases and activations.",
    "The museum opened a new exhibition about ancient history.",
    "We walked along the beach and collected smooth stones.",
)


def _train_bpe(
    *,
    vocab_size: int,
    special_tokens: tuple[str, ...],
    normalizer: normalizers.Normalizer | None,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    initial_alphabet: list[str],
) -> Tokenizer:
    """Train a BPE model on ``CORPUS``.

    Deterministic because every initial symbol comes from the (sorted) initial alphabet, so
    symbol ids, and hence the trainer's tie-breaking between equally frequent pairs, are fixed.
    (The WordPiece trainer and BPE with a ``continuing_subword_prefix`` create prefixed
    symbols in hash-map order and give a different vocab on every run, so we avoid them.)
    """
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=initial_alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    return tok


@functools.cache
def _trained_tokenizer_json(kind: str) -> str:
    """Train the backend tokenizer of ``kind`` ("bpe" or "wordpiece") and return its JSON."""
    if kind == "bpe":
        tok = _train_bpe(
            vocab_size=BPE_VOCAB_SIZE,
            special_tokens=BPE_SPECIAL_TOKENS,
            normalizer=None,
            pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.decoder = decoders.ByteLevel()
        return tok.to_str()
    if kind != "wordpiece":
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    # WordPiece vocab = special tokens + every piece of a char-level BPE, both as a
    # word-initial piece and as a "##" continuation piece.
    normalizer = normalizers.BertNormalizer(lowercase=True)
    chars = {c for line in CORPUS for c in normalizer.normalize_str(line) if not c.isspace()}
    chars |= set(string.ascii_lowercase + string.digits + string.punctuation)
    n_pieces = (WORDPIECE_VOCAB_SIZE - len(BERT_SPECIAL_TOKENS)) // 2
    bpe = _train_bpe(
        vocab_size=n_pieces,
        special_tokens=(),
        normalizer=normalizer,
        pre_tokenizer=pre_tokenizers.BertPreTokenizer(),
        initial_alphabet=sorted(chars),
    )
    pieces = [piece for piece, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = [*BERT_SPECIAL_TOKENS, *pieces, *(f"##{piece}" for piece in pieces)]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(list(BERT_SPECIAL_TOKENS))
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"])
    )
    return tok.to_str()


def _qwen_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Return the pre-tokenizer that ``Qwen2Tokenizer`` hard-codes (regex split + byte-level)."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_tokenizer(
    path: str | os.PathLike[str] | None = None,
    *,
    kind: str = "bpe",
    add_bos: bool = False,
) -> PreTrainedTokenizerFast:
    """Build a deterministic offline tokenizer and optionally save it to ``path``.

    ``kind="bpe"``: byte-level BPE (400 tokens, GPT-2 pre-tokenizer regex) with special tokens
    ``<pad>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos), ``<unk>``=3; ``add_bos`` makes encoding
    prepend ``<s>``. ``kind="qwen_bpe"``: the same vocab/merges with Qwen2's NFC normalizer and
    pre-tokenizer, which is what ``AutoTokenizer`` rebuilds for a ``qwen2`` checkpoint anyway.
    ``kind="wordpiece"`` (alias ``"bert"``): lower-casing WordPiece (~400 tokens) with
    ``[PAD]``/``[UNK]``/``[CLS]``/``[SEP]``/``[MASK]`` and a ``[CLS] ... [SEP]`` post-processor.
    """
    if kind == "bert":
        kind = "wordpiece"
    if kind not in ("bpe", "qwen_bpe", "wordpiece"):
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    backend = Tokenizer.from_str(_trained_tokenizer_json("bpe" if kind == "qwen_bpe" else kind))
    common: dict[str, Any] = {
        "model_max_length": MAX_POSITIONS,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    if kind == "wordpiece":
        if add_bos:
            raise ValueError("add_bos is not supported for kind='wordpiece'")
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            unk_token="[UNK]",
            sep_token="[SEP]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            mask_token="[MASK]",
            **common,
        )
    else:
        if kind == "qwen_bpe":
            backend.normalizer = normalizers.NFC()
            backend.pre_tokenizer = _qwen_pre_tokenizer()
        # add_bos_token/add_eos_token make the wrapper install a TemplateProcessing
        # post-processor; it is saved in tokenizer.json (tokenizer_config.json drops the flags).
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=BOS,
            eos_token=EOS,
            unk_token=UNK,
            pad_token=PAD,
            add_bos_token=add_bos,
            add_eos_token=False,
            **common,
        )
    if path is not None:
        tokenizer.save_pretrained(os.fspath(path))
    return tokenizer


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
