"""Inputs beyond text: image, video and sound files read and handed to the model's processor,
which makes the model's own inputs (`pixel_values`, ...), and the positions each norm sees
labelled (the class token, registers, patches by row and column, frames).

`--images DIR` reads a folder's image files sorted by name; `--inputs FILE.jsonl` and Python's
`inputs=[{...}]` give `text`, `image`, `video` and `audio` per input (prompts.py reads them).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import IngestError, PromptsError
from .audio import audio_inputs, spectrogram_grid
from .prompts import Media, Prompt, PromptsLike, read_prompts

# Main inputs that are not an image's pixels under another name.
_OTHER_MAIN = ("input_ids", "inputs_embeds", "input_features", "input_values", "pixel_values")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")

# The forward arguments that take each kind of input.
_TAKES = {"image": ("pixel_values",), "video": ("pixel_values_videos", "pixel_values"),
          "audio": ("input_features", "input_values"), "text": ("input_ids",)}


def read_inputs(prompts: PromptsLike | None, inputs: PromptsLike | None,
                images: str | os.PathLike[str] | None, format: str | None) -> list[Prompt]:
    """The ingest's inputs from whichever one of `prompts`, `inputs` and `images` is given."""
    given = [n for n, v in (("prompts", prompts), ("inputs", inputs), ("images", images))
             if v is not None]
    if len(given) != 1:
        raise PromptsError("give one of prompts, inputs and images (--prompts, --inputs, "
                           f"--images){'' if not given else ', not ' + ' and '.join(given)}")
    if images is not None:
        return read_image_folder(images)
    if inputs is not None:
        return read_prompts(inputs, format=format or (
            "jsonl" if isinstance(inputs, str | os.PathLike) and os.fspath(inputs) != "-"
            else None))
    assert prompts is not None
    return read_prompts(prompts, format=format)


def read_image_folder(folder: str | os.PathLike[str]) -> list[Prompt]:
    """One input a file of `folder` whose suffix is an image format's, sorted by name."""
    path = Path(folder)
    if not path.is_dir():
        raise PromptsError(f"images folder {os.fspath(folder)!r} does not exist"
                           if not path.exists() else
                           f"images folder {os.fspath(folder)!r} is a file, not a folder")
    files = sorted(p.name for p in path.iterdir()
                   if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise PromptsError(f"images folder {os.fspath(folder)!r} holds no image files "
                           f"({', '.join(IMAGE_SUFFIXES)})")
    return [Prompt(text="", media=Media(image=os.path.join(os.fspath(folder), f)))
            for f in files]


def takes(model: nn.Module) -> set[str]:
    """The kinds of input (text, image, video, audio) the model's forward takes: `pixel_values`
    are an image's, or a video's frames where the config counts frames (VideoMAE's; a
    Perceiver's config counts them too, and it reads an image: both kinds are let through,
    and the model's processor and forward pass tell)."""
    params = set(inspect.signature(model.forward).parameters)
    kinds = {kind for kind, names in _TAKES.items() if params & set(names)}
    config = getattr(model, "config", None)
    frames = getattr(getattr(config, "vision_config", None) or config, "num_frames", None)
    if "pixel_values_videos" not in params and "video" in kinds and frames is None:
        kinds.discard("video")
    return kinds


def check_inputs(prompts: Sequence[Prompt], model: nn.Module, name: str) -> None:
    """Refuse, in one sentence, inputs of a kind the model does not read, and media files
    that are not there: before anything is stored."""
    if type(model).forward is nn.Module.forward:
        # Qwen2.5-Omni's whole model only generates, through a thinker and a talker
        parts = [n for n, c in model.named_children() if type(c).forward is not nn.Module.forward
                 and "input_ids" in inspect.signature(c.forward).parameters]
        raise IngestError(
            f"model {name!r} has no forward pass for actdb to run ({type(model).__name__} "
            "defines none)" + (f": ingest one of its parts that has one "
                               f"({', '.join(repr(p) for p in parts)})" if parts else ""))
    kinds = takes(model)
    if not kinds:  # Pix2Struct reads flattened patches, a Perceiver autoencoder its `inputs`
        known = sorted({n for names in _TAKES.values() for n in names})
        raise IngestError(
            f"model {name!r} reads no input actdb knows ({type(model).__name__}'s forward has "
            f"none of the arguments {', '.join(known)})")
    reads = ", ".join(sorted(kinds))
    for i, p in enumerate(prompts):
        given = set(p.media.fields()) if p.media else set()
        if p.text:
            given.add("text")
        for what in sorted(given - kinds):
            if what == "text" and "audio" in kinds:
                raise IngestError(
                    f"input {i} is text but model {name!r} reads {reads} only: pass --inputs "
                    "FILE.jsonl with an 'audio' field (a sound file; inputs= in Python)")
            if what == "text":
                raise IngestError(
                    f"input {i} is text but model {name!r} reads {reads} only: pass --images "
                    "DIR or --inputs FILE.jsonl with an 'image' field (images=, inputs= in "
                    "Python)")
            article = "an" if what in ("image", "audio") else "a"
            raise IngestError(
                f"input {i} gives {article} {what} but model {name!r} reads {reads} only "
                f"({type(model).__name__}'s forward has no {' or '.join(_TAKES[what])} "
                "argument)")
        if p.media is None:
            continue
        for kind, value in p.media.fields().items():
            if kind in p.media.objects:
                continue
            where = resolve(p.media, value)
            if not (where.is_file() or (kind == "video" and where.is_dir())):
                raise PromptsError(
                    f"input {i}: {kind} {value!r} does not exist"
                    + (f" (read from {p.media.base!r})"
                       if p.media.base and not Path(value).is_absolute() else ""))


def resolve(media: Media, value: str) -> Path:
    """A media path as given, read relative to the folder of the file that named it."""
    return media.path(value)


def load_image(media: Media) -> Any:
    """The input's image as an RGB PIL image; one sentence naming the file if it cannot be."""
    if "image" in media.objects:
        return media.objects["image"].convert("RGB")
    from PIL import Image, UnidentifiedImageError

    assert media.image is not None
    path = resolve(media, media.image)
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise IngestError(f"image {media.image!r} cannot be read as an image "
                          f"({type(e).__name__}: {_first_line(e)})") from None


def natural_key(path: Path) -> tuple[tuple[int, int | str], ...]:
    """A file name's sort key with its runs of digits as numbers: frames named f1 .. f10
    without zero padding keep their order (a string sort puts f10 before f2)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part)
                 for part in re.split(r"(\d+)", path.name) if part)


def load_video(media: Media) -> list[Any]:
    """The input's video as a list of RGB frames (numpy [H, W, 3]): a folder's image files in
    natural order (numbers in names compared as numbers: f2 before f10), or a video file
    decoded by PyAV."""
    import numpy as np

    assert media.video is not None
    path = resolve(media, media.video)
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES),
                       key=natural_key)
        if not files:
            raise IngestError(f"video folder {media.video!r} holds no image files")
        return [np.asarray(load_image(Media(image=str(f)))) for f in files]
    import av

    try:
        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (av.FFmpegError, OSError, ValueError, IndexError) as e:
        raise IngestError(f"video {media.video!r} cannot be decoded "
                          f"({type(e).__name__}: {_first_line(e)})") from None
    if not frames:
        raise IngestError(f"video {media.video!r} holds no frames")
    return frames


def prepare_inputs(processor: Any, batch: Sequence[Prompt], name: str,
                   model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The model's inputs for a batch of image (or video) inputs, made by its processor; the
    pixels go to the `model`'s main input where that is another argument (a Perceiver reads
    its `inputs`, and ignores `pixel_values`)."""
    if processor is None:
        raise IngestError(f"model {name!r} has no processor saved with it (no "
                          "preprocessor_config.json): pass --processor PATH (processor=...)")
    kinds = {k for p in batch if p.media for k in p.media.fields()}
    kw: dict[str, Any] = {}
    if "image" in kinds:
        kw["images"] = [load_image(p.media) for p in batch if p.media]
    if "video" in kinds:
        videos = [load_video(p.media) for p in batch if p.media]
        # A video model's image processor (VideoMAE's) takes each video's frames as its
        # `images`; a video processor takes `videos`.
        takes_videos = "videos" in inspect.signature(processor.__call__).parameters
        kw["videos" if takes_videos else "images"] = videos
    if "audio" in kinds:
        if kinds != {"audio"} or any(p.text for p in batch):
            raise IngestError(f"model {name!r}: inputs of a sound and anything else together "
                              "are not supported")
        return {k: v for k, v in audio_inputs(processor, [p.media for p in batch if p.media],
                                              name).items() if isinstance(v, torch.Tensor)}
    if any(p.text for p in batch):  # a multimodal decoder: image tokens inside its text
        if not all(p.text and p.media for p in batch):
            raise IngestError(f"model {name!r}: inputs of text and an image together, and "
                              "inputs of one of them alone, go to separate ingests")
        kw["text"] = [p.text for p in batch]
        kw["padding"] = True
    try:
        out = processor(**kw, return_tensors="pt")
    except Exception as e:  # noqa: BLE001 - a processor's own failure, said in one sentence
        out = None
        if "text" in kw and "images" in kw:
            # Some processors (Gemma 3's) take a batch's images as one list per text.
            try:
                out = processor(**{**kw, "images": [[i] for i in kw["images"]]},
                                return_tensors="pt")
            except Exception:  # noqa: BLE001 - the first failure is the one to say
                out = None
        if out is None:
            raise IngestError(f"the processor of model {name!r} failed on these inputs "
                              f"({type(e).__name__}: {_first_line(e)})") from None
    # `labels` (PaliGemma's processor makes them) would have the model compute a loss
    made = {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k != "labels"}
    main = getattr(model, "main_input_name", None)
    # only where the main input is no other kind's (a contrastive model's is its text's)
    if (model is not None and isinstance(main, str) and main not in made
            and main not in _OTHER_MAIN and "pixel_values" in made
            and main in inspect.signature(model.forward).parameters):
        made[main] = made.pop("pixel_values")
    return made


@dataclass(frozen=True, kw_only=True)
class Positions:
    """What each position a norm sees is: a label (`<cls>`, `<reg>`, `<patch>`), a patch's
    row, column and frame (None where a position is no patch), and the grid it is on where
    sites see different grids (grids.py; None where every site sees every position)."""

    tokens: list[str]
    patch_row: list[int | None]
    patch_col: list[int | None]
    frame: list[int | None]
    grid: list[int | None] | None = None


def positions(model: nn.Module, inputs: dict[str, torch.Tensor], n: int) -> Positions:
    """The labels of `n` positions a vision model's norms see for one input: a grid of
    patches from the pixels' size and the config's patch size, after the tokens that come
    first (class token, registers). Without a grid that accounts for `n`, plain labels."""
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None) or config
    patch = getattr(vision, "patch_size", None)
    pixels = inputs.get("pixel_values", inputs.get("pixel_values_videos"))
    if isinstance(patch, list | tuple):
        patch = patch[0]
    frames = 1
    if pixels is not None and pixels.dim() == 5:  # [B, F, C, H, W] video
        tubelet = getattr(vision, "tubelet_size", 1) or 1
        if isinstance(tubelet, list | tuple):  # (frames, height, width): ViViT's patches
            patch = patch if patch is not None else int(tubelet[1])
            tubelet = tubelet[0]
        frames = int(pixels.shape[1]) // int(tubelet)
    if isinstance(patch, int) and patch > 0 and pixels is not None and pixels.dim() >= 4:
        rows, cols = int(pixels.shape[-2]) // patch, int(pixels.shape[-1]) // patch
        grid = frames * rows * cols
        prefix = n - grid
        if 0 <= prefix <= 8:
            embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
            registers = int(getattr(getattr(embeddings, "register_tokens", None), "shape",
                                    (0, 0))[1]) if embeddings is not None else 0
            tokens = ["<cls>" if i == 0 and prefix > registers else "<reg>"
                      if i >= prefix - registers else "<prefix>" for i in range(prefix)]
            pr: list[int | None] = [None] * prefix
            pc: list[int | None] = [None] * prefix
            fr: list[int | None] = [None] * prefix
            for k in range(grid):
                f, rest = divmod(k, rows * cols)
                r, c = divmod(rest, cols)
                tokens.append("<patch>")
                pr.append(r)
                pc.append(c)
                fr.append(f if frames > 1 else None)
            return Positions(tokens=tokens, patch_row=pr, patch_col=pc, frame=fr)
    sound = "input_features" in inputs or "input_values" in inputs
    bands = spectrogram_grid(model) if sound else None
    if bands is not None and 0 <= n - bands[0] * bands[1] <= 8:
        # a spectrogram's patches (AST), frequency band by time step, after the class and
        # distillation tokens
        prefix = n - bands[0] * bands[1]
        cells = [divmod(k, bands[1]) for k in range(bands[0] * bands[1])]
        return Positions(tokens=["<cls>"] * prefix + ["<patch>"] * len(cells),
                         patch_row=[None] * prefix + [r for r, _ in cells],
                         patch_col=[None] * prefix + [c for _, c in cells],
                         frame=[None] * n)
    # a sound's positions: the encoder's frames in time, each a stretch of the sound
    label = "<audio>" if sound else "<pos>"
    return Positions(tokens=[label] * n, patch_row=[None] * n, patch_col=[None] * n,
                     frame=[None] * n)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
