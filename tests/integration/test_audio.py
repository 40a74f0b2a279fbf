"""Sound inputs: Whisper (built tiny from a config, with a feature extractor padding to one
second) reads a WAV file written here; its encoder's rows are its frames, its decoder's the
target as the model shifts its labels. References: the model's own forward on its feature
extractor's features (hooks on every norm), and the sampled sine itself for the resampling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch
import transformers as T
from click.testing import CliRunner
from support.tiny_models import build_family_tokenizer, randomize_norms

import actdb
from actdb.cli import cli
from actdb.ingestion.audio import load_audio
from actdb.ingestion.prompts import Media

RATE = 16000


def _sine(rate: int, seconds: float = 0.75, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("audio")
    tok = build_family_tokenizer("llama")
    torch.manual_seed(0)
    model = T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, encoder_layers=2, decoder_layers=2, d_model=32,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=50, max_target_positions=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))
    randomize_norms(model, seed=2)
    model.eval()
    # one second of sound a window: 100 frames of features, 50 encoder positions
    fe = T.WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE, hop_length=160,
                                   chunk_length=1, n_fft=400)
    soundfile.write(root / "a.wav", _sine(RATE), RATE)
    soundfile.write(root / "b.wav", _sine(RATE, hz=1000.0), RATE, subtype="PCM_16")
    soundfile.write(root / "low.wav", _sine(8000), 8000)
    inputs = [{"audio": "a.wav", "target": "the cat sat"}, {"audio": "b.wav"}]
    (root / "in.jsonl").write_text("".join(json.dumps(i) + "\n" for i in inputs))
    store = root / "s.actdb"
    actdb.ingest(store, model=model, tokenizer=tok, processor=fe, inputs=root / "in.jsonl",
                 device="cpu", name="whisper", weights="none")
    return {"root": root, "tok": tok, "model": model, "fe": fe, "store": store,
            "inputs": inputs}


def _own_pass(w: dict[str, Any], item: dict[str, str]
              ) -> tuple[dict[str, torch.Tensor], list[int], torch.Tensor]:
    """The model's own forward on its feature extractor's features of the file as soundfile
    reads it: every norm's input, the ids its decoder read, its logits."""
    model, tok = w["model"], w["tok"]
    samples, rate = soundfile.read(w["root"] / item["audio"], dtype="float32")
    assert rate == RATE
    features = w["fe"](samples, sampling_rate=RATE, return_tensors="pt")["input_features"]
    seen: dict[str, torch.Tensor] = {}
    read: list[list[int]] = []

    def keep(path: str) -> Any:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            seen.setdefault(path, args[0][0].detach().double())
        return hook

    handles = [m.register_forward_hook(keep(p)) for p, m in model.named_modules()
               if isinstance(m, torch.nn.LayerNorm)]
    handles.append(model.get_decoder().register_forward_pre_hook(
        lambda mod, args, kw: read.append(kw["input_ids"][0].tolist()), with_kwargs=True))
    try:
        with torch.no_grad():
            if "target" in item:
                labels = tok(text_target=item["target"], return_tensors="pt")["input_ids"]
                out = model(input_features=features, labels=labels)
            else:
                out = model(input_features=features, decoder_input_ids=torch.tensor(
                    [[model.config.decoder_start_token_id]]))
    finally:
        for h in handles:
            h.remove()
    return seen, read[0], out.logits[0].double()


def test_whisper_reads_a_sound_file_faithfully(whisper: dict[str, Any]) -> None:
    db = actdb.connect(whisper["store"])
    sites = db.sql("SELECT site, module, tower FROM sites").fetchall()
    assert {s[2] for s in sites} == {"encoder", "decoder"}
    for pid, item in enumerate(whisper["inputs"]):
        seen, read, logits = _own_pass(whisper, item)
        enc = db.sql("SELECT token, token_id FROM tokens WHERE prompt_id = $p AND "
                     "tower = 'encoder' ORDER BY position", params={"p": pid}).fetchall()
        assert enc == [("<audio>", None)] * 50
        dec = db.sql("SELECT token_id FROM tokens WHERE prompt_id = $p AND tower = 'decoder' "
                     "ORDER BY position", params={"p": pid}).fetchall()
        assert [d[0] for d in dec] == read
        for site, module, _ in sites:
            vec = db.vectors("SELECT vec FROM acts WHERE prompt_id = $p AND site = $s "
                             "ORDER BY position", params={"p": pid, "s": site}).double()
            ref = seen[module]
            assert vec.shape == ref.shape, site
            err = (vec - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(err.max()) < 2e-3, (site, float(err.max()))
        top = int(logits[-1].argmax())
        got = db.sql("SELECT logit(vec, $t) FROM acts WHERE prompt_id = $p AND site = 'final' "
                     "ORDER BY position", params={"p": pid, "t": top}).fetchall()
        np.testing.assert_allclose([g[0] for g in got], logits[:, top].numpy(), rtol=2e-3,
                                   atol=2e-3 * float(logits.abs().max()))
    assert db.sql("SELECT audio, target FROM prompts ORDER BY prompt_id").fetchall() == [
        ("a.wav", "the cat sat"), ("b.wav", None)]


def test_a_sound_is_resampled_to_the_feature_extractors_rate(whisper: dict[str, Any]) -> None:
    """An 8 kHz file read at 16 kHz is the same sine sampled at 16 kHz (polyphase filtering:
    away from the ends, within the filter's ripple); a stereo pair is its channels' mean."""
    got = load_audio(Media(audio=str(whisper["root"] / "low.wav")), RATE)
    want = _sine(RATE)
    assert got.shape == want.shape
    inner = slice(400, -400)
    assert float(np.abs(got[inner] - want[inner]).max()) < 1e-2
    left, right = _sine(RATE), _sine(RATE, hz=1000.0)
    got = load_audio(Media(audio="<pair>", objects={"audio": (np.stack([left, right], 1),
                                                              RATE)}), RATE)
    np.testing.assert_allclose(got, (left + right) / 2, atol=1e-7)


def test_bad_sound_input_is_one_sentence(whisper: dict[str, Any], tmp_path: Path) -> None:
    """A missing or unreadable sound file, or text for Whisper: one sentence, exit 1, the
    store as it was."""
    root = whisper["root"]
    folder = tmp_path / "whisper"
    whisper["model"].save_pretrained(folder)
    whisper["tok"].save_pretrained(folder)
    whisper["fe"].save_pretrained(folder)
    store = tmp_path / "s.actdb"
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"audio": str(root / "a.wav"), "target": "a dog"}) + "\n")
    res = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(folder), "--inputs",
                                   str(good), "--device", "cpu", "--weights", "none"])
    assert res.exit_code == 0, res.output
    before = actdb.connect(store).sql("SELECT count(*) FROM tokens").fetchall()
    (tmp_path / "noise.wav").write_bytes(b"RIFF\x00\x00not a sound")
    cases = [({"audio": "missing.wav"}, "does not exist"),
             ({"audio": "noise.wav"}, "cannot be read as a sound file"),
             ({"text": "hello"}, "is text but model")]
    for item, said in cases:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(item) + "\n")
        res = CliRunner().invoke(cli, ["ingest", str(store), "--model", str(folder),
                                       "--inputs", str(bad), "--device", "cpu",
                                       "--weights", "none"])
        assert res.exit_code == 1, (item, res.output)
        assert said in res.output and "Traceback" not in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
        assert actdb.connect(store).sql("SELECT count(*) FROM tokens").fetchall() == before


def _noisy(rate: int, hz: float, seconds: float) -> np.ndarray:
    """A tone with a little noise (a pure tone leaves some mel bands without variance)."""
    noise = np.random.default_rng(int(hz)).standard_normal(int(rate * seconds)) * 0.01
    return (_sine(rate, seconds, hz) + noise).astype(np.float32)


def _hooked(model: torch.nn.Module, inputs: dict[str, torch.Tensor]
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every norm module's input of one batch, [B, positions, d], and the model's logits."""
    seen: dict[str, torch.Tensor] = {}

    def keep(path: str) -> Any:
        def hook(mod: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            x = args[0].detach().double()
            seen.setdefault(path, x.reshape(x.shape[0], -1, x.shape[-1]))
        return hook

    handles = [m.register_forward_hook(keep(p)) for p, m in model.named_modules()
               if isinstance(m, torch.nn.LayerNorm)]
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return seen, getattr(out, "logits", torch.empty(0)).double()


def _same_as_hooked(store: Path, name: str, seen: dict[str, torch.Tensor]) -> None:
    db = actdb.connect(store)
    for site, module in db.sql("SELECT site, module FROM sites WHERE model = $m",
                               params={"m": name}).fetchall():
        for pid in range(seen[module].shape[0]):
            vec = db.vectors("SELECT vec FROM acts WHERE model = $m AND prompt_id = $p AND "
                             "site = $s ORDER BY position",
                             params={"m": name, "p": pid, "s": site}).double()
            ref = seen[module][pid]
            assert vec.shape == ref.shape, (site, vec.shape, ref.shape)
            # (AST's class and distillation tokens start as zeros: stored as zeros)
            err = (vec - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
            assert float(err.max()) < 2e-3, (site, float(err.max()))


def test_an_audio_classifiers_head_is_the_classifier_anchor_set(tmp_path: Path) -> None:
    """AST (a spectrogram cut into patches, a head of its own: a LayerNorm of the class and
    distillation tokens' mean, then a dense layer): every site's rows are the model's own norm
    inputs, its patches labelled by frequency band and time step, and `top_logits` at its final
    site (the head's norm, one pooled vector an input) are the model's own logits."""
    torch.manual_seed(0)
    model = T.ASTForAudioClassification(T.ASTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_length=64, num_mel_bins=32, patch_size=16, frequency_stride=16, time_stride=16,
        num_labels=3, id2label={0: "hum", 1: "beep", 2: "hiss"},
        label2id={"hum": 0, "beep": 1, "hiss": 2}))
    randomize_norms(model, seed=3)
    model.eval()
    fe = T.ASTFeatureExtractor(num_mel_bins=32, max_length=64, sampling_rate=RATE)
    sounds = [_noisy(RATE, 440.0, 0.5), _noisy(RATE, 2000.0, 0.9)]
    soundfile.write(tmp_path / "a.flac", sounds[0], RATE)
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, processor=fe, name="ast", device="cpu", weights="none",
                 inputs=[{"audio": str(tmp_path / "a.flac")}, {"audio": (sounds[1], RATE)}])
    # the reference reads the FLAC file back as soundfile gives it (16-bit samples)
    sounds[0] = soundfile.read(tmp_path / "a.flac", dtype="float32")[0]
    seen, logits = _hooked(model, dict(fe(sounds, sampling_rate=RATE, return_tensors="pt")))
    _same_as_hooked(store, "ast", seen)
    db = actdb.connect(store)
    assert db.sql("SELECT head_kind FROM models").fetchall() == [("classifier",)]
    got = db.sql("SELECT prompt_id, top_logits(vec, 3) FROM acts WHERE site = 'final' "
                 "ORDER BY prompt_id").fetchall()
    for pid, top in got:
        mine = {t["token"]: t["logit"] for t in top}
        own = {model.config.id2label[i]: float(v) for i, v in enumerate(logits[pid])}
        assert mine.keys() == own.keys()
        np.testing.assert_allclose([mine[k] for k in own], list(own.values()), rtol=2e-3,
                                   atol=2e-3 * max(abs(v) for v in own.values()))
    patches = db.sql("SELECT count(*), max(patch_row), max(patch_col) FROM tokens WHERE "
                     "prompt_id = 0 AND token = '<patch>'").fetchall()
    assert patches == [(2 * 4, 1, 3)]  # (32 - 16) // 16 + 1 bands, (64 - 16) // 16 + 1 steps


def test_a_wav2vec2_encoders_rows_are_its_frames(tmp_path: Path) -> None:
    """Wav2Vec2 (raw samples in, a position every 20 ms of sound here 400 samples) stores a row
    a frame, as its own norms see them; sounds of different lengths, which it would give
    different numbers of frames, are one sentence."""
    torch.manual_seed(0)
    model = T.Wav2Vec2Model(T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4))
    randomize_norms(model, seed=4)
    model.eval()
    fe = T.Wav2Vec2FeatureExtractor(sampling_rate=RATE)
    sounds = [_noisy(RATE, 440.0, 0.25), _noisy(RATE, 900.0, 0.25)]
    store = tmp_path / "s.actdb"
    actdb.ingest(store, model=model, processor=fe, name="w2v", device="cpu", weights="none",
                 inputs=[{"audio": (s, RATE)} for s in sounds])
    seen, _ = _hooked(model, dict(fe(sounds, sampling_rate=RATE, return_tensors="pt")))
    _same_as_hooked(store, "w2v", seen)
    # a later ingest into the store (a model without a tokenizer: an empty vocabulary) adds
    # its new sound
    sounds.append(_noisy(RATE, 700.0, 0.25))
    more = actdb.ingest(store, model=model, processor=fe, name="w2v", device="cpu",
                        weights="none", inputs=[{"audio": (s, RATE)} for s in sounds])
    assert (more.prompts_new, more.prompts_skipped) == (1, 2)
    seen, _ = _hooked(model, dict(fe(sounds, sampling_rate=RATE, return_tensors="pt")))
    _same_as_hooked(store, "w2v", seen)
    with pytest.raises(actdb.errors.IngestError, match="give sounds of one length"):
        actdb.ingest(store, model=model, processor=fe, name="w2v", device="cpu",
                     weights="none", inputs=[{"audio": (_noisy(RATE, 300.0, 0.3), RATE)},
                                             {"audio": (_noisy(RATE, 500.0, 0.2), RATE)}])
