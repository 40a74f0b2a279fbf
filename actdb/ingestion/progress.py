"""Progress on stderr: tqdm's bar on a terminal, a plain line now and then in a log file."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm


class ProgressLines:
    """tqdm's interface (update, close, context manager) writing one plain line every
    `every` seconds and at the end, for stderr that is a file or a pipe (a CI log), where a
    redrawn bar would leave a line of carriage returns."""

    def __init__(self, total: int, desc: str, *, every: float = 10.0, stream: Any = None) -> None:
        self.total, self.desc, self.every = total, desc, every
        self.stream = stream if stream is not None else sys.stderr
        self.n = self.shown = 0
        self.started = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        self.shown = self.n
        seconds = now - self.started
        rate = self.n / seconds if seconds > 0 else 0.0
        pct = 100.0 * self.n / self.total if self.total else 100.0
        print(f"{self.desc}: {self.n}/{self.total} tokens ({pct:.0f}%), {seconds:.0f} s, "
              f"{rate:.0f} tokens/s", file=self.stream, flush=True)

    def close(self) -> None:
        if self.n != self.shown:
            self._line(time.monotonic())

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: int, desc: str, *, enabled: bool) -> Any:
    """A tqdm bar when stderr is a terminal, plain lines when it is not, nothing if disabled."""
    if enabled and not sys.stderr.isatty():
        return ProgressLines(total, desc)
    return tqdm(total=total, unit="tok", unit_scale=True, disable=not enabled, desc=desc,
                dynamic_ncols=True)
