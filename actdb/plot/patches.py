"""`actdb plot patches`: an image input, each patch coloured by what its row reads as through
the head (the logit lens of an image classifier's patches), one panel per layer.

By default each patch is coloured by its top class at that layer (a colour per label, the
label written on it); with `token`, by that label's probability. The image itself, read from
the prompt's `image` path, is drawn under the patches where the file is still there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .data import PlotError, Spec, block_role, head_tower_sites, resolve_model

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from ..query import Database


def patches_spec(db: Database, prompt_id: int, *, model: str | None = None,
                 layer: int | None = None, token: str | int | None = None,
                 frame: int = 0) -> Spec:
    """The SQL of the picture: every patch row of the prompt at the blocks' norms (the
    pre-attention ones where there is attention) and final sites of the head's width (or at
    `layer`), its top label and that label's probability (or `token`'s)."""
    name = resolve_model(db, model)
    found = db.sql("SELECT count(*) FROM acts WHERE model = $m AND prompt_id = $p AND "
                   "patch_row IS NOT NULL", params={"m": name, "p": int(prompt_id)}).fetchall()
    if not found[0][0]:
        raise PlotError(f"prompt {prompt_id} of model {name!r} has no patches: `plot patches` "
                        "draws an image input's patches (ingest --images)")
    where = "layer = $layer" if layer is not None else "list_contains($roles, role)"
    # the top token by its id: a token's text may name several (byte tokens' '\ufffd')
    read = "$token" if token is not None else "top_logits(vec, 1)[1].token_id"
    sql = f"""SELECT layer, site, patch_row, patch_col,
       top_logits(vec, 1)[1].token AS top,
       prob(vec, {read}) AS p
FROM acts
WHERE model = $m AND prompt_id = $p AND patch_row IS NOT NULL
  AND coalesce(frame, 0) = $frame AND {where}
  -- a hierarchical model's early stages are narrower than its head: not read
  AND site IN (SELECT s.site FROM sites s JOIN models USING (model)
               WHERE s.model = $m AND s.d = models.d_model)
  -- nor another tower's than the head's (a vision tower's rows never meet its final norm)
  AND list_contains($sites, site)
ORDER BY layer, site, patch_row, patch_col"""
    params: dict[str, Any] = {"m": name, "p": int(prompt_id), "frame": int(frame),
                              "sites": head_tower_sites(db, name)}
    if layer is not None:
        params["layer"] = int(layer)
    else:  # the blocks' norms (pre_attn where there is attention: data.block_role), final
        params["roles"] = [block_role(db, name) or "pre_attn", "final"]
    if token is not None:
        params["token"] = token
    image = db.sql("SELECT * FROM prompts WHERE prompt_id = $p",
                   params={"p": int(prompt_id)}).df()
    path = image["image"].iloc[0] if "image" in image and len(image) else None
    return Spec(kind="patches", sql=sql, params=params,
                meta={"model": name, "prompt_id": int(prompt_id), "token": token,
                      "image": path if isinstance(path, str) else None})


def patches_figure(spec: Spec, df: pd.DataFrame) -> Figure:
    import matplotlib
    import numpy as np
    from matplotlib.figure import Figure

    m = spec.meta
    panels = [(layer, site, g) for (layer, site), g in df.groupby(["layer", "site"], sort=True)]
    if not panels:
        raise PlotError(f"prompt {m['prompt_id']} has no patches at the sites asked for")
    rows = int(df["patch_row"].max()) + 1
    cols = int(df["patch_col"].max()) + 1
    picture = _image(m["image"])
    fig = Figure(figsize=(2.6 * len(panels), 3.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    labels = sorted(df["top"].dropna().unique())
    palette = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    colour = {label: palette(i % palette.N) for i, label in enumerate(labels)}
    viridis = matplotlib.colormaps["viridis"]
    for ax, (layer, site, g) in zip(axes, panels, strict=True):
        if picture is not None:
            ax.imshow(picture, extent=(-0.5, cols - 0.5, rows - 0.5, -0.5), interpolation="nearest")
        grid = np.zeros((rows, cols, 4))
        for r in g.itertuples():
            if m["token"] is None:
                grid[int(r.patch_row), int(r.patch_col)] = colour.get(r.top, (0, 0, 0, 0))
            else:
                grid[int(r.patch_row), int(r.patch_col)] = viridis(float(r.p))
            if m["token"] is None and rows * cols <= 64:
                # the label's last word ('3' of 'digit 3'): the legend names it whole
                ax.text(r.patch_col, r.patch_row, str(r.top).split()[-1][:8] if str(r.top)
                        .split() else "", ha="center", va="center", fontsize=6)
        grid[..., 3] = 0.55 if picture is not None else 1.0
        ax.imshow(grid, extent=(-0.5, cols - 0.5, rows - 0.5, -0.5), interpolation="nearest")
        ax.set_title(f"{site} (layer {layer})", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    what = ("each patch coloured by its top label" if m["token"] is None
            else f"each patch coloured by the probability of {m['token']!r} (0 to 1)")
    source = m["image"] or f"prompt {m['prompt_id']}"
    fig.suptitle(f"Patches: model {m['model']}, {source}\n{what}", fontsize=10)
    if m["token"] is None:
        handles = [matplotlib.patches.Patch(color=colour[label], label=str(label))
                   for label in labels]
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(labels), 6),
                   fontsize=7)
    return fig


def _image(path: str | None) -> Any:
    """The input's image as an RGB array, where its file is still there (else None)."""
    if path is None or not Path(path).is_file():
        return None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            import numpy as np

            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError):
        return None
