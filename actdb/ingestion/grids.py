"""Grids of positions: where a model's sites see different numbers of positions for one input
(Swin merges patches between stages, a pooled head's norm sees one vector an input), the sites
that see the same number share a grid, an input's rows are its grids' positions one after the
other, and each site's rows are its own grid's (docs/FORMAT.md, "Grids").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import IngestError
from .inputs import Positions, positions


@dataclass(frozen=True, kw_only=True)
class Grid:
    """The positions a set of sites sees for one input: `size` of them, laid out as `shape`
    (rows, columns) where the norm's input says so (a feature map), starting at `offset`
    among an input's rows."""

    index: int
    size: int
    offset: int
    shape: tuple[int, int] | None = None
    plain: bool = False  # its positions' order is not known (a `bktd` site's): not patches
    # an input's text tokens (a multimodal decoder's sequence, image tokens inside): as many
    # as the input has, last among its rows (after the other grids, at `offset`), so that
    # position_from_end = 0 is its last token
    tokens: bool = False


@dataclass(frozen=True, kw_only=True)
class GridPlan:
    """Every site's grid, the grids in the order their first site runs, and the rows an input
    has (the sum of the grids' sizes). Where every site sees the same positions (a text model,
    a ViT) there is one grid and the store records none (`several` is False)."""

    of_site: dict[str, int]
    grids: tuple[Grid, ...]

    @property
    def several(self) -> bool:
        return len(self.grids) > 1

    @property
    def per_input(self) -> int:
        return sum(g.size for g in self.grids)

    @property
    def tokens(self) -> bool:
        """Whether an input's rows start with its text tokens (a grid of its own length)."""
        return any(g.tokens for g in self.grids)

    def place(self, site: str) -> Grid | None:
        """The site's grid where there are several (its rows are then a part of each
        input's), else None (its rows are all of them)."""
        return self.grids[self.of_site[site]] if self.several else None


def plan_grids(sites: Sequence[tuple[str, int | None, tuple[int, int] | None, str]],
               model: str, *, tokens: bool = False) -> GridPlan:
    """The grids of (site, positions an input, feature-map shape, layout) in call order: sites
    that see the same number of positions share a grid (one grid a count). With `tokens`
    (inputs of text and images together), sites of unknown positions read the text tokens: the
    token grid, index 0, its rows after the others'. One sentence where a site's positions are
    not known (a layout that does not fix them)."""
    if tokens:
        fixed = plan_grids([t for t in sites if t[1] is not None], model)
        moved = tuple(dataclasses.replace(g, index=g.index + 1) for g in fixed.grids)
        return GridPlan(of_site={s: 0 if n is None else fixed.of_site[s] + 1
                                 for s, n, _, _ in sites}, grids=(
            Grid(index=0, size=0, offset=fixed.per_input, tokens=True), *moved))
    unknown = next((s for s, n, _, _ in sites if n is None), None)
    if unknown is not None:
        raise IngestError(f"model {model!r}: site {unknown!r} sees a number of positions that "
                          "does not follow from the input's size; actdb cannot place its rows")
    counts: dict[int, int] = {}
    shapes: dict[int, tuple[int, int] | None] = {}
    of_site: dict[str, int] = {}
    plain: set[int] = set()
    for site, n, shape, layout in sites:
        assert n is not None
        if n not in counts:
            counts[n] = len(counts)
            shapes[n] = shape
        elif shapes[n] is None:
            shapes[n] = shape
        if layout in ("bktd", "kbtd"):
            plain.add(n)
        of_site[site] = counts[n]
    grids, offset = [], 0
    for n, index in counts.items():
        grids.append(Grid(index=index, size=n, offset=offset, shape=shapes[n],
                          plain=n in plain))
        offset += n
    return GridPlan(of_site=of_site, grids=tuple(grids))


def downsampled(n: int, height: int, width: int) -> tuple[int, int] | None:
    """(rows, columns) of a grid of `n` positions that is the image of `height` x `width`
    pixels downsampled by one integer factor (rounded up, as patch merging pads): Swin's later
    stages. None where no factor gives `n`."""
    for s in range(1, max(height, width) + 1):
        rows, cols = -(-height // s), -(-width // s)
        if rows * cols == n:
            return rows, cols
        if rows * cols < n:
            return None
    return None


def grid_positions(model: nn.Module, inputs: dict[str, torch.Tensor], plan: GridPlan
                   ) -> Positions:
    """The labels of an input's rows, each grid's in turn: patches laid out by the patch size
    after any class token and registers (`inputs.positions`), else by the grid's feature-map
    shape, else as the image downsampled by an integer factor (Swin's later stages); a grid of
    one position that is no feature map is a pooled vector (`<pooled>`)."""
    pixels = inputs.get("pixel_values")
    size = (int(pixels.shape[-2]), int(pixels.shape[-1])) if (
        pixels is not None and pixels.dim() == 4) else None
    out = Positions(tokens=[], patch_row=[], patch_col=[], frame=[], grid=[])
    assert out.grid is not None
    for g in plan.grids:
        one = positions(model, {} if g.plain else inputs, g.size)
        plain = one.patch_row.count(None) == g.size  # no patch grid accounts for it
        if plan.several and g.shape is None and g.size == 1 and plain:
            one = Positions(tokens=["<pooled>"], patch_row=[None], patch_col=[None],
                            frame=[None])
        elif plain and not g.plain and (shape := g.shape or (
                downsampled(g.size, *size) if size is not None else None)) is not None:
            cols = shape[1]
            one = Positions(tokens=["<patch>"] * g.size,
                            patch_row=[k // cols for k in range(g.size)],
                            patch_col=[k % cols for k in range(g.size)], frame=[None] * g.size)
        out.tokens.extend(one.tokens)
        out.patch_row.extend(one.patch_row)
        out.patch_col.extend(one.patch_col)
        out.frame.extend(one.frame)
        out.grid.extend([g.index] * g.size)
    return out if plan.several else dataclasses.replace(out, grid=None)
