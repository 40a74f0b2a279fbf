"""The CLI's edges: library errors as one sentence (exit 1), Ctrl-C (exit 130, saying what an
ingest saved), and the process's end once nothing is left to wait for."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from .errors import ActdbError, QuerySyntaxError


@contextmanager
def one_sentence(ctx: click.Context) -> Iterator[None]:
    """ActdbError -> one sentence and exit 1 (or the traceback with --debug); Ctrl-C -> exit
    130, as a shell gives (an ingest says first what it saved: `interrupted`)."""
    try:
        yield
    except ActdbError as e:
        if ctx.obj and ctx.obj.get("debug"):
            raise
        text = e.with_caret() if isinstance(e, QuerySyntaxError) else str(e)
        raise click.ClickException(text) from None
    except KeyboardInterrupt:
        if ctx.obj and ctx.obj.get("debug"):
            raise
        click.echo("\ninterrupted", err=True)
        raise SystemExit(130) from None


def interrupted(store: str, plan: Any) -> None:
    """Ctrl-C during an ingest: say what is saved and how to go on, exit 130 like a shell."""
    if plan is None:
        click.echo(f"\ninterrupted before any prompt was ingested into {store}; run the same "
                   "command again to start", err=True)
        raise SystemExit(130)
    from . import connect

    with connect(store) as db:
        row = db.sql("SELECT count(DISTINCT prompt_id) FROM tokens WHERE model = $m",
                     params={"m": plan.model}).fetchone()
    saved = int(row[0]) if row else 0
    click.echo(
        f"\ninterrupted: {saved} of {plan.prompts_total} prompts are saved in {store} for "
        f"model {plan.model!r}; run the same command again to resume", err=True)
    raise SystemExit(130)


def exit_now(code: object) -> None:
    """Exit with `code` as `sys.exit` does. When the command has returned and no thread is
    left that the ordinary exit would wait for (every store closed, every pool joined; daemon
    threads such as zarr's event loop it never waits for), run the exit handlers, flush the
    standard streams and end the process there: freeing every module and object of NumPy,
    DuckDB and Arrow one by one is a noticeable share of a short query's CPU, and
    leaves nothing on disk or on screen that the handlers and the flush do not. Otherwise the
    ordinary exit, which waits for those threads."""
    import threading

    main = threading.main_thread()
    if threading.current_thread() is not main or any(
            t is not main and not t.daemon for t in threading.enumerate()):
        raise SystemExit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    import atexit

    atexit._run_exitfuncs()
    for stream in dict.fromkeys((sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)):
        if stream is None or getattr(stream, "closed", False):
            continue  # as the ordinary exit: a closed stream is left alone
        try:
            stream.flush()
        except OSError:  # a closed pipe: the ordinary exit's status for it
            status = status or 120
    os._exit(status)
