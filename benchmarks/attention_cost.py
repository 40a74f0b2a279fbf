"""Workload 18, attention weights: what `ingest --attention` costs, in time and bytes.

The GPT-2-small-shaped model of workload 1 (random weights, fixed seed; `--scale medium`:
d=768, 12 layers, 12 heads, 32 prompts x 128 tokens, batch size 8) is ingested into a new
store with `attention=True` and without it (both `weights="none"`: the layer weights are the
same either way), back to back in alternating order; the ratio is the median of the rounds'
ratios (method.py). Bytes: the store's tensors with and without, and the attention arrays'
own bytes against the vectors'.

    python benchmarks/attention_cost.py [--scale medium|full|tiny] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_model  # noqa: E402
from method import paired  # noqa: E402
from run import SCALES  # noqa: E402

import actdb  # noqa: E402


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="medium")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    scale = SCALES[args.scale]
    g = bench_model.gpt2_small(scale)
    work = Path(tempfile.mkdtemp(prefix="actdb-attention-"))
    runs = iter(range(10**6))
    last: dict[bool, Path] = {}

    def ingest(attention: bool) -> None:
        store = work / f"s{next(runs)}.actdb"
        actdb.ingest(store, model=g.model, tokenizer=g.tokenizer, prompts=g.prompts,
                     batch_size=scale.batch_size, device="cpu", name="gpt2", weights="none",
                     attention=attention)
        old = last.get(attention)
        last[attention] = store
        if old is not None:
            shutil.rmtree(old)

    try:
        ratio = paired(lambda: ingest(True), lambda: ingest(False), args.rounds)
        with_a, without = last[True], last[False]
        attention_bytes = _bytes(with_a / "tensors.zarr" / "models" / "0" / "attention")
        acts_bytes = _bytes(with_a / "tensors.zarr" / "models" / "0" / "acts")
        total_with = _bytes(with_a / "tensors.zarr")
        total_without = _bytes(without / "tensors.zarr")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = g.n_tokens
    print(f"scale {scale.name}: {scale.prompts} prompts x {scale.prompt_tokens} tokens "
          f"({n} tokens), d={scale.d}, {scale.layers} layers x {scale.heads} heads, batch "
          f"size {scale.batch_size}, {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
    print(f"ingest with --attention: {statistics.median(ratio.actdb):.2f} s; without: "
          f"{statistics.median(ratio.baseline):.2f} s (medians)")
    print(f"each round's ratio: {', '.join(f'{r:.2f}' for r in ratio.rounds)}")
    print(f"time with / without: {ratio.median:.3g} (median), spread {ratio.spread}")
    print(f"attention arrays: {attention_bytes} bytes "
          f"({attention_bytes / n:.0f} a token; 4 x layers x heads x n a token, n the "
          f"prompt's length: {4 * scale.layers * scale.heads * scale.prompt_tokens})")
    print(f"vectors: {acts_bytes} bytes; attention / vectors: {attention_bytes / acts_bytes:.3g}")
    print(f"tensors with / without: {total_with / total_without:.3g} "
          f"({total_with} / {total_without} bytes)")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
