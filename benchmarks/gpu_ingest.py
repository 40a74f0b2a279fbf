"""Ingest at real size: a model of a real checkpoint's shape with random weights, ingested
against its own forward pass with the hooks actdb needs, and a new store's fixed cost.

    python benchmarks/gpu_ingest.py [--size 1b|135m|small] [--device cuda] [--prompts 32]
                                    [--tokens 512] [--batch-size 16] [--rounds 3]
                                    [--output gpu-ingest.md] [--workdir /tmp/actdb-gpu-ingest]

Shapes (random weights from a config, seed 0, a word-level tokenizer over the vocabulary):
`1b`, Llama-3.2-1B's config (d 2048, 16 layers, 32 query heads over 8 key-value heads, MLP
8192, vocabulary 128,256, tied embeddings); `135m`, SmolLM2-135M's (d 576, 30 layers, 9 heads
over 3, MLP 1536, vocabulary 49,152, tied); `small`, a two-layer model of the family (d 128)
that checks the script on a CPU in seconds. bfloat16 on a GPU, float32 on a CPU.

Figures, each the median of paired rounds (method.py: the two sides back to back, in
alternating order):
1. ingest throughput over the hand-written hook cache's: `actdb.ingest` of the prompts into a
   new store (layer weights too, as a first ingest writes them; no materialized lens), against
   the same batches through the model without its LM head with a forward pre-hook on every
   norm module copying its input, padding dropped, to host memory (the hooks actdb needs and
   nothing more); and the same beyond a one-prompt run of each side (each further token's cost,
   a new store's fixed cost aside; not with `--prompts 1`);
2. a new store's fixed cost: the one-prompt ingest's time less the hook cache's over that
   prompt, in each round (the pass with the hooks: what is left is the store's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_model import norm_input_hooks, sync  # noqa: E402
from method import Ratio, paired  # noqa: E402
from report import Result, machine, write_report  # noqa: E402

import actdb  # noqa: E402

# The configs' shapes (transformers' LlamaConfig fields); the rest is LlamaConfig's default.
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
               rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                 rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 max_position_embeddings=8192),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                  tie_word_embeddings=True, max_position_embeddings=512),
}
NAMES = {"1b": "Llama-3.2-1B", "135m": "SmolLM2-135M", "small": "a two-layer Llama"}


@dataclass(frozen=True, kw_only=True)
class Built:
    model: Any  # LlamaForCausalLM, on the device
    tokenizer: Any
    prompts: list[str]
    batches: list[dict[str, torch.Tensor]]  # the tokenized prompts, batch_size a batch
    batch_size: int
    n_tokens: int


def build(size: str, *, device: str, prompts: int, tokens: int, batch_size: int) -> Built:
    """A `size`-shaped Llama with random weights (seed 0) on `device`, a word-level tokenizer
    over "w0".."w{vocab-1}", and `prompts` random prompts of `tokens` words (seed 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = SHAPES[size]
    vocab = shape["vocab_size"]
    words = [f"w{i}" for i in range(vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: a CPU takes minutes for 1B
        model = LlamaForCausalLM(config).to(dtype).eval()
    rng = np.random.default_rng(0)
    texts = [" ".join(words[i] for i in rng.integers(0, vocab, tokens)) for _ in range(prompts)]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    batches = [{k: v[i : i + batch_size].to(device) for k, v in enc.items()
                if k != "token_type_ids"} for i in range(0, prompts, batch_size)]
    return Built(model=model, tokenizer=tokenizer, prompts=texts, batches=batches,
                 batch_size=batch_size, n_tokens=int(enc["attention_mask"].sum()))


def hook_cache(b: Built, batches: list[dict[str, torch.Tensor]]) -> int:
    """The hand-written activation cache over `batches`: the model without its LM head, a
    forward pre-hook on every norm module, each input copied (padding dropped) to host memory.
    Returns the values cached."""
    cache: list[torch.Tensor] = []
    seen: list[torch.Tensor] = []  # this batch's norm inputs, in call order
    with torch.no_grad(), norm_input_hooks(b.model.model, lambda name, x: seen.append(x)):
        for batch in batches:
            seen.clear()
            out = b.model.model(**batch, use_cache=False)
            real = batch["attention_mask"].bool()  # [batch, T]
            cache += [x[real].to("cpu") for x in seen]  # [tokens, d]
        sync(out.last_hidden_state)
    return sum(t.numel() for t in cache)


def measure(b: Built, *, size: str, device: str, work: Path, rounds: int) -> Result:
    runs = iter(range(10**6))
    stores: list[Path] = []

    def ingest(prompts: list[str]) -> None:
        path = work / f"ingest-{next(runs)}.actdb"
        stores.append(path)
        actdb.ingest(path, model=b.model, tokenizer=b.tokenizer, prompts=prompts,
                     batch_size=b.batch_size, device=device, name=size, lens=0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def clear() -> None:  # untimed: the last store removed (a 1B model's are gigabytes)
        while stores:
            shutil.rmtree(stores.pop(), ignore_errors=True)

    first = [{k: v[:1] for k, v in b.batches[0].items()}]
    # one prompt: a new store's fixed cost alone (the throughput would be that run again)
    whole = None if len(b.prompts) == 1 else paired(
        lambda: ingest(b.prompts), lambda: hook_cache(b, b.batches), rounds, actdb_setup=clear)
    one = paired(lambda: ingest(b.prompts[:1]), lambda: hook_cache(b, first), rounds,
                 actdb_setup=clear)
    clear()
    fixed_s = [i - f for i, f in zip(one.actdb, one.baseline, strict=True)]
    fixed_cost = Ratio.from_rounds(fixed_s)
    n = b.n_tokens
    config = b.model.config
    r = Result(
        title=f"23. Ingest at real size ({NAMES[size]}-shaped, {device})",
        what=(f"`actdb.ingest` of a {NAMES[size]}-shaped Llama (random weights, d="
              f"{config.hidden_size}, {config.num_hidden_layers} layers, "
              f"{config.num_attention_heads} heads over {config.num_key_value_heads}, "
              f"vocabulary {config.vocab_size}, {str(b.model.dtype).removeprefix('torch.')}) "
              f"over {len(b.prompts)} prompts x {n // len(b.prompts)} tokens = {n} tokens, "
              f"batch size {b.batch_size}, on {device}, into a new store each run (layer "
              "weights written, no materialized lens), against the hand-written hook cache "
              "over the same batches (the model without its LM head, a forward pre-hook on "
              "every norm module copying its input, padding dropped, to host memory). "
              f"{rounds} paired rounds each (benchmarks/gpu_ingest.py --size {size})."),
    )
    if whole is not None:
        throughput = whole.inverted()  # ingest tokens/s over the hook cache's
        # (a round where either side's difference is not positive is noise: at a small size)
        beyond_rounds = [(h - h1) / (i - i1) for i, h, i1, h1 in zip(
            whole.actdb, whole.baseline, one.actdb, one.baseline, strict=True)
            if h > h1 and i > i1]
        beyond = Ratio.from_rounds(beyond_rounds or [float("nan")])
        r.figure("hook cache", f"{whole.baseline_seconds:.2f} s "
                 f"({n / whole.baseline_seconds:.0f} tokens/s)")
        r.figure("actdb ingest", f"{whole.seconds:.2f} s ({n / whole.seconds:.0f} tokens/s)")
        r.ratio("ingest tokens/s / hook cache tokens/s", throughput, ">= 0.8",
                throughput.median >= 0.8)
        r.ratio("the same, beyond a one-prompt run of each", beyond, "(information)", True)
    r.figure("the hook cache over one prompt", f"{one.baseline_seconds:.3f} s")
    r.figure("an ingest of one prompt into a new store", f"{one.seconds:.3f} s")
    target = "< 0.3" if size == "135m" else "(information)"
    r.ratio("a new store's fixed cost, seconds (one-prompt ingest less the hook cache over "
            "that prompt)", fixed_cost, target, fixed_cost.median < 0.3 or size != "135m")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", type=Path, default=Path("gpu-ingest.md"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/actdb-gpu-ingest"))
    args = ap.parse_args()
    started = time.perf_counter()
    load = os.getloadavg()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    try:
        b = build(args.size, device=args.device, prompts=args.prompts, tokens=args.tokens,
                  batch_size=args.batch_size)
        r = measure(b, size=args.size, device=args.device, work=args.workdir,
                    rounds=args.rounds)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    r.figure("load average (1 min) when it started and ended",
             f"{load[0]:.2f}, {os.getloadavg()[0]:.2f}")
    command = "python benchmarks/gpu_ingest.py " + " ".join(sys.argv[1:])
    write_report(args.output, [r], machine(load), command=command.strip(),
                 seconds=time.perf_counter() - started, scale=args.size)
    for row in r.ratios:
        print(f"{row.label}: {row.value:.3g} ({row.spread}, {row.rounds} rounds; target "
              f"{row.target})")
    for label, value in r.figures:
        print(f"  {label}: {value}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
