"""``edge-rtgi translate --mic`` through a real PulseAudio null sink: captions and audio.

The microphone is the monitor of the null sink ``vmic`` (the speech tests' fixture). The
translation is recorded with ``--out`` and not played (``--no-speak``): PortAudio output to a
second null sink can stall at shutdown on this machine (see the daemon report).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from edge_rtgi.audio import write_wav
from edge_rtgi.audio.wav import read_wav
from edge_rtgi.tts import make_tts
from tests.integration.native_client import steady_voice, wer
from tests.integration.test_mic_pulse import pulse, run_cli_with_mic  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.audio]

TEXT = "Good morning. I would like a cup of coffee."


def test_translate_mic_prints_captions_and_writes_audio(pulse, tmp_path):  # noqa: F811
    subprocess.run(
        ["pactl", "load-module", "module-null-sink", "sink_name=vspk"],
        env=pulse,
        check=True,
        capture_output=True,
        timeout=30,
    )
    subprocess.run(["pactl", "set-default-sink", "vspk"], env=pulse, check=True, timeout=30)
    voice = steady_voice(make_tts("piper-en_US-joe-medium"))
    pcm = np.concatenate(list(voice.synthesize_stream(TEXT)))
    wav = tmp_path / "speech.wav"
    write_wav(wav, pcm, voice.sample_rate_hz)
    out_wav = tmp_path / "translated.wav"
    stdout = run_cli_with_mic(
        [
            "translate",
            "--mic",
            "--from",
            "en",
            "--to",
            "es",
            "--duration",
            f"{len(pcm) / voice.sample_rate_hz + 5:.1f}",
            "--no-speak",
            "--out",
            str(out_wav),
        ],
        wav,
        pulse,
        tmp_path,
    )
    lines = stdout.splitlines()
    sources = " ".join(line[len("[source] ") :] for line in lines if line.startswith("[source] "))
    translations = " ".join(
        line[len("[translation] ") :] for line in lines if line.startswith("[translation] ")
    )
    assert wer(TEXT, sources) <= 0.2, lines
    assert "café" in translations.lower(), lines
    audio, rate = read_wav(out_wav)
    assert rate == 22050 and len(audio) / rate > 1.0, "the spoken translation was recorded"
