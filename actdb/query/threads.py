"""One thread policy for a query: DuckDB's threads, torch's intra-op pool, and the read-ahead.

Left to torch's defaults, small tensor ops fan out to a pool whose threads fight DuckDB,
the read-ahead and the machine's other processes for the cores, which on a busy machine makes
a scan many times slower. So:
- DuckDB runs one thread: every tensor function is a Python UDF holding the GIL, so more
  DuckDB threads only wait on it (and idle DuckDB workers compete with torch).
- Tensor functions run torch on one thread; an op fans out only when it is big enough to
  repay it (a vocabulary-wide matrix product), and then only to the cores that are idle now.
- One read-ahead thread reads and checks chunks while the query computes (file reads and
  CRC checks release the GIL); it reads `READAHEAD_CHUNKS` chunks ahead of a walk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..lazy import lazy_module, load

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # imported when a tensor is first needed (lazy.py)

DUCKDB_THREADS = 1
READAHEAD_CHUNKS = 8
# Below this many floating-point operations an op is done on one thread faster than a pool
# can be woken and joined.
FAN_OUT_FLOPS = 5e8
# /proc/loadavg is read this many times this far apart when deciding (a small share of such
# an op's time).
_SAMPLES = 3
_SAMPLE_GAP_S = 0.0002


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def idle_cores() -> int:
    """Cores that no other process is running anything on right now (Linux: /proc/loadavg's
    count of runnable tasks, less this process's own). This process's threads are not
    counted: after a parallel op torch's OpenMP workers spin for a while, and counting them
    as busy halved the threads of every other vocabulary-wide product on two cores."""
    n = cores()
    running = n + 1
    try:
        # The fewest of a few samples: a task that runs for an instant is no contention.
        for i in range(_SAMPLES):
            if i:
                time.sleep(_SAMPLE_GAP_S)
            with open("/proc/loadavg") as f:
                running = min(running, int(f.read().split()[3].split("/")[0]))
    except (OSError, ValueError, IndexError):
        return n
    return max(1, min(n, n - max(0, running - _own_running())))


def _own_running() -> int:
    """This process's threads that are runnable now (the caller included)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        # the state follows the command, which is in parentheses and may hold spaces
        if stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"R":
            count += 1
    return max(1, count)


def threads_for(flops: float, device: torch.device | None = None) -> int:
    """torch threads for one op of `flops` on `device`: one unless it is big, on the CPU, and
    cores are idle (a GPU's op needs one host thread to launch it)."""
    on_cpu = device is None or device.type == "cpu"
    return 1 if flops < FAN_OUT_FLOPS or not on_cpu else idle_cores()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with torch's intra-op pool at `n` threads, then restore the caller's
    setting (a notebook's own torch work keeps its threads)."""
    # the first tensor query may reach here from several of DuckDB's threads at once: the
    # lazy import is finished under its lock (lazy.py), never by two threads together
    load(torch)
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
