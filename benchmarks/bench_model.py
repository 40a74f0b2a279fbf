"""The GPT-2-small-shaped model the ingest workloads run (random weights, fixed seed), its
prompts and batches, and the hand-written baselines a researcher would write instead of actdb:
a plain forward loop and a forward loop with hooks that copy each norm input to NumPy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

# The device every workload runs on (run.py --device): the store's queries, the ingest and the
# torch baselines alike.
DEVICE = "cpu"


def sync(t: torch.Tensor) -> torch.Tensor:
    """Wait for a GPU's queued work, so that a timed call ends when its work does."""
    if t.device.type == "cuda":
        torch.cuda.synchronize()
    return t


@dataclass(frozen=True, kw_only=True)
class Gpt2:
    model: Any  # GPT2LMHeadModel, on DEVICE
    tokenizer: Any
    prompts: list[str]
    batches: list[dict[str, torch.Tensor]]  # the tokenized prompts, batch_size a batch
    batch_size: int
    n_tokens: int


def gpt2_small(scale: Any) -> Gpt2:
    """A GPT-2-small-shaped model of `scale` (d, layers, heads, vocab) with a word-level
    tokenizer over "w0".."w{vocab-1}", and `scale.prompts` random prompts of
    `scale.prompt_tokens` words (seed 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(scale.vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    torch.manual_seed(0)
    config = GPT2Config(n_embd=scale.d, n_layer=scale.layers, n_head=scale.heads,
                        vocab_size=scale.vocab, n_positions=1024, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).eval().to(DEVICE)
    rng = np.random.default_rng(0)
    prompts = [" ".join(words[i] for i in rng.integers(0, scale.vocab, scale.prompt_tokens))
               for _ in range(scale.prompts)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    batches = [{k: v[i : i + scale.batch_size].to(DEVICE) for k, v in enc.items()
                if k != "token_type_ids"} for i in range(0, len(prompts), scale.batch_size)]
    return Gpt2(model=model, tokenizer=tokenizer, prompts=prompts, batches=batches,
                batch_size=scale.batch_size, n_tokens=int(enc["attention_mask"].sum()))


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every normalization module, found as a researcher would: LayerNorm, or a class whose
    name ends in RMSNorm or LayerNorm."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.LayerNorm) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))}


@contextmanager
def norm_input_hooks(model: nn.Module, on_input: Any) -> Iterator[None]:
    """`on_input(name, x)` with every norm module's input while the block runs."""
    handles = []
    try:
        for name, m in norm_modules(model).items():
            def pre(module: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                on_input(name, args[0])

            handles.append(m.register_forward_pre_hook(pre))
        yield
    finally:
        for h in handles:
            h.remove()


def forward_pass(g: Gpt2) -> None:
    """The forward pass the ingest itself runs: the model without its LM head, no cache."""
    with torch.no_grad():
        for b in g.batches:
            out = g.model.transformer(**b, use_cache=False)
        sync(out.last_hidden_state)


def full_model(g: Gpt2) -> None:
    """The whole model with `output_hidden_states=True`, as users run it."""
    with torch.no_grad():
        for b in g.batches:
            out = g.model(**b, output_hidden_states=True)
        sync(out.logits)  # a GPU's last batch is inside the time, as the ingest's is


def hook_cache(g: Gpt2) -> dict[str, list[np.ndarray]]:
    """The hand-written activation cache: a plain loop over the batches with forward hooks that
    copy each norm module's input to NumPy (padding dropped), the LM head skipped."""
    cache: dict[str, list[np.ndarray]] = {}
    seen: list[tuple[str, torch.Tensor]] = []  # this batch's norm inputs, in call order
    with torch.no_grad(), norm_input_hooks(g.model.transformer,
                                           lambda name, x: seen.append((name, x.detach()))):
        for b in g.batches:
            seen.clear()
            g.model.transformer(**b, use_cache=False)
            real = b["attention_mask"].bool()  # [batch, T]
            for name, x in seen:
                cache.setdefault(name, []).append(x[real].cpu().numpy())  # [tokens, d]
    return cache
