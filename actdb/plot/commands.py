"""`actdb plot ...`: draw a picture from a store into a PNG, SVG or PDF file (or print its SQL).

Library errors become `click.ClickException` here (exit 1, one sentence on stderr); a file name
with another extension is a usage error (exit 2). matplotlib loads only when a command runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..errors import ActdbError

if TYPE_CHECKING:  # the query layer loads when a picture is drawn, not with the CLI
    from ..query import Database

F = TypeVar("F", bound=Callable[..., Any])

ANCHOR_SETS = ("unembed", "embed", "unembed_folded")
EXTENSIONS = (".png", ".svg", ".pdf")


@contextmanager
def _errors(ctx: click.Context) -> Iterator[None]:
    """ActdbError -> one sentence and exit 1 (or the traceback with `actdb --debug`)."""
    try:
        yield
    except ActdbError as e:
        root = ctx.find_root().obj
        if isinstance(root, dict) and root.get("debug"):
            raise
        raise click.ClickException(str(e)) from None


def _check_output(ctx: click.Context, param: click.Parameter, value: Path | None
                  ) -> Path | None:
    if value is not None and value.suffix.lower() not in EXTENSIONS:
        raise click.BadParameter(
            f"{str(value)!r} must end in .png, .svg or .pdf (the extension picks the format)"
        )
    return value


def _common(func: F) -> F:
    """Options every picture takes: -o FILE, --sql, --device."""
    func = click.option("--device", default="auto", show_default=True,
                        help="Where the tensor functions run: auto, cpu, cuda or cuda:i.")(func)
    func = click.option("--sql", "show_sql", is_flag=True,
                        help="Print the SQL behind the picture (runnable with `actdb query`) "
                             "instead of drawing it.")(func)
    func = click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
                        default=None, callback=_check_output,
                        help="The file to write; .png, .svg or .pdf picks the format "
                             "(default: <kind>.png here).")(func)
    return func


def _draw(ctx: click.Context, kind: str, store: str, device: str, output: Path | None,
          show_sql: bool, make_spec: Callable[[Database], Any]) -> None:
    """Resolve the request, then print its SQL or draw and save the figure."""
    from . import figures
    from .data import inline_sql, opened
    from .patches import patches_figure

    draw = {"lens": figures.lens_figure, "angles": figures.profile_figure,
            "norms": figures.profile_figure, "rotation": figures.profile_figure,
            "dims": figures.dims_figure, "patches": patches_figure}[kind]
    with _errors(ctx), opened(store, device) as db:
        spec = make_spec(db)
        if show_sql:
            click.echo(inline_sql(spec.sql, spec.params))
            return
        fig = draw(spec, spec.run(db).df)
        path = figures.save(fig, output if output is not None else Path(f"{kind}.png"))
    click.echo(f"wrote {path}")


@click.group()
def plot() -> None:
    """Draw pictures of a store: PNG, SVG or PDF by the -o file's extension.

    Each picture comes from one SQL query through the query layer; --sql prints it.

    \b
    Example:
      actdb plot lens runs.actdb --prompt-id 3 -o lens.png
      actdb plot angles runs.actdb --model gpt2 --model pythia -o angles.svg
    """


@plot.command()
@click.argument("store", type=click.Path(path_type=str))
@click.option("--prompt-id", type=int, required=True, help="The prompt to follow.")
@click.option("--model", default=None, help="Model in the store (default: the only one).")
@click.option("--by", type=click.Choice(("logit", "anchor")), default=None,
              help="logit: the model's next-token distribution read at each layer (default "
                   "with an LM head); anchor: the nearest anchor on the sphere.")
@click.option("--token", default=None,
              help="With --by logit: show this token's rank and probability instead of the "
                   "top token, e.g. ' Paris' (a string that is one token, or a token id).")
@click.option("--anchors", type=click.Choice(ANCHOR_SETS), default=None,
              help="Anchor set for --by anchor (default: unembed with an LM head, else "
                   "embed); giving it implies --by anchor.")
@click.option("--role", default=None,
              help="Role of the sites to show, one per layer (default: pre_attn if present, "
                   "else post_mlp); the final norm is added when there is one.")
@_common
@click.pass_context
def lens(ctx: click.Context, store: str, prompt_id: int, model: str | None, by: str | None,
         token: str | None, anchors: str | None, role: str | None, output: Path | None,
         show_sql: bool, device: str) -> None:
    """The lens: layers (rows) by token positions (columns) for one prompt.

    By logit (the default with an LM head), each cell is the token the model's next-token
    distribution puts first when read at that layer, coloured by its probability; with
    --token, that token's rank, coloured by its probability. By anchor, the token of the
    nearest anchor, coloured by the cosine to it. The colour scale is fitted to the layers
    above the first.

    \b
    Example:
      actdb plot lens runs.actdb --prompt-id 3 -o lens.png
      actdb plot lens runs.actdb --prompt-id 3 --token ' Paris' -o paris.png
      actdb plot lens runs.actdb --prompt-id 3 --by anchor --anchors embed --sql
    """
    from .lensmap import lens_spec

    tok: str | int | None = int(token) if token is not None and token.isdigit() else token
    _draw(ctx, "lens", store, device, output, show_sql,
          lambda db: lens_spec(db, prompt_id, model=model, by=by, anchors=anchors, role=role,
                               token=tok))


def _profile_command(kind: str, doc: str, several_models: bool) -> None:
    model_help = ("Model in the store; repeat to compare models, a line each (default: the "
                  "only one)." if several_models else
                  "Model in the store (default: the only one).")

    @plot.command(name=kind, help=doc)
    @click.argument("store", type=click.Path(path_type=str))
    @click.option("--model", "models", multiple=several_models, default=None, help=model_help)
    @click.option("--role", "roles", multiple=True,
                  help="Role to show; repeatable (default: every role at the model width).")
    @click.option("--relative-depth/--layers", "relative_depth", default=None,
                  help="x axis: layer / n_layers, so that models of different depth line up "
                       "(default when the models differ in depth), or the layer number.")
    @_common
    @click.pass_context
    def command(ctx: click.Context, store: str, models: Any, roles: tuple[str, ...],
                relative_depth: bool | None, output: Path | None, show_sql: bool,
                device: str) -> None:
        from .data import profile_spec

        _draw(ctx, kind, store, device, output, show_sql,
              lambda db: profile_spec(db, kind, models=models or None, roles=roles or None,
                                      relative_depth=relative_depth))


_profile_command("angles", """The angle to the all-ones vector per layer, 90 degrees marked.

    A panel per role, a line per model (give --model several times to compare; models of
    different depth line up by relative depth): the mean of uniform_angle(vec) over all
    tokens, with a band from the 10th to the 90th percentile.

    \b
    Example:
      actdb plot angles runs.actdb -o angles.png
      actdb plot angles runs.actdb --model gpt2 --model llama --role pre_attn -o angles.pdf
    """, True)

_profile_command("norms", """The norm of each norm site's input divided by sqrt(d), per layer.

    ||x|| / sqrt(d) is the RMS of x. A panel per role, on a log axis: the median over all
    tokens, with a band from the 10th to the 90th percentile; a cross marks the largest token
    of each layer where some exceed 10 times the median, labelled with their positions.

    \b
    Example:
      actdb plot norms runs.actdb -o norms.png
    """, False)

_profile_command("rotation", """The rotation angle between each norm's input and output, per layer.

    rotation_angle(vec) in degrees, a panel per role: the mean over all tokens, with a band
    from the 10th to the 90th percentile.

    \b
    Example:
      actdb plot rotation runs.actdb --role pre_attn --role pre_mlp -o rotation.svg
    """, False)


@plot.command()
@click.argument("store", type=click.Path(path_type=str))
@click.option("--prompt-id", type=int, required=True, help="The prompt.")
@click.option("--position", type=int, required=True,
              help="Token position in the prompt; negative counts from the end (-1: last).")
@click.option("--token", required=True, help="The token whose logit is split, e.g. ' Paris'.")
@click.option("--model", default=None, help="Model in the store (default: the only one).")
@click.option("--site", default=None,
              help="Norm site whose input is read (default: the final norm).")
@click.option("--k", "k", type=click.IntRange(min=1), default=20, show_default=True,
              help="How many dims to show, by |contribution|.")
@_common
@click.pass_context
def dims(ctx: click.Context, store: str, prompt_id: int, position: int, token: str,
         model: str | None, site: str | None, k: int, output: Path | None, show_sql: bool,
         device: str) -> None:
    """The dims that push toward and pull away from a token most (logit_contribution).

    Diverging bars for the k dims with the largest |logit_contribution(vec, dim, token)|;
    the title gives the total over all dims, which is the logit minus the bias.

    \b
    Example:
      actdb plot dims runs.actdb --prompt-id 3 --position -1 --token ' Paris' -o dims.png
    """
    from .data import dims_spec

    _draw(ctx, "dims", store, device, output, show_sql,
          lambda db: dims_spec(db, prompt_id, position, token, model=model, site=site, k=k))


@plot.command()
@click.argument("store", type=click.Path(path_type=str))
@click.option("--prompt-id", "--input", "prompt_id", type=int, required=True,
              help="The image input (its prompt id).")
@click.option("--model", default=None, help="Model in the store (default: the only one).")
@click.option("--layer", type=int, default=None,
              help="One layer's sites only (default: the pre-attention sites and the final).")
@click.option("--token", default=None,
              help="Colour by this label's probability instead of the top label, e.g. "
                   "'digit 3'.")
@click.option("--frame", type=int, default=0, show_default=True,
              help="For a video input: the frame (tubelet) to draw.")
@_common
@click.pass_context
def patches(ctx: click.Context, store: str, prompt_id: int, model: str | None,
            layer: int | None, token: str | None, frame: int, output: Path | None,
            show_sql: bool, device: str) -> None:
    """An image input's patches, each coloured by what it reads as at each layer.

    A panel per layer (the pre-attention sites and the final one): every patch coloured by
    its top label through the model's head (an image classifier's 'classifier' anchors), or
    with --token by that label's probability, over the image where its file is still there.

    \b
    Example:
      actdb plot patches vision.actdb --input 0 -o patches.png
      actdb plot patches vision.actdb --input 0 --token 'digit 3' -o three.png
    """
    from .patches import patches_spec

    tok: str | int | None = int(token) if token is not None and token.isdigit() else token
    _draw(ctx, "patches", store, device, output, show_sql,
          lambda db: patches_spec(db, prompt_id, model=model, layer=layer, token=tok,
                                  frame=frame))
