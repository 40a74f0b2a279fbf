"""A contrastive model's labels as anchors (a zero-shot lens), on tiny CLIP and SigLIP models
built from configs. The references are the models' own outputs (logits_per_image, text_embeds)
and their norms' inputs captured with plain forward hooks, recomputed in float64 NumPy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from support.vision_models import build_contrastive

import actdb
from actdb.cli import cli
from actdb.errors import ActdbError, QueryError

LABELS = ["cat", "dog", "bird", "fish"]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("contrastive")
    return {kind: build_contrastive(kind, folder) for kind in ("clip", "siglip")}


@pytest.fixture(scope="module")
def clip_store(models: dict[str, Path], images: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("stores") / "clip.actdb"
    labels = store.parent / "labels.txt"
    labels.write_text("\n".join(LABELS) + "\n")
    result = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(models["clip"]),
                                      "--images", str(images), "--labels", str(labels),
                                      "--label-template", "a picture of a {}", "-q"])
    assert result.exit_code == 0, result.output
    return store


def _reference(folder: Path, images: Path, template: str) -> dict[str, np.ndarray]:
    """The model's own logits_per_image [N, L] and text_embeds [L, p], and the inputs of its
    vision tower's norms [N, T, d], float64, from plain transformers and hooks."""
    import transformers as T
    from PIL import Image

    model = T.AutoModel.from_pretrained(folder).eval()
    processor = T.AutoProcessor.from_pretrained(folder)
    files = sorted(images.iterdir())
    pixels = processor(images=[Image.open(f).convert("RGB") for f in files],
                       return_tensors="pt")["pixel_values"]
    texts = [template.format(label) for label in LABELS]
    padding = {"padding": "max_length", "max_length": 32} if "siglip" in folder.name else {
        "padding": True}
    text = processor.tokenizer(texts, return_tensors="pt", **padding)
    got: dict[str, np.ndarray] = {}

    def keep(name: str) -> object:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
            got[name] = args[0].detach().double().numpy()
        return hook

    handles = [m.register_forward_hook(keep(name))
               for name, m in model.vision_model.named_modules()
               if isinstance(m, torch.nn.LayerNorm)]
    try:
        with torch.no_grad():
            out = model(pixel_values=pixels, input_ids=text["input_ids"],
                        attention_mask=text["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    got["logits"] = out.logits_per_image.double().numpy()
    got["text"] = out.text_embeds.double().numpy()
    got["scale"] = np.exp(model.logit_scale.detach().double().numpy())
    state = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    got.update({f"param:{k}": v for k, v in state.items()})
    return got


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * w + b


def test_clip_lens_at_the_class_token_is_the_models_zero_shot_classifier(
        models: dict[str, Path], images: Path, clip_store: Path) -> None:
    ref = _reference(models["clip"], images, "a picture of a {}")
    db = actdb.connect(clip_store)
    rows = db.sql("SELECT prompt_id, top_logits(vec, 4) AS top, prob(vec, 'dog') AS p, "
                  "token_rank(vec, 'bird') AS r, logit(vec, 'fish') AS f FROM acts "
                  "WHERE site = 'final' ORDER BY prompt_id").fetchall()
    logits = ref["logits"]
    assert len(rows) == len(logits) == 5
    for (_, top, p, r, f), want in zip(rows, logits, strict=True):
        order = np.argsort(-want, kind="stable")
        assert [t["token"] for t in top] == [LABELS[i] for i in order]
        np.testing.assert_allclose([t["logit"] for t in top], want[order], rtol=1e-2, atol=2e-3)
        soft = np.exp(want - want.max()) / np.exp(want - want.max()).sum()
        np.testing.assert_allclose(p, soft[1], rtol=1e-2, atol=1e-3)
        assert r == int((want > want[2]).sum()) + 1
        np.testing.assert_allclose(f, want[3], rtol=1e-2, atol=2e-3)
    # the vocabulary is the labels; each piece is what the text tower read
    vocab = db.sql("SELECT token, piece FROM vocab ORDER BY token_id").fetchall()
    assert vocab == [(label, f"a picture of a {label}") for label in LABELS]


def test_clip_lens_at_a_middle_layer_and_the_anchors(models: dict[str, Path], images: Path,
                                                     clip_store: Path) -> None:
    ref = _reference(models["clip"], images, "a picture of a {}")
    x = ref["encoder.layers.1.layer_norm1"][:, 0]  # [N, d]: layer 1's input at the class token
    y = _layer_norm(x, ref["param:vision_model.post_layernorm.weight"],
                    ref["param:vision_model.post_layernorm.bias"])
    p = ref["param:visual_projection.weight"]  # [proj, d]
    e = y @ p.T
    t = ref["text"] / np.linalg.norm(ref["text"], axis=-1, keepdims=True)
    want = ref["scale"] * (e / np.linalg.norm(e, axis=-1, keepdims=True)) @ t.T  # [N, L]
    anchors = t @ p  # the labels read back through the projection, [L, d]
    cos = (x / np.linalg.norm(x, axis=-1, keepdims=True)) @ (
        anchors / np.linalg.norm(anchors, axis=-1, keepdims=True)).T
    db = actdb.connect(clip_store)
    got = db.sql("SELECT prompt_id, logit(vec, 'cat'), logit(vec, 'dog'), "
                 "cosine_to_anchor(vec, 'cat', 'labels'), cosine_to_anchor(vec, 'bird') "
                 "FROM acts WHERE site = 'blocks.1.ln1' AND position = 0 ORDER BY prompt_id"
                 ).fetchall()
    arr = np.array([r[1:] for r in got])
    np.testing.assert_allclose(arr[:, 0], want[:, 0], rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(arr[:, 1], want[:, 1], rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(arr[:, 2], cos[:, 0], atol=2e-3)
    np.testing.assert_allclose(arr[:, 3], cos[:, 2], atol=2e-3)
    # the final norm reads the class token alone: its site holds that one row an input
    final = db.sql("SELECT prompt_id, to_list(vec) FROM acts WHERE site = 'final' "
                   "ORDER BY prompt_id").fetchall()
    assert ref["post_layernorm"].ndim == 2 and len(final) == 5
    np.testing.assert_allclose(np.array([r[1] for r in final]), ref["post_layernorm"],
                               rtol=2e-3, atol=2e-3)
    info = CliRunner().invoke(cli, ["info", str(clip_store)])
    assert "zero-shot lens on the class token" in info.output
    assert CliRunner().invoke(cli, ["verify", str(clip_store), "--full"]).exit_code == 0


def test_siglip_keeps_its_anchors_and_refuses_the_lens(models: dict[str, Path], images: Path,
                                                        tmp_path: Path) -> None:
    store = tmp_path / "siglip.actdb"
    summary = actdb.ingest(store, model=str(models["siglip"]), images=images, labels=LABELS)
    assert any("pools its image embedding" in w for w in summary.warnings)
    ref = _reference(models["siglip"], images, "a photo of a {}")
    t = ref["text"] / np.linalg.norm(ref["text"], axis=-1, keepdims=True)
    x = ref["encoder.layers.0.layer_norm2"][:, 3]  # a patch of block 0
    cos = (x / np.linalg.norm(x, axis=-1, keepdims=True)) @ t.T
    db = actdb.connect(store)
    got = db.sql("SELECT cosine_to_anchor(vec, 'fish', 'labels') FROM acts "
                 "WHERE site = 'blocks.0.ln2' AND position = 3 ORDER BY prompt_id").fetchall()
    np.testing.assert_allclose([r[0] for r in got], cos[:, 3], atol=2e-3)
    with pytest.raises(QueryError, match="pools every position into its image embedding"):
        db.sql("SELECT top_logits(vec, 1) FROM acts WHERE site = 'final'").fetchall()
    # the anchors and the logit bias were proven against the model's own logits
    m = db.sql("SELECT head_kind, head_position, logit_scale, logit_max_rel_error "
               "FROM models").fetchall()[0]
    assert m[:2] == ("labels", None)
    np.testing.assert_allclose(m[2], np.exp(2.3), rtol=1e-6)
    assert m[3] < 1e-4


def test_labels_go_with_a_contrastive_model_said_in_one_sentence(
        models: dict[str, Path], images: Path, tmp_path: Path) -> None:
    import transformers as T

    store = tmp_path / "s.actdb"
    vision = T.CLIPModel.from_pretrained(models["clip"]).vision_model
    processor = T.AutoProcessor.from_pretrained(models["clip"])
    cases = [
        (dict(model=vision, processor=processor, images=images, labels=LABELS),
         "labels need a contrastive model"),
        (dict(model=str(models["clip"]), prompts=["a cat"], labels=LABELS),
         "labels are for a contrastive model's image inputs"),
        (dict(model=str(models["clip"]), images=images, labels=LABELS, label_template="a"),
         "must hold one {} where the label goes"),
        (dict(model=str(models["clip"]), images=images, label_template="a {}"),
         "a label template goes with labels"),
        (dict(model=str(models["clip"]), images=images, labels=["cat", "cat"]),
         "gives the label 'cat' twice"),
        (dict(model=str(models["clip"]), images=images, labels=str(tmp_path / "no.txt")),
         "labels file .* does not exist"),
    ]
    for kw, said in cases:
        with pytest.raises(ActdbError, match=said):
            actdb.ingest(store, **kw)  # type: ignore[arg-type]
        assert not store.exists()
    # a contrastive model without labels: stored, no anchors, said by info and queries
    summary = actdb.ingest(store, model=str(models["clip"]), images=images)
    assert any("without --labels" in w for w in summary.warnings)
    info = CliRunner().invoke(cli, ["info", str(store)])
    assert "contrastive, no labels" in info.output
    db = actdb.connect(store)
    with pytest.raises(QueryError, match="contrastive model stored without labels"):
        db.sql("SELECT top_logits(vec, 1) FROM acts").fetchall()
    db.close()
    # resuming under the same name brings the same labels
    with pytest.raises(ActdbError, match="already in the store without labels"):
        actdb.ingest(store, model=str(models["clip"]), images=images, labels=LABELS)
