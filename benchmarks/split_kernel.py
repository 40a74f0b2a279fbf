"""The ingest hook's compiled kernel (`_native.split_rows`) as the hook runs it: between two of
torch's parallel regions, on one thread and on torch's intra-op thread count.

    python benchmarks/split_kernel.py [--rows 1024] [--d 768] [--repeats 200]

Each step runs a torch matmul of the rows (a parallel region, after which torch's OpenMP
threads wait for the next one) and then the kernel on its output, as a norm site's hook does
between two modules. Prints the median and the fastest kernel call over the steps, for one
thread and for `torch.get_num_threads()` threads, and whether the shared rows are the one
thread's bits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from actdb import _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    n, d = args.rows, args.d
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, d, generator=gen) / d**0.5
    gain = (torch.rand(d, generator=gen) + 0.5).numpy().tobytes()
    out = {}
    for threads in (1, torch.get_num_threads()):
        h = np.empty((n, d), np.float16)
        norm, mean = np.empty(n, np.float32), np.empty(n, np.float32)
        times = []
        for _ in range(args.repeats):
            y = (x @ w).contiguous()  # torch's parallel region, as the module before the hook
            start = time.perf_counter()
            _native.split_rows(x.numpy(), y.numpy(), h, norm, mean, gain, b"", d, True, 1e-5,
                               False, threads)
            times.append(time.perf_counter() - start)
        out[threads] = h.copy()
        print(f"threads {threads}: median {statistics.median(times) * 1e6:8.1f} us, "
              f"fastest {min(times) * 1e6:8.1f} us over {args.repeats} calls "
              f"of {n} rows x {d}")
    same = all(np.array_equal(out[1].view(np.uint16), v.view(np.uint16)) for v in out.values())
    print("same bits on every thread count:", same)


if __name__ == "__main__":
    main()
