"""Where positions sit in a norm's input: a token sequence's layouts read from the input
shapes at two sequence lengths (`[B, T, d]`, `[B*T, d]`, per-head `[B, T, H, d]`,
`[B*T, H, d]` and `[B, H, T, d]`), an image's at two batch sizes (`[B, T, d]`, `[B*T, d]`,
`[B*k, T, d]`), and feature maps (`[B, H, W, C]`, Swin-style and ConvNeXt's channels-last
LayerNorm, or `[B, C, H, W]`, ConvNeXt's channels-first one), whose positions are stored as
rows like tokens.

Which axis of a feature map is the channel axis is measured, not read from a class: one element
of the hooked input is changed and the output moves along the normalized axis only
(`feature_layout`). GroupNorm and BatchNorm are no sites (a GroupNorm normalizes a group of
channels over every position at once, a BatchNorm in eval mode is a per-channel affine:
neither is a direction a position), so their layouts never reach here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .capture import output_tensor, record_calls

# Inputs of the same image in two probe passes of different batch sizes differ by float
# rounding only (a matrix product's order may follow the batch size).
_REPEAT_LIMIT = 1e-3
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


def image_layout(module: nn.Module, x: torch.Tensor, shape2: tuple[int, ...], b1: int,
                 b2: int, *, maps: bool) -> tuple[tuple[str, int] | None,
                                                  tuple[int, int] | None]:
    """((layout, positions an input), a feature map's (H, W)) of an image model's norm input
    `x` at b1 inputs whose shape at b2 is `shape2`; `maps`: whether a 4-D input may be a feature
    map (not a per-head norm's). (None, None) for a layout actdb does not know."""
    fixed = fixed_layout(tuple(x.shape), shape2, b1, b2)
    if fixed is not None or not maps:
        return fixed, None
    found = feature_layout(module, x, shape2, b1, b2)
    if found is None:
        return None, None
    return (found[0], found[1] * found[2]), (found[1], found[2])


def as_rows(x: torch.Tensor, layout: str, batch: int) -> torch.Tensor:
    """A norm's input or output as [B, P, d] for a layout of positions: `btd` ([B, T, d] or
    its [B*T, d] flattening), `bktd` ([B*k, T, d]), `kbtd` ([k*B, T, d], a copy), `bhwc`
    (positions row by row) or `bchw` (permuted, a copy)."""
    if layout == "bhwc":
        return x.reshape(batch, -1, x.shape[-1])
    if layout == "bchw":
        return x.permute(0, 2, 3, 1).reshape(batch, -1, x.shape[1])
    if layout == "kbtd":  # each input's k lists of T positions, list by list
        return x.reshape(-1, batch, *x.shape[-2:]).transpose(0, 1).reshape(
            batch, -1, x.shape[-1])
    return x.reshape(batch, -1, x.shape[-1])


def width_of(x: torch.Tensor, layout: str) -> int:
    """The width of one stored vector: the channel axis's length."""
    return int(x.shape[1] if layout == "bchw" else x.shape[-1])


def fixed_layout(shape1: tuple[int, ...], shape2: tuple[int, ...], b1: int, b2: int
                  ) -> tuple[str, int] | None:
    """(layout, positions an input) from the input shapes at two batch sizes, for inputs
    whose positions do not follow a token count: [B, T, d], its [B*T, d] flattening (`btd`),
    or [B*k, T, d] (`bktd`: MobileViT unfolds each input's feature map into k lists of T
    positions, TimeSformer attends over frames and over patches in turn: the input's k * T
    rows, batch outermost)."""
    if len(shape1) != len(shape2) or shape1[-1] != shape2[-1]:
        return None
    if len(shape1) == 3 and (shape1[0], shape2[0]) == (b1, b2) and shape1[1] == shape2[1]:
        return "btd", int(shape1[1])
    if (len(shape1) == 3 and shape1[1] == shape2[1] and shape1[0] % b1 == 0
            and shape2[0] % b2 == 0 and shape1[0] // b1 == shape2[0] // b2):
        # what k and T index (frames and patches, or patches and frames) the shapes do not
        # say: the rows are stored in this order, labelled as plain positions
        return "bktd", int(shape1[0] // b1 * shape1[1])
    if (len(shape1) == 2 and shape1[0] % b1 == 0 and shape2[0] % b2 == 0
            and shape1[0] // b1 == shape2[0] // b2):
        return "btd", int(shape1[0] // b1)
    return None


def check_repeatable(model: nn.Module, path: str, x: torch.Tensor, x2: torch.Tensor | None,
                     layout: str, b1: int, b2: int) -> str:
    """The layout of the norm at `path`, which saw `x` and `x2` for the same images in the two
    probe passes (the second pass's b2 inputs are the first pass's first b2): `layout`, or
    `kbtd` where a `bktd` input's lists are outermost (DepthPro cuts each scaled image into
    patches, patch by patch over the batch). Refuse, in one sentence, a model whose inputs to
    the norm differ between the passes either way: it draws at random in eval mode (ViT-MAE
    masks and shuffles patches at random), so the rows of one pass would not be the input's."""
    if x2 is None or b2 > b1:
        return layout
    gap = _gap(x, x2, layout, b1, b2)
    if gap > _REPEAT_LIMIT and layout == "bktd" and not _gap(x, x2, "kbtd", b1, b2) > (
            _REPEAT_LIMIT):
        return "kbtd"
    if gap > _REPEAT_LIMIT:
        from ..errors import ModelLoadError

        raise ModelLoadError(
            f"model {type(model).__name__!r} gives norm module {path!r} different inputs for "
            f"the same image in two passes (relative difference {gap:.2g}): it draws at random "
            "in eval mode (random masking or noise), so no pass's rows are the image's")
    return layout


def _gap(x: torch.Tensor, x2: torch.Tensor, layout: str, b1: int, b2: int) -> float:
    """The relative difference of the first `b2` inputs' rows of `x` (of `b1` inputs) and
    `x2`'s, read in `layout` (0 where their shapes differ: nothing to compare)."""
    first = as_rows(x, layout, b1)[:b2]
    again = as_rows(x2, layout, b2)
    if first.shape != again.shape:
        return 0.0
    return _relative(first, again)


def _relative(x: torch.Tensor, again: torch.Tensor) -> float:
    """|again - x| / |x| (float64; over 1 where x is zero)."""
    x, again = x.double(), again.double()
    scale = float(torch.linalg.vector_norm(x)) or 1.0
    return float(torch.linalg.vector_norm(again - x)) / scale


@torch.no_grad()
def check_same_again(model: nn.Module, target: nn.Module, sample: Mapping[str, torch.Tensor],
                     path: str, module: nn.Module, x: torch.Tensor) -> None:
    """Refuse, in one sentence, a model whose norm at `path`, which saw `x` in a pass of
    `target` over `sample`, sees other inputs when the same pass runs again: it draws at
    random in eval mode (Diffusion Gemma's decoder reads a canvas of random tokens where it is
    given none). Asked where a norm's layout is unknown, before saying so, since a model's
    own draws (a canvas, a mask) are the likelier reason for positions that follow no input."""
    with record_calls({path: module}) as log:
        target(**sample)
    calls = log.calls.get(path)
    again = calls[0].input if calls else None
    if again is not None and again.shape == x.shape:
        gap = _relative(x, again)
        if not gap > _REPEAT_LIMIT:
            return
        what = f"relative difference {gap:.2g}"
    else:
        what = (f"shapes {tuple(x.shape)} and "
                f"{None if again is None else tuple(again.shape)}")
    from ..errors import ModelLoadError

    raise ModelLoadError(
        f"model {type(model).__name__!r} gives norm module {path!r} different inputs for "
        f"the same input in two passes ({what}): it draws at random in eval mode (random "
        "masking, noise or a canvas of random tokens), so no pass's rows are the input's")
