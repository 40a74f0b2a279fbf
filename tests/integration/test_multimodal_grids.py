"""Text and images in one input for multimodal decoders whose image tokens are no one-for-one
grid of patches: Qwen2-VL (patches of any image size, merged 2 x 2 for the decoder, its vision
tower reading every image's patches as one sequence) and Idefics3 (an image split into tiles
and a global image, each pixel-shuffled into fewer tokens), tiny models built from configs.

References: each input alone through plain transformers (its processor's token ids, its
logits, each norm module's input captured with forward hooks, float64), and for Qwen2-VL's
image tokens the model's own multimodal rotary positions (`get_rope_index`: an image token's
height and width indices are its merged patch's row and column)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.vision_models import build_multimodal_grid

import actdb

PROMPTS = {
    "qwen2_vl": ["<|vision_start|><|image_pad|><|vision_end|>what is this",
                 "a picture <|vision_start|><|image_pad|><|vision_end|> of cats and dogs"],
    "idefics3": ["<image>what is this", "a picture <image> of cats and dogs"],
    "gemma3": ["<start_of_image>what is this", "a picture <start_of_image> of cats and dogs"],
}
# two inputs of two lengths: one padded batch
# (height, width): Qwen2-VL's 8 x 12 pixels are 4 x 6 patches, 2 x 3 merged (rows and columns
# told apart); Idefics3's 16 x 16 are four 8 x 8 tiles and a global image
SIZE = {"qwen2_vl": (8, 12), "idefics3": (16, 16), "gemma3": (16, 16)}


def _images(kind: str) -> list[Any]:
    from PIL import Image

    rng = np.random.default_rng(2)
    return [Image.fromarray(rng.integers(0, 256, (*SIZE[kind], 3), dtype=np.uint8))
            for _ in PROMPTS[kind]]


def _alone(model: torch.nn.Module, processor: Any, image: Any, text: str,
           modules: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray],
                                            np.ndarray]:
    """One input alone: (its processor's tensors, each module's first input as rows [n, d]
    (a per-head module's, given its layout in `modules`, head by head), its logits [T, V])."""
    x = dict(processor(images=[image], text=[text], return_tensors="pt"))
    kept: dict[str, np.ndarray] = {}
    named = dict(model.named_modules())

    def keep(name: str) -> Any:
        def hook(m: torch.nn.Module, args: tuple[torch.Tensor, ...], o: object) -> None:
            if name not in kept:
                x = args[0].detach().double()
                x = x.transpose(1, 2) if modules[name] == "bthd" else x  # heads outer
                kept[name] = x.reshape(-1, x.shape[-1]).numpy()
        return hook

    handles = [named[n].register_forward_hook(keep(n)) for n in modules]
    try:
        with torch.no_grad():
            logits = model(**x).logits[0].double().numpy()
    finally:
        for h in handles:
            h.remove()
    return x, kept, logits


@pytest.fixture(scope="module", params=["qwen2_vl", "idefics3", "gemma3"])
def ingested(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[str, Path, torch.nn.Module, Any]:
    import transformers as T

    kind = request.param
    folder, processor = build_multimodal_grid(kind, tmp_path_factory.mktemp(kind))
    store = folder.parent / "s.actdb"
    inputs = [{"image": im, "text": t} for im, t in zip(_images(kind), PROMPTS[kind],
                                                         strict=True)]
    actdb.ingest(store, model=str(folder), processor=processor, inputs=inputs, batch_size=2,
                 device="cpu")
    model = T.AutoModelForImageTextToText.from_pretrained(folder).eval()
    return kind, store, model, processor


def test_every_site_is_the_models_own_input(ingested: tuple[str, Path, torch.nn.Module, Any]
                                            ) -> None:
    """Each site's rows of each input (batched two at a time) are its norm module's input
    with the input run alone, in the module's own order: the vision tower's patches (Qwen2-VL:
    every image's as one sequence; Idefics3: tile by tile, the global image last), then the
    decoder's sequence; the decoder's tokens are the processor's; the LM head's logits at the
    final site are the model's own."""
    kind, store, model, processor = ingested
    db = actdb.connect(store)
    sites = db.sql("SELECT site, module, tower, layout FROM sites").fetchall()
    assert {s[2] for s in sites} - {"projector"} == {"vision", "text"}
    for p, (image, text) in enumerate(zip(_images(kind), PROMPTS[kind], strict=True)):
        x, kept, logits = _alone(model, processor, image, text, {s[1]: s[3] for s in sites})
        got_ids = db.sql("SELECT token_id FROM acts WHERE prompt_id = $p AND site = 'final' "
                         "ORDER BY position", params={"p": p}).fetchall()
        assert [g[0] for g in got_ids] == x["input_ids"][0].tolist()
        for site, module, _, _ in sites:
            got = db.vectors("SELECT vec FROM acts WHERE prompt_id = $p AND site = $s ORDER BY "
                             "head NULLS FIRST, position", params={"p": p, "s": site}
                             ).double().numpy()
            want = kept[module]
            assert got.shape == want.shape, (site, got.shape, want.shape)
            np.testing.assert_allclose(got, want, rtol=2e-3,
                                       atol=2e-3 * float(np.abs(want).max()), err_msg=site)
        top = db.sql("SELECT top_logits(vec, 1)[1] FROM acts WHERE prompt_id = $p "
                     "AND site = 'final' ORDER BY position", params={"p": p}).fetchall()
        got_top = np.array([t[0]["logit"] for t in top])
        np.testing.assert_allclose(got_top, logits.max(-1), rtol=2e-3, atol=2e-3)
        # the stored top token is the model's, or one within rounding of its logit
        own = logits[np.arange(len(top)), [t[0]["token_id"] for t in top]]
        np.testing.assert_allclose(own, logits.max(-1), rtol=2e-3, atol=2e-3)
    # the vision tower's rows never meet the decoder's final norm: no lens, in one sentence
    from actdb.errors import QueryError

    with pytest.raises(QueryError, match=r"^top_logits reads [^\n]*site 'vision\.blocks\.0\.ln1' "
                       r"is its vision tower's[^\n]*NOT LIKE 'vision\.%'\)$"):
        db.sql("SELECT top_logits(vec, 1) FROM acts WHERE site = 'vision.blocks.0.ln1'"
               ).fetchall()


def test_image_tokens_carry_their_patches(ingested: tuple[str, Path, torch.nn.Module, Any]
                                          ) -> None:
    """Qwen2-VL: an image token's (patch_row, patch_col) is its merged patch's, which is where
    the model's own rotary positions put it (height and width index less the image's first);
    Idefics3: NULL (its tokens are pixel-shuffled tiles, whose arrangement only the text's
    <row_i_col_j> tokens say). The vision tower's rows are NULL in both: their order is the
    tower's own (Qwen2-VL's merge blocks, Idefics3's tiles), which no grid of the image is.
    Gemma 3: the vision tower's rows are its patches row by row, its projector's rows the
    pooled cells (checked against the model's own pooling), its image tokens NULL."""
    kind, store, model, processor = ingested
    db = actdb.connect(store)
    image_id = model.config.image_token_id
    for p, (image, text) in enumerate(zip(_images(kind), PROMPTS[kind], strict=True)):
        rows = db.sql("SELECT token_id, patch_row, patch_col FROM acts WHERE prompt_id = $p "
                      "AND site = 'final' ORDER BY position", params={"p": p}).fetchall()
        vision = db.sql("SELECT patch_row, patch_col FROM acts WHERE prompt_id = $p AND "
                        "site = 'vision.blocks.0.ln1' ORDER BY position",
                        params={"p": p}).fetchall()
        image_rows = [(r[1], r[2]) for r in rows if r[0] == image_id]
        assert all((r[1], r[2]) == (None, None) for r in rows if r[0] != image_id)
        if kind == "gemma3":  # a ViT's patches, row by row; image tokens pooled: NULL
            assert vision == [(k // 8, k % 8) for k in range(64)]
            assert len(image_rows) == 16 and set(image_rows) == {(None, None)}
            _pooled_cells_are_the_models(db, model, processor, image, text, p)
            continue
        assert len(vision) > 0 and set(vision) == {(None, None)}
        if kind == "idefics3":
            assert len(image_rows) == 5 * 4 and set(image_rows) == {(None, None)}
            continue
        x = processor(images=[image], text=[text], return_tensors="pt")
        pos, _ = model.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"],
                                            image_grid_thw=x["image_grid_thw"],
                                            attention_mask=x["attention_mask"])
        at = x["input_ids"][0] == image_id
        h, w = pos[1, 0][at], pos[2, 0][at]
        want = list(zip((h - h.min()).tolist(), (w - w.min()).tolist(), strict=True))
        assert image_rows == want
        assert max(r for r, _ in want) == 1 and max(c for _, c in want) == 2  # 2 x 3


def _pooled_cells_are_the_models(db: Any, model: torch.nn.Module, processor: Any, image: Any,
                                 text: str, p: int) -> None:
    """Gemma 3's projector rows at (patch_row, patch_col) are the mean of the vision tower's
    output over that cell's 2 x 2 patches: the 8 x 8 grid average-pooled, computed here."""
    kept: dict[str, torch.Tensor] = {}
    tower = model.model.vision_tower.post_layernorm

    def keep(m: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        kept.setdefault("out", out.detach().double())  # returning it would replace it

    handle = tower.register_forward_hook(keep)
    try:
        with torch.no_grad():
            model(**processor(images=[image], text=[text], return_tensors="pt"))
    finally:
        handle.remove()
    patches = kept["out"][0].reshape(8, 8, -1)  # [row, col, d]
    want = patches.reshape(4, 2, 4, 2, -1).mean(dim=(1, 3))  # [4, 4, d]
    rows = db.sql("SELECT patch_row, patch_col FROM acts WHERE prompt_id = $p AND "
                  "site = 'projector.final' ORDER BY position", params={"p": p}).fetchall()
    got = db.vectors("SELECT vec FROM acts WHERE prompt_id = $p AND site = 'projector.final' "
                     "ORDER BY position", params={"p": p}).double()
    ref = torch.stack([want[r, c] for r, c in rows])
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=2e-3,
                               atol=2e-3 * float(ref.abs().max()))


def test_images_of_other_sizes_are_refused(ingested: tuple[str, Path, torch.nn.Module, Any]
                                           ) -> None:
    """Qwen2-VL's vision tower reads every image's patches as one sequence, so a batch of a
    36-patch and a 12-patch image has the 48 rows of two 24-patch ones: images whose tensors
    differ from the first input's are refused in one sentence, before anything is stored."""
    from PIL import Image

    from actdb.errors import IngestError

    kind, store, _, processor = ingested
    if kind != "qwen2_vl":
        pytest.skip("Idefics3's and Gemma 3's processors resize every image to one size")
    rng = np.random.default_rng(3)
    sizes = [(8, 12)] * 4 + [(12, 12), (4, 12)]  # the last two batched together: 36 + 12
    inputs = [{"image": Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)),
               "text": f"{PROMPTS[kind][0]} {i}"} for i, s in enumerate(sizes)]
    other = store.parent / "other.actdb"
    with pytest.raises(IngestError, match=r"^input 4's media give model '.*' other tensors "
                       r"than input 0's \(image_grid_thw values \[1, 6, 6\], not \[1, 4, 6\]; "
                       r"pixel_values \[36, 24\], not \[24, 24\]\)[^\n]*$"):
        actdb.ingest(other, model=str(store.parent / kind), processor=processor,
                     inputs=inputs, batch_size=2, device="cpu")
    assert not other.exists()
