"""The CLI's argv text turned into values: the SQL of a query, `-p NAME=VALUE`, `--table
NAME=FILE`, `--shard I/N`, the format an output file's extension names. A bad value is a
usage error (exit 2) naming the option."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click


def shard_option(ctx: click.Context, param: click.Parameter, value: str | None
                  ) -> tuple[int, int] | None:
    """--shard I/N checked here: a malformed one is a usage error (exit 2)."""
    if value is None:
        return None
    from .ingestion.shards import parse_shard

    try:
        return parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def read_sql(sql: str | None, file: str | None) -> str:
    """The query from the argument, a file (-f FILE) or standard input ('-')."""
    if sql is not None and file is not None:
        raise click.UsageError("give the SQL either as an argument or with -f, not both")
    source = file if file is not None else sql
    if source is None:
        raise click.UsageError("no SQL: give it as an argument, with -f FILE.sql, or - for stdin")
    if source == "-":
        return sys.stdin.read()
    if file is None:
        return source
    try:
        return Path(file).read_text(encoding="utf-8")
    except OSError as e:
        raise click.BadParameter(f"cannot read {file!r}: {e.strerror or e}",
                                 param_hint="-f") from None


# `query -o FILE` without --format: the format its extension names (json: JSON Lines, as
# --format json writes)
FORMAT_OF = {".csv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json",
              ".parquet": "parquet"}


def parse_tables(texts: tuple[str, ...]) -> list[tuple[str, Path]]:
    """--table NAME=FILE options; a name given twice (SQL names ignore case) is refused, where
    the last file would silently have hidden the first."""
    named: dict[str, tuple[str, Path]] = {}
    for text in texts:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{text!r} is not NAME=FILE", param_hint="--table")
        earlier = named.get(name.lower())
        if earlier is not None:
            raise click.BadParameter(
                f"table name {name!r} is given twice ({str(earlier[1])!r} and {path!r}); give "
                "each file its own name", param_hint="--table")
        named[name.lower()] = (name, Path(path))
    return list(named.values())


def parse_param(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise click.BadParameter(f"{text!r} is not NAME=VALUE", param_hint="--param")
    name, value = text.split("=", 1)
    for cast in (int, float):
        try:
            return name, cast(value)
        except ValueError:
            pass
    return name, value
