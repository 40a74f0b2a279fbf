"""Every encoder-decoder family `transformers` ships that builds tiny from a config, ingested.

    python tests/support/encdec_scan.py [model_type ...]

A survey of which encoder-decoders actdb stores faithfully and which it refuses in one
sentence (tests/integration/test_encoder_decoder.py runs T5 and BART, test_audio.py Whisper).
Each family is built at a tiny size from its config class (common sizes, filtered by what the
config takes) and given three inputs: two with a `target`, one without (a sound for the speech
models). Its own forward pass runs first (a failure there is the survey config's, not
actdb's). After the ingest, an independent check beside actdb's own: the model's forward with
`labels=` (which shifts them itself), hooked on every norm module, must give each site's
stored vectors (worst relative error) and the decoder's input ids its stored decoder tokens.
Prints one line a family: OK with the sites, the worst error against the hooks and the logit
check actdb recorded; REFUSED with actdb's sentence; or FAIL with the stage.
"""

from __future__ import annotations

import inspect
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

from support.tiny_models import build_family_tokenizer, randomize_norms  # noqa: E402

RATE = 16000
TARGETS = ["a dog ran far", "there", None]
TEXTS = ["the cat sat on the mat", "hello world", "one more input"]

# model type -> (config class, model class, speech feature extractor or None)
FAMILIES: dict[str, tuple[str, str, str | None]] = {
    "t5": ("T5Config", "T5ForConditionalGeneration", None),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", None),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", None),
    "longt5": ("LongT5Config", "LongT5ForConditionalGeneration", None),
    "switch_transformers": ("SwitchTransformersConfig",
                            "SwitchTransformersForConditionalGeneration", None),
    "bart": ("BartConfig", "BartForConditionalGeneration", None),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", None),
    "marian": ("MarianConfig", "MarianMTModel", None),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", None),
    "pegasus_x": ("PegasusXConfig", "PegasusXForConditionalGeneration", None),
    "plbart": ("PLBartConfig", "PLBartForConditionalGeneration", None),
    "blenderbot": ("BlenderbotConfig", "BlenderbotForConditionalGeneration", None),
    "blenderbot-small": ("BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration",
                         None),
    "led": ("LEDConfig", "LEDForConditionalGeneration", None),
    "bigbird_pegasus": ("BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration", None),
    "fsmt": ("FSMTConfig", "FSMTForConditionalGeneration", None),
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", None),
    "nllb-moe": ("NllbMoeConfig", "NllbMoeForConditionalGeneration", None),
    "prophetnet": ("ProphetNetConfig", "ProphetNetForConditionalGeneration", None),
    "mvp": ("MvpConfig", "MvpForConditionalGeneration", None),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", "WhisperFeatureExtractor"),
    "speech_to_text": ("Speech2TextConfig", "Speech2TextForConditionalGeneration",
                       "Speech2TextFeatureExtractor"),
    "moonshine": ("MoonshineConfig", "MoonshineForConditionalGeneration",
                  "Wav2Vec2FeatureExtractor"),
}

D, LAYERS, HEADS, FFN, POSITIONS = 32, 2, 4, 64, 64


def _config(name: str, vocab: int) -> Any:
    cls = getattr(T, name)
    sizes: dict[str, Any] = dict(
        vocab_size=vocab, d_model=D, hidden_size=D, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=HEADS, d_kv=D // HEADS, d_ff=FFN, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN, encoder_hidden_layers=LAYERS, decoder_hidden_layers=LAYERS,
        encoder_num_attention_heads=HEADS, decoder_num_attention_heads=HEADS,
        intermediate_size=FFN, num_attention_heads=HEADS, num_encoder_layers=LAYERS,
        num_encoder_attention_heads=HEADS, num_decoder_attention_heads=HEADS,
        encoder_ffn_dim_=FFN, max_position_embeddings=POSITIONS, max_target_positions=POSITIONS,
        max_source_positions=200, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, num_experts=2, expert_capacity=8, ngram=2,
        num_mel_bins=80, input_feat_per_channel=80, num_conv_layers=2, conv_channels=32,
        attention_window=4, block_size=4, num_random_blocks=1, src_vocab_size=vocab,
        tgt_vocab_size=vocab, langs=["en", "de"], decoder_vocab_size=vocab,
        router_z_loss_coef=0.0, router_aux_loss_coef=0.0, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, encoder_sparse_step=1, decoder_sparse_step=1,
    )
    if name == "WhisperConfig":
        sizes["max_source_positions"] = 50
    if name == "LongT5Config":
        sizes["local_radius"] = 4
    params = set(inspect.signature(cls.__init__).parameters)
    config = cls(**{k: v for k, v in sizes.items() if k in params})
    if getattr(config, "decoder_start_token_id", None) is None and name != "PLBartConfig":
        config.decoder_start_token_id = config.pad_token_id  # T5's own: the pad token
    return config


def _extractor(name: str) -> Any:
    cls = getattr(T, name)
    if name == "WhisperFeatureExtractor":  # one second a window: 50 encoder positions
        return cls(feature_size=80, sampling_rate=RATE, hop_length=160, chunk_length=1,
                   n_fft=400)
    if name == "Speech2TextFeatureExtractor":
        return cls(feature_size=80, num_mel_bins=80, sampling_rate=RATE)
    return cls(sampling_rate=RATE)


def _sound(hz: float) -> np.ndarray:
    t = np.arange(RATE // 2) / RATE
    noise = np.random.default_rng(int(hz)).standard_normal(len(t)) * 0.01
    return (0.3 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)


def _inputs(speech: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, (text, target) in enumerate(zip(TEXTS, TARGETS, strict=True)):
        item: dict[str, Any] = {"audio": (_sound(300.0 + 200 * i), RATE)} if speech else {
            "text": text}
        if target is not None:
            item["target"] = target
        out.append(item)
    return out


def _own(model: Any, tok: Any, fe: Any, item: dict[str, Any]
         ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The model's own forward on one input: each norm module's input, and the ids its decoder
    read (its own shift of `labels`, or its start token)."""
    if fe is not None:
        kw = dict(fe([item["audio"][0]], sampling_rate=RATE, return_tensors="pt"))
    else:
        kw = dict(tok(item["text"], return_tensors="pt"))
    if "target" in item:
        kw["labels"] = tok(text_target=item["target"], return_tensors="pt")["input_ids"]
    else:
        kw["decoder_input_ids"] = torch.tensor([[model.config.decoder_start_token_id]])
    seen: dict[str, torch.Tensor] = {}
    read: list[list[int]] = []

    def keep(path: str) -> Any:
        def hook(mod: Any, args: tuple[Any, ...], out: Any) -> None:
            x = args[0].detach().double()
            seen.setdefault(path, x.reshape(-1, x.shape[-1]))
        return hook

    handles = [m.register_forward_hook(keep(p)) for p, m in model.named_modules()
               if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith(
                   ("LayerNorm", "RMSNorm"))]
    handles.append(model.get_decoder().register_forward_pre_hook(
        lambda mod, args, k: read.append((k.get("input_ids") if k.get("input_ids") is not None
                                          else args[0])[0].tolist()), with_kwargs=True))
    try:
        with torch.no_grad():
            try:
                model(**kw)
            except ValueError:  # FSMT's forward does not shift labels: its own function does
                seen.clear()
                read.clear()
                kw["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(
                    kw["labels"])
                model(**kw)
    finally:
        for h in handles:
            h.remove()
    return seen, read[0]


def scan(model_type: str) -> str:
    import actdb
    from actdb.errors import ActdbError

    config_name, model_name, fe_name = FAMILIES[model_type]
    tok = build_family_tokenizer("llama")
    try:
        torch.manual_seed(0)
        model = getattr(T, model_name)(_config(config_name, len(tok))).eval()
        randomize_norms(model, seed=1)
        fe = _extractor(fe_name) if fe_name else None
        inputs = _inputs(fe is not None)
        _own(model, tok, fe, inputs[0])
    except Exception as e:  # noqa: BLE001 - the survey's own config, reported
        return f"FAIL     {model_type} (build): {type(e).__name__}: {str(e)[:160]}"
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "s.actdb"
        try:
            actdb.ingest(store, model=model, tokenizer=tok, processor=fe, inputs=inputs,
                         device="cpu", name=model_type, weights="none", batch_size=2,
                         progress=False)
        except ActdbError as e:
            return f"REFUSED  {model_type}: {e}"
        except Exception as e:  # noqa: BLE001 - actdb's failure, reported
            return f"FAIL     {model_type} (ingest): {type(e).__name__}: {str(e)[:200]}"
        db = actdb.connect(store)
        sites = db.sql("SELECT site, module FROM sites").fetchall()
        worst, tokens_ok = 0.0, True
        for pid, item in enumerate(inputs):
            seen, read = _own(model, tok, fe, item)
            got = [r[0] for r in db.sql(
                "SELECT token_id FROM tokens WHERE prompt_id = $p AND tower = 'decoder' "
                "ORDER BY position", params={"p": pid}).fetchall()]
            tokens_ok = tokens_ok and got == read
            for site, module in sites:
                vec = db.vectors("SELECT vec FROM acts WHERE prompt_id = $p AND site = $s "
                                 "ORDER BY position", params={"p": pid, "s": site}).double()
                ref = seen[module]
                if vec.shape != ref.shape:
                    return (f"FAIL     {model_type} (check): site {site!r} holds {tuple(vec.shape)}"
                            f", its module saw {tuple(ref.shape)}")
                err = (vec - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
                worst = max(worst, float(err.max()))
        logit = db.sql("SELECT logit_max_rel_error FROM models").fetchall()[0][0]
        roles = sorted({r[0] for r in db.sql("SELECT role FROM sites").fetchall()})
        status = "OK" if worst < 2e-3 and tokens_ok and logit is not None else "FAIL"
        return (f"{status:<8} {model_type}: {len(sites)} sites ({', '.join(roles)}), worst "
                f"{worst:.1e} against hooks, decoder tokens {'the' if tokens_ok else 'NOT the'}"
                f" model's own, logits proven to {logit if logit is None else f'{logit:.1e}'}")


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    T.logging.set_verbosity_error()
    for model_type in argv or list(FAMILIES):
        print(scan(model_type), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
