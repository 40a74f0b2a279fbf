"""A video given as a folder of frames reads them in natural order: frames named without zero
padding (f1 .. f12) keep their time order, which a string sort breaks (f10 before f2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from actdb.ingestion.inputs import load_video
from actdb.ingestion.prompts import Media


def test_frames_are_read_in_natural_order(tmp_path: Path) -> None:
    folder = tmp_path / "clip"
    folder.mkdir()
    for i in range(1, 13):  # frame i is a flat image of value 10 * i
        Image.fromarray(np.full((4, 4, 3), 10 * i, np.uint8)).save(folder / f"f{i}.png")
    frames = load_video(Media(video=str(folder)))
    assert [int(f[0, 0, 0]) for f in frames] == [10 * i for i in range(1, 13)]
