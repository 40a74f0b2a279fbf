"""The tiny models' tokenizers, trained deterministically offline on a small built-in English
corpus. Apart from tiny_models.py (which re-exports them) so that a process that only needs a
tokenizer (tests/integration/test_tiny_models.py's fresh process) does not import torch."""

from __future__ import annotations

import functools
import os
import string
from typing import Any

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
from transformers import PreTrainedTokenizerFast

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
