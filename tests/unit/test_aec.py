"""Echo cancellation (WebRTC AEC3 through pywebrtc-audio) on real speech: Piper renders a reply
(the reference) and a user's words; the microphone hears the reply delayed and attenuated, as
from a loudspeaker, plus the user."""

from __future__ import annotations

import numpy as np
import pytest

from edge_rtgi.audio.aec import EchoCanceller, PlayoutReference, join_reference, split_reference
from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample
from edge_rtgi.catalog import resolve_model
from edge_rtgi.errors import AudioError

RATE_HZ = 16000
REPLY = "The capital of France is Paris. It is a large city on the river Seine, famous for its museums."
USER = "Stop, what about Germany?"


@pytest.fixture(scope="module")
def speech():
    from edge_rtgi.tts.piper import PiperVoice

    voice = PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"), intra_op_threads=1)

    def say(text: str) -> np.ndarray:
        pcm = np.concatenate(list(voice.synthesize_stream(text)))
        return resample(pcm16_to_float32(pcm), voice.sample_rate_hz, RATE_HZ)

    return say(REPLY), say(USER)


def _echo(reply: np.ndarray, delay_ms: int, gain: float) -> np.ndarray:
    delay = RATE_HZ * delay_ms // 1000
    return np.concatenate([np.zeros(delay, np.float32), reply])[: len(reply)] * gain


def _run(mic: np.ndarray, ref: np.ndarray, chunk: int) -> np.ndarray:
    aec = EchoCanceller(RATE_HZ)
    parts = [aec.process(mic[i : i + chunk], ref[i : i + chunk]) for i in range(0, len(mic), chunk)]
    return np.concatenate(parts)


def _db(x: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(x.astype(np.float64) ** 2) + 1e-9))


@pytest.mark.slow
def test_the_echo_of_the_reply_is_removed(speech):
    reply, _ = speech
    mic, ref = float32_to_pcm16(_echo(reply, 100, 0.5)), float32_to_pcm16(reply)
    out = _run(mic, ref, 320)
    assert len(out) == len(mic) - len(mic) % 160  # whole 10 ms frames
    settled = slice(RATE_HZ, len(out))  # after the first second, while the filter adapts
    assert _db(mic[settled]) - _db(out[settled]) >= 20.0
    # the same stream in other chunk sizes gives the same samples (the remainder is carried)
    assert np.array_equal(_run(mic, ref, 137)[: len(out) - 160], out[: len(out) - 160])


@pytest.mark.slow
def test_the_user_speaking_over_the_reply_is_kept(speech):
    reply, user = speech
    start = 2 * RATE_HZ  # the user starts 2 s into the reply
    near = np.zeros(len(reply), np.float32)
    near[start : start + len(user)] = user[: len(reply) - start]
    echo = _echo(reply, 100, 0.5)
    out = pcm16_to_float32(_run(float32_to_pcm16(echo + near), float32_to_pcm16(reply), 320))
    n = len(out) // 320 * 320
    span = slice(start // 320, min(start + len(user), n) // 320)
    # AEC3 filters and shifts the signal (no sample-wise comparison): the loudness envelope of
    # what comes out, in 20 ms frames, follows the user's words and not the reply's
    level = _envelope(out[:n])[span]
    assert np.corrcoef(level, _envelope(near[:n])[span])[0, 1] > 0.7
    assert abs(np.corrcoef(level, _envelope(echo[:n])[span])[0, 1]) < 0.3


def _envelope(x: np.ndarray, frame: int = 320) -> np.ndarray:
    frames = x[: len(x) // frame * frame].reshape(-1, frame).astype(np.float64)
    return 10 * np.log10(np.mean(frames**2, axis=1) + 1e-9)


def test_the_reference_must_match_the_microphone():
    aec = EchoCanceller(RATE_HZ)
    with pytest.raises(AudioError, match="160 samples for 320"):
        aec.process(np.zeros(320, np.int16), np.zeros(160, np.int16))
    with pytest.raises(AudioError, match="8-48 kHz"):
        EchoCanceller(4000)


def test_stereo_frames_carry_the_reference():
    mic = np.arange(-5, 5, dtype=np.int16)
    ref = np.arange(100, 110, dtype=np.int16)
    stereo = join_reference(mic, ref)
    assert stereo.tolist()[:4] == [-5, 100, -4, 101]
    m, r = split_reference(stereo)
    assert m.tolist() == mic.tolist() and r.tolist() == ref.tolist()
    with pytest.raises(AudioError, match="even number of samples"):
        split_reference(stereo[:-1])


def test_playout_reference_follows_the_speaker():
    played = PlayoutReference(RATE_HZ)
    assert played.take(4).tolist() == [0, 0, 0, 0]  # nothing playing: silence
    played.played(np.array([1, 2, 3], np.int16), RATE_HZ)
    played.played(np.array([4, 5], np.int16), RATE_HZ)
    assert played.take(2).tolist() == [1, 2]
    assert played.take(5).tolist() == [3, 4, 5, 0, 0]
    played.played(np.ones(22050, np.int16) * 1000, 22050)  # a Piper voice's rate, resampled
    n = len(played.take(20000)) - int(np.sum(played.take(0) == 0))
    assert n == 20000
    played.clear()
    assert not played.take(3).any()
