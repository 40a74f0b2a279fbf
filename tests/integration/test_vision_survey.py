"""A representative few of the vision survey's families (tests/support/vision_scan.py; the
whole survey's output is docs/FAMILIES.md): each ingests, with every site's stored energy
equal to its module's inputs captured by plain forward hooks (the survey's own check, beside
the one actdb makes of every site's output at ingest), or is refused in one sentence that
names what is unsupported."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.vision_families import Family
from support.vision_scan import scan

# Swin and ConvNeXt, at the survey's sizes, are checked vector by vector in
# test_feature_maps.py; here a ViT with registers, a video model and a multimodal decoder.
OK = [Family("dinov2_with_registers", "image"), Family("videomae", "video"),
      Family("llava", "multimodal")]
REFUSED = {Family("vit_mae", "backbone"): "draws at random in eval mode",
           Family("mobilenet_v1", "image"): "has no normalization modules"}


@pytest.mark.parametrize("family", OK, ids=[f.model_type for f in OK])
def test_family_ingests_faithfully(family: Family, tmp_path: Path) -> None:
    outcome = scan(family, tmp_path)
    assert outcome.status == "OK", outcome.line()
    assert "energy" in outcome.detail  # the independent check ran


@pytest.mark.parametrize("family", list(REFUSED), ids=[f.model_type for f in REFUSED])
def test_family_is_refused_in_one_sentence(family: Family, tmp_path: Path) -> None:
    outcome = scan(family, tmp_path)
    assert outcome.status == "REFUSED", outcome.line()
    assert REFUSED[family] in outcome.detail and "\n" not in outcome.detail
