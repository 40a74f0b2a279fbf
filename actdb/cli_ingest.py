"""The `actdb ingest` command: run a model over inputs into a store, and say what it stored.

Library errors become one sentence at the CLI's edge (cli_exit.py), as in cli.py.
"""

from __future__ import annotations

from typing import Any

import click

from .cli_args import shard_option
from .cli_exit import interrupted, one_sentence


def human(n: float) -> str:
    """A byte count for people: 1.2 MB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@click.command()
@click.argument("store", type=click.Path(path_type=str))
@click.option("--model", "model", required=True,
              help="Hugging Face hub name, model folder, or .gguf file (or a folder holding one).")
@click.option("--prompts", "prompts", default=None,
              help="A .txt file (a prompt per line), a .jsonl file (text + extra fields), "
                   "or - for stdin.")
@click.option("--images", "images", default=None, metavar="DIR",
              help="A folder of image files (one input each, sorted by name), instead of "
                   "--prompts.")
@click.option("--inputs", "inputs", default=None, metavar="FILE.jsonl",
              help="JSON Lines with any of text, image, video (a file or a folder of frames) "
                   "and audio (a sound file) per line (paths relative to the file), target "
                   "(what an encoder-decoder's decoder reads), plus extra fields.")
@click.option("--processor", default=None, metavar="PATH",
              help="A processor folder that prepares the images or sounds (default: the "
                   "model's own).")
@click.option("--labels", "labels", default=None, metavar="FILE",
              help="A contrastive model's (CLIP, SigLIP) labels, one a line: the anchor set "
                   "'labels', embedded by its text tower, a zero-shot lens on the images.")
@click.option("--label-template", "label_template", default=None, metavar="TEXT",
              help="How each label is said to the text tower, {} for the label (default: "
                   "'a photo of a {}').")
@click.option("--prompts-format", type=click.Choice(["txt", "jsonl"]), default=None,
              help="Read --prompts in this format, whatever its suffix (default: from the "
                   "suffix; stdin is JSONL when its first line starts with '{').")
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
              help="Token rows per Zarr chunk (default: a power of two, at least 64, giving "
                   "about 256 KiB of float16 directions per chunk).")
@click.option("--device-map", default=None,
              help="Spread a model too large for one device over several (accelerate's "
                   "device_map, e.g. auto); hooks capture wherever each module lives.")
@click.option("--progress/--no-progress", default=None,
              help="Progress on stderr: a bar on a terminal, a plain line every few seconds "
                   "otherwise (default: on unless -q).")
@click.option("--chat-template", is_flag=True,
              help="Wrap each prompt as a user turn with the tokenizer's chat template "
                   "(instruct models); the templated text is the stored prompt.")
@click.option("--shard", default=None, metavar="I/N", callback=shard_option,
              help="Be worker I (from 0) of N ingesting shares of the prompts into STORE side "
                   "by side; `actdb merge STORE` makes them visible when all have finished.")
@click.option("--cluster", default=None, metavar="ADDRESS|local:N",
              help="Run one shard ingest per Dask worker (a scheduler address, or local:N "
                   "worker processes here), then merge them.")
@click.option("--weights", type=click.Choice(["all", "none"]), default="all", show_default=True,
              help="Store a new model's attention and MLP matrices per layer, and each head's "
                   "OV and QK circuits, beside its embedding and head.")
@click.option("--attention", is_flag=True, default=False,
              help="Also store every head's attention weights for each prompt (a second, "
                   "eager forward pass per batch), queried as the view `attention`.")
@click.option("--lens", "lens", type=click.IntRange(min=0, max=1000), default=None, metavar="K",
              help="Store the logit lens of every residual row: its top K tokens, log-sum-exp, "
                   "entropy and the model's own prediction's rank; the lens functions read it "
                   "(default: 10 on a GPU, 0 (none) on a CPU, where it costs more than the "
                   "forward pass).")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.pass_context
def ingest(ctx: click.Context, store: str, progress: bool | None, quiet: bool,
           **kw: Any) -> None:
    """Run a model over prompts or images; store every norm site's input in STORE.

    Safe to run again: prompts already stored for the model are skipped, so an
    interrupted ingest (Ctrl-C, exit 130) resumes where it stopped. --model takes a hub name,
    a model folder, or a .gguf file (or a folder holding one).

    \b
    Example:
      actdb ingest runs.actdb --model gpt2 --prompts examples/prompts.txt --batch-size 16
      actdb ingest runs.actdb --model gpt2 --prompts examples/prompts.txt --lens 10
      actdb ingest runs.actdb --model HuggingFaceTB/SmolLM2-135M-Instruct \\
          --prompts examples/prompts.txt --chat-template
      actdb ingest runs.actdb --model gpt2 --prompts examples/prompts.txt --shard 0/2
      actdb ingest runs.actdb --model gpt2 --prompts examples/prompts.txt --cluster local:2
      actdb ingest vision.actdb --model ./vit-digits --images ./digits
      actdb ingest clip.actdb --model ./clip --images ./photos --labels labels.txt
    """
    from .ingestion import IngestPlan
    from .ingestion import ingest as run_ingest

    if sum(kw[k] is not None for k in ("prompts", "images", "inputs")) != 1:
        raise click.UsageError("give one of --prompts, --images and --inputs")
    planned: list[IngestPlan] = []

    def announce(plan: IngestPlan) -> None:
        planned.append(plan)
        if quiet:
            return
        click.echo(
            f"ingesting {plan.prompts_todo} of {plan.prompts_total} prompts "
            f"({plan.tokens_todo} tokens x {plan.sites} sites) into {store}: "
            f"about {human(plan.bytes_estimate)} on disk",
            err=True,
        )

    show = not quiet if progress is None else progress
    with one_sentence(ctx):
        try:
            s = run_ingest(store, progress=show, on_plan=announce, **kw)
        except KeyboardInterrupt:
            interrupted(store, planned[0] if planned else None)
    for warning in s.warnings:
        click.echo(f"note: {warning}", err=True)
    if quiet:
        return
    if s.note:
        click.echo(s.note)
        return
    if s.prompts_new == 0:  # no error figure to give: nothing ran through the model
        click.echo(f"model {s.model!r}: 0 prompts ingested, all {s.prompts_total} already "
                   "stored; nothing to do")
        return
    worst = max(s.max_rel_error.values(), default=0.0)
    click.echo(
        f"model {s.model!r}: {s.prompts_new} prompts ingested, {s.prompts_skipped} already "
        f"stored, {s.prompts_truncated} truncated; {s.tokens_written} tokens x {s.sites} sites "
        f"in {s.seconds:.1f} s ({s.tokens_per_second:.0f} tokens/s); "
        f"{human(s.bytes_stored)} stored (the store: {human(s.store_bytes)} on disk); "
        f"worst relative error {worst:.1e}"
    )
