"""A sound given in Python as an (array, rate) pair: [samples] or [samples, channels]. An array
laid out [channels, samples] (torchaudio's) is refused in one sentence: read as [samples,
channels], a stereo sound would silently become two samples."""

from __future__ import annotations

import numpy as np
import pytest

from actdb.errors import IngestError
from actdb.ingestion.audio import load_audio
from actdb.ingestion.prompts import Media

RATE = 16000


def _pair(samples: np.ndarray) -> Media:
    return Media(audio="<pair>", objects={"audio": (samples, RATE)})


def test_channels_first_is_refused_in_one_sentence() -> None:
    t = np.arange(RATE // 4) / RATE
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 1000 * t)])  # [2, N]
    with pytest.raises(IngestError, match=r"\[samples, channels\]") as e:
        load_audio(_pair(stereo), RATE)
    assert "\n" not in str(e.value)
    # the same sound laid out [samples, channels] is its channels' mean (the reference)
    got = load_audio(_pair(stereo.T.copy()), RATE)
    np.testing.assert_allclose(got, stereo.mean(0), atol=1e-7)


@pytest.mark.parametrize("rate", [1, 0])
def test_a_rate_no_sound_has_is_one_sentence_not_gigabytes(rate: int) -> None:
    """A damaged header's rate of 1 Hz would resample 100k samples to 1.6e9 (6 GB)."""
    media = Media(audio="bad.wav", objects={"audio": (np.zeros(100_000, np.float32), rate)})
    with pytest.raises(IngestError, match="bad.wav") as e:
        load_audio(media, RATE)
    assert "\n" not in str(e.value)
