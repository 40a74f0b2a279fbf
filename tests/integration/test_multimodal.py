"""Text and images in one input for multimodal decoders (LLaVA, PaliGemma), tiny models built
from configs. The references are the models' own processors, logits and norm inputs captured
with plain forward hooks, in float64 NumPy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from support.vision_models import build_multimodal

import actdb
from actdb.cli import cli
from actdb.errors import ActdbError

TEXTS = ["<image>\nwhat is this", "a picture: <image> of cats and dogs",
         "USER: <image> hello there ASSISTANT:"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("mm")
    rng = np.random.default_rng(1)
    lines = []
    for i, text in enumerate(TEXTS):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "text": text, "n": i}))
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "in.jsonl"


def _reference(folder: Path, jsonl: Path) -> dict[str, object]:
    """Each input alone through plain transformers: its token ids, its logits, and each norm
    module's input (float64)."""
    import transformers as T
    from PIL import Image

    model = T.AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = T.AutoProcessor.from_pretrained(folder)
    out: dict[str, object] = {"ids": [], "logits": [], "norms": [], "model": model}
    for line in jsonl.read_text().splitlines():
        row = json.loads(line)
        image = Image.open(jsonl.parent / row["image"]).convert("RGB")
        x = processor(images=[image], text=[row["text"]], return_tensors="pt")
        x = {k: v for k, v in x.items() if k != "labels"}
        kept: dict[str, np.ndarray] = {}

        def keep(name: str, kept: dict[str, np.ndarray] = kept) -> object:
            def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], o: object
                     ) -> None:
                if name not in kept:  # a hook returning a value would replace the output
                    kept[name] = args[0].detach().double().numpy()
            return hook

        handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules()
                   if "norm" in type(m).__name__.lower()]
        try:
            with torch.no_grad():
                logits = model(**x).logits[0].double().numpy()
        finally:
            for h in handles:
                h.remove()
        out["ids"].append(x["input_ids"][0].tolist())  # type: ignore[attr-defined]
        out["logits"].append(logits)  # type: ignore[attr-defined]
        out["norms"].append(kept)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("kind", ["llava", pytest.param("paligemma", marks=pytest.mark.slow)])
def test_text_and_image_in_one_input(kind: str, inputs: Path, tmp_path: Path) -> None:
    folder = build_multimodal(kind, tmp_path)
    store = tmp_path / "s.actdb"
    result = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(folder), "--inputs",
                                      str(inputs), "--batch-size", "2", "-q"])
    assert result.exit_code == 0, result.output
    ref = _reference(folder, inputs)
    db = actdb.connect(store)
    image_id = ref["model"].config.image_token_id  # type: ignore[attr-defined]
    vision_name, decoder_name = {
        "llava": ("model.vision_tower.encoder.layers.0.layer_norm1",
                  "model.language_model.layers.1.input_layernorm"),
        "paligemma": ("model.vision_tower.encoder.layers.0.layer_norm1",
                      "model.language_model.layers.1.input_layernorm")}[kind]
    for p, ids in enumerate(ref["ids"]):  # type: ignore[arg-type]
        rows = db.sql("SELECT position, token_id, patch_row, patch_col, position_from_end "
                      "FROM acts WHERE prompt_id = $p AND site = 'final' ORDER BY position",
                      params={"p": p}).fetchall()
        # the decoder's rows are the sequence the processor built, image tokens inside, last
        assert [r[1] for r in rows] == ids
        assert rows[-1][4] == 0
        k = 0
        for r in rows:
            if r[1] == image_id:
                assert (r[2], r[3]) == (k // 4, k % 4)  # 4 x 4 patches, row by row
                k += 1
            else:
                assert (r[2], r[3]) == (None, None)
        assert k == 16
        # the decoder's norm inputs and the vision tower's, as the model computed them
        norms = ref["norms"][p]  # type: ignore[index]
        got = np.array([r[0] for r in db.sql(
            "SELECT to_list(vec) FROM acts WHERE prompt_id = $p AND site = 'blocks.1.ln1' "
            "ORDER BY position", params={"p": p}).fetchall()])
        want = norms[decoder_name][0]
        np.testing.assert_allclose(got, want, rtol=2e-3,
                                   atol=2e-3 * float(np.abs(want).max()))
        got = np.array([r[0] for r in db.sql(
            "SELECT to_list(vec) FROM acts WHERE prompt_id = $p AND site = 'vision.blocks.0.ln1'"
            " ORDER BY position", params={"p": p}).fetchall()])
        want = norms[vision_name][0]
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()))
        # the LM head's logits at the final site are the model's own
        logits = ref["logits"][p]  # type: ignore[index]
        top = db.sql("SELECT top_logits(vec, 1)[1] FROM acts WHERE prompt_id = $p AND "
                     "site = 'final' ORDER BY position", params={"p": p}).fetchall()
        assert [t[0]["token_id"] for t in top] == list(logits.argmax(-1))
        np.testing.assert_allclose([t[0]["logit"] for t in top], logits.max(-1), rtol=2e-3,
                                   atol=2e-3)
    assert CliRunner().invoke(cli, ["verify", str(store), "--full"]).exit_code == 0
    prompts = db.sql("SELECT text, image, n FROM prompts ORDER BY prompt_id").fetchall()
    assert prompts == [(t, f"{i}.png", i) for i, t in enumerate(TEXTS)]


def test_the_lens_refuses_a_vision_towers_rows_of_the_text_width(inputs: Path,
                                                                 tmp_path: Path) -> None:
    """A vision tower as wide as the text decoder: no width tells its rows from the decoder's,
    yet they never meet the decoder's final norm, so the lens functions refuse them in one
    sentence (geometric functions keep them), and the lens and patches pictures read the
    decoder's sites only (the patches picture names a top token by its id: byte tokens share
    the text '\ufffd')."""
    from actdb.plot.lensmap import lens_spec
    from actdb.plot.patches import patches_spec

    folder = build_multimodal("llava", tmp_path, vision_width=32)
    store = tmp_path / "s.actdb"
    result = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(folder), "--inputs",
                                      str(inputs), "--batch-size", "2", "-q"])
    assert result.exit_code == 0, result.output
    db = actdb.connect(store, device="cpu")
    assert db.sql("SELECT DISTINCT d FROM sites").fetchall() == [(32,)]
    for call in ("top_logits(vec, 1)", "entropy(vec)", "logit(vec, 5)", "token_rank(vec, 5)"):
        with pytest.raises(ActdbError, match=r"^[^\n]*site 'vision\.blocks\.1\.ln1' is its "
                           r"vision tower's[^\n]*WHERE site NOT LIKE 'vision\.%'\)$"):
            db.sql(f"SELECT {call} FROM acts WHERE site = 'vision.blocks.1.ln1'").fetchall()
    got = db.sql("SELECT count(entropy(vec)) FROM acts WHERE site NOT LIKE 'vision.%'"
                 ).fetchall()[0][0]
    assert got == db.sql("SELECT count(*) FROM acts WHERE site NOT LIKE 'vision.%'"
                         ).fetchall()[0][0] > 0
    assert db.sql("SELECT count(cosine_to_anchor(vec, 5)) FROM acts WHERE site = "
                  "'vision.blocks.1.ln1'").fetchall()[0][0] > 0
    # the decoder's final norm applied to a row that never meets it: NULL, as off the stream
    counts = db.sql("SELECT site LIKE 'vision.%', count(vec_norm(final_norm(vec))), count(*) "
                    "FROM acts GROUP BY ALL ORDER BY ALL").fetchall()
    assert counts[0][1] == counts[0][2] > 0 and counts[1][1] == 0 < counts[1][2], counts
    spec = lens_spec(db, 0)
    assert set(spec.run(db).df["site"]) == {"blocks.0.ln1", "blocks.1.ln1", "final"}
    spec = patches_spec(db, 0)
    df = spec.run(db).df
    assert set(df["site"]) == {"blocks.0.ln1", "blocks.1.ln1", "final"}
    assert len(df) == 3 * 16 and df["p"].between(0, 1).all()


def test_text_and_images_said_in_one_sentence(inputs: Path, tmp_path: Path) -> None:
    folder = build_multimodal("llava", tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"image": str(inputs.parent / "0.png"), "text": "hi"}) + "\n"
                   + json.dumps({"image": str(inputs.parent / "1.png")}) + "\n")
    with pytest.raises(ActdbError, match="go to separate ingests"):
        actdb.ingest(tmp_path / "s.actdb", model=str(folder), inputs=bad)
    assert not (tmp_path / "s.actdb").exists()
