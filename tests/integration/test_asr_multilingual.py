"""whisper-base: the language setting and the translate task reach the model."""

from __future__ import annotations

import numpy as np
import pytest

from edge_rtgi.asr import AsrConfig, FinalTranscript, StreamingTranscriber, WhisperAsr
from edge_rtgi.asr.evaluation import stream_samples
from edge_rtgi.audio import resample
from edge_rtgi.tts import make_tts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spanish() -> np.ndarray:
    engine = make_tts("espeak:es")
    # Two sentences: whisper-base left the one sentence "Me gusta mucho el café." untranslated on an
    # AVX2 CPU ("Magusta mocha el café"), and more speech settles its reading of the language.
    pcm = np.concatenate(list(engine.synthesize_stream("Buenos días. Me gusta mucho el café con leche.")))
    return resample(pcm.astype(np.float32) / 32768.0, engine.sample_rate_hz, 16000)


@pytest.mark.parametrize("task,expected", [("transcribe", ("gusta",)), ("translate", ("like", "coffee"))])
def test_spanish_speech_transcribed_or_translated(spanish, task, expected):
    """The espeak voice is hard to understand; one telling word is enough to show the setting works."""
    asr = WhisperAsr(AsrConfig(model="whisper-base", language="es", task=task, min_chunk_ms=2000))
    events = stream_samples(StreamingTranscriber(asr), np.concatenate([np.zeros(8000, np.float32), spanish]))
    finals = [e for e in events if isinstance(e, FinalTranscript)]
    assert len(finals) == 1 and finals[0].language == "es"
    assert any(word in finals[0].text.lower() for word in expected), finals[0].text
