"""Where every picture is drawn: a Figure that shows itself in Jupyter, its colours, its
token labels, and `save`, the one place that writes a figure to a file.

Figures are made with `matplotlib.figure.Figure` on an Agg canvas, never through pyplot, so
drawing needs no display and leaves a notebook's own backend alone.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..query.display import visible_token
from .data import PlotError, is_missing

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
DPI = 150
# Diverging bars: a dark and a light colour (viridis ends), told apart in greyscale too.
PUSH, PULL = "#3b528b", "#b5de2b"


class InlineFigure(Figure):
    """A matplotlib Figure that shows itself in Jupyter with no `%matplotlib` magic: IPython
    asks an object for `_repr_png_`, and a Figure made without pyplot has no other display."""

    def _repr_png_(self) -> bytes:
        import io

        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")
            self.savefig(buf, format="png", dpi=DPI)
        return buf.getvalue()


def new_figure(width: float, height: float) -> Figure:
    """An empty figure of this size (inches), laid out by matplotlib's constrained layout."""
    fig = InlineFigure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def show_token(token: Any, limit: int = 12, *, label: bool = False) -> str:
    """A token as text with its whitespace made visible; long ones are cut with an ellipsis.
    `label`: a class label's name ('tabby cat', an image classifier's vocabulary), whose
    spaces are words' spaces, shown as they are."""
    if is_missing(token):
        return "—"
    text = " ".join(str(token).split()) if label else visible_token(str(token))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def shorten(text: str, limit: int = 70) -> str:
    """A prompt on one line, cut with an ellipsis past `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write a figure; the format is the file's extension (.png, .svg or .pdf)."""
    p = Path(path)
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise PlotError(f"cannot write {str(p)!r}: the file name must end in .png, .svg or .pdf")
    if not p.parent.is_dir():
        raise PlotError(f"cannot write {str(p)!r}: the folder {str(p.parent)!r} does not exist")
    try:
        with warnings.catch_warnings():
            # A token in a script the font lacks is drawn as a box; one warning per glyph
            # would bury the command's output.
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")
            fig.savefig(p, format=fmt, dpi=DPI)
    except OSError as e:
        raise PlotError(f"cannot write {str(p)!r}: {e.strerror or e}") from None
    return p
