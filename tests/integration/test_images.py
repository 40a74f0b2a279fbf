"""Image inputs, checked on a real trained model: a ViT classifier trained on scikit-learn's
digits (tests/vision_models.py). The references are the model's own outputs and its norms'
inputs captured with plain forward hooks, never actdb's code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from support.vision_models import Digits, train_digits

import actdb
from actdb.cli import cli
from actdb.errors import ActdbError


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Digits:
    trained = train_digits(tmp_path_factory.mktemp("digits"))
    assert trained.accuracy >= 0.9, trained.accuracy  # the model really reads the images
    return trained


@pytest.fixture(scope="session")
def digits_store(digits: Digits, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("stores") / "digits.actdb"
    result = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(digits.model),
                                      "--images", str(digits.images), "--batch-size", "16"])
    assert result.exit_code == 0, result.output
    return store


def _reference(digits: Digits) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[Path]]:
    """The model's logits [N, 10] and each norm module's input [N, T, d], float64, from plain
    transformers with hooks of the test's own, on the held-out PNG files."""
    from PIL import Image
    from transformers import AutoImageProcessor, ViTForImageClassification

    model = ViTForImageClassification.from_pretrained(digits.model).eval()
    processor = AutoImageProcessor.from_pretrained(digits.model)
    files = sorted(digits.images.iterdir())
    pixels = processor(images=[Image.open(f).convert("RGB") for f in files],
                       return_tensors="pt")["pixel_values"]
    inputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> object:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
            inputs[name] = args[0].detach().double()

        return hook

    handles = [m.register_forward_hook(keep(name)) for name, m in model.named_modules()
               if isinstance(m, torch.nn.LayerNorm)]
    try:
        with torch.no_grad():
            logits = model(pixel_values=pixels).logits.double()
    finally:
        for h in handles:
            h.remove()
    return logits, inputs, files


def test_trained_model_reads_the_class_token(digits: Digits, digits_store: Path) -> None:
    logits, _, files = _reference(digits)
    db = actdb.connect(digits_store)
    rows = db.sql("SELECT p.prompt_id, p.image, top_logits(vec, 1)[1].token AS top, "
                  "top_logits(vec, 1)[1].logit AS logit, a.token, a.patch_row "
                  "FROM acts a JOIN prompts p USING (prompt_id) "
                  "WHERE site = 'final' AND position = 0 ORDER BY prompt_id").fetchall()
    assert [r[1] for r in rows] == [str(f) for f in files]  # sorted by name, path as given
    predicted = [f"digit {int(i)}" for i in logits.argmax(-1)]
    assert [r[2] for r in rows] == predicted  # on every image
    np.testing.assert_allclose([r[3] for r in rows], logits.max(-1).values.numpy(),
                               rtol=2e-3, atol=2e-3)
    assert {(r[4], r[5]) for r in rows} == {("<cls>", None)}
    # the trained model is right on most of them: the class token carries the class
    right = sum(p == f"digit {t}" for p, t in zip(predicted, digits.labels, strict=True))
    assert right >= 0.85 * len(files)


def test_every_site_stores_the_hooked_inputs(digits: Digits, digits_store: Path) -> None:
    _, inputs, files = _reference(digits)
    db = actdb.connect(digits_store)
    sites = dict(db.sql("SELECT module, site FROM sites WHERE model = 'vit-digits'").fetchall())
    assert set(sites) == set(inputs)  # every LayerNorm of the model is a site
    for module, x in inputs.items():
        n, t, d = x.shape
        assert t == 17  # the class token and 4 x 4 patches
        got = db.sql("SELECT prompt_id, position, norm, mean, to_list(vec), patch_row, "
                     "patch_col FROM acts WHERE site = ? ORDER BY prompt_id, position",
                     params=[sites[module]]).fetchall()
        assert len(got) == n * t
        energy = torch.linalg.vector_norm(x, dim=-1).reshape(-1).numpy()
        np.testing.assert_allclose([r[2] for r in got], energy, rtol=1e-6)
        np.testing.assert_allclose([r[3] for r in got], x.mean(-1).reshape(-1).numpy(),
                                   rtol=1e-5, atol=1e-6)
        vec = np.array([r[4] for r in got])
        np.testing.assert_allclose(vec, x.reshape(n * t, d).numpy(), rtol=2e-3,
                                   atol=2e-3 * energy.max() / np.sqrt(d))
        # position p >= 1 is patch p - 1 of the 4 x 4 grid, row by row
        assert [(r[5], r[6]) for r in got[1:17]] == [(i // 4, i % 4) for i in range(16)]


def test_classifier_anchors(digits: Digits, digits_store: Path) -> None:
    from transformers import ViTForImageClassification

    head = ViTForImageClassification.from_pretrained(digits.model).classifier
    w = head.weight.detach().double().numpy()
    db = actdb.connect(digits_store)
    x = np.array(db.sql("SELECT to_list(vec) FROM acts WHERE site = 'blocks.1.ln1' "
                        "AND prompt_id = 0 AND position = 0").fetchall()[0][0], dtype=np.float64)
    want = x @ w[3] / np.linalg.norm(x) / np.linalg.norm(w[3])
    got = db.sql("SELECT cosine_to_anchor(vec, 'digit 3'), "
                 "cosine_to_anchor(vec, 'digit 3', 'classifier'), token_rank(vec, 'digit 3') "
                 "FROM acts WHERE site = 'blocks.1.ln1' AND prompt_id = 0 "
                 "AND position = 0").fetchall()[0]
    assert got[0] == pytest.approx(want, abs=2e-3)
    assert got[1] == got[0]
    assert 1 <= got[2] <= 10
    model = db.sql("SELECT head_kind, head_position, has_embed, vocab_size, "
                   "logit_max_rel_error FROM models").fetchall()[0]
    assert model[:4] == ("classifier", 0, False, 10)
    assert model[4] < 1e-3
    info = CliRunner().invoke(cli, ["info", str(digits_store)])
    assert info.exit_code == 0 and "classifier head (its labels are the vocabulary)" in info.output
    with pytest.raises(ActdbError, match="no token embedding"):
        db.sql("SELECT cosine_to_anchor(vec, 'digit 3', 'embed') FROM acts LIMIT 1").fetchall()


def test_python_inputs_with_objects_and_fields(digits: Digits, tmp_path: Path) -> None:
    from PIL import Image

    files = sorted(digits.images.iterdir())[:3]
    inputs = [{"image": Image.open(files[0]).convert("RGB"), "label": digits.labels[0]},
              {"image": str(files[1]), "label": digits.labels[1]}]
    store = tmp_path / "s.actdb"
    s = actdb.ingest(store, model=str(digits.model), inputs=inputs)
    assert (s.prompts_new, s.tokens_written) == (2, 34)
    again = actdb.ingest(store, model=str(digits.model), inputs=inputs)
    assert again.prompts_new == 0  # the same images are the same prompts
    rows = actdb.connect(store).sql(
        "SELECT text, image, label, n_tokens FROM prompts ORDER BY prompt_id").fetchall()
    assert rows[0][0] is None and rows[0][1].startswith("<image sha256:")
    assert rows[1] == (None, str(files[1]), digits.labels[1], 17)
    assert rows[0][2] == digits.labels[0]


def test_jsonl_inputs_read_paths_beside_the_file(digits: Digits, tmp_path: Path) -> None:
    import json
    import shutil

    shutil.copy(sorted(digits.images.iterdir())[0], tmp_path / "a.png")
    (tmp_path / "in.jsonl").write_text(json.dumps({"image": "a.png", "split": "test"}) + "\n")
    store = tmp_path / "s.actdb"
    result = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(digits.model),
                                      "--inputs", str(tmp_path / "in.jsonl")])
    assert result.exit_code == 0, result.output
    rows = actdb.connect(store).sql("SELECT image, split FROM prompts").fetchall()
    assert rows == [("a.png", "test")]


def _ingest(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["ingest", *args])
    return result.exit_code, result.output


def test_bad_inputs_are_one_sentence(digits: Digits, digits_store: Path, tmp_path: Path,
                                     model_dir: object) -> None:
    before = actdb.connect(digits_store).sql("SELECT count(*) FROM acts").fetchall()
    model = str(digits.model)
    (tmp_path / "missing.jsonl").write_text('{"image": "nowhere.png"}\n')
    code, out = _ingest(str(digits_store), "--model", model, "--inputs",
                        str(tmp_path / "missing.jsonl"))
    assert code == 1 and "image 'nowhere.png' does not exist" in out
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.png").write_bytes(b"not a png at all")
    code, out = _ingest(str(digits_store), "--model", model, "--images", str(bad))
    assert code == 1 and "image" in out and "cannot be read as an image" in out
    (tmp_path / "text.txt").write_text("hello there\n")
    code, out = _ingest(str(digits_store), "--model", model, "--prompts",
                        str(tmp_path / "text.txt"))
    assert code == 1 and "is text but model 'vit-digits' reads image only" in out
    (tmp_path / "video.jsonl").write_text('{"video": "clip.mp4"}\n')
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 64)
    code, out = _ingest(str(digits_store), "--model", model, "--inputs",
                        str(tmp_path / "video.jsonl"))
    assert code == 1 and "gives a video but model 'vit-digits' reads image only" in out
    text_model = model_dir("gpt2")  # type: ignore[operator]
    code, out = _ingest(str(tmp_path / "t.actdb"), "--model", str(text_model), "--images",
                        str(digits.images))
    assert code == 1 and "gives an image but model" in out and "reads text only" in out
    assert "Traceback" not in out
    after = actdb.connect(digits_store).sql("SELECT count(*) FROM acts").fetchall()
    assert after == before
    verified = CliRunner().invoke(cli, ["verify", str(digits_store)])
    assert verified.exit_code == 0, verified.output


def test_undecodable_video(tmp_path: Path) -> None:
    from actdb.errors import IngestError
    from actdb.ingestion.inputs import load_video
    from actdb.ingestion.prompts import Media

    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 64)
    with pytest.raises(IngestError, match="video 'clip.mp4' cannot be decoded"):
        load_video(Media(video="clip.mp4", base=str(tmp_path)))


@pytest.fixture(scope="module")
def video_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny VideoMAE (4 frames of 8 x 8, tubelets of 2 frames, 2 x 2 patches) and its
    processor, saved."""
    import transformers

    torch.manual_seed(0)
    config = transformers.VideoMAEConfig(
        image_size=8, patch_size=2, num_channels=3, num_frames=4, tubelet_size=2,
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=3, use_mean_pooling=False)
    folder = tmp_path_factory.mktemp("videomae")
    transformers.VideoMAEForVideoClassification(config).save_pretrained(folder)
    transformers.VideoMAEImageProcessor(size={"height": 8, "width": 8},
                                        do_center_crop=False).save_pretrained(folder)
    return folder


def _frames(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (8, 8, 3), dtype=np.uint8) for _ in range(n)]


def test_video_frames_and_patches(video_model: Path, tmp_path: Path) -> None:
    import json

    import av
    from PIL import Image
    from transformers import AutoImageProcessor, VideoMAEForVideoClassification

    folder = tmp_path / "clip"
    folder.mkdir()
    frames = _frames(4, 1)
    for i, f in enumerate(frames):
        Image.fromarray(f).save(folder / f"{i:02d}.png")
    with av.open(str(tmp_path / "b.mp4"), "w") as c:  # a video file, decoded by PyAV
        stream = c.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        for f in _frames(4, 2):
            big = np.kron(f, np.ones((2, 2, 1), dtype=np.uint8))
            for packet in stream.encode(av.VideoFrame.from_ndarray(big, format="rgb24")):
                c.mux(packet)
        for packet in stream.encode():
            c.mux(packet)
    (tmp_path / "in.jsonl").write_text(json.dumps({"video": "clip", "n": 1}) + "\n"
                                       + json.dumps({"video": "b.mp4", "n": 2}) + "\n")
    store = tmp_path / "v.actdb"
    code, out = _ingest(str(store), "--model", str(video_model), "--inputs",
                        str(tmp_path / "in.jsonl"))
    assert code == 0, out
    db = actdb.connect(store)
    assert db.sql("SELECT video, n FROM prompts ORDER BY prompt_id").fetchall() == [
        ("clip", 1), ("b.mp4", 2)]
    rows = db.sql("SELECT position, token, frame, patch_row, patch_col FROM acts "
                  "WHERE site = 'final' AND prompt_id = 0 ORDER BY position").fetchall()
    # 2 tubelets x 4 x 4 patches, tubelet by tubelet, row by row
    assert rows == [(p, "<patch>", p // 16, p % 16 // 4, p % 4) for p in range(32)]
    # every site's stored energy is the hooked input's, from the frames read independently
    model = VideoMAEForVideoClassification.from_pretrained(video_model).eval()
    pixels = AutoImageProcessor.from_pretrained(video_model)(
        images=[[np.asarray(Image.open(folder / f"{i:02d}.png").convert("RGB"))
                 for i in range(4)]], return_tensors="pt")["pixel_values"]
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> object:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
            seen[name] = args[0].detach().double()

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.LayerNorm)]
    try:
        with torch.no_grad():
            model(pixel_values=pixels)
    finally:
        for h in handles:
            h.remove()
    sites = dict(db.sql("SELECT module, site FROM sites").fetchall())
    assert set(sites) == set(seen)
    for module, x in seen.items():
        got = db.sql("SELECT norm FROM acts WHERE site = ? AND prompt_id = 0 ORDER BY position",
                     params=[sites[module]]).fetchall()
        np.testing.assert_allclose([r[0] for r in got],
                                   torch.linalg.vector_norm(x[0], dim=-1).numpy(), rtol=1e-6)


def test_bad_videos_are_one_sentence(video_model: Path, tmp_path: Path) -> None:
    import json

    from PIL import Image

    (tmp_path / "broken.mp4").write_bytes(b"\x00" * 64)
    (tmp_path / "a.jsonl").write_text(json.dumps({"video": "broken.mp4"}) + "\n")
    code, out = _ingest(str(tmp_path / "v.actdb"), "--model", str(video_model), "--inputs",
                        str(tmp_path / "a.jsonl"))
    assert code == 1 and "video 'broken.mp4' cannot be decoded" in out, out
    assert out.count("\n") == 1
    short = tmp_path / "short"
    short.mkdir()
    for i, f in enumerate(_frames(3, 0)):  # 3 frames for a model of 4
        Image.fromarray(f).save(short / f"{i}.png")
    (tmp_path / "b.jsonl").write_text(json.dumps({"video": "short"}) + "\n")
    code, out = _ingest(str(tmp_path / "v.actdb"), "--model", str(video_model), "--inputs",
                        str(tmp_path / "b.jsonl"))
    assert code == 1 and "fails on a forward pass over the inputs its processor made" in out
    assert "Traceback" not in out


def test_plot_patches_reads_each_patch_through_the_head(digits: Digits, digits_store: Path,
                                                       tmp_path: Path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor, ViTForImageClassification

    from actdb.plot.patches import patches_spec

    db = actdb.connect(digits_store)
    spec = patches_spec(db, 0)
    df = spec.run(db).df
    final = df[df["site"] == "final"].sort_values(["patch_row", "patch_col"])
    assert len(final) == 16 and set(df["site"]) == {"blocks.0.ln1", "blocks.1.ln1", "final"}
    # the reference: the model's own final-norm output at each patch, through its classifier
    model = ViTForImageClassification.from_pretrained(digits.model).eval()
    processor = AutoImageProcessor.from_pretrained(digits.model)
    first = sorted(digits.images.iterdir())[0]
    pixels = processor(images=[Image.open(first).convert("RGB")],
                       return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        y = model.vit(pixel_values=pixels).last_hidden_state[0, 1:]  # the patches, normed
        want = model.classifier(y).argmax(-1)
    assert list(final["top"]) == [f"digit {int(i)}" for i in want]
    assert spec.meta["image"] == str(first)
    out = tmp_path / "patches.png"
    code = CliRunner().invoke(cli, ["plot", "patches", str(digits_store), "--input", "0",
                                    "--token", "digit 3", "-o", str(out)]).exit_code
    assert code == 0 and out.stat().st_size > 1000
    result = CliRunner().invoke(cli, ["plot", "patches", str(digits_store), "--input", "0",
                                      "--sql"])
    assert result.exit_code == 0 and "patch_row IS NOT NULL" in result.output


def test_an_image_model_raises_the_format_version_and_migrates_an_older_store(
        digits: Digits, tmp_path: Path, model_dir: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text store of version 2 (as an older actdb wrote it) gets an image model: the writer
    upgrades it (chunk digests, version 5) and registering the model adds its new columns, its
    older rows NULL; an actdb reading up to 3 refuses it instead of calling its missing
    embedding damage."""
    import duckdb

    from actdb.errors import StoreFormatError
    from actdb.store import catalog
    from actdb.store import store as store_module

    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=str(model_dir("gpt2")), prompts=["hello there"],  # type: ignore[operator]
                 name="gpt2")

    def version() -> str:
        con = duckdb.connect(str(store / "catalog.duckdb"), read_only=True)
        try:
            return str(con.execute("SELECT value FROM meta WHERE key = 'format_version'"
                                   ).fetchall()[0][0])
        finally:
            con.close()

    # a store written before images and chunk digests: no tower, layout or patch columns
    con = duckdb.connect(str(store / "catalog.duckdb"))
    con.execute("DROP TABLE chunk_digests")
    con.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    for table, column in (("tokens", "patch_row"), ("tokens", "patch_col"), ("tokens", "frame"),
                          ("sites", "tower"), ("sites", "layout"), ("models", "towers"),
                          ("tokens", "grid"), ("sites", "grid"),
                          ("models", "has_embed"), ("models", "head_kind"),
                          ("models", "head_position")):
        con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    con.close()
    assert version() == "2"
    old = actdb.connect(store).sql("SELECT count(*), count(patch_row) FROM acts").fetchall()
    assert old[0][0] > 0 and old[0][1] == 0  # read as before: no patches
    actdb.ingest(store, model=str(digits.model), images=digits.images)
    assert version() == "5"
    db = actdb.connect(store)
    assert db.sql("SELECT count(*) FROM acts WHERE model = 'gpt2' AND patch_row IS NULL"
                  ).fetchall() == [(old[0][0],)]
    assert db.sql("SELECT count(DISTINCT prompt_id) FROM acts WHERE model = 'vit-digits'"
                  ).fetchall()[0][0] == len(digits.labels)
    verified = CliRunner().invoke(cli, ["verify", str(store)])
    assert verified.exit_code == 0, verified.output
    monkeypatch.setattr(store_module, "FORMAT_VERSION", 3)  # an actdb from before images
    with pytest.raises(StoreFormatError, match="format version 5"):
        actdb.connect(store)
    assert catalog.LOCAL_FORMAT_VERSION == 5


def test_report_and_pictures_on_an_image_classifier(digits: Digits, digits_store: Path,
                                                    tmp_path: Path) -> None:
    """The report's vision sections read the class token the head reads (not the last patch),
    each number equal to the model's own outputs; `plot lens` and `plot angles` draw."""
    from PIL import Image
    from support.report_page import ReportPage
    from transformers import AutoImageProcessor, ViTForImageClassification

    out = tmp_path / "report.html"
    result = CliRunner().invoke(cli, ["report", str(digits_store), "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = ReportPage()
    page.feed(out.read_text())
    assert page.sections == ["angles", "norms", "rotation", "spectrum", "class_lens",
                             "image_lens", "patches", "class_dims"]
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    # the reference: the model's prediction (float32, as ingested), and its class token at
    # layer 1's input and its patches at the final norm read through its own final norm and
    # classifier in float64
    model = ViTForImageClassification.from_pretrained(digits.model).eval()
    processor = AutoImageProcessor.from_pretrained(digits.model)
    files = sorted(digits.images.iterdir())
    pixels = processor(images=[Image.open(f).convert("RGB") for f in files],
                       return_tensors="pt")["pixel_values"]
    kept: dict[str, torch.Tensor] = {}
    layer1 = model.vit.layers[1].layernorm_before

    def keep(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
        kept["x"] = args[0].detach()

    handle = layer1.register_forward_hook(keep)
    try:
        with torch.no_grad():
            out_model = model(pixel_values=pixels, output_hidden_states=True)
    finally:
        handle.remove()
    model = model.double()
    with torch.no_grad():
        seq = model.vit.layernorm(out_model.hidden_states[-1].double())  # [N, T, d]
        lens1 = model.classifier(model.vit.layernorm(kept["x"][:, 0].double())).argmax(-1)
        patches0 = model.classifier(seq[0, 1:]).argmax(-1)
    predicted = out_model.logits.argmax(-1)
    share = float((lens1 == predicted).double().mean())

    def number(section: str, name: str) -> str:
        return page.numbers[f"vit-digits/{section}/{name}"][0]

    assert float(number("class_lens", "top1_last_inner")) == pytest.approx(share, abs=1e-9)
    assert int(number("class_lens", "prompts")) == len(files)
    probs = out_model.logits.softmax(-1)[0]
    assert number("image_lens", "label") == f"digit {int(predicted[0])}"
    assert float(number("image_lens", "prob")) == pytest.approx(float(probs.max()), abs=2e-3)
    counts = torch.bincount(patches0, minlength=10)
    assert float(number("patches", "share")) == pytest.approx(float(counts.max()) / 16, abs=1e-9)
    # the lens and angles pictures on the image store
    for kind, extra in (("lens", ["--prompt-id", "0"]), ("angles", [])):
        picture = tmp_path / f"{kind}.png"
        run = CliRunner().invoke(cli, ["plot", kind, str(digits_store), *extra,
                                       "-o", str(picture)])
        assert run.exit_code == 0, run.output
        assert picture.stat().st_size > 1000
