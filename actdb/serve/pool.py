"""The explorer's queries: read-only connections, each owned by one thread, with a time limit,
a row limit and cancellation.

A DuckDB connection runs one query at a time, so the server keeps `size` worker threads and
each opens its own `actdb.connect(store)` (a snapshot of the committed catalog, the same
sandbox as every query). A request becomes a `Job` handed to the pool through a queue; the
job's worker runs it and answers through a future. The time limit is the connection's own
(`actdb.connect(..., timeout=)`: DuckDB interrupted and the tensor functions stopped). A job
whose client goes away is cancelled: DuckDB is interrupted on that worker's connection, which
stops the query between chunks of rows and leaves the connection ready for the next one.

A connection sees the store as it was when it was opened, as every reader does; a worker
opens a fresh one when its snapshot is older than `refresh_seconds`, so prompts an ingest
commits meanwhile appear on the explorer's next queries, and when another worker has opened a
newer one, so that a page's next query never sees less than its last (each would otherwise
answer from a snapshot of its own age).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ActdbError, QueryCancelledError, QueryTimeoutError

if TYPE_CHECKING:
    import pyarrow as pa

    from ..query import Database

# A worker's connection older than this is replaced before its next job.
REFRESH_SECONDS = 5.0


@dataclass(frozen=True, kw_only=True)
class Answer:
    """A query's rows (at most the row limit) and whether more were left out."""

    table: pa.Table
    truncated: bool
    max_rows: int
    seconds: float


# What a job runs on a worker's connection: its rows, or an ActdbError.
Work = Callable[["Database"], Any]


class Job:
    """One request's work, and the means to stop it while it runs."""

    def __init__(self, work: Work, timeout: float | None) -> None:
        self.work = work
        self.timeout = timeout
        self.future: Future[Any] = Future()
        self._lock = threading.Lock()
        self._db: Database | None = None  # the connection it runs on, while it runs
        self.started: float | None = None  # time.monotonic() when a worker took it
        self.reason: str | None = None  # why it was cancelled: "timeout", "gone", "closing"

    def cancel(self, reason: str) -> None:
        """Stop the job: before it starts it never runs; while it runs, DuckDB is
        interrupted on its connection (its time limit is the connection's: this is for a
        client that went away, and for a job answered as overdue)."""
        with self._lock:
            if self.reason is not None or self.future.done():
                return
            self.reason = reason
            if self._db is not None:
                self._db.con.interrupt()

    def _start(self, db: Database) -> bool:
        with self._lock:
            if self.reason is not None:
                return False
            self._db = db
            self.started = time.monotonic()
            return True

    def overdue(self, grace: float) -> bool:
        """Whether the job has run `grace` seconds past its time limit: DuckDB checks its
        interrupt between chunks of rows, and a step that never ends one (a single huge
        tensor-function call) keeps the worker; its client is answered all the same."""
        return (self.timeout is not None and self.started is not None
                and time.monotonic() - self.started > self.timeout + grace)

    def _end(self) -> None:
        with self._lock:
            self._db = None

    def error(self) -> ActdbError:
        """The error a cancelled job answers with."""
        if self.reason == "timeout":
            return QueryTimeoutError(
                f"the query ran past the time limit of {self.timeout:g} s and was cancelled; "
                "narrow it (WHERE, LIMIT), or start the server with a longer --query-timeout")
        if self.reason == "closing":
            return QueryCancelledError("the query was cancelled: the server is stopping")
        return QueryCancelledError("the query was cancelled: its client went away")


class Pool:
    """`size` threads, each with its own read-only connection to `store`.

    Args:
        connect: opens a connection (`actdb.connect(store, timeout=...)`); called in the
            worker thread that will use it.
        size: how many queries run at once; more wait in line.
        refresh_seconds: a connection older than this is reopened before its next job.
    """

    def __init__(self, connect: Callable[[], Database], *, size: int,
                 refresh_seconds: float = REFRESH_SECONDS) -> None:
        self._connect = connect
        self._refresh = refresh_seconds
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._newest = 0.0  # time.monotonic() at which the newest snapshot was opened
        self._lock = threading.Lock()  # guards _newest and _running
        self._running: set[Job] = set()  # the jobs workers are running now (close stops them)
        self._threads = [threading.Thread(target=self._serve, name=f"actdb-serve-{i}",
                                          daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def submit(self, work: Work, *, timeout: float | None) -> Job:
        """Queue `work`; its result (or error) comes through `job.future`."""
        job = Job(work, timeout)
        self._jobs.put(job)
        return job

    def cancel_all(self) -> None:
        """Answer every job as cancelled: those waiting never run, running ones are
        interrupted (the server is stopping)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel("closing")
                job.future.set_exception(job.error())
        with self._lock:
            running = list(self._running)
        for job in running:
            job.cancel("closing")

    def close(self) -> None:
        """Stop the workers (cancelling what they run) and close their connections."""
        self.cancel_all()
        for _ in self._threads:
            self._jobs.put(None)  # a named message: stop
        deadline = time.monotonic() + 10
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        db: Database | None = None
        opened = 0.0
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if db is not None and (time.monotonic() - opened > self._refresh
                                   or opened < self._newest):
                db.close()
                db = None
            if db is None:
                started = time.monotonic()
                try:
                    db = self._connect()
                except BaseException as e:  # noqa: BLE001 - the request answers with it
                    job.future.set_exception(e)
                    continue
                opened = started
                with self._lock:
                    self._newest = max(self._newest, opened)
            db = self._run(job, db)
        if db is not None:
            db.close()

    def _run(self, job: Job, db: Database) -> Database | None:
        """Run one job on `db`; returns the connection to keep (None: it must be reopened)."""
        if not job._start(db):
            job.future.set_exception(job.error())
            return db
        with self._lock:
            self._running.add(job)
        keep: Database | None = db
        try:
            result = job.work(db)
        except BaseException as e:  # noqa: BLE001 - every outcome goes to the request
            # DuckDB's interrupt comes back as KeyboardInterrupt (query/result.py), and any
            # error raised once the job is cancelled is the cancellation
            if isinstance(e, QueryTimeoutError) and job.reason is None:
                job.reason = "timeout"  # answered in the server's words (--query-timeout)
            if job.reason is not None:
                job.future.set_exception(job.error())
            elif isinstance(e, ActdbError):
                job.future.set_exception(e)
            else:
                keep = None  # an unexpected failure: do not trust this connection again
                job.future.set_exception(e)
        else:
            if job.reason is not None:
                job.future.set_exception(job.error())
            else:
                job.future.set_result(result)
        finally:
            job._end()
            with self._lock:
                self._running.discard(job)
        if keep is None:
            db.close()
        return keep


def run_sql(db: Database, sql: str, params: dict[str, Any] | list[Any] | None,
            max_rows: int) -> Answer:
    """A query's first `max_rows` rows (DuckDB stops there), and whether there were more.
    Vec handles are refused as the CLI's json output refuses them."""
    from ..query.export import refuse_handles

    started = time.perf_counter()
    result = db.sql(sql, params=params)
    refuse_handles(result, "json")
    table = result.limit(max_rows + 1).to_arrow_table()
    truncated = table.num_rows > max_rows
    if truncated:
        table = table.slice(0, max_rows)
    return Answer(table=table, truncated=truncated, max_rows=max_rows,
                  seconds=time.perf_counter() - started)
