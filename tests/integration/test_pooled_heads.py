"""Classification heads that average their positions: the head's rows, composed with the linear
layers before the mean, are the 'classifier' anchors, and each row's logits are its vote, the
model's logits their mean. A Wav2Vec2 sequence classifier (post-norm: the last block's norm gives
what its `projector` reads, then a mean over frames, then `classifier`); DINOv2's head reads the
class token beside the patches' mean and is refused in one sentence, kept for `info`. (Swin's is
in test_feature_maps.py.) References: the model's own logits and its norm's input and output
captured with plain forward hooks, its weights composed in float64 NumPy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as T
from click.testing import CliRunner
from support.tiny_models import randomize_norms

import actdb
from actdb.cli import cli
from actdb.errors import QueryError

RATE = 16000
LABELS = {0: "dog bark", 1: "tabby cat", 2: "siren"}
READ = "wav2vec2.encoder.layers.1.final_layer_norm"  # the norm whose output the head reads


def _sound(hz: float, seed: int) -> np.ndarray:
    t = np.arange(int(RATE * 0.05)) / RATE  # 39 frames: the lens picture labels each cell
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def wav2vec2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.manual_seed(0)
    model = T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, classifier_proj_size=8, num_labels=3,
        id2label=LABELS, label2id={v: k for k, v in LABELS.items()}))
    randomize_norms(model, seed=5)
    with torch.no_grad():  # a head far from zero, so that the logits differ by label
        model.projector.bias.normal_(0.0, 1.0)
        model.classifier.bias.normal_(0.0, 1.0)
    model.eval()
    fe = T.Wav2Vec2FeatureExtractor(sampling_rate=RATE)
    sounds = [_sound(440.0, 0), _sound(900.0, 1)]
    store = tmp_path_factory.mktemp("pooled") / "s.actdb"
    summary = actdb.ingest(store, model=model, processor=fe, name="w2v", device="cpu",
                           weights="none", inputs=[{"audio": (s, RATE)} for s in sounds])
    seen: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        seen["x"], seen["y"] = args[0].detach().double(), out.detach().double()

    handle = model.get_submodule(READ).register_forward_hook(keep)
    try:
        with torch.no_grad():
            logits = model(**fe(sounds, sampling_rate=RATE, return_tensors="pt")).logits
    finally:
        handle.remove()
    # the head as one map of a normed row, in float64: classifier . projector
    wc, wp = (model.get_submodule(n).weight.detach().double().numpy()
              for n in ("classifier", "projector"))
    bc, bp = (model.get_submodule(n).bias.detach().double().numpy()
              for n in ("classifier", "projector"))
    return {"store": store, "summary": summary, "logits": logits.double().numpy(),
            "x": seen["x"].numpy(), "y": seen["y"].numpy(), "w": wc @ wp, "b": wc @ bp + bc}


def _rows(db: actdb.Database, sql: str) -> np.ndarray:
    """Per prompt and position (in order), the values `sql` selects at the site the head reads."""
    got = db.sql(f"SELECT prompt_id, position, {sql} FROM acts WHERE site = (SELECT "
                 "final_site FROM models) ORDER BY prompt_id, position").fetchall()
    return np.array([r[2:] for r in got], dtype=np.float64)


def test_the_mean_of_every_rows_logits_is_the_models_own(wav2vec2: dict[str, Any]) -> None:
    db = actdb.connect(wav2vec2["store"])
    assert wav2vec2["summary"].warnings == []
    model = db.sql("SELECT head_kind, head_position, head_pool, head_note, vocab_size, "
                   "final_site FROM models").fetchall()[0]
    assert model[:5] == ("classifier", None, "mean", None, 3)
    module = db.sql("SELECT module FROM sites WHERE site = $s", params={"s": model[5]}
                    ).fetchall()
    assert module == [(READ,)]  # a post-norm model: no final norm, its last block's
    logits = wav2vec2["logits"]
    per_row = _rows(db, ", ".join(f"logit(vec, '{LABELS[t]}')" for t in range(3)))
    n, t = wav2vec2["y"].shape[:2]
    assert per_row.shape == (n * t, 3)
    np.testing.assert_allclose(per_row.reshape(n, t, 3).mean(1), logits, rtol=2e-3,
                               atol=2e-3 * np.abs(logits).max())
    # each row's own logits: its normed row through the composed head
    y = wav2vec2["y"].reshape(n * t, -1)
    own = y @ wav2vec2["w"].T + wav2vec2["b"]
    np.testing.assert_allclose(per_row, own, rtol=2e-3, atol=2e-3 * np.abs(own).max())


def test_anchor_and_distribution_functions_read_the_labels(wav2vec2: dict[str, Any]) -> None:
    db = actdb.connect(wav2vec2["store"])
    got = _rows(db, "cosine_to_anchor(vec, 'tabby cat'), "
                    "cosine_to_anchor(vec, 'tabby cat', 'classifier'), prob(vec, 'tabby cat'), "
                    "token_rank(vec, 'tabby cat')")
    x = wav2vec2["x"].reshape(-1, wav2vec2["x"].shape[-1])
    anchor = wav2vec2["w"][1] / np.linalg.norm(wav2vec2["w"][1])
    cos = x @ anchor / np.linalg.norm(x, axis=-1)
    np.testing.assert_allclose(got[:, 0], cos, atol=2e-3)
    np.testing.assert_allclose(got[:, 1], cos, atol=2e-3)
    own = wav2vec2["y"].reshape(len(x), -1) @ wav2vec2["w"].T + wav2vec2["b"]
    p = np.exp(own - own.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got[:, 2], p[:, 1], atol=2e-3)
    rank = 1 + (own > own[:, [1]]).sum(-1)
    assert (got[:, 3] == rank).mean() > 0.95  # ties within float16 rounding aside
    info = CliRunner().invoke(cli, ["info", str(wav2vec2["store"])])
    assert info.exit_code == 0, info.output
    assert "each position's logits at the final site are its vote" in info.output


def test_the_lens_picture_writes_label_names_as_they_are(wav2vec2: dict[str, Any]) -> None:
    """A label's space is a word's, not a text token's leading space: no '␣' marker."""
    from matplotlib.text import Text

    from actdb.plot import lens

    fig = lens(wav2vec2["store"], 0, device="cpu")
    texts = [t.get_text() for t in fig.findobj(Text)]
    shown = {name if len(name) <= 8 else name[:7] + "…" for name in LABELS.values()}
    assert shown & set(texts)  # cells name their top label (cut at 8 characters), as is
    assert not any("␣" in t for t in texts)
    assert any("position's vote" in t for t in texts)  # what one row's lens is, said


def test_a_head_beside_the_class_token_is_refused_and_said(tmp_path: Path) -> None:
    """DINOv2's head reads the class token and the patches' mean side by side: no one row's
    logits give it, so it is refused, in one sentence that `info` shows."""
    from support.vision_families import build_classifier, random_images

    model, processor = build_classifier("dinov2")
    store = tmp_path / "s.actdb"
    summary = actdb.ingest(store, model=model, processor=processor, weights="none",
                           inputs=[{"image": i} for i in random_images(1)])
    assert len(summary.warnings) == 1 and "class token beside the mean" in summary.warnings[0]
    db = actdb.connect(store)
    kind, note = db.sql("SELECT head_kind, head_note FROM models").fetchall()[0]
    assert kind is None and note is not None and note in summary.warnings[0]
    with pytest.raises(QueryError, match="no LM head"):
        db.sql("SELECT top_logits(vec, 1) FROM acts WHERE site = 'final'").fetchall()
    info = CliRunner().invoke(cli, ["info", str(store)])
    assert info.exit_code == 0 and note in info.output
