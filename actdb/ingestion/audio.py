"""Sound inputs: a file decoded by soundfile (libsndfile: WAV, FLAC, OGG, ...) or an
`(array, rate)` pair given in Python, mixed down to one channel (the mean of the channels) and
resampled to the feature extractor's `sampling_rate` by polyphase filtering
(`scipy.signal.resample_poly`: upsample by L, a Kaiser-windowed low-pass FIR, downsample by M,
L / M the two rates' ratio in lowest terms), then handed to the model's own feature extractor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import IngestError
from .prompts import Media


def feature_extractor(processor: Any) -> Any:
    """What turns sound into the model's features: a processor's feature extractor, or the
    processor itself where it is one."""
    return getattr(processor, "feature_extractor", None) or processor


def load_audio(media: Media, rate: int) -> np.ndarray:
    """The input's sound as float32 [samples] at `rate`; one sentence naming the file where it
    cannot be read."""
    if "audio" in media.objects:
        samples, given = media.objects["audio"]
        data = np.asarray(samples, dtype=np.float32)
        where = media.audio
        if data.ndim == 2 and data.shape[1] > data.shape[0]:  # no sound has more channels
            raise IngestError(f"audio {where!r} is an array of shape {data.shape}, which reads "
                              "as more channels than samples: give [samples, channels] (a "
                              "[channels, samples] array transposed)")
    else:
        try:
            import soundfile
        except ImportError:
            raise IngestError("reading sound files needs the soundfile package: pip install "
                              "'actdb[audio]'") from None

        assert media.audio is not None
        where = media.audio
        try:
            data, given = soundfile.read(str(media.path(media.audio)), dtype="float32",
                                         always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, OSError, ValueError) as e:
            raise IngestError(f"audio {media.audio!r} cannot be read as a sound file "
                              f"({type(e).__name__}: {_first_line(e)})") from None
    if data.ndim == 2:  # [samples, channels]: one channel, their mean
        data = data.mean(axis=1)
    if data.ndim != 1 or data.size == 0:
        raise IngestError(f"audio {where!r} holds no samples")
    return resample(data, int(given), rate, where=str(where)).astype(np.float32)


# The most samples a sound may have after resampling: 2^28 float32 (1 GiB, hours of sound at a
# feature extractor's rate); past it a sound is a damaged header, not speech.
MAX_SAMPLES = 1 << 28


def resample(data: np.ndarray, given: int, rate: int, *, where: str = "a sound") -> np.ndarray:
    """`data` at `given` samples a second, at `rate`: polyphase filtering (module docstring)."""
    if given == rate:
        return data
    try:
        from scipy.signal import resample_poly
    except ImportError:
        raise IngestError(f"resampling a sound from {given} Hz to {rate} Hz needs the scipy "
                          "package: pip install 'actdb[audio]'") from None

    if given <= 0:
        raise IngestError(f"audio {where!r}'s sample rate is {given} Hz, which no sound has")
    if data.size * rate / given > MAX_SAMPLES:  # a damaged header's tiny rate
        raise IngestError(f"audio {where!r}: {data.size} samples at {given} Hz would be "
                          f"{data.size * rate // given} samples at {rate} Hz, more than the "
                          f"{MAX_SAMPLES} actdb reads (about {MAX_SAMPLES // rate // 3600} hours): "
                          "is its sample rate right?")
    g = math.gcd(given, rate)
    return np.asarray(resample_poly(data, rate // g, given // g))


def audio_inputs(processor: Any, media: Sequence[Media], name: str) -> dict[str, Any]:
    """A batch's sounds through the model's feature extractor: its own features
    (`input_features`, `input_values`)."""
    fe = feature_extractor(processor)
    rate = getattr(fe, "sampling_rate", None)
    if not isinstance(rate, int):
        raise IngestError(f"model {name!r}: its processor has no sampling_rate, so actdb "
                          "cannot tell the rate to resample its sounds to")
    sounds = [load_audio(m, rate) for m in media]
    if len({len(s) for s in sounds}) > 1 and not _pads_to_fixed_length(fe):
        raise IngestError(
            f"model {name!r}: these sounds last {sorted({len(s) for s in sounds})} samples at "
            f"{rate} Hz, and its feature extractor ({type(fe).__name__}) gives each as many "
            "positions as it lasts: actdb stores as many rows for every sound of an ingest; "
            "give sounds of one length")
    out = dict(fe(sounds, sampling_rate=rate, return_tensors="pt"))
    for key, value in out.items():
        if (isinstance(value, torch.Tensor) and value.is_floating_point()
                and not bool(value.isfinite().all())):
            # (a pure tone through a per-utterance normalization divides by a zero deviation)
            raise IngestError(f"model {name!r}: its feature extractor made {key} that are not "
                              "all finite numbers from these sounds, which the model cannot "
                              "read faithfully")
    return out


def spectrogram_grid(model: Any) -> tuple[int, int] | None:
    """(frequency bands, time steps) of the patches of a model that cuts its spectrogram into
    patches (AST: `embeddings.get_shape`), in the order its sequence holds them (frequency
    major); None for a model whose positions are frames in time."""
    base = getattr(model, "base_model", model)
    embeddings = getattr(base, "embeddings", None)
    shape = getattr(embeddings, "get_shape", None)
    config = getattr(embeddings, "config", None)
    if not callable(shape) or config is None:
        return None
    f, t = shape(config)
    return int(f), int(t)


def _pads_to_fixed_length(fe: Any) -> bool:
    """Whether the feature extractor pads (or cuts) every sound to one length: Whisper's 30 s
    (`n_samples`), AST's `max_length` frames."""
    return isinstance(getattr(fe, "n_samples", None), int) or (
        type(fe).__name__.startswith("AST") and isinstance(getattr(fe, "max_length", None), int))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
