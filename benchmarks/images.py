"""Workload 15, image ingest: images per second of `actdb ingest --images` against the model's
own forward pass over the same images, its processor included on both sides.

A ViT-Small-shaped classifier (random weights; at scales full and medium d=384, 12 layers,
224 x 224 images in 16 x 16 patches: 197 positions an image) is saved with its image
processor, and PNG files (random pixels, fixed seed) are written once. Each round times, in
alternating order, the ingest of the folder into a new store and the baseline: the same files
read with PIL, prepared by the processor and run through the model in batches of the same
size.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import torch
from method import paired
from report import Result

import actdb

# (d, layers, heads, image side, patch side, images) by scale: ViT-Small at `full` and
# `medium`, a model of seconds at `tiny` (the suite's test that the scripts run).
SIZES = {"full": (384, 12, 6, 224, 16, 64), "medium": (384, 12, 6, 224, 16, 32),
         "tiny": (32, 2, 2, 32, 8, 8)}
LABELS = 1000


def _model(work: Path, size: tuple[int, ...]) -> tuple[Path, Path]:
    """The saved model folder and the folder of images (made once)."""
    d, layers, heads, side, patch, n_images = size
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    folder, images = work / "vit", work / "images"
    if not folder.exists():
        torch.manual_seed(0)
        config = ViTConfig(image_size=side, patch_size=patch, hidden_size=d,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=4 * d, num_labels=LABELS)
        ViTForImageClassification(config).save_pretrained(folder)
        ViTImageProcessor(size={"height": side, "width": side}).save_pretrained(folder)
    if not images.exists():
        images.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for i in range(n_images):
            pixels = rng.integers(0, 255, (side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / f"{i:04d}.png")
    return folder, images


def image_ingest(work: Path, repeats: int, scale: str, *, batch_size: int = 16) -> Result:
    from PIL import Image
    from transformers import AutoImageProcessor, ViTForImageClassification

    size = SIZES.get(scale, SIZES["medium"])
    d, layers, _, side, patch, n_images = size
    folder, images = _model(work, size)
    files = sorted(images.iterdir())
    model = ViTForImageClassification.from_pretrained(folder).eval()
    processor = AutoImageProcessor.from_pretrained(folder)
    runs = iter(range(1000))

    def ingest() -> None:
        actdb.ingest(work / f"images-{next(runs)}.actdb", model=str(folder), images=images,
                     batch_size=batch_size, device="cpu")

    def forward() -> None:
        with torch.no_grad():
            for i in range(0, len(files), batch_size):
                batch = [Image.open(f).convert("RGB") for f in files[i:i + batch_size]]
                model(**processor(images=batch, return_tensors="pt"))

    rounds = max(repeats, 5)
    timed = paired(ingest, forward, rounds)
    t_ingest, t_forward = list(timed.actdb), list(timed.baseline)
    r = Result(
        title="15. Image ingest",
        what=(f"`actdb.ingest(images=...)` of a ViT classifier (random weights, d={d}, "
              f"{layers} layers, {side} x {side} images in {patch} x {patch} patches: "
              f"{(side // patch) ** 2 + 1} positions an image, {2 * layers + 1} sites, "
              f"{LABELS} labels) over {n_images} PNG "
              f"files, batch size {batch_size}, CPU, into a new store each run, against the "
              "same files read with PIL, prepared by the model's processor and run through the "
              f"model; the median of {rounds} rounds' ratios, each round timing the two back to "
              "back in alternating order (`python benchmarks/run.py --only images`)."),
    )
    r.figure("ingest", f"{statistics.median(t_ingest):.2f} s "
             f"({n_images / statistics.median(t_ingest):.1f} images/s)")
    r.figure("the model's own forward pass (processor included)",
             f"{statistics.median(t_forward):.2f} s "
             f"({n_images / statistics.median(t_forward):.1f} images/s)")
    r.ratio("ingest time / the model's own forward pass", timed, "(information)", True)
    return r
