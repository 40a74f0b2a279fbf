"""The `actdb` command: parse argv, call one library function, print.

Library errors become `click.ClickException` here and nowhere else (exit 1, one sentence on
stderr); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from .errors import ActdbError, QuerySyntaxError

F = TypeVar("F", bound=Callable[..., Any])


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@contextmanager
def _errors(ctx: click.Context) -> Iterator[None]:
    """ActdbError -> one sentence and exit 1 (or the traceback with --debug)."""
    try:
        yield
    except ActdbError as e:
        if ctx.obj and ctx.obj.get("debug"):
            raise
        text = e.with_caret() if isinstance(e, QuerySyntaxError) else str(e)
        raise click.ClickException(text) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="actdb")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """actdb: every normalization site's input, on the unit sphere, queryable with SQL.

    \b
    Example:
      actdb ingest runs.actdb --model gpt2 --prompts prompts.txt
      actdb query runs.actdb "SELECT layer, cosine_to_anchor(vec, ' Paris') FROM acts LIMIT 5"
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


@cli.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--model", "model", required=True, help="Hugging Face hub name or local path.")
@click.option("--prompts", "prompts", required=True,
              help="A .txt file (a prompt per line), a .jsonl file (text + extra fields), "
                   "or - for stdin.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--max-length", type=click.IntRange(min=1), default=None,
              help="Truncate prompts to this many tokens (the summary counts those cut).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:i.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
              help="Model dtype: auto is float32 on CPU and the checkpoint's dtype on CUDA.")
@click.option("--sites", default=None,
              help="Comma-separated globs over site names or module paths, e.g. 'blocks.*.ln1'.")
@click.option("--name", default=None, help="Name of the model in the store (default: derived).")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=None,
              help="Token rows per Zarr chunk (default: about 2 MiB per chunk).")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.pass_context
def ingest(ctx: click.Context, store: Path, progress: bool | None, **kw: Any) -> None:
    """Run a model over prompts; store every norm site's input in STORE.

    Safe to run again: prompts already stored for the model are skipped, so an
    interrupted ingest resumes where it stopped.

    \b
    Example:
      actdb ingest runs.actdb --model gpt2 --prompts examples/prompts.txt --batch-size 16
    """
    from .ingest import IngestPlan
    from .ingest import ingest as run_ingest

    def announce(plan: IngestPlan) -> None:
        click.echo(
            f"ingesting {plan.prompts_todo} of {plan.prompts_total} prompts "
            f"({plan.tokens_todo} tokens x {plan.sites} sites) into {store}: "
            f"about {_human(plan.bytes_estimate)} on disk",
            err=True,
        )

    show = sys.stderr.isatty() if progress is None else progress
    with _errors(ctx):
        s = run_ingest(store, progress=show, on_plan=announce, **kw)
    worst = max(s.max_rel_error.values(), default=0.0)
    click.echo(
        f"model {s.model!r}: {s.prompts_new} prompts ingested, {s.prompts_skipped} already "
        f"stored, {s.prompts_truncated} truncated; {s.tokens_written} tokens x {s.sites} sites "
        f"in {s.seconds:.1f} s ({s.tokens_per_second:.0f} tokens/s); "
        f"{_human(s.bytes_stored)} stored; worst relative error {worst:.1e}"
    )


@cli.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.argument("sql")
@click.option("--format", "fmt", default="table", show_default=True,
              type=click.Choice(["table", "csv", "json", "parquet"]),
              help="json is JSON Lines: one object per row.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Write to this file instead of stdout (required for parquet).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:i.")
@click.option("-p", "--param", "params", multiple=True, metavar="NAME=VALUE",
              help="Bind $NAME in the query (repeatable); numbers bind as numbers.")
@click.option("--table", "tables", multiple=True, metavar="NAME=FILE",
              help="Make FILE (.csv, .parquet, .jsonl/.json) a read-only table NAME for the "
                   "query (repeatable); queries cannot read files otherwise.")
@click.pass_context
def query(ctx: click.Context, store: Path, sql: str, fmt: str, output: Path | None,
          device: str, params: tuple[str, ...], tables: tuple[str, ...]) -> None:
    """Run a read-only SQL query (DuckDB dialect) with the tensor functions.

    Queries run sandboxed: one SELECT, no files except those named with --table.

    \b
    Example:
      actdb query runs.actdb "SELECT layer, token, nearest_anchors(vec, 3) AS near
        FROM acts WHERE prompt_id = \\$p AND role = 'pre_attn'" -p p=3
      actdb query runs.actdb "SELECT l.label, count(*) FROM prompts p
        JOIN labels l USING (prompt_id) GROUP BY 1" --table labels=labels.csv
    """
    from . import connect
    from .query.output import check_output, write_result

    if fmt == "parquet" and output is None:
        raise click.UsageError("parquet output needs -o FILE")
    bound = dict(_parse_param(p) for p in params) if params else None
    named = [_parse_table(t) for t in tables]
    with _errors(ctx):
        if output is not None:
            check_output(output)
        with connect(store, device=device) as db:
            for name, path in named:
                db.register(name, path)
            result = db.sql(sql, params=bound)
            write_result(result, fmt, output)


def _parse_table(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise click.BadParameter(f"{text!r} is not NAME=FILE", param_hint="--table")
    return name, Path(path)


def _parse_param(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise click.BadParameter(f"{text!r} is not NAME=VALUE", param_hint="--param")
    name, value = text.split("=", 1)
    for cast in (int, float):
        try:
            return name, cast(value)
        except ValueError:
            pass
    return name, value


@cli.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.pass_context
def info(ctx: click.Context, store: Path) -> None:
    """Models, prompts, sites (role, kind, faithfulness) and bytes on disk.

    \b
    Example:
      actdb info runs.actdb
    """
    from . import connect

    with _errors(ctx), connect(store) as db:
        i = db.info()
    sizes = ", ".join(f"{k} {_human(v)}" for k, v in i.bytes_on_disk.items() if k != "total")
    click.echo(f"store {i.path} (format {i.format_version}): "
               f"{_human(i.bytes_on_disk['total'])} on disk ({sizes})")
    click.echo(f"{i.n_prompts} prompts, {len(i.models)} models")
    for m in i.models:
        click.echo(
            f"\nmodel {m['model']!r}: {m['architecture']}, d={m['d_model']}, "
            f"{m['n_layers']} layers, vocab {m['vocab_size']}, "
            f"LM head {'yes' if m['has_lm_head'] else 'no'}, {m['prompts']} prompts, "
            f"{m['tokens']} tokens, {m['n_sites']} sites, {m['dtype']}, from {m['source']}"
        )
        click.echo(f"  {'site':<22} {'layer':>5}  {'role':<10} {'kind':<11} {'d':>5}  "
                   f"{'heads':>5}  {'max rel err':>11}  module")
        for s in (s for s in i.sites if s["model"] == m["model"]):
            err = s["max_rel_error"]
            err_text = "-" if err is None or err != err else f"{err:.1e}"
            heads = "-" if s["n_heads"] is None or s["n_heads"] != s["n_heads"] else int(
                s["n_heads"])
            click.echo(f"  {s['site']:<22} {s['layer']:>5}  {s['role']:<10} {s['kind']:<11} "
                       f"{s['d']:>5}  {heads!s:>5}  {err_text:>11}  {s['module']}")


@cli.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--full", is_flag=True,
              help="Also read every stored chunk and weight and check its checksum.")
@click.pass_context
def verify(ctx: click.Context, store: Path, full: bool) -> None:
    """Check that the catalog and the tensors agree; exit 1 listing the problems.

    \b
    Example:
      actdb verify runs.actdb --full
    """
    from . import connect

    with _errors(ctx), connect(store) as db:
        problems = db.verify(full=full)
        n_models = len(db.info().models)
        checksums = db.store.has_checksums
    if problems:
        for p in problems:
            click.echo(f"problem: {p}", err=True)
        raise click.ClickException(f"{len(problems)} problems found in {store}")
    note = ""
    if full and not checksums:
        note = ("; format 1 store: chunks written by format 1 carry no checksums, so only "
                "their sizes were checked (ingest into a new store to get them)")
    click.echo(f"ok: {store} is consistent ({n_models} models{note})")


@cli.command()
@click.option("--format", "fmt", default="table", type=click.Choice(["table", "json"]),
              show_default=True)
def functions(fmt: str) -> None:
    """List the tensor functions with their signatures and one-line docs.

    \b
    Example:
      actdb functions
    """
    from .query.functions import describe

    rows = describe()
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(f"{r['signature']}\n    {r['doc']}")


def _add_plot_commands() -> None:
    """`actdb plot ...` lives with the pictures (actdb/plot/commands.py)."""
    from .plot.commands import plot

    cli.add_command(plot)


_add_plot_commands()


def main() -> None:
    cli(prog_name="actdb")


if __name__ == "__main__":
    main()
