"""The pictures: each a matplotlib Figure drawn from the query layer's answer to one SQL query.

The per-layer profiles (angles, norms, rotation) and the dims bars are drawn here, the logit
lens in lensmap.py; all are made on canvas.py's figures, which show themselves in Jupyter, and
written by its `save`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from .canvas import PULL, PUSH, new_figure, save, show_token
from .data import (
    BAND,
    OUTLIER_FACTOR,
    DbOrPath,
    PlotData,
    Spec,
    dims_spec,
    opened,
    profile_spec,
)
from .lensmap import lens, lens_data, lens_figure

__all__ = ["angles", "angles_data", "dims", "dims_data", "dims_figure", "lens", "lens_data",
           "lens_figure", "norms", "norms_data", "profile_figure", "rotation", "rotation_data",
           "save"]

CMAP = "viridis"  # lightness rises monotonically: reads in greyscale
OUTLIER = "#c0392b"  # outlier tokens of the norms picture
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
DASHES: tuple[Any, ...] = ("-", "--", ":", "-.")
_BAND_TEXT = f"band: {BAND[0] * 100:.0f}th to {BAND[1] * 100:.0f}th percentile over tokens"


def _shades(n: int) -> list[Any]:
    """n colours of clearly different lightness (dark to light along viridis)."""
    cmap = colormaps[CMAP]
    return [cmap(x) for x in (np.linspace(0.0, 0.8, n) if n > 1 else [0.0])]


# -- per-layer profiles: angles, norms, rotation ----------------------------------------------

_PROFILE_TEXT = {
    "angles": ("Angle between each norm site's input and the all-ones vector",
               "angle to the all-ones vector (degrees)"),
    "norms": ("Size of each norm site's input: \u2016x\u2016 / \u221ad (the RMS of x)",
              "\u2016x\u2016 / \u221ad (RMS of the input, model units)"),
    "rotation": ("Rotation by each norm: angle between its input x and its output y",
                 "angle(x, y) (degrees)"),
}


def profile_figure(spec: Spec, df: pd.DataFrame) -> Figure:
    """A panel per role (shared y axis), a line per model in each: mean with its band."""
    m = spec.meta
    models, roles = m["models"], m["roles"]
    several = len(models) > 1
    colour = dict(zip(models, _shades(len(models)), strict=True))
    layers = {r: sorted(df.loc[df["role"] == r, "layer"].unique()) for r in roles}
    roles = [r for r in roles if len(layers[r])] or roles
    spans = [max(len(layers[r]), 1) for r in roles]
    ratios = [max(s, 0.35 * max(spans)) for s in spans]  # a one-layer role still gets room
    fig = new_figure(max(7.5, 2.2 + 1.3 * len(roles) + 0.12 * sum(spans)), 5.0)
    axes = fig.subplots(1, len(roles), sharey=True, squeeze=False,
                        gridspec_kw={"width_ratios": ratios})[0]
    title, ylabel = _PROFILE_TEXT[spec.kind]
    relative = bool(m.get("relative_depth"))
    norms = spec.kind == "norms"
    x_of = "depth" if relative else "layer"
    # A layer's width on the x axis: one in layers, a tenth of the depth in relative depth.
    unit = 0.1 if relative else 1.0
    for ax, role in zip(axes, roles, strict=True):
        xs = df.loc[df["role"] == role, x_of].to_numpy(dtype=float)
        single = len(layers[role]) <= 1 or all(
            (df[(df["model"] == x) & (df["role"] == role)]["layer"].nunique() <= 1)
            for x in models)
        for mi, model in enumerate(models):
            part = df[(df["model"] == model) & (df["role"] == role)].sort_values("layer")
            if part.empty:
                continue
            c = colour[model]
            x = part[x_of].to_numpy(dtype=float)
            lo, hi = part["lo"].to_numpy(dtype=float), part["hi"].to_numpy(dtype=float)
            if len(part) > 1:
                ax.fill_between(x, lo, hi, color=c, alpha=0.2, linewidth=0)
            else:  # one layer: the band as a bar through its mean, models side by side
                x = x + (mi - (len(models) - 1) / 2) * 0.12 * unit
                ax.vlines(x, lo, hi, color=c, alpha=0.35, linewidth=6)
            ax.plot(x, part["center"].to_numpy(dtype=float), color=c,
                    linestyle=DASHES[mi % len(DASHES)], marker=MARKERS[mi % len(MARKERS)],
                    markersize=6, linewidth=1.8, label=f"{model} \u00b7 {role}", gid="mean")
            if norms:
                _mark_outliers(ax, x, part)
        if spec.kind == "angles":
            ax.axhline(90.0, color="black", linewidth=1.0, linestyle=(0, (4, 3)),
                       gid="reference")
        ax.set_title(role, fontsize=10)
        if norms:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        _x_axis(ax, xs, layers[role], relative=relative, single=single, unit=unit)
        # Short: a label under each panel, the narrow ones too, must not reach the next.
        ax.set_xlabel("depth" if relative else "layer")
    axes[0].set_ylabel(ylabel)
    tokens = ", ".join(f"{m['n_tokens'][x]} tokens" for x in models)
    who = ("models " + ", ".join(models)) if several else f"model {models[0]}"
    centre = "median" if norms else "mean"
    depth = "\ndepth: layer / n_layers, so models of different depths line up" if relative else ""
    fig.suptitle(f"{title}\n{who}: {centre} per layer over {tokens}, a panel per role{depth}",
                 fontsize=11)
    handles: list[Any] = [Line2D([], [], color=colour[x], linestyle=DASHES[i % len(DASHES)],
                                 marker=MARKERS[i % len(MARKERS)], label=x)
                          for i, x in enumerate(models)] if several else []
    handles.append(Patch(color=colour[models[0]] if not several else "grey", alpha=0.3,
                         linewidth=0, label=_BAND_TEXT))
    if spec.kind == "angles":
        handles.append(Line2D([], [], color="black", linewidth=1.0, linestyle=(0, (4, 3)),
                              label="90\u00b0: orthogonal to the all-ones vector"))
    if norms and df["outlier_positions"].map(_positions).map(len).any():
        handles.append(Line2D([], [], color=OUTLIER, marker="x", linestyle="none",
                              label=f"largest token where some exceed {OUTLIER_FACTOR:g}x "
                                    "the median (outlier positions named)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3),
               fontsize=9, frameon=False)
    return fig


def _x_axis(ax: Any, xs: np.ndarray, layers: list[Any], *, relative: bool, single: bool,
            unit: float) -> None:
    """A panel's x range and ticks, from the x values its rows hold (so a role before the
    first layer, the embedding's at layer -1, is inside its panel in either unit)."""
    if len(xs) == 0:
        return
    lo, hi = float(xs.min()), float(xs.max())
    if single:  # one layer a model: room for the side-by-side bars around them
        ax.set_xlim(lo - 0.6 * unit, hi + 0.6 * unit)
    elif relative:
        ax.set_xlim(min(lo, 0.0) - 0.05, max(hi, 1.0) + 0.05)
    if relative:
        values = sorted(set(np.round(xs, 2).tolist()))
        if single and len(values) <= 2 and (len(values) == 1 or values[1] - values[0] >= 0.1):
            ax.set_xticks(values)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=2 if single else 5))
    elif len(layers) <= 8:
        ax.set_xticks([int(v) for v in layers])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))


def _positions(value: Any) -> list[int]:
    return [] if value is None or (isinstance(value, float) and np.isnan(value)) \
        else [int(p) for p in value]


def _mark_outliers(ax: Any, x: np.ndarray, part: pd.DataFrame) -> None:
    """A cross at the largest norm of each layer holding outliers, labelled with the
    positions of its outlier tokens (the attention sink shows as one position, every layer)."""
    for xi, top, where in zip(x, part["top"], part["outlier_positions"], strict=True):
        pos = _positions(where)
        if not pos:
            continue
        ax.plot([xi], [float(top)], marker="x", color=OUTLIER, markersize=8,
                linestyle="none", gid="outlier")
        shown = ", ".join(str(p) for p in pos[:4]) + (", …" if len(pos) > 4 else "")
        ax.annotate(f"pos {shown}", (xi, float(top)), textcoords="offset points",
                    xytext=(4, 4), fontsize=7, color=OUTLIER, gid="outlier-label")


# -- dims: which dimensions push toward a token ------------------------------------------------


def dims_figure(spec: Spec, df: pd.DataFrame) -> Figure:
    m = spec.meta
    values = df["contribution"].to_numpy(dtype=float)
    n = len(values)
    fig = new_figure(8.0, max(3.5, 2.2 + 0.28 * n))
    ax = fig.add_subplot()
    colours = [PUSH if v >= 0 else PULL for v in values]
    ax.barh(np.arange(n), values, color=colours, edgecolor="#222222", linewidth=0.6)
    ax.set_yticks(np.arange(n))
    ax.set_yticklabels([f"dim {int(d)}" for d in df["dim"]])
    ax.set_ylim(n - 0.5, -0.5)  # the largest |contribution| on top
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.grid(True, axis="x", alpha=0.3)
    token = m["token"]
    tok = repr(token) if isinstance(token, str) else f"token id {token}"
    total = float(df["total"].iloc[0]) if n else float("nan")
    n_dims = int(df["n_dims"].iloc[0]) if n else 0
    if m.get("measure", "logit") == "logit":
        ax.set_xlabel(f"contribution to the logit of {tok} (logit units)")
        whole = df["logit"].iloc[0] if n else float("nan")
        summary = (f"total over all {n_dims} dims = {total:.4g} = logit \u2212 bias "
                   f"before any logit scale or cap (logit = {float(whole):.4g})")
    else:
        ax.set_xlabel(f"contribution to the cosine with the embedding anchor of {tok}")
        whole = df["cosine"].iloc[0] if n else float("nan")
        summary = (f"no LM head: total over all {n_dims} dims = {total:.4g} = cosine to the "
                   f"embedding anchor ({float(whole):.4g})")
    ax.set_ylabel(f"dimension (top {n} by |contribution|)")
    ax.set_title(
        f"Which dimensions push toward {tok} and which pull away\n"
        f"model {m['model']}, prompt {m['prompt_id']}, position {m['position']} "
        f"(input token \u201c{show_token(m['at_token'])}\u201d), site {m['site']}\n"
        f"{summary}",
        fontsize=11,
    )
    fig.legend(handles=[Patch(facecolor=PUSH, edgecolor="#222222", label="pushes toward"),
                        Patch(facecolor=PULL, edgecolor="#222222", label="pulls away")],
               loc="outside lower center", ncols=2, fontsize=9, frameon=False)
    return fig


# -- the public functions ---------------------------------------------------------------------


def _profile_data(kind: str, db_or_path: DbOrPath, models: str | Sequence[str] | None,
                  roles: str | Sequence[str] | None, device: str,
                  relative_depth: bool | None = None) -> PlotData:
    with opened(db_or_path, device) as db:
        return profile_spec(db, kind, models=models, roles=roles,
                            relative_depth=relative_depth).run(db)


def _profile(kind: str, db_or_path: DbOrPath, models: str | Sequence[str] | None,
             roles: str | Sequence[str] | None, device: str,
             relative_depth: bool | None = None) -> Figure:
    with opened(db_or_path, device) as db:
        spec = profile_spec(db, kind, models=models, roles=roles,
                            relative_depth=relative_depth)
        return profile_figure(spec, spec.run(db).df)


def angles_data(db_or_path: DbOrPath, *, model: str | Sequence[str] | None = None,
                roles: str | Sequence[str] | None = None, relative_depth: bool | None = None,
                device: str = "auto") -> PlotData:
    """Per model, layer and role: uniform_angle (degrees) mean, std and percentile band,
    with each layer's relative depth (layer / n_layers)."""
    return _profile_data("angles", db_or_path, model, roles, device, relative_depth)


def angles(db_or_path: DbOrPath, *, model: str | Sequence[str] | None = None,
           roles: str | Sequence[str] | None = None, relative_depth: bool | None = None,
           device: str = "auto") -> Figure:
    """Angle to the all-ones vector per layer and role (a line per model), 90 degrees marked.

    Args:
        db_or_path: an open Database or a store path.
        model: one model or several to overlay (default: the store's only one).
        roles: roles to show (default: every role at the model width).
        relative_depth: x axis layer / n_layers, so models of different depth line up
            (default: when the models differ in depth).
        device: where the tensor functions run.

    Returns:
        A matplotlib Figure.
    """
    return _profile("angles", db_or_path, model, roles, device, relative_depth)


def norms_data(db_or_path: DbOrPath, *, model: str | None = None,
               roles: str | Sequence[str] | None = None, device: str = "auto") -> PlotData:
    """Per layer and role: norm / sqrt(d) median, mean, std and percentile band, the
    largest value and the positions of outliers (over 10x the layer's median)."""
    return _profile_data("norms", db_or_path, model, roles, device)


def norms(db_or_path: DbOrPath, *, model: str | None = None,
          roles: str | Sequence[str] | None = None, device: str = "auto") -> Figure:
    """The input's norm divided by sqrt(d) per layer and role: median and spread on a log
    axis, outlier positions marked."""
    return _profile("norms", db_or_path, model, roles, device)


def rotation_data(db_or_path: DbOrPath, *, model: str | None = None,
                  roles: str | Sequence[str] | None = None, device: str = "auto") -> PlotData:
    """Per layer and role: rotation_angle (degrees) mean, std and percentile band."""
    return _profile_data("rotation", db_or_path, model, roles, device)


def rotation(db_or_path: DbOrPath, *, model: str | None = None,
             roles: str | Sequence[str] | None = None, device: str = "auto") -> Figure:
    """The angle between each norm's input and output per layer and role."""
    return _profile("rotation", db_or_path, model, roles, device)


def dims_data(db_or_path: DbOrPath, prompt_id: int, position: int, token: str | int, *,
              model: str | None = None, site: str | None = None, k: int = 20,
              device: str = "auto") -> PlotData:
    """The top-k dims by |logit_contribution| toward a token, with the total over all dims."""
    with opened(db_or_path, device) as db:
        return dims_spec(db, prompt_id, position, token, model=model, site=site, k=k).run(db)


def dims(db_or_path: DbOrPath, prompt_id: int, position: int, token: str | int, *,
         model: str | None = None, site: str | None = None, k: int = 20,
         device: str = "auto") -> Figure:
    """Diverging bars: the dims that push toward and pull away from a token most."""
    with opened(db_or_path, device) as db:
        spec = dims_spec(db, prompt_id, position, token, model=model, site=site, k=k)
        return dims_figure(spec, spec.run(db).df)
