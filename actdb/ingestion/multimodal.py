"""Inputs of text and images together, for a multimodal decoder (LLaVA, Qwen2-VL, PaliGemma):
the processor builds one sequence in which each image is a run of image tokens, and the
vision tower reads the image beside it.

An input's rows are the rows of the vision tower's grids (grids.py), then its text tokens (the
decoder's sequence as the processor built it, image tokens included: the token grid, as long
as the input's sequence; last, so that position_from_end = 0 is its last token). A decoder
row carries its token; an image token also its patch's row and column where the image tokens
are the image's patches one for one, row by row (LLaVA's, PaliGemma's), or its merged patches
(Qwen2-VL's `spatial_merge_size`, from its `image_grid_thw`); else NULL (Idefics3's
pixel-shuffled tiles). Every input must give the model media tensors of one shape: a vision
tower that reads every image's patches as one sequence (Qwen2-VL's) would otherwise have its
rows split among the batch's inputs at the wrong places.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import IngestError
from .grids import GridPlan, grid_positions
from .inputs import Positions, prepare_inputs
from .prompts import Prompt


def image_token_id(model: nn.Module) -> int | None:
    """The id of the token that stands for an image patch in the decoder's sequence."""
    config = getattr(model, "config", None)
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _patch_grid(model: nn.Module, inputs: dict[str, torch.Tensor], n: int
                ) -> tuple[int, int] | None:
    """(rows, columns) of the image's `n` image tokens, where they are its patches (merged
    `spatial_merge_size` x `spatial_merge_size` where the model merges them); else None."""
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    thw = inputs.get("image_grid_thw")
    if thw is not None and thw.shape[0] == 1:  # Qwen2-VL: the patches' (t, h, w), then merged
        t, h, w = (int(v) for v in thw[0])
        merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
        rows, cols = h // merge, w // merge
        return (rows, cols) if t == 1 and rows * cols == n else None
    pixels = inputs.get("pixel_values")
    patch = getattr(vision, "patch_size", None)
    if isinstance(patch, list | tuple):
        patch = patch[0]
    if pixels is None or pixels.dim() != 4 or not isinstance(patch, int) or patch <= 0:
        return None
    rows, cols = int(pixels.shape[-2]) // patch, int(pixels.shape[-1]) // patch
    return (rows, cols) if rows * cols == n else None


# The processor's tensors that follow the text (their length is the sequence's); the others
# are the media's, of one shape for every input of an ingest.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                        "position_ids"})


def media_shape(inputs: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The shapes of an input's media tensors (pixels, masks), and the values of the patch
    grids a processor reports (`image_grid_thw`: images of one pixel count but other sides
    give tensors of one shape)."""
    out = {k: tuple(v.shape) for k, v in inputs.items()
           if isinstance(v, torch.Tensor) and k not in _TEXT_KEYS}
    out.update({f"{k} values": tuple(int(x) for x in v.flatten()) for k, v in inputs.items()
                if isinstance(v, torch.Tensor) and k.endswith("_grid_thw")})
    return out


def mixed_rows(model: nn.Module, processor: Any, prompts: Sequence[Prompt], plan: GridPlan,
               name: str) -> tuple[list[list[int]], list[Positions]]:
    """Each input's row ids (-1 for each row of the vision grids, then its token ids) and
    labels, from its processor's output alone (the sequence it builds for that input)."""
    image = image_token_id(model)
    fixed = GridPlan(of_site={}, grids=tuple(g for g in plan.grids if not g.tokens))
    ids_out: list[list[int]] = []
    labels: list[Positions] = []
    first: dict[str, tuple[int, ...]] | None = None
    for i, p in enumerate(prompts):
        inputs = prepare_inputs(processor, [p], name, model)
        made = media_shape(inputs)
        first = made if first is None else first
        if made != first:
            differ = sorted(k for k in made.keys() | first.keys()
                            if made.get(k) != first.get(k))
            raise IngestError(
                f"input {i}'s media give model {name!r} other tensors than input 0's ("
                + "; ".join(f"{k} {list(made.get(k, ()))}, not {list(first.get(k, ()))}"
                            for k in differ)
                + "): the positions a vision tower gives an input are fixed for one ingest; "
                "resize the images to one size, or ingest each size apart")
        ids = inputs["input_ids"][0]
        mask = inputs.get("attention_mask")
        ids = ids[mask[0].bool()] if mask is not None else ids
        tokens = [int(t) for t in ids]
        n_image = sum(t == image for t in tokens) if image is not None else 0
        if image is not None and n_image == 0:
            raise IngestError(f"input {i}: the processor of model {name!r} put no image token "
                              "in its text: the image would not be read (put the processor's "
                              "image token where the image goes)")
        grid = _patch_grid(model, inputs, n_image) if n_image else None
        rows: list[int | None] = []
        cols: list[int | None] = []
        k = 0
        for t in tokens:
            if grid is not None and t == image:
                rows.append(k // grid[1])
                cols.append(k % grid[1])
                k += 1
            else:
                rows.append(None)
                cols.append(None)
        vision = grid_positions(model, inputs, fixed)
        given = vision.grid or [g.index for g in fixed.grids for _ in range(g.size)]
        labels.append(Positions(
            tokens=vision.tokens + ["<token>"] * len(tokens),
            patch_row=vision.patch_row + rows, patch_col=vision.patch_col + cols,
            frame=vision.frame + [None] * len(tokens),
            grid=list(given) + [0] * len(tokens)))
        ids_out.append([-1] * fixed.per_input + tokens)
    return ids_out, labels


def rows_mask(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """[B, max] with each input's rows first: the batch's rows the sink fills."""
    width = max(lengths)
    n = torch.tensor(list(lengths), device=device).unsqueeze(1)
    return torch.arange(width, device=device).unsqueeze(0) < n
