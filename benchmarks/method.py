"""How every benchmark ratio is measured, so that none can flatter.

A ratio is the median of per-round ratios. Each round times actdb and its baseline back to
back, actdb first in odd rounds (1, 3, ...) and the baseline first in even ones, so that a load
that drifts from minute to minute, or a cache that one side warms for the other, meets both
alike; the spread of the rounds' ratios is printed beside the median. A ratio of medians
(times taken apart, then divided) hides a bad round and lets the two sides meet different
loads: nothing here computes one.

>>> import time
>>> r = paired(lambda: time.sleep(0.002), lambda: time.sleep(0.001), rounds=3)
>>> r.median > 1 and len(r.rounds) == 3 and r.lo <= r.median <= r.hi
True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Fn = Callable[[], Any]


@dataclass(frozen=True, kw_only=True)
class Ratio:
    """actdb's time over its baseline's: the median of `rounds`, each one round's ratio, with
    the two sides' seconds of each round beside them."""

    median: float
    lo: float
    hi: float
    rounds: tuple[float, ...]
    actdb: tuple[float, ...]
    baseline: tuple[float, ...]

    @classmethod
    def of(cls, actdb: list[float], baseline: list[float]) -> Ratio:
        """The ratio of two lists of per-round seconds (actdb's over the baseline's)."""
        return cls.from_rounds([a / b for a, b in zip(actdb, baseline, strict=True)],
                               actdb=actdb, baseline=baseline)

    @classmethod
    def from_rounds(cls, ratios: list[float], *, actdb: list[float] | None = None,
                    baseline: list[float] | None = None) -> Ratio:
        """The median and spread of per-round ratios computed elsewhere (e.g. a difference of
        two runs over another's)."""
        if not ratios:
            raise ValueError("a ratio needs at least one round")
        return cls(median=statistics.median(ratios), lo=min(ratios), hi=max(ratios),
                   rounds=tuple(ratios), actdb=tuple(actdb or ()),
                   baseline=tuple(baseline or ()))

    def inverted(self) -> Ratio:
        """The baseline's time over actdb's (a speed ratio: actdb rows/s over the
        baseline's), the median of the inverted rounds."""
        return Ratio.from_rounds([1 / r for r in self.rounds], actdb=list(self.baseline),
                                 baseline=list(self.actdb))

    @property
    def spread(self) -> str:
        """min..max of the rounds' ratios, as printed in BENCHMARKS.md."""
        return f"{self.lo:.3g}..{self.hi:.3g}"

    @property
    def seconds(self) -> float:
        """actdb's median seconds over the rounds."""
        return statistics.median(self.actdb)

    @property
    def baseline_seconds(self) -> float:
        """The baseline's median seconds over the rounds."""
        return statistics.median(self.baseline)

    def each(self) -> str:
        """Every round's ratio, in order, for a workload's figures."""
        return ", ".join(f"{r:.3g}" for r in self.rounds)


def _time(fn: Fn, setup: Fn | None, clock: Callable[[], float] | None = None) -> float:
    if setup is not None:
        setup()  # untimed: e.g. the chunk cache dropped, a competing load resumed
    now = clock or time.perf_counter
    t = now()
    fn()
    return now() - t


def paired(actdb_fn: Fn, baseline_fn: Fn, rounds: int, *, warmup: bool = True,
           actdb_setup: Fn | None = None, baseline_setup: Fn | None = None,
           clock: Callable[[], float] | None = None) -> Ratio:
    """actdb's time over the baseline's: `rounds` rounds after one untimed warm-up of each
    side, each round timing the two back to back, actdb first in odd rounds and the baseline
    first in even ones; a `*_setup` runs untimed just before its side each time. `clock`:
    what is timed (wall time by default; `time.process_time`: the CPU seconds of all the
    process's threads, which other processes on the machine move less)."""
    if warmup:
        _time(actdb_fn, actdb_setup, clock)
        _time(baseline_fn, baseline_setup, clock)
    ours: list[float] = []
    theirs: list[float] = []
    for k in range(1, rounds + 1):
        if k % 2 == 1:
            ours.append(_time(actdb_fn, actdb_setup, clock))
            theirs.append(_time(baseline_fn, baseline_setup, clock))
        else:
            theirs.append(_time(baseline_fn, baseline_setup, clock))
            ours.append(_time(actdb_fn, actdb_setup, clock))
    return Ratio.of(ours, theirs)


def paired_many(actdb_fn: Fn, baselines: dict[str, Fn], rounds: int, *, warmup: bool = True,
                actdb_setup: Fn | None = None) -> dict[str, Ratio]:
    """`paired` against several baselines: each round times actdb once beside each baseline,
    back to back in the alternating order, so every ratio's two sides are neighbours in time
    (actdb runs once per baseline per round)."""
    if warmup:
        _time(actdb_fn, actdb_setup)
        for fn in baselines.values():
            _time(fn, None)
    ours: dict[str, list[float]] = {k: [] for k in baselines}
    theirs: dict[str, list[float]] = {k: [] for k in baselines}
    for k in range(1, rounds + 1):
        for name, fn in baselines.items():
            if k % 2 == 1:
                ours[name].append(_time(actdb_fn, actdb_setup))
                theirs[name].append(_time(fn, None))
            else:
                theirs[name].append(_time(fn, None))
                ours[name].append(_time(actdb_fn, actdb_setup))
    return {name: Ratio.of(ours[name], theirs[name]) for name in baselines}


def median_time(fn: Fn, repeats: int, *, warmup: bool = True) -> float:
    """Median wall time of `fn` over `repeats` runs (after one warm-up): for a figure that
    no ratio is made from."""
    if warmup:
        fn()
    return statistics.median(_time(fn, None) for _ in range(repeats))
