"""The report's own figures: covariance spectra, the answer's emergence on the logit lens, and
the dims that push toward the answer. Each is drawn from its section's query answer alone."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from .canvas import PULL, PUSH, new_figure


def spectrum_figure(df: pd.DataFrame, model: str) -> Figure:
    """A line per site: its eigenvalues, largest first, on a log axis."""
    fig = new_figure(8.0, 4.8)
    ax = fig.add_subplot()
    cmap = colormaps["viridis"]
    n = len(df)
    for i, (site, eig, count) in enumerate(zip(df["site"], df["eigenvalues"], df["n"],
                                               strict=True)):
        if eig is None:
            continue
        vals = np.asarray(eig, dtype=float)[: max(int(count) - 1, 1)]
        floor = max(float(vals.max()) * 1e-16, np.finfo(float).tiny)
        ax.plot(np.arange(1, len(vals) + 1), np.maximum(vals, floor),
                color=cmap(0.85 * i / max(n - 1, 1)), linewidth=1.2, label=str(site),
                gid="spectrum")
    ax.set_yscale("log")
    ax.set_xlabel("eigenvalue index (largest first)")
    ax.set_ylabel("covariance eigenvalue of normalized(vec)")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Covariance spectrum of normalized vectors per site, model {model}\n"
                 "dark = early layers, light = late; a drop at the right end is a vanishing "
                 "direction", fontsize=11)
    if n <= 12:
        ax.legend(fontsize=7, ncols=2)
    return fig


def emergence_figure(df: pd.DataFrame, model: str, *,
                     answer: str = "the model's top token at the last position of each prompt"
                     ) -> Figure:
    """Per layer: the share of prompts whose final answer is the lens's top token, and the
    answer's median rank (log axis, right)."""
    fig = new_figure(8.0, 4.6)
    ax = fig.add_subplot()
    x = np.arange(len(df))
    ax.plot(x, df["top1_share"].to_numpy(dtype=float), color=PUSH, marker="o",
            label="share of prompts: answer is the top token", gid="top1")
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("share of prompts with the answer at rank 1")
    ax.set_xticks(x)
    ax.set_xticklabels(list(df["site"]), rotation=60, ha="right", rotation_mode="anchor",
                       fontsize=7)
    ax.set_xlabel("site (layer order)")
    right = ax.twinx()
    right.plot(x, df["median_rank"].to_numpy(dtype=float), color="#555555", linestyle="--",
               marker="s", markersize=4, label="median rank of the answer", gid="rank")
    right.set_yscale("log")
    right.set_ylabel("median rank of the final answer (log)")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Where the final answer appears on the logit lens, model {model}\n"
                 f"answer = {answer}",
                 fontsize=11)
    fig.legend(loc="outside lower center", ncols=2, fontsize=9, frameon=False)
    return fig


def dims_summary_figure(df: pd.DataFrame, model: str) -> Figure:
    """Bars: each top dim's mean contribution to the answer's logit over prompts."""
    fig = new_figure(8.0, max(3.5, 2.2 + 0.3 * len(df)))
    ax = fig.add_subplot()
    vals = df["mean_contribution"].to_numpy(dtype=float)
    ax.barh(np.arange(len(df)), vals, color=[PUSH if v >= 0 else PULL for v in vals],
            edgecolor="#222222", linewidth=0.6)
    ax.set_yticks(np.arange(len(df)))
    ax.set_yticklabels([f"dim {int(d)}" for d in df["dim"]])
    ax.set_ylim(len(df) - 0.5, -0.5)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("mean logit_contribution toward each prompt's final answer (logit units)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(f"The dims with the largest mean |contribution| to the answer, model {model}",
                 fontsize=11)
    return fig
