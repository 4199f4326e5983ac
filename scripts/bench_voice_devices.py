#!/usr/bin/env python
"""Voice-assistant devices: wake-word detection and echo cancellation, in one run.

Wake words (microWakeWord, ``edge_rtgi.asr.wakeword``): each of the four bundled wake words,
spoken by Piper (three speeds) and espeak-ng (several voices and speeds), followed by a
question, in noise at 10 dB SNR. Reported: detection rate, detection latency after the end of
the wake word (the last sample above -40 dB of its peak), and false wakes of a detector
listening for all four words over about 10 minutes of other speech in the same noise.

Echo cancellation (``edge_rtgi.audio.aec``, WebRTC AEC3): 20 Piper replies played into the
microphone at -6 dB with 50-150 ms of delay. Reported, with and without AEC: false barge-ins
(silero VAD, the voice-assistant pipeline's settings, declares speech during a reply); a
user's question spoken over the reply: barge-in within 300 ms of its start; the ASR WER
(whisper tiny.en) of that question after AEC, against the clean question, twice: with the reply
playing on over the whole question, and with the reply cut where the daemon would cut it (the
VAD's speech start after AEC, plus the voice-assistant pipeline's barge-in wait over a reply,
``barge_in_min_speech_ms``, plus ``--playout-ms`` of audio already queued in the device).

    python scripts/bench_voice_devices.py [--minutes 10] [--seed 0] [--json out.json] [--peaks]
        [--echo-only] [--playout-ms 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_rtgi.asr.wakeword import WakeWordDetector, available_wake_words  # noqa: E402
from edge_rtgi.audio.aec import EchoCanceller  # noqa: E402
from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample  # noqa: E402

RATE_HZ = 16000
SNR_DB = 10.0
WAKE_TEXTS = {
    "okay_nabu": "Okay Nabu.",
    "hey_jarvis": "Hey Jarvis.",
    "alexa": "Alexa.",
    "hey_mycroft": "Hey Mycroft.",
}
PIPER_SPEEDS = (0.85, 1.0, 1.2)  # length_scale: faster, normal, slower
ESPEAK_VOICES = (("en-us", 150), ("en-us", 190), ("en-gb", 170), ("en-us+f3", 165), ("en-gb-x-rp", 175))
# --peaks also tries voices the detection-rate trials do not use, to tell a voice from a rendering.
EXTRA_VOICES = (
    "espeak:en-sc@160",
    "espeak:en-us+m3@170",
    "espeak:en-029@165",
    "espeak:en-gb+f2@160",
    "piper@0.9",
    "piper@1.1",
)
CHUNK = 320  # 20 ms


@dataclass(frozen=True)
class WakeTrial:
    word: str
    voice: str
    detected: bool
    latency_ms: float | None


@dataclass(frozen=True)
class EchoTrial:
    delay_ms: int
    false_barge_in_aec: bool
    false_barge_in_raw: bool
    barge_in_ms_aec: float | None
    barge_in_ms_raw: float | None
    wer_aec: float
    wer_clean: float
    # the reply cut at the barge-in, as the daemon cuts it (None: no barge-in to cut at)
    reply_cut_ms: float | None = None  # from the question's first sample to the reply's last
    wer_aec_reply_cut: float | None = None


class Voices:
    """Renders text at 16 kHz float32 with the Piper voice (at a speed) or espeak-ng."""

    def __init__(self) -> None:
        from edge_rtgi.catalog import resolve_model
        from edge_rtgi.tts.piper import PiperVoice

        self.piper = PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"), intra_op_threads=1)
        self._base = self.piper.config

    def names(self) -> list[str]:
        return [f"piper@{s}" for s in PIPER_SPEEDS] + [f"espeak:{v}@{w}" for v, w in ESPEAK_VOICES]

    def say(self, voice: str, text: str) -> np.ndarray:
        import dataclasses

        from edge_rtgi.tts.espeak import EspeakEngine

        name, _, speed = voice.partition("@")
        if name == "piper":
            self.piper.config = dataclasses.replace(self._base, length_scale=float(speed))
            engine = self.piper
        else:
            engine = EspeakEngine(name.removeprefix("espeak:"), int(speed))
        pcm = np.concatenate(list(engine.synthesize_stream(text)))
        return resample(pcm16_to_float32(pcm), engine.sample_rate_hz, RATE_HZ)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-12))


def _active_rms(x: np.ndarray) -> float:
    """RMS of the 20 ms frames within 30 dB of the loudest (the speech, not the pauses)."""
    frames = x[: len(x) // CHUNK * CHUNK].reshape(-1, CHUNK)
    levels = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    return float(np.sqrt(np.mean(levels[levels > levels.max() * 10 ** (-30 / 20)] ** 2)))


def _end_of_speech(x: np.ndarray) -> int:
    loud = np.nonzero(np.abs(x) > np.abs(x).max() * 10 ** (-40 / 20))[0]
    return int(loud[-1]) + 1 if len(loud) else len(x)


def _noise(rng: np.random.Generator, n: int) -> np.ndarray:
    """Pink noise (1/f power, shaped in the frequency domain), unit RMS."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / RATE_HZ)
    spectrum /= np.sqrt(np.maximum(freqs, 20.0))
    pink = np.fft.irfft(spectrum, n)
    return (pink / _rms(pink)).astype(np.float32)


def _mix(speech: np.ndarray, noise: np.ndarray, snr_db: float, speech_rms: float) -> np.ndarray:
    mixed = speech + noise[: len(speech)] * speech_rms / 10 ** (snr_db / 20)
    peak = np.abs(mixed).max()
    return mixed * (0.9 / peak) if peak > 0.9 else mixed


def _detect(words: list[str], pcm: np.ndarray) -> list[tuple[str, int]]:
    detector = WakeWordDetector(words)
    try:
        found = []
        for i in range(0, len(pcm), 1024):
            found += [(d.name, d.audio_ms) for d in detector.process(pcm[i : i + 1024])]
        return found
    finally:
        detector.close()


def bench_wake(voices: Voices, rng: np.random.Generator, questions: list[str]) -> list[WakeTrial]:
    trials = []
    for word, text in WAKE_TEXTS.items():
        for k, voice in enumerate(voices.names()):
            wake = voices.say(voice, text)
            question = voices.say(voice, questions[(k + len(trials)) % len(questions)])
            lead = np.zeros(RATE_HZ, np.float32)
            clean = np.concatenate([lead, wake, np.zeros(RATE_HZ // 3, np.float32), question, lead])
            pcm = float32_to_pcm16(_mix(clean, _noise(rng, len(clean)), SNR_DB, _active_rms(wake)))
            wake_end_ms = 1000 * (len(lead) + _end_of_speech(wake)) / RATE_HZ
            hits = [ms for name, ms in _detect([word], pcm) if name == word]
            ok = [ms for ms in hits if 1000 * len(lead) / RATE_HZ <= ms <= wake_end_ms + 1000]
            trials.append(WakeTrial(word, voice, bool(ok), ok[0] - wake_end_ms if ok else None))
            print(f"  wake {word:12s} {voice:22s} {'hit' if ok else 'MISS'} {hits}", flush=True)
    return trials


def _peak_probability(word: str, pcm: np.ndarray, start_ms: float, end_ms: float) -> float:
    """The highest averaged probability ``word``'s model reaches between two stream positions."""
    from pymicro_wakeword import MicroWakeWord, MicroWakeWordFeatures

    model = MicroWakeWord.from_config(available_wake_words()[word].config_path)
    features = MicroWakeWordFeatures()
    peak, step = 0.0, 0
    try:
        for feature in features.process_streaming(pcm.astype("<i2").tobytes()):
            step += 1
            probability = model.process_streaming_prob(feature) or 0.0
            if start_ms <= step * 10 + 20 <= end_ms:
                peak = max(peak, probability)
    finally:
        model.close()
    return peak


def wake_peaks(voices: Voices, rng: np.random.Generator, questions: list[str]) -> None:
    """Print each trial's peak averaged probability beside the model's cut-off (why a trial missed)."""
    names = voices.names() + list(EXTRA_VOICES)
    for word, text in WAKE_TEXTS.items():
        cutoff = available_wake_words()[word].probability_cutoff
        for k, voice in enumerate(names):
            wake = voices.say(voice, text)
            question = voices.say(voice, questions[k % len(questions)])
            lead = np.zeros(RATE_HZ, np.float32)
            clean = np.concatenate([lead, wake, np.zeros(RATE_HZ // 3, np.float32), question, lead])
            pcm = float32_to_pcm16(_mix(clean, _noise(rng, len(clean)), SNR_DB, _active_rms(wake)))
            wake_end_ms = 1000 * (len(lead) + _end_of_speech(wake)) / RATE_HZ
            peak = _peak_probability(word, pcm, 1000 * len(lead) / RATE_HZ, wake_end_ms + 1000)
            print(f"  {word:12s} {voice:22s} peak {peak:.3f} (cut-off {cutoff})", flush=True)


def bench_false_wakes(voices: Voices, rng: np.random.Generator, texts: list[str], minutes: float) -> tuple:
    """Other speech in noise, about ``minutes`` long; detections of any wake word."""
    parts: list[np.ndarray] = []
    total = 0
    names = voices.names()
    i = 0
    while total < minutes * 60 * RATE_HZ:
        speech = voices.say(names[i % len(names)], texts[i % len(texts)])
        gap = np.zeros(int(rng.uniform(0.2, 1.0) * RATE_HZ), np.float32)
        parts += [speech, gap]
        total += len(speech) + len(gap)
        i += 1
    speech = np.concatenate(parts)
    pcm = float32_to_pcm16(_mix(speech, _noise(rng, len(speech)), SNR_DB, _active_rms(speech)))
    t0 = time.perf_counter()
    found = _detect(list(available_wake_words()), pcm)
    cpu_s = time.perf_counter() - t0
    return found, len(pcm) / RATE_HZ, cpu_s, i


def _assistant_asr():
    from edge_rtgi.asr.config import AsrConfig
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipeline

    return load_pipeline(builtin_pipelines_dir() / "voice-assistant.yaml").stage(AsrConfig)


def _vad_starts(pcm: np.ndarray) -> list[int]:
    """Stream positions (samples) at which the pipeline's VAD reported a speech start."""
    from edge_rtgi.asr.vad import SileroVad

    vad = SileroVad(_assistant_asr().vad)
    starts = []
    for i in range(0, len(pcm), CHUNK):
        for ev in vad.process(pcm16_to_float32(pcm[i : i + CHUNK])):
            if ev.kind == "start":
                starts.append(i + CHUNK)
    return starts


def _cancel(mic: np.ndarray, ref: np.ndarray) -> np.ndarray:
    aec = EchoCanceller(RATE_HZ)
    return np.concatenate(
        [aec.process(mic[i : i + CHUNK], ref[i : i + CHUNK]) for i in range(0, len(mic), CHUNK)]
    )


def _barge_ms(starts: list[int], onset: int) -> float | None:
    """Stream time from the user's first word to the first speech start after it."""
    after = [s for s in starts if s >= onset]
    return 1000 * (after[0] - onset) / RATE_HZ if after else None


def bench_echo(
    voices: Voices, rng: np.random.Generator, replies: list[str], questions: list[str], playout_ms: float
) -> list:
    from jiwer import wer

    from edge_rtgi.asr.config import AsrConfig
    from edge_rtgi.asr.whisper import WhisperAsr

    asr = WhisperAsr(AsrConfig(model="whisper-tiny.en", language="en"))
    turns = _assistant_asr().turn_detection
    # speech over a reply cuts it only after this much of it in semantic mode (docs/speech.md)
    talkover_ms = turns.barge_in_min_speech_ms if turns is not None and turns.mode == "semantic" else 0

    def words(t: str) -> str:
        return " ".join("".join(c for c in t.lower() if c.isalnum() or c in " '").split())

    def played(reply: np.ndarray, delay: int, floor: np.ndarray, near: np.ndarray) -> tuple:
        """The reference and the microphone (echo at -6 dB after ``delay`` samples, the room, the
        user), as int16 with a second of tail."""
        echo = np.concatenate([np.zeros(delay, np.float32), reply])[: len(reply)] * 0.5  # -6 dB
        pad = np.zeros(RATE_HZ, np.float32)
        return float32_to_pcm16(np.concatenate([reply, pad])), float32_to_pcm16(
            np.concatenate([echo + floor, pad]) + near
        )

    trials = []
    for k, text in enumerate(replies[:20]):
        reply = voices.say("piper@1.0", text)
        reply = np.concatenate([reply, reply])  # a long reply: the user talks over its second half
        delay = int(rng.uniform(50, 150) * RATE_HZ / 1000)
        floor = _noise(rng, len(reply)) * 10 ** (-55 / 20)  # a quiet room
        question_text = questions[k % len(questions)]
        user = voices.say("piper@1.1", question_text)
        onset = len(reply) // 2
        near = np.zeros(len(reply) + RATE_HZ, np.float32)
        near[onset : onset + len(user)] = user[: len(near) - onset]
        silent = np.zeros_like(near)
        ref, alone = played(reply, delay, floor, silent)  # the reply only
        _, over = played(reply, delay, floor, near)  # the user talks over it

        cleaned = _cancel(over, ref)
        seg = slice(max(onset - RATE_HZ // 5, 0), min(onset + len(user) + RATE_HZ // 2, len(cleaned)))

        def heard_wer(pcm: np.ndarray, seg: slice = seg, said: str = question_text) -> tuple[str, float]:
            audio = pcm16_to_float32(pcm[seg]) if pcm.dtype == np.int16 else pcm[seg]
            heard = asr.transcribe(audio).text
            return heard, float(wer(words(said), words(heard) or "-"))

        heard, wer_aec = heard_wer(cleaned)
        barge_ms = _barge_ms(_vad_starts(cleaned), onset)
        cut_ms = wer_cut = None
        if barge_ms is not None:  # the reply stops where the daemon would stop it
            cut_ms = barge_ms + talkover_ms + playout_ms
            cut = reply.copy()
            cut[onset + int(cut_ms * RATE_HZ / 1000) :] = 0.0
            ref_cut, over_cut = played(cut, delay, floor, near)
            _, wer_cut = heard_wer(_cancel(over_cut, ref_cut))
        trial = EchoTrial(
            delay_ms=round(1000 * delay / RATE_HZ),
            false_barge_in_aec=bool(_vad_starts(_cancel(alone, ref))),
            false_barge_in_raw=bool(_vad_starts(alone)),
            barge_in_ms_aec=barge_ms,
            barge_in_ms_raw=_barge_ms(_vad_starts(over), onset),
            wer_aec=wer_aec,
            wer_clean=heard_wer(near)[1],
            reply_cut_ms=cut_ms,
            wer_aec_reply_cut=wer_cut,
        )
        trials.append(trial)
        print(f"  echo {k:2d} {trial} | {heard!r}", flush=True)
    return trials


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the false-wake audio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the trials here")
    ap.add_argument("--peaks", action="store_true", help="only print each wake trial's peak probability")
    ap.add_argument("--echo-only", action="store_true", help="only the echo-cancellation part")
    ap.add_argument(
        "--playout-ms",
        type=float,
        default=100.0,
        help="audio already queued in the device when the reply is cut (its output buffer)",
    )
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    load_before = os.getloadavg()
    voices = Voices()
    questions = json.loads((ROOT / "edge_rtgi/bench/data/voice_questions.json").read_text())
    sentences = (ROOT / "tests/data/sentences_en.txt").read_text().splitlines()
    questions = [q[0].upper() + q[1:] + "?" for q in questions]
    if args.peaks:
        wake_peaks(voices, rng, questions)
        return 0

    wake: list[WakeTrial] = []
    false: list = []
    audio_s, wake_cpu_s, n_utts = 0.0, 0.0, 0
    if not args.echo_only:
        print("wake words:", flush=True)
        wake = bench_wake(voices, rng, questions)
        print("false wakes:", flush=True)
        false, audio_s, wake_cpu_s, n_utts = bench_false_wakes(
            voices, rng, sentences + questions, args.minutes
        )
    print("echo cancellation:", flush=True)
    echo = bench_echo(voices, rng, sentences, questions, args.playout_ms)
    load_after = os.getloadavg()

    if wake:
        lat = [t.latency_ms for t in wake if t.latency_ms is not None]
        print("\n== wake words ==")
        for word in WAKE_TEXTS:
            mine = [t for t in wake if t.word == word]
            print(f"{word:12s} detected {sum(t.detected for t in mine)}/{len(mine)}")
        for family in ("piper", "espeak"):
            mine = [t for t in wake if t.voice.startswith(family)]
            print(f"{family:12s} detected {sum(t.detected for t in mine)}/{len(mine)}")
        print(
            f"all          detected {sum(t.detected for t in wake)}/{len(wake)}"
            f" ({100 * len(lat) / len(wake):.1f} %)"
        )
        if lat:
            q = statistics.quantiles(lat, n=10) if len(lat) > 1 else lat
            print(
                f"latency after the end of the word: median {statistics.median(lat):.0f} ms,"
                f" p90 {q[-1]:.0f} ms"
            )
        print(f"false wakes: {len(false)} in {audio_s / 60:.1f} min ({n_utts} utterances) {false}")
        print(
            f"detector CPU: {wake_cpu_s:.1f} s for {audio_s:.0f} s of audio, 4 words"
            f" ({wake_cpu_s / audio_s:.3f} x real time)"
        )
    print("\n== echo cancellation (20 replies, -6 dB, 50-150 ms delay) ==")
    print(
        f"false barge-ins: with AEC {sum(t.false_barge_in_aec for t in echo)}/{len(echo)}, "
        f"without {sum(t.false_barge_in_raw for t in echo)}/{len(echo)}"
    )
    fast = [t for t in echo if t.barge_in_ms_aec is not None and t.barge_in_ms_aec <= 300]
    ms = [t.barge_in_ms_aec for t in echo if t.barge_in_ms_aec is not None]
    print(
        f"user barge-in within 300 ms with AEC: {len(fast)}/{len(echo)}"
        f" (median {statistics.median(ms) if ms else float('nan'):.0f} ms)"
    )
    print(
        f"ASR WER of the user's question: after AEC {statistics.mean(t.wer_aec for t in echo):.3f}, "
        f"clean {statistics.mean(t.wer_clean for t in echo):.3f} (mean over {len(echo)})"
    )
    cut = [t for t in echo if t.wer_aec_reply_cut is not None]
    if cut:
        after_ms = (cut[0].reply_cut_ms or 0.0) - (cut[0].barge_in_ms_aec or 0.0)
        wer_cut = statistics.mean(t.wer_aec_reply_cut or 0.0 for t in cut)
        print(
            f"  with the reply cut at the barge-in (+{after_ms:.0f} ms after the speech start):"
            f" after AEC {wer_cut:.3f}, the same trials without the cut"
            f" {statistics.mean(t.wer_aec for t in cut):.3f} (mean over {len(cut)})"
        )
    print(f"load average: before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "wake": [asdict(t) for t in wake],
                    "false_wakes": false,
                    "false_audio_s": audio_s,
                    "echo": [asdict(t) for t in echo],
                    "load": [load_before, load_after],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
