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
           Family("mobilenet_v1", "image"): "has no normalization modules",
           # its decoder's per-head norms see a canvas of random tokens: the layout of no
           # input, asked first whether the pass repeats
           Family("diffusion_gemma", "multimodal"): "draws at random in eval mode"}


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


def test_a_linear_patch_embedding_is_no_token_table(tmp_path: Path) -> None:
    """Siglip2 embeds flattened patches with a linear layer, which `get_input_embeddings`
    returns: no token table (no 'embed' anchors made of its weight's rows); its vocabulary is
    its classification head's labels."""
    outcome = scan(Family("siglip2", "image"), tmp_path)
    assert outcome.status == "OK", outcome.line()
    assert "head classifier" in outcome.detail
    import actdb

    db = actdb.connect(tmp_path / "siglip2.actdb")
    labels = db.sql("SELECT count(*) FROM vocab").fetchall()[0][0]
    assert db.sql("SELECT has_embed, head_kind, vocab_size FROM models").fetchall() == [
        (False, "classifier", labels)]


def test_patches_cut_over_the_batch_are_each_images_own(tmp_path: Path) -> None:
    """DepthPro cuts each scaled image into patches patch by patch over the batch ([k*B, T, d]
    at its patch encoder's norms): each image's stored rows are the rows its norms see when
    the image runs alone, in the same order."""
    import numpy as np
    import torch
    from support.vision_families import build, image_processor, random_images

    import actdb

    model, size = build(Family("depth_pro", "backbone"))
    images = random_images(3, size=size, seed=1)
    processor = image_processor(size)
    store = tmp_path / "depth_pro.actdb"
    actdb.ingest(store, model=model, inputs=[{"image": im} for im in images],
                 processor=processor, batch_size=3, device="cpu")
    db = actdb.connect(store)
    sites = db.sql("SELECT site, module, layout FROM sites WHERE module LIKE "
                   "'encoder.patch_encoder.%'").fetchall()
    assert sites and {layout for _, _, layout in sites} == {"kbtd"}
    site, module, _ = sites[0]
    seen: list[torch.Tensor] = []
    hook = model.get_submodule(module).register_forward_hook(
        lambda m, args, out: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            for im in images:  # alone: [k, T, d], one image's k patches in order
                model(pixel_values=processor(images=[im], return_tensors="pt")["pixel_values"])
    finally:
        hook.remove()
    for i, x in enumerate(seen):
        want = x.reshape(-1, x.shape[-1]).double().numpy()
        got = np.array([r[0] for r in db.sql(
            "SELECT to_list(vec) FROM acts WHERE site = ? AND prompt_id = ? ORDER BY position",
            params=[site, i]).fetchall()])
        assert got.shape == want.shape
        scale = np.linalg.norm(want, axis=-1, keepdims=True)
        assert np.abs(got - want).max() <= 2e-3 * scale.max(), i
