"""``edge-rtgi transcribe --mic`` through a real PulseAudio null sink (no mock).

A private PulseAudio server gets a null sink ``vmic`` whose monitor is the default source;
``paplay`` plays a Piper-spoken WAV into the sink, and the CLI records it through
sounddevice -> PortAudio -> ALSA's pulse plugin, exactly as from a microphone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_rtgi.asr.evaluation import word_error_rate
from edge_rtgi.audio import write_wav
from edge_rtgi.tts import make_tts
from tests.integration.native_client import steady_voice

pytestmark = [pytest.mark.slow, pytest.mark.audio]

TEXT = "Please turn off the kitchen lights before you leave the house."


@pytest.fixture()
def pulse(tmp_path):
    if shutil.which("pulseaudio") is None or shutil.which("paplay") is None:
        pytest.skip(
            "pulseaudio / pulseaudio-utils are not installed (apt-get install pulseaudio pulseaudio-utils)"
        )
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "HOME": str(tmp_path)}
    env.pop("PULSE_SERVER", None)
    subprocess.run(
        [
            "pulseaudio",
            "--daemonize=yes",
            "--exit-idle-time=-1",
            "-n",
            "--load=module-native-protocol-unix",
            "--load=module-null-sink sink_name=vmic",
            "--load=module-always-sink",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    pid_file = runtime / "pulse" / "pid"
    try:
        subprocess.run(["pactl", "set-default-source", "vmic.monitor"], env=env, check=True, timeout=30)
        yield env
    finally:
        subprocess.run(["pulseaudio", "--kill"], env=env, capture_output=True, timeout=30)
        try:  # only the server this test started; `--kill` may remove the pid file meanwhile
            os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass


def _wait_for(path: Path, needle: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not seen in {path} after {timeout_s} s: {path.read_text()!r}")


def run_cli_with_mic(cli_args: list[str], wav: Path, pulse: dict, tmp_path: Path) -> str:
    """Run ``edge-rtgi CLI_ARGS`` in a subprocess, play ``wav`` into the virtual microphone once it
    listens, and return its stdout. The command must end by itself with exit 0."""
    err_path, out_path = tmp_path / "stderr.txt", tmp_path / "stdout.txt"
    with open(err_path, "w") as err, open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge_rtgi.cli", *cli_args], stdout=out, stderr=err, env=pulse
        )
        try:
            _wait_for(err_path, "listening", 240)
            subprocess.run(["paplay", "-d", "vmic", str(wav)], env=pulse, check=True, timeout=60)
            assert proc.wait(timeout=240) == 0, err_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    return out_path.read_text()


def test_transcribe_mic_through_pulseaudio(pulse, tmp_path):
    voice = steady_voice(make_tts("piper-en_US-joe-medium"))
    pcm = np.concatenate(list(voice.synthesize_stream(TEXT)))
    wav = tmp_path / "speech.wav"
    write_wav(wav, pcm, voice.sample_rate_hz)
    speech_s = len(pcm) / voice.sample_rate_hz

    stdout = run_cli_with_mic(
        ["transcribe", "--mic", "--json", "--seconds", f"{speech_s + 6:.1f}"], wav, pulse, tmp_path
    )
    events = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    finals = [e["text"] for e in events if e["type"] == "final_transcript"]
    assert any(e["type"] == "speech_started" for e in events)
    assert word_error_rate([TEXT], [" ".join(finals)]) <= 0.1, finals


def test_speak_plays_on_the_pulseaudio_speaker(pulse, tmp_path):
    """``speak`` without --out plays through PortAudio; we record the null sink's monitor."""
    from edge_rtgi.audio import read_wav

    if shutil.which("parecord") is None:
        pytest.skip("parecord (pulseaudio-utils) is not installed")
    captured = tmp_path / "captured.wav"
    recorder = subprocess.Popen(
        ["parecord", "-d", "vmic.monitor", "--file-format=wav", str(captured)], env=pulse
    )
    try:
        time.sleep(1.0)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "edge_rtgi.cli",
                "speak",
                "Testing the speaker, one two three.",
                "--voice",
                "espeak",
            ],
            env=pulse,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr
        time.sleep(0.5)
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=30)
    audio, rate = read_wav(captured)
    mono = audio if audio.ndim == 1 else audio.mean(axis=1)
    loud = np.abs(mono) > 0.05
    assert loud.sum() / rate > 0.5, "the speech must have reached the speaker"
