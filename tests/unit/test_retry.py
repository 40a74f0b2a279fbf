"""The one retry helper (store/retry.py): retried while `again` holds, until the deadline."""

from __future__ import annotations

import time

import pytest

from actdb.store.retry import retry


def test_a_step_is_retried_until_it_succeeds() -> None:
    tries: list[float] = []

    def step() -> str:
        tries.append(time.monotonic())
        if len(tries) < 4:
            raise BlockingIOError
        return "taken"

    assert retry(step, again=lambda e: isinstance(e, BlockingIOError), pause=0.001) == "taken"
    assert len(tries) == 4
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert all(g >= 0.001 for g in gaps) and gaps[2] >= 0.004  # 1, 2, then 4 ms


def test_an_error_not_worth_retrying_is_raised_at_once() -> None:
    tries = []

    def step() -> None:
        tries.append(1)
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        retry(step, again=lambda e: isinstance(e, BlockingIOError))
    assert tries == [1]


def test_past_the_deadline_the_last_error_is_raised() -> None:
    start = time.monotonic()
    with pytest.raises(BlockingIOError):
        retry(lambda: (_ for _ in ()).throw(BlockingIOError()), again=lambda e: True,
              deadline=start + 0.05, pause=0.005, grow=1.0)
    assert 0.05 <= time.monotonic() - start < 1.0
