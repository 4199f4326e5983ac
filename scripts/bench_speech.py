#!/usr/bin/env python
"""Speech benchmark: streaming ASR latency and WER against one-shot whisper, TTS first audio and RTF.

    .venv/bin/python scripts/bench_speech.py [--runs 1] [--out bench_speech.md]

ASR. The project sentences (tests/data/sentences_en.txt) are spoken by the Piper voice, then
fed to an ``AsrSession`` truly in real time (20 ms chunks, paced by the wall clock, 0.5 s of
silence before and 1.5 s after). For each file we record the wall-clock moment the last
sample of speech was fed, the moment the endpoint fired and the moment the final transcript
arrived. The baseline, in the same run on the same audio: the same VAD endpoint, then one
faster-whisper ``transcribe`` of the whole utterance with the options of our final decode
(beam 5, faster-whisper's default),
which is what a non-streaming recogniser has to do once speech has ended. WER of both
paths is computed with jiwer's standard normalisation.

TTS. Time to first audio and real-time factor (synthesis time / audio time) for Piper and
espeak-ng on two-sentence texts.

Benchmarks never assert anything; they print medians, p95 and the number of runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_rtgi.asr import AsrConfig, AsrSession, FinalTranscript, SpeechEnded, WhisperAsr  # noqa: E402
from edge_rtgi.asr.evaluation import word_error_rate  # noqa: E402
from edge_rtgi.audio import resample  # noqa: E402
from edge_rtgi.tts import make_tts  # noqa: E402

SR = 16000
LEAD_S, TAIL_S, CHUNK_MS = 0.5, 1.5, 20


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def speech_end_s(x: np.ndarray, rate_hz: int = SR, floor_db: float = -40.0) -> float:
    """End of the last 10 ms frame louder than ``floor_db`` relative to the loudest frame."""
    frame = rate_hz // 100
    n = len(x) // frame
    energy = np.sqrt(np.mean(x[: n * frame].reshape(n, frame) ** 2, axis=1) + 1e-12)
    loud = np.nonzero(20 * np.log10(energy / energy.max()) > floor_db)[0]
    return float((loud[-1] + 1) * frame / rate_hz) if len(loud) else 0.0


async def stream_realtime(asr: WhisperAsr, audio: np.ndarray) -> dict:
    """Feed ``audio`` paced by the wall clock; return the final text and wall-clock marks."""
    session = AsrSession(asr)
    step = SR * CHUNK_MS // 1000
    marks: dict = {"finals": []}

    async def feed() -> None:
        start = time.monotonic()
        marks["start"] = start
        for i in range(0, len(audio), step):
            delay = start + (i + step) / SR - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            session.feed(audio[i : i + step])
        await session.close()

    feeder = asyncio.create_task(feed())
    async for event in session:
        if isinstance(event, FinalTranscript):
            marks["finals"].append(event)
        elif isinstance(event, SpeechEnded):
            marks.setdefault("ended", event)
    await feeder
    return marks


def bench_asr(asr: WhisperAsr, corpus: list[tuple[str, np.ndarray]], runs: int) -> dict:
    rows = {
        "stream_eos_ms": [],
        "stream_endpoint_ms": [],
        "oneshot_eos_ms": [],
        "oneshot_decode_ms": [],
        "final_decode_ms": [],
        "stream_hyps": [],
        "oneshot_hyps": [],
        "refs": [],
        "lag_ms": [],
    }
    for run in range(runs):
        for i, (text, x) in enumerate(corpus):
            audio = np.concatenate(
                [np.zeros(int(LEAD_S * SR), np.float32), x, np.zeros(int(TAIL_S * SR), np.float32)]
            )
            marks = asyncio.run(stream_realtime(asr, audio))
            if not marks["finals"]:
                print(f"  run {run} file {i}: no final transcript", file=sys.stderr)
                continue
            final = marks["finals"][-1]
            eos_wall = marks["start"] + LEAD_S + speech_end_s(x)
            endpoint_wall = marks["start"] + final.endpoint_audio_s
            rows["stream_eos_ms"].append((final.t_s - eos_wall) * 1000)
            rows["stream_endpoint_ms"].append((final.t_s - endpoint_wall) * 1000)
            rows["final_decode_ms"].append(final.final_decode_ms)
            rows["stream_hyps"].append(" ".join(f.text for f in marks["finals"]))
            # Baseline: the same endpoint, then one decode of the whole utterance.
            utt = audio[int(final.start_audio_s * SR) : int((final.speech_end_audio_s + 0.2) * SR)]
            hyp = asr.transcribe(utt, beam_size=asr.config.final_beam_size)
            vad_wait_ms = (final.endpoint_audio_s - (LEAD_S + speech_end_s(x))) * 1000
            rows["oneshot_decode_ms"].append(hyp.decode_ms)
            rows["oneshot_eos_ms"].append(vad_wait_ms + hyp.decode_ms)
            rows["oneshot_hyps"].append(hyp.text)
            rows["refs"].append(text)
            print(
                f"  run {run} file {i:2d}: stream {rows['stream_eos_ms'][-1]:7.0f} ms, one-shot "
                f"{rows['oneshot_eos_ms'][-1]:7.0f} ms | {rows['stream_hyps'][-1]}",
                file=sys.stderr,
            )
    return rows


def bench_tts(name: str, texts: list[str]) -> dict:
    engine = make_tts(name)
    list(engine.synthesize_stream("Warm up."))
    ttfa, rtf = [], []
    for text in texts:
        t0 = time.perf_counter()
        first, n = None, 0
        for chunk in engine.synthesize_stream(text):
            if first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
        total = time.perf_counter() - t0
        ttfa.append(first * 1000)
        rtf.append(total / (n / engine.sample_rate_hz))
    return {"ttfa_ms": ttfa, "rtf": rtf}


def report(asr_rows: dict, tts: dict[str, dict], runs: int, n_files: int, threads: int) -> str:
    s, o = asr_rows["stream_eos_ms"], asr_rows["oneshot_eos_ms"]
    wer_s = word_error_rate(asr_rows["refs"], asr_rows["stream_hyps"])
    wer_o = word_error_rate(asr_rows["refs"], asr_rows["oneshot_hyps"])
    load = os.getloadavg()[0]
    lines = [
        "# Speech benchmark",
        "",
        f"Machine: {os.cpu_count()} CPU cores, whisper tiny.en int8 with {threads} threads; load average "
        f"{load:.1f} at the end (other jobs shared the CPU when it is above the core count).",
        f"ASR: {n_files} Piper-spoken sentences x {runs} run(s) = {len(s)} utterances, fed in real time "
        f"({CHUNK_MS} ms chunks), VAD min_silence 500 ms.",
        "",
        "| end of speech -> final transcript | median ms | p95 ms |",
        "|---|---|---|",
        f"| streaming (LocalAgreement + speculative final) | {statistics.median(s):.0f} | {pct(s, 95):.0f} |",
        "| one-shot faster-whisper (beam 5) after the same endpoint "
        f"| {statistics.median(o):.0f} | {pct(o, 95):.0f} |",
        f"| streaming, from the endpoint only | {statistics.median(asr_rows['stream_endpoint_ms']):.0f} | "
        f"{pct(asr_rows['stream_endpoint_ms'], 95):.0f} |",
        f"| one-shot decode alone | {statistics.median(asr_rows['oneshot_decode_ms']):.0f} | "
        f"{pct(asr_rows['oneshot_decode_ms'], 95):.0f} |",
        "",
        f"Streaming / one-shot median latency: {statistics.median(s) / statistics.median(o):.2f}x. "
        f"Finals that reused the speculative decode: "
        f"{sum(1 for d in asr_rows['final_decode_ms'] if d == 0)}/{len(s)}.",
        f"WER (jiwer standard normalisation): streaming {wer_s:.2%}, one-shot {wer_o:.2%}.",
        "",
        "| TTS (two-sentence texts) | runs | time to first audio median ms | p95 ms | RTF median | RTF p95 |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in tts.items():
        lines.append(
            f"| {name} | {len(r['ttfa_ms'])} | {statistics.median(r['ttfa_ms']):.0f} | "
            f"{pct(r['ttfa_ms'], 95):.0f} | {statistics.median(r['rtf']):.3f} | {pct(r['rtf'], 95):.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="passes over the sentences (default 1)")
    ap.add_argument("--files", type=int, default=None, help="use only the first N sentences")
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--out", default="bench_speech.md", help="markdown summary path")
    args = ap.parse_args()

    sentences = [
        s.strip() for s in (ROOT / "tests/data/sentences_en.txt").read_text().splitlines() if s.strip()
    ]
    sentences = sentences[: args.files] if args.files else sentences
    voice = make_tts("piper-en_US-joe-medium")
    corpus = []
    for text in sentences:
        pcm = np.concatenate(list(voice.synthesize_stream(text)))
        corpus.append((text, resample(pcm.astype(np.float32) / 32768.0, voice.sample_rate_hz, SR)))
    asr = WhisperAsr(AsrConfig(model="whisper-tiny.en", cpu_threads=args.cpu_threads))
    asr.transcribe(corpus[0][1])  # warm-up
    print("ASR (real time)...", file=sys.stderr)
    asr_rows = bench_asr(asr, corpus, args.runs)
    pairs = [" ".join(sentences[i : i + 2]) for i in range(0, len(sentences), 2)]
    print("TTS...", file=sys.stderr)
    tts = {
        "piper-en_US-joe-medium": bench_tts("piper-en_US-joe-medium", pairs),
        "espeak-ng (en-us)": bench_tts("espeak:en-us", pairs),
    }
    text = report(asr_rows, tts, args.runs, len(corpus), args.cpu_threads)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
