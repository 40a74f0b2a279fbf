"""benchmarks/method.py: a ratio is the median of per-round ratios, each round timing the two
sides back to back in alternating order; checked on a clock the timed functions move."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import method  # noqa: E402


class Clock:
    """perf_counter for method.py: each timed call advances it by the seconds it is given."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def side(self, name: str, seconds: list[float]) -> method.Fn:
        it = iter(seconds)

        def run() -> None:
            self.calls.append(name)
            self.now += next(it)

        return run


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(method.time, "perf_counter", c)
    return c


def test_paired_alternates_and_takes_the_median_of_round_ratios(clock: Clock) -> None:
    # warm-up, then rounds whose ratios are 2, 1 and 4; the medians' ratio would be 3 / 2
    ours = clock.side("a", [9.0, 2.0, 3.0, 8.0])
    theirs = clock.side("b", [9.0, 1.0, 3.0, 2.0])
    r = method.paired(ours, theirs, rounds=3)
    assert clock.calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert r.rounds == (2.0, 1.0, 4.0) and r.median == 2.0
    assert (r.lo, r.hi, r.spread) == (1.0, 4.0, "1..4")
    assert statistics.median(r.actdb) / statistics.median(r.baseline) != r.median
    inv = r.inverted()
    assert inv.rounds == (0.5, 1.0, 0.25) and inv.median == 0.5


def test_paired_many_pairs_actdb_with_each_baseline(clock: Clock) -> None:
    ours = clock.side("a", [1.0] * 10)
    got = method.paired_many(ours, {"b": clock.side("b", [2.0] * 5),
                                    "c": clock.side("c", [4.0] * 5)}, rounds=2)
    assert clock.calls == ["a", "b", "c", "a", "b", "a", "c", "b", "a", "c", "a"]
    assert got["b"].median == 0.5 and got["c"].median == 0.25


def test_setups_run_untimed_before_their_side(clock: Clock) -> None:
    seen: list[str] = []

    def setup() -> None:
        seen.append("setup")
        clock.now += 100.0  # not in the time

    r = method.paired(clock.side("a", [1.0] * 3), clock.side("b", [1.0] * 3), rounds=2,
                      actdb_setup=setup)
    assert r.rounds == (1.0, 1.0) and seen == ["setup"] * 3


def test_paired_times_on_the_clock_it_is_given(clock: Clock) -> None:
    """A `clock` (the CPU clock, in the selective workload) is what is timed; the wall clock
    the sides also move is not read."""
    cpu = Clock()

    def side(seconds: list[float]) -> method.Fn:
        it = iter(seconds)

        def run() -> None:
            cpu.now += next(it)
            clock.now += 1000.0  # wall time the given clock does not see

        return run

    r = method.paired(side([5.0, 3.0, 4.0]), side([5.0, 1.0, 8.0]), rounds=2, clock=cpu)
    assert r.rounds == (3.0, 0.5) and r.actdb == (3.0, 4.0) and r.baseline == (1.0, 8.0)
