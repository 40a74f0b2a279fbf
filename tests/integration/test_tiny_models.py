"""Tests for the offline tiny-model builders in ``tests/support/tiny_models.py``."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from support.tiny_models import (
    BOS_FAMILIES,
    FAMILIES,
    build_tiny_model,
    build_tokenizer,
    load_tiny_model,
    make_tiny_model,
    norm_modules,
)
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world"]


def _forward(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a padded batch; return (main output, last hidden state, attention mask)."""
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    main = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return main, out.hidden_states[-1], batch["attention_mask"]


@pytest.fixture(scope="module", params=FAMILIES)
def built(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, pathlib.Path]:
    """Build each family once per module into a fresh temporary directory."""
    family: str = request.param
    path = build_tiny_model(family, tmp_path_factory.mktemp(family), seed=0)
    return family, path


def test_build_reload_forward(built: tuple[str, pathlib.Path]) -> None:
    """Reloaded model runs a padded batch, has random norms and matches the in-memory model."""
    family, path = built
    assert (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file()
    model, tok = load_tiny_model(family, path)
    assert model.config._attn_implementation == "eager"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.pad_token_id is not None
    assert model.config.pad_token_id == tok.pad_token_id

    main, hidden, mask = _forward(model, tok, PROMPTS)
    assert mask.shape[0] == 2 and not bool(mask.all()), "prompts should need padding"
    assert torch.isfinite(main).all() and torch.isfinite(hidden).all()
    if family != "bert":
        assert main.shape[-1] == len(tok)

    norms = norm_modules(model)
    assert norms, f"{family}: no normalization modules"
    for name, module in norms:
        weight = getattr(module, "weight", None)
        assert isinstance(weight, torch.Tensor), f"{name}: norm without weight"
        assert not torch.all(weight == 1.0) and not torch.all(weight == 0.0), name
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            assert not torch.all(bias == 0.0), name

    mem_model, mem_tok = make_tiny_model(family, seed=0)
    assert mem_tok(PROMPTS)["input_ids"] == tok(PROMPTS)["input_ids"]
    mem_main, mem_hidden, _ = _forward(mem_model, mem_tok, PROMPTS)
    assert torch.equal(mem_main, main) and torch.equal(mem_hidden, hidden)


def test_padding_does_not_change_valid_positions(built: tuple[str, pathlib.Path]) -> None:
    """The short prompt's outputs are the same alone and right-padded in a batch."""
    family, path = built
    model, tok = load_tiny_model(family, path)
    main, _, mask = _forward(model, tok, PROMPTS)
    alone, _, _ = _forward(model, tok, PROMPTS[1:])
    n = int(mask[1].sum())
    assert alone.shape[1] == n
    torch.testing.assert_close(main[1, :n], alone[0], atol=1e-5, rtol=1e-4)


def test_special_tokens(built: tuple[str, pathlib.Path]) -> None:
    """BERT wraps in [CLS] ... [SEP]; BOS families prepend <s>; others add nothing."""
    family, path = built
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("the cat sat")["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids)
    if family == "bert":
        assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
        assert tok.decode(ids, skip_special_tokens=True) == "the cat sat"
    else:
        assert (tokens[0] == "<s>") == (family in BOS_FAMILIES)
        assert tokens[-1] != "</s>"
        assert tok.decode(ids, skip_special_tokens=True) == "the cat sat"
        assert tok.pad_token == "<pad>" and tok.eos_token == "</s>"


def test_single_token_decoding() -> None:
    """Single tokens decode to readable text (byte-level / WordPiece decoders)."""
    bpe = build_tokenizer(kind="bpe")
    (the_id,) = bpe(" the", add_special_tokens=False)["input_ids"]
    assert bpe.decode([the_id]) == " the"
    assert 300 <= len(bpe) <= 500
    wp = build_tokenizer(kind="wordpiece")
    ids = wp("the", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 and wp.decode(ids) == "the"
    assert 300 <= len(wp) <= 500


def test_tokenizer_roundtrip(tmp_path: pathlib.Path) -> None:
    """A saved tokenizer reloads offline with the same vocab and encodings."""
    for kind in ("bpe", "qwen_bpe", "wordpiece"):
        tok = build_tokenizer(tmp_path / kind, kind=kind)
        again = AutoTokenizer.from_pretrained(tmp_path / kind)
        assert again.get_vocab() == tok.get_vocab()
        text = "Numbers like 2024, can't stop (the) café!"
        assert again(text)["input_ids"] == tok(text)["input_ids"]


# The tokenizers alone (support/tiny_tokenizers.py, which tiny_models.py re-exports): the fresh
# process trains them without importing torch.
_VOCAB_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from support.tiny_tokenizers import build_tokenizer
print(json.dumps([build_tokenizer(kind=k).get_vocab() for k in ("bpe", "wordpiece")]))
"""


def test_tokenizer_training_is_deterministic() -> None:
    """A fresh process trains exactly the same vocabularies."""
    here = str(pathlib.Path(__file__).resolve().parents[1])  # tests/, which holds `support`
    proc = subprocess.run(
        [sys.executable, "-c", _VOCAB_SCRIPT, here], capture_output=True, text=True, check=True
    )
    other = json.loads(proc.stdout.strip().splitlines()[-1])
    mine = [build_tokenizer(kind=k).get_vocab() for k in ("bpe", "wordpiece")]
    assert other == mine


def test_same_seed_same_weights() -> None:
    """Building twice with one seed gives identical weights; another seed differs."""
    a, _ = make_tiny_model("llama", seed=3)
    b, _ = make_tiny_model("llama", seed=3)
    c, _ = make_tiny_model("llama", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.norm.weight"], sc["model.norm.weight"])
