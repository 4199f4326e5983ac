"""``edge-rtgi transcribe`` on files: odd formats work, bad input gives one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from edge_rtgi.asr.evaluation import word_error_rate
from edge_rtgi.audio import resample, wav_bytes, write_wav
from edge_rtgi.tts import make_tts
from tests.integration.native_client import steady_voice

TEXT = "The library closes early on public holidays."


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_rtgi.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )


def _assert_clean_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_transcribe_stereo_44k_file_as_json(tmp_path):
    voice = steady_voice(make_tts("piper-en_US-joe-medium"))  # the same audio every run
    pcm = np.concatenate(list(voice.synthesize_stream(TEXT))).astype(np.float32) / 32768.0
    x = resample(pcm, voice.sample_rate_hz, 44100)
    path = tmp_path / "stereo.wav"
    write_wav(path, np.stack([x, 0.8 * x], axis=1), 44100)  # 44.1 kHz stereo: down-mixed and resampled
    done = _cli("transcribe", str(path), "--json", "--fast")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["type"] for e in events][0] == "speech_started"
    finals = [e for e in events if e["type"] == "final_transcript"]
    assert len(finals) == 1 and word_error_rate([TEXT], [finals[0]["text"]]) <= 0.15
    assert finals[0]["segments"] and finals[0]["language"] == "en"


def test_truncated_and_non_wav_files(tmp_path):
    blob = wav_bytes(np.zeros(16000, np.float32), 16000)
    (tmp_path / "cut.wav").write_bytes(blob[:5000])
    _assert_clean_error(_cli("transcribe", str(tmp_path / "cut.wav")), "truncated WAV file")
    (tmp_path / "song.mp3").write_bytes(b"ID3\x04\x00 not a wav")
    _assert_clean_error(_cli("transcribe", str(tmp_path / "song.mp3")), "not a WAV file")
    _assert_clean_error(_cli("transcribe", str(tmp_path / "nothing.wav")), "audio file not found")
    _assert_clean_error(_cli("transcribe"), "give either a WAV file or --mic")


def test_missing_or_broken_model(tmp_path):
    path = tmp_path / "ok.wav"
    write_wav(path, np.zeros(1600, np.float32), 16000)
    _assert_clean_error(
        _cli("transcribe", str(path), "--model", str(tmp_path / "no" / "model")),
        "whisper model folder not found",
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    _assert_clean_error(_cli("transcribe", str(path), "--model", str(broken)), "lacks model.bin")
    (broken / "model.bin").write_bytes(b"\x00" * 100)  # a truncated download
    _assert_clean_error(_cli("transcribe", str(path), "--model", str(broken)), "cannot load whisper model")
    _assert_clean_error(
        _cli("transcribe", str(path), "--task", "translate"), "needs a multilingual whisper model"
    )
