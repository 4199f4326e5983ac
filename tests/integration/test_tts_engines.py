"""Piper and espeak-ng engines: streaming order, id conventions, async wrapper, CLI errors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from edge_rtgi.audio import read_wav
from edge_rtgi.tts import EmptyTextError, EspeakEngine, PiperVoice, make_tts, synthesize_async

THREE_SENTENCES = "The sun is up. Birds are singing in the trees. Let us go for a walk."


@pytest.fixture(scope="module")
def piper() -> PiperVoice:
    voice = make_tts("piper-en_US-joe-medium")
    assert isinstance(voice, PiperVoice)
    return voice


def _rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))


@pytest.mark.slow
def test_piper_yields_one_chunk_per_sentence_before_the_rest_is_made(piper, monkeypatch):
    calls = []
    real = piper.synthesize_ids
    monkeypatch.setattr(piper, "synthesize_ids", lambda ids: calls.append(len(ids)) or real(ids))
    stream = piper.synthesize_stream(THREE_SENTENCES)
    first = next(stream)
    assert len(calls) == 1, "the first chunk must come before later sentences are synthesised"
    rest = list(stream)
    assert len(calls) == 3 and len(rest) == 2
    for chunk in [first, *rest]:
        assert chunk.dtype == np.int16 and _rms(chunk) > 300
    seconds = sum(len(c) for c in [first, *rest]) / piper.sample_rate_hz
    assert piper.sample_rate_hz == 22050 and 2.5 < seconds < 9.0


def test_piper_plans_no_memory_pattern_per_sentence_length(piper):
    # each new sentence length would add a pattern and grow onnxruntime's arena (issue 18's soak)
    assert piper._session.get_session_options().enable_mem_pattern is False


def test_piper_phoneme_ids_follow_piper_conventions(piper):
    id_map = piper.config.phoneme_id_map
    ids = piper.phoneme_ids("hə")
    assert (
        ids == id_map["^"] + id_map["_"] + id_map["h"] + id_map["_"] + id_map["ə"] + id_map["_"] + id_map["$"]
    )
    # Punctuation survives phonemisation: voices were trained with it.
    phonemes = piper._phonemizer.phonemize("Hello, world. Dr. Smith paid 3.14 dollars!", "en-us")
    assert phonemes.count(",") == 1 and phonemes.endswith("!") and "." in phonemes
    assert "pɔɪnt" in phonemes  # "3.14" read as a number, not split into two sentences


def test_espeak_engine_speaks_spanish_in_chunks():
    engine = EspeakEngine("es")
    chunks = list(engine.synthesize_stream("Hola, ¿cómo estás? Hoy hace buen tiempo en Madrid."))
    assert len(chunks) >= 2 and all(c.dtype == np.int16 for c in chunks)
    audio = np.concatenate(chunks)
    assert 1.5 < len(audio) / engine.sample_rate_hz < 8.0 and _rms(audio) > 300


def test_control_characters_are_spoken_around_not_passed_on(piper):
    # a tiny model's byte token once put a NUL into a reply: espeak-ng's argv cannot hold one
    for engine in (EspeakEngine("en-us"), piper):
        audio = np.concatenate(list(engine.synthesize_stream("Hello\x00 there.\x07 Good\x1b day.")))
        assert _rms(audio) > 300


async def test_async_wrapper_streams_and_stops_early(piper, monkeypatch):
    calls = []
    real = piper.synthesize_ids
    monkeypatch.setattr(piper, "synthesize_ids", lambda ids: calls.append(1) or real(ids))
    got = []
    async for chunk in synthesize_async(piper, "One. Two. Three. Four. Five. Six.", max_queued_chunks=1):
        got.append(chunk)
        break  # barge-in: the listener stops after the first sentence
    assert len(got) == 1
    assert len(calls) <= 3, "synthesis must stop soon after the consumer leaves"


def test_empty_text_is_a_clear_error(piper):
    for text in ("", "   ", "?!"):
        with pytest.raises(EmptyTextError, match="nothing to speak"):
            list(piper.synthesize_stream(text))


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_rtgi.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_speak_cli_writes_wav_and_reports_bad_input(tmp_path):
    out = tmp_path / "hola.wav"
    done = _cli("speak", "Hola, ¿qué tal?", "--voice", "espeak:es", "--out", str(out))
    assert done.returncode == 0, done.stderr
    audio, rate = read_wav(out)
    assert rate == 22050 and len(audio) > 0.5 * rate

    done = _cli("speak", "")
    assert done.returncode == 2 and "nothing to speak" in done.stderr and "Traceback" not in done.stderr
    done = _cli("speak", "Hi there", "--voice", str(tmp_path / "missing" / "voice.onnx"), "--out", str(out))
    assert (
        done.returncode == 2
        and "Piper voice model not found" in done.stderr
        and "Traceback" not in done.stderr
    )
    # No sound server and no sound card here: say so instead of failing inside PortAudio.
    done = _cli(
        "speak",
        "Hi there",
        "--voice",
        "espeak",
        env={"XDG_RUNTIME_DIR": str(tmp_path), "PULSE_SERVER": "none"},
    )
    assert done.returncode in (0, 2), done.stderr  # 0 only where a real sound card exists
    if done.returncode == 2:
        assert (
            done.returncode == 2
            and "no audio output device" in done.stderr
            and "Traceback" not in done.stderr
        )
