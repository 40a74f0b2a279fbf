"""The one retry loop: a step tried again, after growing pauses, while it fails in a way that
may pass (a lock held by another process, a lease not yet run out), until a deadline.

>>> tries = []
>>> def step() -> str:
...     tries.append(1)
...     if len(tries) < 3:
...         raise BlockingIOError
...     return "taken"
>>> retry(step, again=lambda e: isinstance(e, BlockingIOError), pause=0.001)
'taken'
>>> len(tries)
3
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def retry(step: Callable[[], T], *, again: Callable[[Exception], bool],
          deadline: float | None = None, pause: float = 0.002, longest: float = 0.05,
          grow: float = 2.0) -> T:
    """`step()`'s value, trying it again while it raises an exception for which `again`
    holds, sleeping `pause` seconds between tries (times `grow` each time, at most `longest`);
    past `deadline` (a `time.monotonic()` value; None: none) the exception is raised, as is
    any other at once. Polling, never a blocking wait: Ctrl-C (or a task's cancellation) ends
    the wait between two tries."""
    while True:
        try:
            return step()
        except Exception as e:
            if not again(e) or (deadline is not None and time.monotonic() >= deadline):
                raise
        time.sleep(pause)
        pause = min(pause * grow, longest)


__all__ = ["retry"]
