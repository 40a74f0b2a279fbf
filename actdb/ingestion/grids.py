"""Feature maps and grids: norms of an image model whose input is a feature map (`[B, H, W, C]`,
Swin-style and ConvNeXt's channels-last LayerNorm, or `[B, C, H, W]`, ConvNeXt's channels-first
one) are stored as rows of positions like token rows; and a model whose stages see different
numbers of positions (Swin merges patches, a pooled head's norm sees one vector an input) has
one grid of positions per count, each site's rows on its own grid.

Which axis is the channel axis is measured, not read from a class: one element of the hooked
input is changed and the output moves along the normalized axis only (`feature_layout`).
GroupNorm and BatchNorm are no sites (a GroupNorm normalizes a group of channels over every
position at once, a BatchNorm in eval mode is a per-channel affine: neither is a direction a
position), so their layouts never reach here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import IngestError
from .capture import output_tensor
from .inputs import Positions, positions

FEATURE_MAPS = ("bhwc", "bchw")


@torch.no_grad()
def feature_layout(module: nn.Module, x: torch.Tensor, shape2: tuple[int, ...], b1: int,
                   b2: int) -> tuple[str, int, int] | None:
    """(`bhwc` or `bchw`, H, W) for a 4-D input `x` of b1 inputs whose shape at b2 inputs is
    `shape2`: the axis the module normalizes over is the one along which a change to one
    element moves the output (every other axis is a position). None where neither the last
    axis nor axis 1 alone is (not a feature-map norm)."""
    shape = tuple(x.shape)
    if len(shape) != 4 or len(shape2) != 4 or (shape[0], shape2[0]) != (b1, b2) or (
            shape[1:] != shape2[1:]):
        return None
    one = x[:1].detach().clone()
    base = output_tensor(module(one))
    if base is None or base.shape != one.shape:
        return None
    at = tuple(n // 2 for n in one.shape[1:])
    poked = one.clone()
    scale = float(one.abs().max()) or 1.0
    poked[(0, *at)] += scale
    moved = output_tensor(module(poked))
    if moved is None:
        return None
    changed = (moved != base)[0]  # [a1, a2, a3]
    where = changed.nonzero()
    if len(where) < 2:  # a change that moves one element only: nothing normalized
        return None
    fixed = [bool((where[:, k] == at[k]).all()) for k in range(3)]
    if fixed == [True, True, False]:  # moves along the last axis only
        return "bhwc", shape[1], shape[2]
    if fixed == [False, True, True]:  # along axis 1 only
        return "bchw", shape[2], shape[3]
    return None


def as_rows(x: torch.Tensor, layout: str, batch: int) -> torch.Tensor:
    """A norm's input or output as [B, P, d] for a layout of positions: `btd` ([B, T, d] or
    its [B*T, d] flattening), `bhwc` (positions row by row) or `bchw` (permuted, a copy)."""
    if layout == "bhwc":
        return x.reshape(batch, -1, x.shape[-1])
    if layout == "bchw":
        return x.permute(0, 2, 3, 1).reshape(batch, -1, x.shape[1])
    return x.reshape(batch, -1, x.shape[-1])


def width_of(x: torch.Tensor, layout: str) -> int:
    """The width of one stored vector: the channel axis's length."""
    return int(x.shape[1] if layout == "bchw" else x.shape[-1])


@dataclass(frozen=True, kw_only=True)
class Grid:
    """The positions a set of sites sees for one input: `size` of them, laid out as `shape`
    (rows, columns) where the norm's input says so (a feature map), starting at `offset`
    among an input's rows."""

    index: int
    size: int
    offset: int
    shape: tuple[int, int] | None = None


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

    def place(self, site: str) -> Grid | None:
        """The site's grid where there are several (its rows are then a part of each
        input's), else None (its rows are all of them)."""
        return self.grids[self.of_site[site]] if self.several else None


def plan_grids(sites: Sequence[tuple[str, int | None, tuple[int, int] | None]], model: str
               ) -> GridPlan:
    """The grids of (site, positions an input, feature-map shape) in call order: sites that see
    the same number of positions share a grid (one grid a count). One sentence where a site's
    positions are not known (a layout that does not fix them)."""
    unknown = next((s for s, n, _ in sites if n is None), None)
    if unknown is not None:
        raise IngestError(f"model {model!r}: site {unknown!r} sees a number of positions that "
                          "does not follow from the input's size; actdb cannot place its rows")
    counts: dict[int, int] = {}
    shapes: dict[int, tuple[int, int] | None] = {}
    of_site: dict[str, int] = {}
    for site, n, shape in sites:
        assert n is not None
        if n not in counts:
            counts[n] = len(counts)
            shapes[n] = shape
        elif shapes[n] is None:
            shapes[n] = shape
        of_site[site] = counts[n]
    grids, offset = [], 0
    for n, index in counts.items():
        grids.append(Grid(index=index, size=n, offset=offset, shape=shapes[n]))
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
        one = positions(model, inputs, g.size)
        plain = one.patch_row.count(None) == g.size  # no patch grid accounts for it
        if plan.several and g.shape is None and g.size == 1 and plain:
            one = Positions(tokens=["<pooled>"], patch_row=[None], patch_col=[None],
                            frame=[None])
        elif plain and (shape := g.shape or (
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
