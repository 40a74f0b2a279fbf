"""The `actdb` command: parse argv, call one library function, print.

Library errors become `click.ClickException` at the CLI's edge (cli_exit.py) and nowhere
else (exit 1, one sentence on stderr); `--debug` shows the traceback instead. Option values are
parsed in cli_args.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from . import __version__
from .cli_args import FORMAT_OF, parse_param, parse_tables, read_sql
from .cli_exit import exit_now, one_sentence
from .cli_ingest import human, ingest

F = TypeVar("F", bound=Callable[..., Any])

# NumPy's OpenBLAS starts a thread per core when numpy is imported, and they spin waiting for
# work, a noticeable share of a CLI query's start, for a pool actdb never
# uses (its matrix work is torch's, under the thread policy of query/threads.py). Set before
# anything imports numpy; a value the user set is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")




@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(version=__version__, prog_name="actdb")
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


cli.add_command(ingest)


@cli.command()
@click.argument("store", type=click.Path(path_type=str))
@click.pass_context
def merge(ctx: click.Context, store: str) -> None:
    """Merge the catalogs of finished shard ingests (--shard I/N) into STORE's, in one go.

    \b
    Example:
      actdb merge runs.actdb
    """
    from .ingestion import merge as run_merge

    with one_sentence(ctx):
        s = run_merge(store)
    if s.already_merged:
        model = "" if s.model is None else f"model {s.model!r}: "
        click.echo(f"{model}the shards of {store} are merged already (no shard ingest is left "
                   "to merge); nothing to do")
        return
    if s.finished_removal:
        click.echo(f"model {s.model!r}: its shards were already merged into {store} (by a "
                   "merge that stopped while removing them); removed what was left of them")
        return
    click.echo(f"model {s.model!r}: merged {s.shards} shards ({s.prompts} prompts, "
               f"{s.tokens} tokens) into {store}")


@cli.command()
@click.argument("store", type=click.Path(path_type=str))
@click.argument("sql", required=False)
@click.option("-f", "--file", "sql_file", default=None, metavar="FILE.sql",
              help="Read the SQL from this file (- for standard input).")
@click.option("--format", "fmt", default=None,
              type=click.Choice(["table", "csv", "json", "parquet"]),
              help="json is JSON Lines: one object per row. Default: from -o's extension "
                   "(.csv, .json, .jsonl, .ndjson: JSON Lines, .parquet), else table.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Write to this file instead of stdout (required for parquet).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:i.")
@click.option("-p", "--param", "params", multiple=True, metavar="NAME=VALUE",
              help="Bind $NAME in the query (repeatable); numbers bind as numbers.")
@click.option("--table", "tables", multiple=True, metavar="NAME=FILE",
              help="Make FILE (.csv, .parquet, .jsonl/.json) a read-only table NAME for the "
                   "query (repeatable); queries cannot read files otherwise.")
@click.option("--cluster", default=None, metavar="ADDRESS|local:N",
              help="Run the query on Dask: a scheduler address, or local:N to start N worker "
                   "processes here. What does not split runs here, with a note on stderr.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help="Stop the query after this many seconds (exit 1, one sentence); default: "
                   "no limit.")
@click.pass_context
def query(ctx: click.Context, store: str, sql: str | None, sql_file: str | None,
          fmt: str | None, output: Path | None, device: str, params: tuple[str, ...],
          tables: tuple[str, ...], cluster: str | None, timeout: float | None) -> None:
    """Run a read-only SQL query (DuckDB dialect) with the tensor functions.

    Queries run sandboxed: one SELECT, no files except those named with --table. The SQL is
    an argument, a file (-f FILE.sql) or standard input (- or -f -). vec handles are refused
    in csv, json and parquet output: select to_list(vec), or use actdb export.

    \b
    Example:
      actdb query runs.actdb "SELECT layer, token, nearest_anchors(vec, 3) AS near
        FROM acts WHERE prompt_id = \\$p AND role = 'pre_attn'" -p p=3
      actdb query runs.actdb -f lens.sql --format csv -o lens.csv
      actdb query runs.actdb "SELECT l.label, count(*) FROM prompts p
        JOIN labels l USING (prompt_id) GROUP BY 1" --table labels=labels.csv
      actdb query runs.actdb "SELECT layer, avg(norm) FROM acts GROUP BY layer"
        --cluster local:2
      actdb query runs.actdb "SELECT token, top_logits(vec, 5) FROM acts" --timeout 60
    """
    sql = read_sql(sql, sql_file)
    from . import connect
    from .query.output import check_output, write_result

    if fmt is None:
        suffix = output.suffix.lower() if output is not None else ""
        if suffix in (".npy", ".safetensors"):
            raise click.UsageError(f"query writes tables; for vectors in {suffix}, use actdb "
                                   "export (or give --format)")
        fmt = FORMAT_OF.get(suffix, "table")
    if fmt == "parquet" and output is None:
        raise click.UsageError("parquet output needs -o FILE")
    bound = dict(parse_param(p) for p in params) if params else None
    named = parse_tables(tables)
    with one_sentence(ctx):
        if output is not None:
            check_output(output)
        with connect(store, device=device, cluster=cluster, timeout=timeout) as db:
            for name, path in named:
                db.register(name, path)
            result = db.sql(sql, params=bound)
            write_result(result, fmt, output)
            if result.note is not None and not result.note.startswith("split"):
                click.echo(f"note: {result.note}", err=True)


@cli.command()
@click.argument("store", type=click.Path(path_type=str))
@click.argument("sql", required=False)
@click.option("-f", "--file", "sql_file", default=None, metavar="FILE.sql",
              help="Read the SQL from this file (- for standard input).")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="The file to write: .parquet, .npy or .safetensors picks the format.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:i.")
@click.option("-p", "--param", "params", multiple=True, metavar="NAME=VALUE",
              help="Bind $NAME in the query (repeatable); numbers bind as numbers.")
@click.pass_context
def export(ctx: click.Context, store: str, sql: str | None, sql_file: str | None,
           output: Path, device: str, params: tuple[str, ...]) -> None:
    """Write the vectors a query selects (views applied), with its other columns.

    The vectors: the vec column (or a view of it), or else a list of numbers the query
    computes, such as delta(vec) or mean_vector(list(vec)). parquet: the columns plus `vec` as
    a FLOAT[d] list column; safetensors: a `vec` tensor [N, d] and one tensor per numeric
    column; npy: the matrix [N, d] alone.

    \b
    Example:
      actdb export runs.actdb "SELECT prompt_id, position, layer, vec FROM acts
        WHERE role = 'pre_attn'" -o pre_attn.parquet
    """
    from . import connect

    sql = read_sql(sql, sql_file)
    bound = dict(parse_param(p) for p in params) if params else None
    with one_sentence(ctx), connect(store, device=device) as db:
        done = db.export(sql, output, params=bound)
    beside = f" with {len(done.columns)} other columns" if done.columns else ""
    click.echo(f"wrote {done.rows} vectors of d={done.d}{beside} to {output}")
    if done.left_out:
        click.echo(f"note: {output.suffix} holds the matrix alone; the query's other columns "
                   f"({', '.join(done.left_out)}) were not written: export to .parquet or "
                   ".safetensors to keep them", err=True)


@cli.command()
@click.argument("store", type=click.Path(path_type=str))
@click.pass_context
def info(ctx: click.Context, store: str) -> None:
    """Models, prompts, sites (role, kind, faithfulness) and bytes on disk.

    \b
    Example:
      actdb info runs.actdb
    """
    from . import connect

    with one_sentence(ctx), connect(store) as db:
        i = db.info()
    sizes = ", ".join(f"{k} {human(v)}" for k, v in i.bytes_on_disk.items() if k != "total")
    click.echo(f"store {i.path} (format {i.format_version}): "
               f"{human(i.bytes_on_disk['total'])} on disk ({sizes})")
    click.echo(f"{_count(i.n_prompts, 'prompt')}, {_count(len(i.models), 'model')}")
    for m in i.models:
        click.echo(
            f"\nmodel {m['model']!r}: {m['architecture']}, d={m['d_model']}, "
            f"{m['n_layers']} layers, vocab {m['vocab_size']}, "
            + _head_text(m)
            + f"{m['prompts']} prompts, "
            f"{m['tokens']} tokens, {m['n_sites']} sites, {m['dtype']}, from {m['source']}"
        )
        if m["has_lm_head"]:
            click.echo(f"  logits: {_logit_text(m)}")
        if m["has_lm_head"] and m.get("head_kind") in (None, "lm"):
            click.echo(f"  materialized lens: {_lens_text(m)}")
        click.echo(f"  layer weights: {_weights_text(m.get('weights'))}")
        click.echo(f"  {'site':<22} {'layer':>5}  {'role':<10} {'kind':<11} {'d':>5}  "
                   f"{'heads':>5}  {'max rel err':>11}  module")
        for s in (s for s in i.sites if s["model"] == m["model"]):
            err = s["max_rel_error"]
            err_text = "-" if err is None or err != err else f"{err:.1e}"
            heads = "-" if s["n_heads"] is None or s["n_heads"] != s["n_heads"] else int(
                s["n_heads"])
            click.echo(f"  {s['site']:<22} {s['layer']:>5}  {s['role']:<10} {s['kind']:<11} "
                       f"{s['d']:>5}  {heads!s:>5}  {err_text:>11}  {s['module']}")


def _lens_text(m: dict[str, object]) -> str:
    """Whether the model stores its logit lens, and why not where it does not."""
    k = _number(m.get("lens_k"))
    if not k:
        return ("none (the default on a CPU, where its products with the vocabulary cost more "
                "than the forward pass; `actdb ingest --lens K` stores it): the lens functions "
                "multiply by the vocabulary")
    return (f"top {int(k)} tokens, log-sum-exp, entropy and the prediction's rank per row, "
            "proven at ingest against the model's logits; top_logits (k <= "
            f"{int(k)}), entropy, and prob, logprob and token_rank of those tokens read it")


def _weights_text(w: dict[str, Any] | None) -> str:
    """What of the blocks' matrices the store holds, and what it adds on disk."""
    if w is None:
        return "none stored (ingested with --weights none, or before weights were stored)"
    text = (f"{human(w['bytes'])} (attention of {_count(w['attention_layers'], 'layer')}, "
            f"MLP of {_count(w['mlp_layers'], 'layer')}, with each head's OV and QK circuits)")
    for r in w["refused"]:
        text += f"\n    not stored: layer {r['layer']} {r['part']} ({r['module']}): {r['reason']}"
    return text


def _number(v: object) -> float | None:
    return None if v is None or v != v else float(v)  # type: ignore[arg-type]


def _count(n: int, noun: str) -> str:
    """'1 model', '2 models'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _head_text(m: dict[str, object]) -> str:
    """What the model's head is, in the words of `info`'s model line."""
    kind = m.get("head_kind")
    if kind == "classifier" and m.get("head_pool") == "mean":
        return ("classifier head averaging its positions (its labels are the vocabulary; each "
                "position's logits at the final site are its vote, the model's answer their "
                "mean), ")
    if kind == "classifier":
        return "classifier head (its labels are the vocabulary), "
    note = m.get("head_note")
    if isinstance(note, str) and note:
        return f"no head anchors ({note}), "
    if kind == "labels":
        lens = ("a zero-shot lens on the class token" if _number(m.get("head_position"))
                is not None else "no lens: its image embedding pools every position")
        return f"contrastive, labels as anchors ({lens}), "
    if kind == "contrastive":
        return "contrastive, no labels (no anchors: ingest with --labels FILE), "
    return f"LM head {'yes' if m['has_lm_head'] else 'no'}, "


def _logit_text(m: dict[str, object]) -> str:
    """How the model's logits are made, and how well the store reproduces them."""
    scale, cap = _number(m.get("logit_scale")), _number(m.get("logit_softcap"))
    pre = "W_U . final_norm(x) + b_U"
    if m.get("head_kind") == "classifier" and m.get("head_pool") == "mean":
        pre = ("mean over an input's positions of W . final_norm(x) + b (W, b: the head "
               "composed with the linear layers before its mean)")
    if m.get("head_kind") == "labels":  # labels.py: a cosine with each label's embedding
        pre = ("W . y / ||P y|| + b (y = final_norm(x), W = the labels read through P)"
               if _number(m.get("head_position")) is not None else
               "cos(image embedding, label) + b (the model's own pooled embedding: no site)")
    if scale is None and cap is None:
        formula = pre
    else:
        formula = "pre" if scale is None else f"{scale:.6g} * pre"
        if cap is not None:
            formula = f"{cap:.6g} * tanh({formula} / {cap:.6g})"
        formula = f"{formula} with pre = {pre}"
    err = _number(m.get("logit_max_rel_error"))
    proof = "not checked" if err is None else f"max rel err {err:.1e} against the model's own"
    return f"{formula}; {proof}"


@cli.command()
@click.argument("store", type=click.Path(path_type=str))
@click.option("--full", is_flag=True,
              help="Also read every stored chunk and weight and check its checksum.")
@click.pass_context
def verify(ctx: click.Context, store: str, full: bool) -> None:
    """Check that the catalog and the tensors agree; exit 1 listing the problems.

    \b
    Example:
      actdb verify runs.actdb --full
    """
    from . import connect

    with one_sentence(ctx), connect(store) as db:
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
    click.echo(f"ok: {store} is consistent ({_count(n_models, 'model')}{note})")


@cli.command()
@click.argument("store", type=click.Path(path_type=str))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("report.html"), show_default=True, help="The HTML file to write.")
@click.option("--model", "models", multiple=True,
              help="Model to report on; repeatable (default: every model in the store).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:i.")
@click.pass_context
def report(ctx: click.Context, store: str, output: Path, models: tuple[str, ...],
           device: str) -> None:
    """Run the papers' measurements on a store and write them as one HTML page.

    Angle to the all-ones vector, norms and outlier positions, rotation by the norm, the
    covariance spectrum of normalized vectors, where the answer appears on the logit lens
    and which dims push toward it: each a figure (inline), the SQL that made it, the
    published claim and what this model shows.

    \b
    Example:
      actdb report runs.actdb -o report.html
    """
    from .plot.report import report as write_report

    if output.suffix.lower() not in (".html", ".htm"):
        raise click.BadParameter(f"{str(output)!r} must end in .html", param_hint="-o")
    with one_sentence(ctx):
        path = write_report(store, output, models=list(models) or None, device=device)
    click.echo(f"wrote {path}")


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


@cli.command()
@click.argument("store", type=click.Path(path_type=str))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; any but 127.0.0.1, localhost or ::1 needs a token "
                   "(one is made and printed when --token is not given).")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free one; the printed address says which).")
@click.option("--query-timeout", default=30.0, show_default=True, metavar="SECONDS",
              type=click.FloatRange(min=0, min_open=True),
              help="Cancel a query that runs longer than this.")
@click.option("--max-rows", default=10_000, show_default=True, type=click.IntRange(min=1),
              help="Most rows in one answer; the answer says when more were left out.")
@click.option("--token", default=None,
              help="Every request must carry this token (at least 16 of A-Z a-z 0-9 - . _ ~).")
@click.option("--connections", default=None, type=click.IntRange(min=1),
              help="Queries run at once, each on its own read-only connection (default: the "
                   "cores, 2 to 8); more requests wait in line.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:i.")
@click.pass_context
def serve(ctx: click.Context, store: str, **kw: Any) -> None:
    """Explore STORE in a browser: the lens grid, a cell's anchors and dims, trajectories
    across layers, and an SQL editor; POST /api/query {"sql", "params"} answers
    {"columns", "rows"}. Read-only, through the same sandbox as `actdb query`.

    \b
    Example:
      actdb serve runs.actdb
      actdb serve runs.actdb --host 0.0.0.0 --port 8080 --query-timeout 10
    """
    from .serve import serve as run_server

    with one_sentence(ctx):
        run_server(store, announce=lambda line: click.echo(line, err=False), **kw)


def _add_plot_commands() -> None:
    """`actdb plot ...` lives with the pictures (actdb/plot/commands.py)."""
    from .plot.commands import plot

    cli.add_command(plot)


_add_plot_commands()


def main() -> None:
    """The `actdb` command: click's standalone run, then an exit that skips tearing the
    interpreter down once nothing is left to wait for."""
    try:
        cli.main(prog_name="actdb")
    except SystemExit as e:
        exit_now(e.code)
    exit_now(0)


if __name__ == "__main__":
    main()
