"""Norms whose input is a feature map ([B, H, W, C]: ConvNeXt's channels-last LayerNorm; [B, C, H,
W]: its channels-first one) and models whose stages see different numbers of positions (Swin
merges patches; ConvNeXt's head norms the pooled vector): every site's rows are its own grid's
positions. The references are each norm module's input captured with plain forward hooks and
laid out by the model's own `data_format`, and the model's own logits, never actdb's code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.vision_families import build_classifier, random_images

import actdb

N_IMAGES = 3


def _reference(model: torch.nn.Module, processor: object, images: list[object]
               ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, tuple[int, int] | None,
                                                    str]]]:
    """The model's logits [N, L], and per norm module its input as [N, P, d] float64 rows,
    the feature map's (H, W) where it is one, and the layout its `data_format` says."""
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]  # type: ignore
    inputs: dict[str, tuple[torch.Tensor, tuple[int, int] | None, str]] = {}

    def keep(name: str, module: torch.nn.Module) -> object:
        def hook(m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
            x = args[0].detach().double()
            if x.dim() == 4 and getattr(module, "data_format", "") == "channels_first":
                hw = (x.shape[2], x.shape[3])
                x, layout = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, x.shape[1]), "bchw"
            elif x.dim() == 4:
                hw = (x.shape[1], x.shape[2])
                x, layout = x.reshape(x.shape[0], -1, x.shape[3]), "bhwc"
            else:
                hw, layout = None, "btd"
                x = x.reshape(pixels.shape[0], -1, x.shape[-1])
            inputs[name] = (x, hw, layout)

        return hook

    handles = [m.register_forward_hook(keep(name, m)) for name, m in model.named_modules()
               if isinstance(m, torch.nn.LayerNorm)]
    try:
        with torch.no_grad():
            logits = model(pixel_values=pixels).logits.double()
    finally:
        for h in handles:
            h.remove()
    return logits, inputs


@pytest.fixture(scope="module", params=["swin", "convnext"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path, torch.Tensor, dict[str, tuple[torch.Tensor, object, str]]]:
    mt = request.param
    model, processor = build_classifier(mt)
    images = random_images(N_IMAGES)
    store = tmp_path_factory.mktemp(mt) / "s.actdb"
    # two batches: the second input's rows start after the first batch's, on every grid
    actdb.ingest(store, model=model, processor=processor, inputs=[{"image": i} for i in images],
                 batch_size=2)
    logits, inputs = _reference(model, processor, images)
    return mt, store, logits, inputs


def test_every_site_stores_its_grid_of_positions(family: tuple) -> None:
    mt, store, _, inputs = family
    db = actdb.connect(store)
    sites = {r[0]: r[1:] for r in db.sql(
        "SELECT module, site, layout, grid FROM sites").fetchall()}
    assert set(sites) == set(inputs)  # every LayerNorm of the model is a site
    layouts = {layout for _, layout, _ in sites.values()}
    assert layouts == ({"bchw", "bhwc", "btd"} if mt == "convnext" else {"btd"})
    sizes = {x.shape[1] for x, _, _ in inputs.values()}
    assert len(sizes) > 1  # the stages see different numbers of positions
    assert len({g for _, _, g in sites.values()}) == len(sizes)  # one grid a number
    for module, (x, hw, layout) in inputs.items():
        site, stored_layout, _ = sites[module]
        assert stored_layout == layout, module
        n, p, d = x.shape
        got = db.sql("SELECT prompt_id, position, norm, mean, to_list(vec), patch_row, "
                     "patch_col, token FROM acts WHERE site = ? ORDER BY prompt_id, position",
                     params=[site]).fetchall()
        assert len(got) == n * p, site  # its own grid's positions, no other
        energy = torch.linalg.vector_norm(x, dim=-1).reshape(-1).numpy()
        np.testing.assert_allclose([r[2] for r in got], energy, rtol=1e-6)
        np.testing.assert_allclose([r[3] for r in got], x.mean(-1).reshape(-1).numpy(),
                                   rtol=1e-5, atol=1e-6)
        vec = np.array([r[4] for r in got])
        np.testing.assert_allclose(vec, x.reshape(n * p, d).numpy(), rtol=2e-3,
                                   atol=2e-3 * energy.max() / np.sqrt(d))
        if p == 1:  # the head's norm of the pooled feature map
            assert {(r[5], r[6], r[7]) for r in got} == {(None, None, "<pooled>")}
            continue
        rows, cols = hw or (int(np.sqrt(p)),) * 2  # Swin's stages: square, as the image is
        assert rows * cols == p
        first = [(r[5], r[6]) for r in got[:p]]
        assert first == [(k // cols, k % cols) for k in range(p)], site  # row by row


def test_grids_are_consistent_in_the_catalog(family: tuple) -> None:
    _, store, _, inputs = family
    db = actdb.connect(store)
    # an input's rows are its grids' positions one after the other, each grid once
    per_input = sum({x.shape[1] for x, _, _ in inputs.values()})
    assert db.sql("SELECT DISTINCT n_tokens FROM prompts").fetchall() == [(per_input,)]
    spans = db.sql("SELECT grid, min(position), max(position), count(*) FROM tokens "
                   "WHERE prompt_id = 1 GROUP BY grid ORDER BY grid").fetchall()
    at = 0
    for _, lo, hi, n in spans:
        assert (lo, hi) == (at, at + n - 1)
        at += n
    assert at == per_input
    assert db.sql("SELECT count(*) FROM sites WHERE grid IS NULL").fetchall() == [(0,)]


def test_pooled_head_is_proven_and_reads_the_model(family: tuple) -> None:
    mt, store, logits, _ = family
    db = actdb.connect(store)
    head = db.sql("SELECT head_kind, head_position, head_pool FROM models").fetchall()[0]
    if mt == "swin":
        # its head averages the final norm's positions: each position's logits are its vote,
        # and their mean is the model's own logits
        assert head == ("classifier", None, "mean")
        n_labels = logits.shape[1]
        cols = ", ".join(f"avg(logit(vec, {t}))" for t in range(n_labels))
        got = db.sql(f"SELECT prompt_id, count(*), {cols} FROM acts WHERE site = 'final' "
                     "GROUP BY prompt_id ORDER BY prompt_id").fetchall()
        assert [r[1] for r in got] == [_positions(db, "final")] * N_IMAGES
        np.testing.assert_allclose([r[2:] for r in got], logits.numpy(), rtol=2e-3,
                                   atol=2e-3 * float(logits.abs().max()))
        return
    assert head == ("classifier", 0, None)
    rows = db.sql("SELECT top_logits(vec, 1)[1].token_id, top_logits(vec, 1)[1].logit "
                  "FROM acts WHERE site = 'final' ORDER BY prompt_id").fetchall()
    assert [r[0] for r in rows] == logits.argmax(-1).tolist()
    np.testing.assert_allclose([r[1] for r in rows], logits.max(-1).values.numpy(),
                               rtol=2e-3, atol=2e-3)


def _positions(db: actdb.Database, site: str) -> int:
    """The positions an input gives `site` (its grid's)."""
    return int(db.sql("SELECT count(*) FROM acts WHERE site = $s AND prompt_id = 0",
                      params={"s": site}).fetchall()[0][0])


def test_a_store_with_grids_is_format_6(family: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """An actdb reading up to version 5 would give every site every grid's rows: it refuses
    the store instead."""
    from actdb.errors import StoreFormatError
    from actdb.store import store as store_module

    _, store, _, _ = family
    assert actdb.connect(store).info().format_version == 6
    monkeypatch.setattr(store_module, "FORMAT_VERSION", 5)
    with pytest.raises(StoreFormatError, match="format version 6"):
        actdb.connect(store)


def test_hierarchical_blocks_count_across_stages(tmp_path: Path) -> None:
    """Swin's blocks are its stages' lists one after the other: block j of stage s is layer
    depths[0] + ... + depths[s-1] + j, with its pre-attention and pre-MLP norms; a patch
    merging norm between stages is `other` at the layer of the block after it. The reference
    is each module's own path in the model."""
    from support.vision_families import image_processor
    from transformers import SwinConfig, SwinForImageClassification

    depths = [2, 1]
    torch.manual_seed(0)
    model = SwinForImageClassification(SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=depths, num_heads=[2, 2],
        window_size=2, num_labels=3)).eval()
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, processor=image_processor(),
                 inputs=[{"image": i} for i in random_images(1)])
    db = actdb.connect(store)
    got = {r[0]: r[1:] for r in db.sql("SELECT module, layer, role FROM sites").fetchall()}
    want: dict[str, tuple[int, str]] = {"swin.embeddings.norm": (-1, "embed"),
                                        "swin.layernorm": (sum(depths), "final")}
    for s, depth in enumerate(depths):
        for j in range(depth):
            block = f"swin.encoder.layers.{s}.blocks.{j}"
            want[f"{block}.layernorm_before"] = (sum(depths[:s]) + j, "pre_attn")
            want[f"{block}.layernorm_after"] = (sum(depths[:s]) + j, "pre_mlp")
        if s + 1 < len(depths):
            want[f"swin.encoder.layers.{s}.downsample.norm"] = (sum(depths[:s + 1]), "other")
    assert got == want
    assert db.sql("SELECT n_layers FROM models").fetchall() == [(sum(depths),)]


def test_pictures_read_the_blocks_norms_of_the_heads_width(family: tuple) -> None:
    """ConvNeXt has no attention (no pre_attn sites): the lens and patches pictures, and the
    report's lens, read its blocks' own norms without being told a role, and only those as wide
    as its head (its first stage is narrower). The reference is the model's modules' widths."""
    from actdb.plot import lens_data
    from actdb.plot.patches import patches_spec
    from actdb.plot.section import lens_roles

    mt, store, logits, inputs = family
    if mt != "convnext":
        return
    db = actdb.connect(store)
    width = int(db.sql("SELECT d_model FROM models").fetchall()[0][0])
    wide = {module for module, (x, _, _) in inputs.items()
            if x.shape[-1] == width and "embeddings" not in module
            and "downsampling" not in module}
    module_of = dict(db.sql("SELECT site, module FROM sites").fetchall())
    assert lens_roles(db, db.sql("SELECT model FROM models").fetchall()[0][0]) == [
        "other", "final"]
    lens = lens_data(db, 0, device="cpu").df
    assert {module_of[s] for s in lens["site"]} == wide
    final = lens[lens["site"] == "final"]  # the head's own logits, as the model's
    assert final["top_id"].tolist() == [int(logits[0].argmax())]
    patches = patches_spec(db, 0).run(db).df
    assert {module_of[s] for s in patches["site"]} == wide - {"convnext.layernorm"}
