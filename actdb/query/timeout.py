"""A query's time limit: DuckDB's interrupt from a timer, and a flag the tensor functions check.

DuckDB stops a query between the chunks of rows it processes once its connection is
interrupted, and leaves the connection ready for the next query. A tensor function is a Python
UDF running inside one such step, where DuckDB cannot reach it, so the timer also sets a flag:
each UDF call checks it on entry, and the long loops inside one call (a bulk window, the
vocabulary-wide blocks of the logit lens) check it between their steps (`check`), so work
already in flight stops too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import QueryError, QueryTimeoutError

# The flag of the query the current thread is computing a tensor function for (`watching`).
_local = threading.local()


def check_seconds(timeout: Any) -> float | None:
    """`timeout` as seconds (None: no limit); a QueryError unless a positive number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            math.isfinite(timeout) and timeout > 0):
        raise QueryError(f"timeout is a number of seconds above 0 (or None for no limit), "
                         f"not {timeout!r}")
    return float(timeout)


class TimeLimit:
    """The limit of one connection's queries, and the flag its tensor functions watch.

    Args:
        con: the DuckDB connection the queries run on (what the timer interrupts).
        stop: the flag its UDFs watch (execute.ErrorBox.stop), set when a query passes its
            limit.
    """

    def __init__(self, con: Any, stop: threading.Event) -> None:
        self.con = con
        self.stop = stop

    @contextmanager
    def running(self, seconds: float | None) -> Iterator[None]:
        """Run the block under a limit of `seconds` (None: none): past it, DuckDB is
        interrupted and the UDFs stop, and whatever the block raises becomes one
        QueryTimeoutError. A generator's close (GeneratorExit) passes through untouched."""
        if seconds is None:
            yield
            return
        lock = threading.Lock()
        live = [True]  # the timer interrupts only while the block runs

        def fire() -> None:
            with lock:
                if live[0]:
                    self.stop.set()
                    self.con.interrupt()

        self.stop.clear()
        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        except BaseException as e:
            # DuckDB's interrupt (read as Ctrl-C: result.translate), a UDF's stop, or a
            # streamed batch's error: once the limit has passed, each is the limit
            if self.stop.is_set() and not isinstance(e, GeneratorExit):
                raise exceeded(seconds) from None
            raise
        finally:
            with lock:
                live[0] = False
            timer.cancel()
            self.stop.clear()


def exceeded(seconds: float) -> QueryTimeoutError:
    """The one sentence for a query stopped at its limit (here, or on a cluster's workers)."""
    return QueryTimeoutError(f"the query ran past its time limit of {seconds:g} s and was "
                             "stopped; narrow it (WHERE, LIMIT) or give a longer timeout")


@contextmanager
def watching(stop: threading.Event) -> Iterator[None]:
    """Make `stop` the flag `check` reads in this thread while a tensor function runs."""
    before = getattr(_local, "stop", None)
    _local.stop = stop
    try:
        check()
        yield
    finally:
        _local.stop = before


def check() -> None:
    """Raise QueryTimeoutError if the query this thread computes for passed its limit."""
    stop = getattr(_local, "stop", None)
    if stop is not None and stop.is_set():
        raise QueryTimeoutError("the query was stopped at its time limit")


__all__ = ["TimeLimit", "check", "check_seconds", "exceeded", "watching"]
