#!/usr/bin/env python
"""Voice-to-voice latency of the daemon: end of user speech -> first reply audio byte.

Each utterance (a question from edge_rtgi/bench/data/voice_questions.json, spoken by the
Piper voice) is streamed at real time over a loopback WebSocket to an in-process daemon
running the voice-assistant pipeline (silero VAD + whisper tiny.en + SmolLM2-135M +
Piper). The client knows exactly when it sent the last speech sample, so its
voice-to-voice time is measured on its own clock, up to the first ``response.audio``
frame received. The server's per-turn parts are reported beside it:

    endpointing (silence until VAD ends the turn), ASR final, LLM TTFT, first clause,
    TTS first chunk.

Baseline, measured in the same run on the same models and utterances: a non-streaming
cascade (one-shot whisper on the utterance, the whole LLM reply, then the whole reply
synthesised), timed stage by stage, plus the same endpointing delay. The report prints
medians, p95 and the ratio streaming / baseline.

    .venv/bin/python scripts/bench_voice.py --utterances 20 [--out bench-voice.json] [--report bench-voice.md]

``--report`` writes a Markdown section (table of medians and p95 with the number of
utterances, the load average sampled during the run, the commit) for docs/daemon.md.
``--no-baseline`` skips the non-streaming cascade (quicker while iterating).

``--speakers 1,2,4,8`` measures many people at once instead (issue 27): in each round N
sessions speak at the same moment (their speech ends together) or staggered (each end moved
by a random 0-2 s), ``--rounds`` times each, against daemons with the shared ASR engine and
with the old per-session ASR (``asr: shared: false``), both running in this process, the order
alternating per round. It prints p50/p95 of voice-to-voice and its parts per mode, speaker
count and arrival, and the streaming WER of each mode's transcripts. ``--tts-concurrency
1,4,8`` measures Piper's first-chunk latency with that many replies synthesised at once.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_voice.py --speakers 1,2,4,8 --rounds 3

``--against PATH`` compares two checkouts instead, in one sitting: this one and PATH (for
example the commit before a change, from ``git worktree add``) each run ``edge-rtgi serve`` as
a child process on the same models, and every utterance is played to both, the order
alternating from one utterance to the next. It prints each daemon's medians and the median of
the per-utterance ratios this / other, which the turn-to-turn swings of a loaded machine
disturb far less than two separate runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample  # noqa: E402
from tests.integration.native_client import NativeClient  # noqa: E402

PARTS = (
    "endpointing_ms",
    "asr_final_ms",
    "llm_ttft_ms",
    "first_clause_ms",
    "tts_first_chunk_ms",
    "voice_to_voice_ms",
)
ASR_SPLIT = ("asr_queue_ms", "asr_decode_ms")  # the ASR final's wait for the shared engine, its decode
LABELS = {
    "client_voice_to_voice_ms": (
        "**voice-to-voice** (client clock: acoustic end of speech -> first reply audio received)"
    ),
    "endpointing_ms": "endpointing (VAD silence until the turn ends)",
    "asr_final_ms": "ASR final (after the endpoint)",
    "llm_ttft_ms": "LLM time to first token (after the final)",
    "first_clause_ms": "first speakable chunk (after the first token)",
    "tts_first_chunk_ms": "TTS first audio (after the first chunk)",
    "voice_to_voice_ms": "voice-to-voice on the server's clock (speech end -> first audio sent)",
}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def start_daemon(engine_threads: int | None = None):
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, DaemonEngineConfig, ServerConfig

    pipes = load_pipelines([builtin_pipelines_dir()])
    engine = DaemonEngineConfig(num_threads=engine_threads)  # the daemon's engine, as `serve` runs it
    daemon = Daemon(
        DaemonConfig(server=ServerConfig(port=0), engine=engine),
        {"voice-assistant": pipes["voice-assistant"]},
        Resources(engine),
    )
    await daemon.resources.prepare(pipes["voice-assistant"])
    await daemon.start()
    return daemon, pipes["voice-assistant"]


def speak(voice, text: str) -> tuple[np.ndarray, int]:
    """(int16 16 kHz PCM with 0.3 s lead and 1.5 s tail silence, index of the last speech sample).

    The last speech sample is the acoustic end of the speech (the last sample above 2 % of the
    clip's peak), not the end of Piper's clip: Piper ends a sentence with 170-250 ms of
    near-silence, which would otherwise be counted as speech and flatter the latency.
    """
    pcm = np.concatenate(list(voice.synthesize_stream(text)))
    audio = resample(pcm16_to_float32(pcm), voice.sample_rate_hz, 16000)
    loud = np.flatnonzero(np.abs(audio) > 0.02 * np.abs(audio).max())
    speech_len = int(loud[-1]) + 1 if len(loud) else len(audio)
    lead, tail = np.zeros(4800, np.float32), np.zeros(24000, np.float32)
    return float32_to_pcm16(np.concatenate([lead, audio, tail])), len(lead) + speech_len


async def one_turn(port: int, pcm: np.ndarray, speech_end: int) -> dict:
    c = await NativeClient.open(port)
    try:
        await c.wait_type("session.created")
        loop = asyncio.get_running_loop()
        sent_speech_end = None
        step, start = 320, loop.time()
        for i in range(0, len(pcm), step):
            await c.ws.send(pcm[i : i + step].astype("<i2").tobytes())
            if sent_speech_end is None and i + step >= speech_end:
                sent_speech_end = time.monotonic()
            delay = start + (i + step) / 16000 - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if c.of("response.audio"):
                break  # the reply started: the rest of the tail silence is not needed
        first_audio = await c.wait_type("response.audio", timeout=120)
        first_audio_t = next(t for t, (h, _) in zip(c.arrival, c.messages, strict=False) if h is first_audio)
        done = await c.wait_type("response.done", timeout=120)
        final = c.of("transcript.final")[0]["text"]
        row = {k: done["stats"].get(k) for k in PARTS}
        row.update({k: done["stats"].get(k) for k in ASR_SPLIT})
        partials = [
            t for t, (h, _) in zip(c.arrival, c.messages, strict=False) if h["type"] == "transcript.partial"
        ]
        row.update(
            client_voice_to_voice_ms=(first_audio_t - sent_speech_end) * 1000.0,
            partials=len(partials),  # live captions the speaker saw before the reply
            transcript=final,
            reply=done["text"],
            status=done["status"],
        )
        return row
    finally:
        await c.close()


def baseline_turn(resources, pipeline, voice_pcm: np.ndarray, speech_end: int, question: str) -> dict:
    """The non-streaming cascade on the same models: each stage waits for the previous one."""
    from edge_rtgi.asr.config import AsrConfig
    from edge_rtgi.llm.sampling import SamplingParams
    from edge_rtgi.pipeline.config import AssistantStageConfig, TtsStageConfig

    asr_cfg = pipeline.stage(AsrConfig)
    assistant = pipeline.stage(AssistantStageConfig)
    whisper = resources.whisper(asr_cfg)
    engine = resources.llm(assistant.model)
    voice = resources.voice(pipeline.stage(TtsStageConfig).voice)
    t0 = time.perf_counter()
    text = whisper.transcribe(pcm16_to_float32(voice_pcm[: speech_end + 3200])).text
    t1 = time.perf_counter()
    messages = [{"role": "system", "content": assistant.system_prompt}, {"role": "user", "content": text}]
    reply = engine.generate(
        [engine.tokenizer.encode_chat(messages)], SamplingParams(max_tokens=assistant.max_reply_tokens)
    )[0].text.strip()
    t2 = time.perf_counter()
    for _ in voice.synthesize_stream(reply or "Okay."):
        pass
    t3 = time.perf_counter()
    return {
        "asr_ms": (t1 - t0) * 1000,
        "llm_ms": (t2 - t1) * 1000,
        "tts_ms": (t3 - t2) * 1000,
        "endpointing_ms": float(asr_cfg.vad.min_silence_ms),
    }


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--utterances", type=int, default=20)
    ap.add_argument("--out", help="write the raw rows and the summary as JSON here")
    ap.add_argument("--report", help="write a Markdown table for docs/daemon.md here")
    ap.add_argument("--no-baseline", action="store_true", help="skip the non-streaming cascade")
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="the LLM engine's torch threads (engine: num_threads); default: all cores",
    )
    ap.add_argument("--against", metavar="PATH", help="another checkout: A/B in one sitting (see above)")
    ap.add_argument("--speakers", help="many at once (issue 27): speaker counts, e.g. 1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3, help="with --speakers: rounds per count and arrival")
    ap.add_argument("--arrivals", default="together,staggered", help="with --speakers")
    ap.add_argument(
        "--asr-modes",
        default="shared,unshared",
        help="with --speakers: ASR engines to compare: shared, shared:B (batch size B) or unshared, "
        "each with @W for encoder_window_s W (30: whisper's own window), then /C for min_chunk_ms C",
    )
    ap.add_argument("--seed", type=int, default=0, help="with --speakers: the staggered arrivals' seed")
    ap.add_argument("--tts-concurrency", help="Piper first-chunk latency at these concurrent replies")
    ap.add_argument(
        "--turn-taking",
        choices=(
            "complete",
            "paused",
            "backchannel",
            "heldout_backchannel",
            "interruption",
            "heldout_complete",
            "heldout_paused",
        ),
        help="semantic end of turn against the silence timer on one part of the turn-taking set (see below)",
    )
    ap.add_argument("--turn-items", metavar="A:B", help="with --turn-taking: a slice of the part's items")
    ap.add_argument(
        "--turn-merge", nargs="+", metavar="JSON", help="summarise --turn-taking --out files together"
    )
    ap.add_argument(
        "--turn-clock",
        choices=("wall", "audio"),
        default="wall",
        help="with --turn-taking: through the daemon at real time (wall), or straight into the "
        "ASR stage's transcriber with every decision made where it is due (audio; see below)",
    )
    ap.add_argument(
        "--turn-modes",
        type=lambda s: tuple(s.split(",")),
        default=TURN_MODES,
        help="with --turn-taking: which of semantic,model-only,silence (and on the audio clock "
        "no-fragment-hold, no-continuation-hold, recheck-<ms>; through the daemon no-talkover-prompt) "
        "to run; speech over a reply runs all but model-only",
    )
    ap.add_argument(
        "--turn-replies",
        action="store_true",
        help="with --turn-taking paused: the daemon replies to each turn (short replies), so the "
        "compute of replies started on a likely final runs while the speech goes on",
    )
    ap.add_argument(
        "--turn-model-cost",
        type=int,
        metavar="N",
        help="time the turn model alone on N decisions (median and p95 ms) and stop",
    )
    args = ap.parse_args()
    if args.turn_model_cost:
        return await asyncio.to_thread(turn_model_cost, args.turn_model_cost)
    if args.turn_merge:
        return merge_turn_results(args.turn_merge, args.out)
    if args.turn_taking and args.turn_clock == "audio":
        return await asyncio.to_thread(run_turn_taking_offline, args)
    if args.turn_taking:
        return await run_turn_taking(args)
    if args.against:
        return await compare(args)
    if args.speakers or args.tts_concurrency:
        return await many_speakers(args)
    questions = json.loads((ROOT / "edge_rtgi" / "bench" / "data" / "voice_questions.json").read_text())
    questions = [questions[i % len(questions)] for i in range(args.utterances)]
    load_start = os.getloadavg()[0]
    print(
        f"bench_voice: starting the daemon (voice-assistant) for {len(questions)} utterances "
        f"({os.cpu_count()} CPUs, load average {load_start:.1f})...",
        flush=True,
    )
    daemon, pipeline = await start_daemon(args.engine_threads)
    from edge_rtgi.pipeline.config import TtsStageConfig

    voice = daemon.resources.voice(pipeline.stage(TtsStageConfig).voice)
    spoken = [speak(voice, q) for q in questions]
    rows = []
    for i, (q, (pcm, end)) in enumerate(zip(questions, spoken, strict=True)):
        row = await one_turn(daemon.port, pcm, end)
        row["load_average_1m"] = os.getloadavg()[0]
        rows.append(row)
        parts = " ".join(f"{k.removesuffix('_ms').split('_')[0]} {_f(row[k]).strip()}" for k in PARTS[:-1])
        print(
            f"  {i + 1:2d} v2v {row['client_voice_to_voice_ms']:6.0f} ms "
            f"({parts}; load {row['load_average_1m']:.1f}) "
            f"| {q!r} -> {row['transcript']!r} -> {row['reply'][:60]!r}",
            flush=True,
        )
    base = (
        []
        if args.no_baseline
        else [
            await asyncio.to_thread(baseline_turn, daemon.resources, pipeline, pcm, end, q)
            for q, (pcm, end) in zip(questions, spoken, strict=True)
        ]
    )
    await daemon.drain(timeout_s=1)
    daemon.resources.close()
    summary = summarize(rows, base, load_start)
    print_summary(summary)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows, "baseline": base}, indent=2))
    if args.report:
        Path(args.report).write_text(markdown_report(summary))
        print(f"wrote {args.report}")
    return 0


def load_questions(count: int) -> list[str]:
    questions = json.loads((ROOT / "edge_rtgi" / "bench" / "data" / "voice_questions.json").read_text())
    return [questions[i % len(questions)] for i in range(count)]


async def compare(args: argparse.Namespace) -> int:
    """This checkout against ``args.against``: each utterance to both daemons, alternating order."""
    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.tts.piper import PiperVoice
    from tests.integration.daemon_process import DaemonProcess

    questions = load_questions(args.utterances)
    daemons = [
        DaemonProcess(ROOT, ["voice-assistant"], "voice-assistant", "this"),
        DaemonProcess(Path(args.against), ["voice-assistant"], "voice-assistant", "other"),
    ]
    rows: dict[str, list[dict]] = {"this": [], "other": []}
    loads = [os.getloadavg()[0]]
    try:
        voice = PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"))
        spoken = [speak(voice, q) for q in questions]
        for d in daemons:
            await asyncio.to_thread(d.wait_ready)
        for i, (pcm, end) in enumerate(spoken):
            for d in daemons if i % 2 == 0 else daemons[::-1]:
                row = await one_turn(d.port, pcm, end)
                row["load_average_1m"] = os.getloadavg()[0]
                loads.append(row["load_average_1m"])
                rows[d.label].append(row)
            this, other = rows["this"][-1], rows["other"][-1]
            a, b = this["client_voice_to_voice_ms"], other["client_voice_to_voice_ms"]
            print(f"  {i + 1:2d} v2v this {a:6.0f} ms, other {b:6.0f} ms (load {loads[-1]:.1f})", flush=True)
    finally:
        for d in daemons:
            d.stop()
    key = "client_voice_to_voice_ms"
    ratios = [a[key] / b[key] for a, b in zip(rows["this"], rows["other"], strict=True)]
    result = {
        "n": len(ratios),
        "commit": _commit(),
        "against": str(args.against),
        "load_average_1m": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "medians": {
            label: {k: statistics.median(r[k] for r in rs if r.get(k) is not None) for k in (key, *PARTS)}
            for label, rs in rows.items()
        },
        "ratio_of_medians": statistics.median(r[key] for r in rows["this"])
        / statistics.median(r[key] for r in rows["other"]),
        "median_of_ratios": statistics.median(ratios),
        "this_faster_in": sum(r < 1 for r in ratios),
    }
    print(
        f"\nvoice-to-voice over {result['n']} utterances, each played to both daemons "
        f"(load average {min(loads):.1f}-{max(loads):.1f}):"
    )
    for label, m in result["medians"].items():
        print(f"  {label:5s} median {m[key]:6.0f} ms   " + ", ".join(f"{k} {m[k]:.0f}" for k in PARTS))
    print(
        f"  this / other: ratio of medians {result['ratio_of_medians']:.3f}, median of per-utterance ratios "
        f"{result['median_of_ratios']:.3f}; this faster in {result['this_faster_in']} of {result['n']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": result, "rows": rows}, indent=2))
    return 0


# ---------------------------------------------------------------- many speakers at once (issue 27)

MANY_KEYS = (
    "client_voice_to_voice_ms",
    "asr_final_ms",
    "asr_queue_ms",
    "asr_decode_ms",
    *PARTS[2:5],
    "partials",
)


def _asr_mode(cfg, mode: str):
    """``cfg`` as ``mode`` says: ``shared``, ``shared:B`` (batch size B) or ``unshared``, each
    with an optional ``@W`` (``encoder_window_s`` W; 30 is whisper's own window) and then an
    optional ``/C`` (``min_chunk_ms`` C, the new speech between partials)."""
    import dataclasses

    mode, _, chunk = mode.partition("/")
    if chunk:
        cfg = dataclasses.replace(cfg, min_chunk_ms=int(chunk))
    engine, _, window = mode.partition("@")
    name, _, batch = engine.partition(":")
    if name not in ("shared", "unshared"):
        raise SystemExit(f"--asr-modes: unknown mode {mode!r}; use shared, shared:B or unshared, then @W")
    if window:
        cfg = dataclasses.replace(cfg, encoder_window_s=float(window))
    if name == "unshared":
        return dataclasses.replace(cfg, shared=False)
    return dataclasses.replace(cfg, shared=True, batch_size=int(batch) if batch else cfg.batch_size)


async def start_mode_daemon(mode: str):
    """An in-process daemon on the voice-assistant pipeline with the ASR of ``mode`` (``_asr_mode``)."""
    import dataclasses

    from edge_rtgi.asr.config import AsrConfig
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, ServerConfig

    base = load_pipelines([builtin_pipelines_dir()])["voice-assistant"]
    stages = tuple(_asr_mode(s, mode) if isinstance(s, AsrConfig) else s for s in base.stages)
    pipeline = dataclasses.replace(base, stages=stages)
    server = ServerConfig(port=0, max_sessions=32)
    config = DaemonConfig(server=server)
    daemon = Daemon(config, {"voice-assistant": pipeline}, Resources(config.engine))
    await daemon.resources.prepare(pipeline)
    await daemon.start()
    return daemon


async def speakers_round(
    port: int, spoken: list[tuple[np.ndarray, int]], offsets_s: list[float]
) -> list[dict]:
    """Every utterance in its own session, the ends of speech ``offsets_s`` after the first."""
    ends_s = [end / 16000 for _, end in spoken]
    starts = [max(ends_s) - e + off for e, off in zip(ends_s, offsets_s, strict=True)]

    async def one(i: int) -> dict:
        await asyncio.sleep(starts[i])
        return await one_turn(port, *spoken[i])

    return list(await asyncio.gather(*(one(i) for i in range(len(spoken)))))


def tts_first_chunk(voice, texts: list[str]) -> list[float]:
    """First-chunk latency (ms) of each text, all synthesised at once on their own threads."""
    import threading

    out: list[float] = [0.0] * len(texts)
    barrier = threading.Barrier(len(texts))

    def run(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        for _ in voice.synthesize_stream(texts[i]):
            out[i] = (time.perf_counter() - t0) * 1000.0
            break

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


async def many_speakers(args: argparse.Namespace) -> int:
    """``--speakers`` / ``--tts-concurrency`` (see the module docstring)."""
    import random

    from edge_rtgi.asr.evaluation import word_error_rate

    rng = random.Random(args.seed)
    questions = load_questions(64)
    loads = [os.getloadavg()[0]]
    result: dict = {"commit": _commit(), "cpus": os.cpu_count(), "rounds": args.rounds, "rows": []}
    modes = [m for m in args.asr_modes.split(",") if m]
    daemons = {m: await start_mode_daemon(m) for m in modes} if args.speakers else {}
    try:
        from edge_rtgi.pipeline.config import TtsStageConfig

        voice_name = "piper-en_US-joe-medium"
        if daemons:
            first = next(iter(daemons.values()))
            voice_name = first.pipelines["voice-assistant"].stage(TtsStageConfig).voice
        from edge_rtgi.pipeline.resources import Resources

        voice = (
            next(iter(daemons.values())).resources.voice(voice_name)
            if daemons
            else Resources().voice(voice_name)
        )
        spoken = {q: speak(voice, q) for q in questions}
        q_next = 0
        for n in [int(x) for x in (args.speakers or "").split(",") if x]:
            for arrival in args.arrivals.split(","):
                for r in range(args.rounds):
                    qs = [questions[(q_next + k) % len(questions)] for k in range(n)]
                    q_next += n
                    offsets = [0.0] * n if arrival == "together" else [rng.uniform(0, 2.0) for _ in range(n)]
                    order = modes if r % 2 == 0 else modes[::-1]
                    for mode in order:
                        rows = await speakers_round(daemons[mode].port, [spoken[q] for q in qs], offsets)
                        loads.append(os.getloadavg()[0])
                        for q, row in zip(qs, rows, strict=True):
                            row.update(mode=mode, speakers=n, arrival=arrival, round=r, question=q)
                            row["load_average_1m"] = loads[-1]
                            result["rows"].append(row)
                        v2v = sorted(row["client_voice_to_voice_ms"] for row in rows)
                        print(
                            f"  {n} {arrival:9s} round {r} {mode:12s} v2v p50 {statistics.median(v2v):6.0f} "
                            f"max {v2v[-1]:6.0f} ms (load {loads[-1]:.1f})",
                            flush=True,
                        )
        if args.tts_concurrency:
            result["tts"] = {}
            for n in [int(x) for x in args.tts_concurrency.split(",") if x]:
                firsts: list[float] = []
                for r in range(args.rounds):
                    firsts += tts_first_chunk(
                        voice, [questions[(r * n + k) % len(questions)] for k in range(n)]
                    )
                loads.append(os.getloadavg()[0])
                result["tts"][n] = {
                    "p50": statistics.median(firsts),
                    "p95": pct(firsts, 0.95),
                    "n": len(firsts),
                }
                print(
                    f"  Piper first chunk, {n} at once: p50 {result['tts'][n]['p50']:.0f} ms, "
                    f"p95 {result['tts'][n]['p95']:.0f} ms (n={len(firsts)}, load {loads[-1]:.1f})",
                    flush=True,
                )
    finally:
        for d in daemons.values():
            await d.drain(timeout_s=1)
            d.resources.close()
    result["load_average_1m"] = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    result["summary"] = many_summary(result["rows"])
    result["wer"] = {
        m: word_error_rate(
            [r["question"] for r in result["rows"] if r["mode"] == m],
            [r["transcript"] for r in result["rows"] if r["mode"] == m],
        )
        for m in modes
    }
    print_many(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


def many_summary(rows: list[dict]) -> list[dict]:
    """p50/p95 of each part per (speakers, arrival, mode)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["speakers"], r["arrival"], r["mode"]), []).append(r)
    out = []
    for (n, arrival, mode), rs in sorted(groups.items()):
        entry: dict = {"speakers": n, "arrival": arrival, "mode": mode, "n": len(rs)}
        for key in MANY_KEYS:
            vals = [r[key] for r in rs if r.get(key) is not None]
            entry[key] = {"p50": statistics.median(vals) if vals else None, "p95": pct(vals, 0.95)}
        out.append(entry)
    return out


def print_many(result: dict) -> None:
    load = result["load_average_1m"]
    print(
        f"\nmany speakers (ms, p50 / p95; load average {load['min']:.1f}-{load['max']:.1f}, "
        f"median {load['median']:.1f}, {result['cpus']} CPUs, commit {result['commit']}):"
    )
    print(
        "| speakers | arrival | ASR | n | voice-to-voice | ASR final | of it queue | of it decode "
        "| LLM TTFT | "
        "first clause | TTS first | partials per turn |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for e in result["summary"]:
        cells = " | ".join(f"{_f(e[k]['p50']).strip()} / {_f(e[k]['p95']).strip()}" for k in MANY_KEYS)
        print(f"| {e['speakers']} | {e['arrival']} | {e['mode']} | {e['n']} | {cells} |")
    for mode, wer in result["wer"].items():
        print(f"streaming WER, {mode}: {100 * wer:.1f} %")


# -- turn taking (issue 23): semantic end of turn against the silence timer -------------------
#
# ``--turn-taking PART`` plays the set in edge_rtgi/bench/data/turn_taking.json through the
# in-process daemon, every item once in each mode, the order rotating from item to item:
# semantic (the pipeline's: the model and the words check), model-only (``text_check``
# off) and the silence timer (``session.update`` turn_detection mode silence); backchannels
# semantic and silence only. Even items are spoken by Piper with its prosody noise off, odd ones by espeak-ng.
#   complete     finished requests: endpointing, voice-to-voice, the model's cost per decision
#                (replies capped at REPLY_TOKENS: only their first audio is timed)
#   paused       a pause of 300-700 ms of silence inside the request: premature cut-offs
#   backchannel  a question, then a backchannel ("mm-hm") 400 ms into the spoken reply: interruptions
#   heldout_backchannel  a second set of backchannels, not used to choose the talkover prompt
#   interruption a question, then a short request that takes the turn ("Stop.", "Wait, what?") 400 ms
#                into the reply: it must cut the reply; how soon after its start it did
#   heldout_complete / heldout_paused  a second set of the same kinds, written before the
#                rule was revised and not used to choose it (checks that the rule carries over)
# ``--turn-items A:B`` takes a slice of the part's items (to keep each locked run short);
# ``--turn-modes semantic,silence`` runs only those arms; ``--turn-merge FILE...`` sums the JSON
# of several runs into one summary. ``--turn-clock audio`` plays the items into the ASR stage's
# transcriber instead of the daemon, each decision made where it is due in the audio (below);
# ``--turn-model-cost N`` times the model alone on N decisions. The mode ``no-talkover-prompt``
# is semantic with speech over a reply decoded without whisper's prompt; ``no-preemptive-reply``
# (through the daemon) semantic with the reply started at the final, not on a likely final, and
# ``silence-no-preemptive-reply`` the same for the silence timer.

# semantic: the pipeline's (model + words check); model-only: the model's verdict alone
TURN_MODES = ("semantic", "model-only", "silence")
TURN_PAUSES_MS = (300, 400, 500, 600, 700)
BACKCHANNEL_OFFSET_S = 0.4  # from the first reply audio received to the backchannel's start
# through the daemon also: semantic with speech over a reply decoded without whisper's prompt,
# and semantic (or the silence timer) with the reply started only at the final (not on a likely final)
DAEMON_MODES = (*TURN_MODES, "no-talkover-prompt", "no-preemptive-reply", "silence-no-preemptive-reply")
# the parts spoken over a reply, and their items in the turn-taking set
OVER_REPLY_PARTS = {
    "backchannel": "backchannels",
    "heldout_backchannel": "heldout_backchannels",
    "interruption": "interruptions",
}
TURN_TAIL_S = 2.0  # silence after an item's speech: more than the semantic cap (1200 ms)
PAUSED_TAIL_S = 1.0  # the paused set commits after this (a turn still open ends then, as one)
REPLY_TOKENS = 20  # complete set: short replies (the first audio is what is timed)


def load_turn_set() -> dict:
    return json.loads((ROOT / "edge_rtgi" / "bench" / "data" / "turn_taking.json").read_text())


def turn_voices() -> list:
    """The input voices, alternating by item: Piper with its prosody noise off (the same audio
    on every run), and espeak-ng. Separate from the daemon's own (random) reply voice."""
    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.tts.espeak import EspeakEngine
    from edge_rtgi.tts.piper import PiperVoice
    from tests.integration.native_client import steady_voice

    return [
        steady_voice(PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"))),
        EspeakEngine("en-us"),
    ]


def say_16k(voice, text: str) -> np.ndarray:
    """``text`` as float32 16 kHz audio, cut after its last sample above 2 % of the peak (the
    acoustic end: Piper and espeak-ng both end in a stretch of near-silence)."""
    pcm = np.concatenate(list(voice.synthesize_stream(text)))
    audio = resample(pcm16_to_float32(pcm), voice.sample_rate_hz, 16000)
    loud = np.flatnonzero(np.abs(audio) > 0.02 * np.abs(audio).max())
    return audio[: int(loud[-1]) + 1] if len(loud) else audio


def say_paused(voice, before: str, after: str, pause_ms: int) -> tuple[np.ndarray, int]:
    """``before``, ``pause_ms`` of digital silence, then ``after``: each piece rendered on its
    own (so the pause sits exactly where the text puts it), trimmed of the synthesiser's own
    leading and trailing near-silence. Returns the audio and where the pause begins."""
    first, second = say_16k(voice, before), say_16k(voice, after)
    loud = np.flatnonzero(np.abs(second) > 0.02 * np.abs(second).max())
    second = second[int(loud[0]) :] if len(loud) else second
    loud = np.flatnonzero(np.abs(first) > 0.02 * np.abs(first).max())
    first = first[int(loud[0]) :] if len(loud) else first
    pause = np.zeros(pause_ms * 16, np.float32)
    return np.concatenate([first, pause, second]), len(first)


def _with_silence(audio: np.ndarray, lead_s: float, tail_s: float) -> np.ndarray:
    z = np.zeros
    return float32_to_pcm16(
        np.concatenate([z(int(lead_s * 16000), np.float32), audio, z(int(tail_s * 16000), np.float32)])
    )


async def _turn_session(port: int, mode: str, **settings) -> NativeClient:
    """A native session with ``mode`` turn detection (and any other settings)."""
    c = await NativeClient.open(port)
    await c.wait_type("session.created")
    update = dict(settings)
    if mode == "silence":
        update["turn_detection"] = {"mode": "silence"}
    elif mode == "silence-no-preemptive-reply":
        update["turn_detection"] = {"mode": "silence", "preemptive_reply": False}
    elif mode == "model-only":
        update["turn_detection"] = {"text_check": False}
    elif _recheck_ms(mode) is not None:
        update["turn_detection"] = {"recheck_ms": _recheck_ms(mode)}
    elif _recheck_ms(mode, "question-recheck-") is not None:
        update["turn_detection"] = {"question_recheck_ms": _recheck_ms(mode, "question-recheck-")}
    elif mode == "no-talkover-prompt":
        update["turn_detection"] = {"talkover_prompt": ""}
    elif mode == "no-preemptive-reply":
        update["turn_detection"] = {"preemptive_reply": False}
    if update:
        await c.send(type="session.update", session=update)
        updated = (await c.wait_type("session.updated", timeout=30))["session"]
        # the effective settings; the turn_detection_status beside them can still be the old one
        # (the ASR stage rebuilds its transcriber after the reply)
        silent = ("silence", None)
        want = {"silence": silent, "silence-no-preemptive-reply": silent, "model-only": (None, False)}.get(
            mode, (None, None)
        )
        got = (updated.get("turn_mode"), updated.get("turn_text_check"))
        unprompted = updated.get("turn_talkover_prompt") == ""
        unpreempted = updated.get("turn_preemptive_reply") is False
        if (
            got != want
            or updated.get("turn_recheck_ms") != _recheck_ms(mode)
            or updated.get("turn_question_recheck_ms") != _recheck_ms(mode, "question-recheck-")
            or unprompted != (mode == "no-talkover-prompt")
            or unpreempted != mode.endswith("no-preemptive-reply")
        ):
            raise RuntimeError(f"asked for {mode} turn detection, the session has {updated}")
    return c


async def _stream_realtime(c: NativeClient, pcm: np.ndarray, until=None) -> float | None:
    """Send ``pcm`` at real time in 20 ms frames; the monotonic time the frame holding sample
    ``until`` went out (None without ``until``)."""
    loop, step = asyncio.get_running_loop(), 320
    start, sent_t = loop.time(), None
    for i in range(0, len(pcm), step):
        await c.ws.send(pcm[i : i + step].astype("<i2").tobytes())
        if until is not None and sent_t is None and i + step >= until:
            sent_t = time.monotonic()
        delay = start + (i + step) / 16000 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
    return sent_t


def _finals(c: NativeClient) -> list[dict]:
    return [h for h in c.of("transcript.final") if h.get("text", "").strip()]


async def turn_complete_item(port: int, mode: str, audio: np.ndarray) -> dict:
    """One finished request: the server's endpointing and turn-decision marks, the same measured
    from the acoustic end of speech, and voice-to-voice on the client's clock."""
    lead_s = 0.3
    pcm = _with_silence(audio, lead_s, TURN_TAIL_S)
    speech_end = int(lead_s * 16000) + len(audio)
    c = await _turn_session(port, mode, max_reply_tokens=REPLY_TOKENS)
    try:
        sent_t = await _stream_realtime_until_reply(c, pcm, speech_end)
        first = await c.wait_type("response.audio", timeout=60)
        first_t = next(t for t, (h, _) in zip(c.arrival, c.messages, strict=False) if h is first)
        done = await c.wait_type("response.done", timeout=60)
        stopped = c.of("input.speech_stopped")
        stats = done.get("stats", {})
        vad_lag_ms = stopped[0]["audio_ms"] - speech_end / 16.0 if stopped else None
        ep = stats.get("endpointing_ms")
        return {
            "mode": mode,
            "endpointing_ms": ep,
            "endpointing_from_acoustic_end_ms": (vad_lag_ms + ep)
            if ep is not None and vad_lag_ms is not None
            else None,
            "vad_end_lag_ms": vad_lag_ms,
            "turn_decision_ms": stats.get("turn_decision_ms"),
            "asr_final_ms": stats.get("asr_final_ms"),
            "client_voice_to_voice_ms": (first_t - sent_t) * 1000.0 if sent_t else None,
            "llm_ttft_ms": stats.get("llm_ttft_ms"),
            "first_clause_ms": stats.get("first_clause_ms"),
            "tts_first_chunk_ms": stats.get("tts_first_chunk_ms"),
            "reply_head_start_ms": stats.get("reply_head_start_ms"),
            "finals": [f["text"] for f in _finals(c)],
            "end_reasons": [f.get("end_reason") for f in _finals(c)],
            "reply": done.get("text", ""),
        }
    finally:
        await c.close()


async def _stream_realtime_until_reply(c: NativeClient, pcm: np.ndarray, speech_end: int) -> float | None:
    """As ``_stream_realtime``, stopping once reply audio arrives (the rest is tail silence)."""
    loop, step = asyncio.get_running_loop(), 320
    start, sent_t = loop.time(), None
    for i in range(0, len(pcm), step):
        await c.ws.send(pcm[i : i + step].astype("<i2").tobytes())
        if sent_t is None and i + step >= speech_end:
            sent_t = time.monotonic()
        delay = start + (i + step) / 16000 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if c.of("response.audio"):
            break
    return sent_t


async def turn_paused_item(port: int, mode: str, audio: np.ndarray, replies: bool = False) -> dict:
    """A request with a pause inside, with replies off (``auto_response`` false: only where the
    turns end matters) unless ``replies`` (short ones: a reply started on a likely final then
    runs during the pause and may slow the decodes that decide it); cut off prematurely when it
    came out as more than one final."""
    settings = {"max_reply_tokens": REPLY_TOKENS} if replies else {"auto_response": False}
    c = await _turn_session(port, mode, **settings)
    try:
        await _stream_realtime(c, _with_silence(audio, 0.3, PAUSED_TAIL_S))
        await c.send(type="input_audio.commit")
        await c.wait_type("input_audio.committed", timeout=60)
        finals = [f["text"] for f in _finals(c)]
        reasons = [f.get("end_reason") for f in _finals(c)]
        return {"mode": mode, "finals": finals, "end_reasons": reasons, "premature": len(finals) > 1}
    finally:
        await c.close()


async def turn_backchannel_item(port: int, mode: str, prompt: np.ndarray, backchannel: np.ndarray) -> dict:
    """A question, then ``backchannel`` (or an interruption) spoken ``BACKCHANNEL_OFFSET_S`` after
    the first reply audio arrives (the client's microphone stays live, silence in between);
    interrupted when the daemon cut the reply, ``cut_after_start_ms`` after the speech began.
    ``over_reply``: the reply's audio lasted past the speech's end (on the real-time playback
    estimate), so a cut was possible."""
    c = await _turn_session(port, mode)
    loop, step = asyncio.get_running_loop(), 320
    lead = np.zeros(4800, np.float32)
    queue = float32_to_pcm16(np.concatenate([lead, prompt]))
    bc = float32_to_pcm16(backchannel)
    silence = np.zeros(step, np.int16)
    try:
        start, i, pos, first_t, bc_at, bc_end_t = loop.time(), 0, 0, None, None, None
        bc_start_t: float | None = None
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            if first_t is None and c.of("response.audio"):
                first_t = now
                bc_at = now + BACKCHANNEL_OFFSET_S
            if pos < len(queue):
                chunk, pos = queue[pos : pos + step], pos + step
            elif bc_at is not None and now >= bc_at and bc_end_t is None:
                queue, pos = bc, 0
                bc_start_t, bc_end_t = now, now + len(bc) / 16000
                continue
            else:
                chunk = silence
            await c.ws.send(chunk.astype("<i2").tobytes())
            i += step
            delay = start + i / 16000 - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if bc_end_t is not None and now > bc_end_t + TURN_TAIL_S:
                break
        created = c.of("response.created")
        rid = created[0]["response_id"] if created else None
        done = await c.wait_type("response.done", timeout=60, response_id=rid) if rid else {}
        cut_t = [
            t
            for (h, _), t in zip(c.messages, c.arrival, strict=True)
            if h["type"] == "response.interrupted" and h.get("response_id") == rid
        ]
        interrupted = bool(cut_t)
        audio, rate = c.audio(rid) if rid else (np.zeros(0, np.int16), 0)
        reply_s = len(audio) / rate if rate else 0.0
        bc_end_after_first_s = (bc_end_t - first_t) if bc_end_t and first_t else None
        return {
            "mode": mode,
            "interrupted": interrupted,
            "status": done.get("status"),
            "over_reply": bc_end_after_first_s is not None
            and (interrupted or reply_s > bc_end_after_first_s),
            "reply_audio_s": reply_s,
            "cut_after_start_ms": round((cut_t[0] - bc_start_t) * 1000) if cut_t and bc_start_t else None,
            "backchannel_finals": [
                (f["text"], bool(f.get("backchannel"))) for f in c.of("transcript.final")[1:]
            ],
        }
    finally:
        await c.close()


def _slice(items: list, spec: str | None) -> list[tuple[int, object]]:
    pairs = list(enumerate(items))
    if not spec:
        return pairs
    a, _, b = spec.partition(":")
    return pairs[int(a or 0) : int(b) if b else None]


def _recheck_ms(mode: str, prefix: str = "recheck-") -> int | None:
    """The <ms> of a ``recheck-<ms>`` mode (semantic with turn_detection recheck_ms <ms>: a
    ``session.update`` through the daemon, the config on the audio clock), else None; with
    ``prefix`` "question-recheck-", of such a mode (``question_recheck_ms``)."""
    ms = mode.removeprefix(prefix)
    return int(ms) if mode.startswith(prefix) and ms.isdigit() else None


async def run_turn_taking(args: argparse.Namespace) -> int:
    """``--turn-taking PART``: each selected item in every mode, rotating which goes first."""
    if not all(_daemon_mode_known(m) for m in args.turn_modes):
        raise SystemExit(
            f"through the daemon --turn-modes takes some of {','.join(DAEMON_MODES)}, "
            "recheck-<ms> and question-recheck-<ms>"
        )
    data = load_turn_set()
    voices = turn_voices()
    load_start = os.getloadavg()[0]
    t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"bench_voice --turn-taking {args.turn_taking}: rendering (load average {load_start:.2f})...",
        flush=True,
    )
    part = args.turn_taking
    if part.endswith("complete"):
        items = [(i, say_16k(voices[i % 2], t), t) for i, t in _slice(data[part], args.turn_items)]
    elif part.endswith("paused"):
        items, kinds = [], {}
        for i, p in _slice(data[part], args.turn_items):
            audio, _ = say_paused(
                voices[i % 2], p["before"], p["after"], TURN_PAUSES_MS[i % len(TURN_PAUSES_MS)]
            )
            items.append((i, audio, f"{p['before']} | {p['after']}"))
            kinds[i] = p["kind"]
    else:
        prompts = data["backchannel_prompts"]
        items = [
            (i, (say_16k(voices[0], prompts[i % len(prompts)]), say_16k(voices[i % 2], t)), t)
            for i, t in _slice(data[OVER_REPLY_PARTS[part]], args.turn_items)
        ]
    daemon, _pipeline = await start_daemon(args.engine_threads)
    rows = []
    try:
        for n, (i, audio, text) in enumerate(items):
            modes = tuple(m for m in args.turn_modes if part not in OVER_REPLY_PARTS or m != "model-only")
            for mode in modes[n % len(modes) :] + modes[: n % len(modes)]:
                if part.endswith("complete"):
                    row = await turn_complete_item(daemon.port, mode, audio)
                elif part.endswith("paused"):
                    row = await turn_paused_item(daemon.port, mode, audio, args.turn_replies)
                else:
                    row = await turn_backchannel_item(daemon.port, mode, *audio)
                if part.endswith("paused"):
                    row["kind"] = kinds[i]
                row.update(
                    item=i,
                    text=text,
                    voice="piper" if i % 2 == 0 else "espeak-ng",
                    load_average_1m=os.getloadavg()[0],
                )
                rows.append(row)
                print(f"  {i:2d} {mode:8s} {_turn_row_line(part, row)} | {text!r}", flush=True)
    finally:
        await daemon.drain(timeout_s=1)
        daemon.resources.close()
    result = _turn_result(args, part, t_start, load_start, rows)
    print_turn_summary(summarize_turns([result]))
    return 0


def _turn_result(
    args: argparse.Namespace, part: str, t_start: str, load_start: float, rows: list[dict], **extra: str
) -> dict:
    """One turn-taking run's record (written to ``--out`` when given)."""
    result = {
        "part": part,
        **extra,
        "items": args.turn_items or "all",
        "replies": args.turn_replies if part.endswith("paused") else True,
        "started": t_start,
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "load_average_1m": {
            "start": load_start,
            "max": max([load_start] + [r["load_average_1m"] for r in rows]),
        },
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def _turn_row_line(part: str, row: dict) -> str:
    if part.endswith("complete"):
        ep, ac = _f(row["endpointing_ms"]).strip(), _f(row["endpointing_from_acoustic_end_ms"]).strip()
        model, v2v = _f(row["turn_decision_ms"]).strip(), _f(row["client_voice_to_voice_ms"]).strip()
        return (
            f"endpointing {ep} ms (from acoustic end {ac}), model {model} ms, v2v {v2v} ms; {row['finals']}"
        )
    if part.endswith("paused"):
        return f"{'CUT' if row['premature'] else 'ok '} {row['finals']}"
    if part == "interruption":
        cut = f"cut after {row['cut_after_start_ms']} ms" if row["interrupted"] else "NOT CUT"
        return f"{cut} (over reply: {row['over_reply']}) {row['backchannel_finals']}"
    return (
        f"{'INTERRUPTED' if row['interrupted'] else 'kept'} (over reply: {row['over_reply']}, "
        f"reply {row['reply_audio_s']:.1f} s) {row['backchannel_finals']}"
    )


def summarize_turns(results: list[dict]) -> dict:
    """Per part and mode: the figures issue 23 asks for, over the rows of all ``results``."""
    out: dict = {"runs": [], "parts": {}}
    for res in results:
        out["runs"].append({k: res[k] for k in ("part", "items", "started", "commit", "load_average_1m")})
        out["parts"].setdefault(res["part"], []).extend(res["rows"])
    summary: dict = {"runs": out["runs"]}
    for part, rows in out["parts"].items():
        for mode in dict.fromkeys(r["mode"] for r in rows):
            rs = [r for r in rows if r["mode"] == mode]
            if part.endswith("complete"):
                s = {"n": len(rs)}
                for key in (
                    "endpointing_ms",
                    "endpointing_from_acoustic_end_ms",
                    "turn_decision_ms",
                    "asr_final_ms",
                    "client_voice_to_voice_ms",
                ):
                    vals = [r[key] for r in rs if r.get(key) is not None]
                    s[key] = {"p50": pct(vals, 0.5), "p95": pct(vals, 0.95), "n": len(vals)} if vals else None
                s["split"] = sum(len(r["finals"]) > 1 for r in rs)
                s["ended_by"] = {
                    reason: sum(r["end_reasons"][:1] == [reason] for r in rs)
                    for reason in sorted({x for r in rs for x in r["end_reasons"][:1]}, key=str)
                }
            elif part.endswith("paused"):
                s = {"n": len(rs), "premature": sum(r["premature"] for r in rs)}
                kinds = sorted({r.get("kind", "") for r in rs})
                s["by_kind"] = {k: sum(r["premature"] for r in rs if r.get("kind") == k) for k in kinds}
            else:
                over = [r for r in rs if r["over_reply"]]
                s = {
                    "n": len(rs),
                    "over_reply": len(over),
                    "interrupted": sum(r["interrupted"] for r in over),
                }
                cut_ms = [r["cut_after_start_ms"] for r in over if r.get("cut_after_start_ms") is not None]
                if cut_ms:
                    s["cut_after_start_ms"] = {
                        "p50": pct(cut_ms, 0.5),
                        "p95": pct(cut_ms, 0.95),
                        "n": len(cut_ms),
                    }
            summary.setdefault(part, {})[mode] = s
    return summary


def print_turn_summary(summary: dict) -> None:
    loads = [r["load_average_1m"] for r in summary["runs"]]
    print(
        f"\nturn taking, {len(loads)} run(s); load average at start/max: "
        + ", ".join(f"{lo['start']:.2f}/{lo['max']:.2f}" for lo in loads)
    )
    for part in [p for p in summary if p.endswith("complete")]:
        for mode, s in summary[part].items():
            print(f"  {part}, {mode} (n={s['n']}, split {s['split']}, first turn ended by {s['ended_by']}):")
            for key, v in s.items():
                if isinstance(v, dict) and "p50" in v:
                    print(f"    {key:34s} p50 {_f(v['p50'])}  p95 {_f(v['p95'])}  (n={v['n']})")
    for part in [p for p in summary if p.endswith("paused")]:
        for mode, s in summary[part].items():
            print(f"  {part}, {mode}: premature cut-offs {s['premature']} of {s['n']}")
    for part in [p for p in summary if p in OVER_REPLY_PARTS]:
        for mode, s in summary[part].items():
            cut = s.get("cut_after_start_ms")
            when = f"; cut after p50 {_f(cut['p50'])} p95 {_f(cut['p95'])} ms" if cut else ""
            print(
                f"  {part}, {mode}: interrupted {s['interrupted']} of {s['over_reply']} "
                f"played over a reply ({s['n']} items){when}"
            )


def merge_turn_results(paths: list[str], out: str | None) -> int:
    summary = summarize_turns([json.loads(Path(p).read_text()) for p in paths])
    print_turn_summary(summary)
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))
    return 0


# -- turn taking on the audio clock ------------------------------------------------------------
#
# ``--turn-taking PART --turn-clock audio`` plays the same rendered items straight into the ASR
# stage's ``StreamingTranscriber`` (built as the voice-assistant pipeline builds it), 20 ms at a
# time, with ``process_iter`` after every chunk and every decode awaited: each decision is made at
# the audio position where it is due, as on a machine with unlimited CPU. Where turns end and
# how much silence that took are then properties of the decision rule alone, not of the load; the
# model's cost and the final's decode time are measured beside them (wall ms, load-dependent).
# Every model decision is logged with its probability, its silence and the words it was checked
# against, so a missed target can be traced to items.

AUDIO_CHUNK = 320  # 20 ms, as the benchmark client sends
# the daemon's three arms, semantic without the holds (the rules before them), and
# "recheck-<ms>": semantic asking again every <ms> after an "unfinished" verdict ("recheck-0": never)
# "no-talkover-prompt": speech over a reply decoded without whisper's prompt (over-reply parts);
# "question-recheck-<ms>": semantic asking again after <ms> only where the words are a question
AUDIO_CLOCK_MODES = (
    *TURN_MODES,
    "no-fragment-hold",
    "no-continuation-hold",
    "recheck-<ms>",
    "no-talkover-prompt",
)


def _recheck_mode(mode: str) -> bool:
    return _recheck_ms(mode) is not None or _recheck_ms(mode, "question-recheck-") is not None


def _audio_clock_mode_known(mode: str) -> bool:
    return mode in AUDIO_CLOCK_MODES or _recheck_mode(mode)


def _daemon_mode_known(mode: str) -> bool:
    return mode in DAEMON_MODES or _recheck_mode(mode)


PROBE_SILENCE_MS = (100, 200, 300, 500, 700, 1000)


def _offline_setup():
    from edge_rtgi.asr.config import AsrConfig
    from edge_rtgi.asr.turn import load_turn_model
    from edge_rtgi.asr.whisper import WhisperAsr
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines

    pipe = load_pipelines([builtin_pipelines_dir()])["voice-assistant"]
    cfg = pipe.stage(AsrConfig)
    whisper = WhisperAsr(dataclasses.replace(cfg, shared=False), num_workers=2)
    model = load_turn_model(cfg.turn_detection.model)
    return cfg, whisper, model


def offline_transcribe(
    cfg, whisper, model, mode: str, audio: np.ndarray, lead_s: float, tail_s: float, over_reply: bool = False
) -> dict:
    """One item through a fresh ``StreamingTranscriber`` in ``mode`` on the audio clock: where
    each turn ended (in audio), why, and every model decision (probability, silence, words).
    ``over_reply``: the speech is decoded as speech over a reply is (with the talkover prompt,
    but in mode ``no-talkover-prompt``)."""
    from edge_rtgi.asr.events import FinalTranscript, SpeechEnded
    from edge_rtgi.asr.streaming import StreamingTranscriber
    from edge_rtgi.asr.turn import SemanticEndpointer
    from edge_rtgi.asr.vad import SileroVad

    turn = cfg.turn_detection
    if mode == "model-only":
        turn = turn.with_overrides(text_check=False)
    elif mode == "no-fragment-hold":
        turn = dataclasses.replace(turn, fragment_hold_ms=0, continuation_hold_ms=0)
    elif mode == "no-continuation-hold":  # the rule before the continuation hold
        turn = dataclasses.replace(turn, continuation_hold_ms=0)
    elif (recheck_ms := _recheck_ms(mode)) is not None:
        turn = dataclasses.replace(turn, recheck_ms=recheck_ms)
    elif (question_ms := _recheck_ms(mode, "question-recheck-")) is not None:
        turn = dataclasses.replace(turn, question_recheck_ms=question_ms)
    elif mode == "silence":
        turn = turn.with_overrides(mode="silence")
    prompt = turn.talkover_prompt if over_reply and mode != "no-talkover-prompt" else ""
    decisions: list[dict] = []
    fed = [0]

    class Recording(SemanticEndpointer):
        """The stage's endpointer, logging what it decided and on what."""

        def decide(self, audio_window, silence_start_index, silence_samples=0):
            d = super().decide(audio_window, silence_start_index, silence_samples)
            self.decided_at = time.perf_counter()
            decisions.append(
                {
                    "silence_start_s": silence_start_index / 16000,
                    "at_s": fed[0] / 16000,
                    "probability": d.probability,
                    "model_complete": d.complete,
                    "model_ms": d.model_ms,
                    # "unfinished" with rechecks on: asked again at this much silence
                    "recheck_at_ms": (
                        None if d.retry_silence_samples is None else d.retry_silence_samples / 16.0
                    ),
                }
            )
            return d

        def check_words(self, decision, text, silence_samples=0):
            d = super().check_words(decision, text, silence_samples)
            # the wait for the speculative final that the words check adds after the model
            wait_ms = (time.perf_counter() - self.decided_at) * 1000.0
            decisions[-1].update(
                text=text,
                unfinished_text=d.unfinished_text,
                # held: the words' hold (fragment or continuation) is longer than the pause so far
                fragment_hold=d.retry_silence_samples is not None,
                hold_ms=None if d.retry_silence_samples is None else d.retry_silence_samples / 16.0,
                words_wait_ms=wait_ms,
            )
            return d

    asr = _TimedDecodes(whisper)
    endpointer = None
    vad_cfg = cfg.vad
    if turn.mode == "semantic":
        endpointer = Recording.from_config(model, turn)
    vad_cfg = dataclasses.replace(vad_cfg, min_silence_ms=turn.silence_ms(cfg.vad.min_silence_ms))
    tr = StreamingTranscriber(asr, dataclasses.replace(cfg, vad=vad_cfg), SileroVad(vad_cfg), endpointer)
    lead = np.zeros(int(lead_s * 16000), np.float32)
    x = np.concatenate([lead, audio, np.zeros(int(tail_s * 16000), np.float32)])
    events = []
    try:
        for i in range(0, len(x), AUDIO_CHUNK):
            tr.insert_audio(x[i : i + AUDIO_CHUNK])
            if prompt and tr.active_utterance_id is not None:  # as the ASR stage gives it
                tr.prompt_utterance(tr.active_utterance_id, prompt)
            fed[0] = min(i + AUDIO_CHUNK, len(x))
            events.extend(tr.process_iter())
        events.extend(tr.finish())
    finally:
        tr.close()
    ended = [e for e in events if isinstance(e, SpeechEnded)]
    finals = [e for e in events if isinstance(e, FinalTranscript) and e.text.strip()]
    return {
        "mode": mode,
        "turns": [
            {
                "speech_end_s": e.speech_end_audio_s,
                "endpoint_s": e.endpoint_audio_s,
                "reason": e.reason,
                "turn_decision_ms": e.turn_decision_ms,
            }
            for e in ended
        ],
        "finals": [f.text for f in finals],
        # wall ms of every beam-search decode (the speculative finals and any final), in order
        "final_decode_ms": [ms for ms, beam in asr.decodes if beam == cfg.final_beam_size],
        "decisions": decisions,
    }


class _TimedDecodes:
    """The whisper model, timing each decode (wall ms) with its beam size; decodes run on the
    transcriber's worker and its speculative-final thread, so the list is appended under a lock."""

    def __init__(self, inner):
        self.inner, self.config, self.multilingual = inner, inner.config, inner.multilingual
        self.decodes: list[tuple[float, int | None]] = []
        self._lock = threading.Lock()

    def transcribe(self, audio, **kwargs):
        t0 = time.perf_counter()
        hyp = self.inner.transcribe(audio, **kwargs)
        with self._lock:
            self.decodes.append(((time.perf_counter() - t0) * 1000.0, kwargs.get("beam_size")))
        return hyp

    def last_timing(self):
        return self.inner.last_timing()

    def detach(self) -> None:
        self.inner.detach()


def probe_probabilities(model, audio: np.ndarray, cut_index: int) -> dict[str, float]:
    """The model's probability with ``PROBE_SILENCE_MS`` of silence after ``audio[:cut_index]``
    (100 ms of lead silence, as the stage's speech pad gives it)."""
    lead = np.zeros(1600, np.float32)
    return {
        str(ms): round(
            model.probability(np.concatenate([lead, audio[:cut_index], np.zeros(ms * 16, np.float32)])), 4
        )
        for ms in PROBE_SILENCE_MS
    }


def run_turn_taking_offline(args: argparse.Namespace) -> int:
    """``--turn-taking PART --turn-clock audio``: each item in every mode on the audio clock.
    Speech over a reply (backchannels, interruptions) is the speech alone, decoded as the stage
    decodes speech over a reply; whether its final would cut one is the outcome."""
    from edge_rtgi.asr.turn import is_backchannel

    data = load_turn_set()
    voices = turn_voices()
    load_start = os.getloadavg()[0]
    t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    part = args.turn_taking
    if not all(_audio_clock_mode_known(m) for m in args.turn_modes):
        known, got = ",".join(AUDIO_CLOCK_MODES), ",".join(args.turn_modes)
        raise SystemExit(f"--turn-modes takes some of {known}, got {got}")
    cfg, whisper, model = _offline_setup()
    lead_s = 0.3
    rows = []
    pairs = _slice(data[OVER_REPLY_PARTS.get(part, part)], args.turn_items)
    for n, (i, item) in enumerate(pairs):
        voice = voices[i % 2]
        if part in OVER_REPLY_PARTS:  # the speech alone: what its final says decides
            audio, cut, text = say_16k(voice, item), None, item
        elif part.endswith("complete"):
            audio, cut, text = say_16k(voice, item), None, item
        else:
            pause_ms = TURN_PAUSES_MS[i % len(TURN_PAUSES_MS)]
            audio, cut = say_paused(voice, item["before"], item["after"], pause_ms)
            text = f"{item['before']} | {item['after']}"
        probe = probe_probabilities(model, audio, cut if cut is not None else len(audio))
        modes = args.turn_modes
        for mode in modes[n % len(modes) :] + modes[: n % len(modes)]:
            over = part in OVER_REPLY_PARTS
            row = offline_transcribe(cfg, whisper, model, mode, audio, lead_s, TURN_TAIL_S, over)
            speech_end_s = lead_s + len(audio) / 16000
            row.update(
                item=i,
                text=text,
                voice="piper" if i % 2 == 0 else "espeak-ng",
                acoustic_end_s=speech_end_s,
                probe=probe,
                load_average_1m=os.getloadavg()[0],
            )
            if over:  # its final would cut a reply (the speech's length aside: these are short)
                row.update(interrupted=not is_backchannel(" ".join(row["finals"])), over_reply=True)
            elif part.endswith("paused"):
                row.update(
                    kind=item["kind"],
                    pause_start_s=lead_s + cut / 16000,
                    pause_ms=TURN_PAUSES_MS[i % len(TURN_PAUSES_MS)],
                    premature=len(row["finals"]) > 1,
                )
            else:
                first = row["turns"][0] if row["turns"] else None
                row["endpointing_audio_ms"] = (
                    1000 * (first["endpoint_s"] - first["speech_end_s"]) if first else None
                )
                row["endpointing_from_acoustic_end_audio_ms"] = (
                    1000 * (first["endpoint_s"] - speech_end_s) if first else None
                )
            rows.append(row)
            print(f"  {i:2d} {mode:10s} {_offline_line(part, row)} | {text!r}", flush=True)
    result = _turn_result(args, part, t_start, load_start, rows, clock="audio")
    print_offline_summary(summarize_offline([result]))
    return 0


def turn_model_cost(decisions: int) -> int:
    """``--turn-model-cost N``: the smart-turn model alone (features + onnxruntime, one thread as
    the stage runs it) on N windows: the complete requests, each ending in 100 ms of silence."""
    from edge_rtgi.asr.config import AsrConfig
    from edge_rtgi.asr.turn import load_turn_model
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines

    load_start = os.getloadavg()[0]
    cfg = load_pipelines([builtin_pipelines_dir()])["voice-assistant"].stage(AsrConfig)
    model = load_turn_model(cfg.turn_detection.model)
    voices, texts = turn_voices(), load_turn_set()["complete"]
    windows = [
        np.concatenate([np.zeros(1600, np.float32), say_16k(voices[i % 2], t), np.zeros(1600, np.float32)])
        for i, t in enumerate(texts[: min(len(texts), decisions)])
    ]
    for w in windows[:3]:  # warm-up, not timed
        model.probability(w)
    ms = []
    for n in range(decisions):
        t0 = time.perf_counter()
        model.probability(windows[n % len(windows)])
        ms.append((time.perf_counter() - t0) * 1000.0)
    load_end = os.getloadavg()[0]
    print(
        f"smart-turn cost per decision over {decisions} decisions: p50 {pct(ms, 0.5):.1f} ms, "
        f"p95 {pct(ms, 0.95):.1f} ms (load average {load_start:.2f} -> {load_end:.2f}, {os.cpu_count()} CPUs)"
    )
    return 0


def _offline_line(part: str, row: dict) -> str:
    ps = " ".join(f"{d['probability']:.2f}" for d in row["decisions"] if d["probability"] is not None)
    reasons = ",".join(t["reason"] for t in row["turns"])
    if part.endswith("paused"):
        return f"{'CUT' if row['premature'] else 'ok '} p=[{ps}] {reasons} {row['finals']}"
    if part in OVER_REPLY_PARTS:
        return f"{'would cut' if row['interrupted'] else 'backchannel'} {row['finals']}"
    return (
        f"endpointing {_f(row['endpointing_audio_ms']).strip()} ms (audio) p=[{ps}] {reasons} {row['finals']}"
    )


def summarize_offline(results: list[dict]) -> dict:
    """Per part and mode, over the rows of all ``results``: cut-offs, audio-clock endpointing,
    the model's cost per decision and the final's decode time (wall ms)."""
    summary: dict = {
        "runs": [
            {k: r[k] for k in ("part", "items", "started", "commit", "load_average_1m")} for r in results
        ]
    }
    rows_by_part: dict[str, list[dict]] = {}
    for res in results:
        rows_by_part.setdefault(res["part"], []).extend(res["rows"])
    for part, rows in rows_by_part.items():
        for mode in dict.fromkeys(r["mode"] for r in rows):
            rs = [r for r in rows if r["mode"] == mode]
            s: dict = {
                "n": len(rs),
                "model_ms": _p50_p95([d["model_ms"] for r in rs for d in r["decisions"]]),
                "final_decode_ms": _p50_p95([ms for r in rs for ms in r["final_decode_ms"]]),
                "words_wait_ms": _p50_p95(
                    [d["words_wait_ms"] for r in rs for d in r["decisions"] if "words_wait_ms" in d]
                ),
            }
            if part.endswith("paused"):
                s["premature"] = sum(r["premature"] for r in rs)
                s["cut_items"] = [r["item"] for r in rs if r["premature"]]
            elif part in OVER_REPLY_PARTS:
                s["interrupted"] = sum(r["interrupted"] for r in rs)
                s["cut_items"] = [r["item"] for r in rs if r["interrupted"]]
            else:
                for key in ("endpointing_audio_ms", "endpointing_from_acoustic_end_audio_ms"):
                    s[key] = _p50_p95([r[key] for r in rs if r.get(key) is not None])
                s["split"] = sum(len(r["finals"]) > 1 for r in rs)
                s["ended_by"] = {}
                for r in rs:
                    reason = r["turns"][0]["reason"] if r["turns"] else "none"
                    s["ended_by"][reason] = s["ended_by"].get(reason, 0) + 1
            summary.setdefault(part, {})[mode] = s
    return summary


def _p50_p95(vals: list[float]) -> dict:
    return {"p50": pct(vals, 0.5), "p95": pct(vals, 0.95), "n": len(vals)}


def print_offline_summary(summary: dict) -> None:
    print("\nturn taking on the audio clock (decisions where due; costs in wall ms at this load):")
    for part in [p for p in summary if p != "runs"]:
        for mode, s in summary[part].items():
            line = f"  {part}, {mode} (n={s['n']}):"
            if part.endswith("paused"):
                line += f" premature cut-offs {s['premature']} of {s['n']} {s['cut_items']}"
            elif part in OVER_REPLY_PARTS:
                line += f" finals that would cut a reply {s['interrupted']} of {s['n']} {s['cut_items']}"
            else:
                ep, ac = s["endpointing_audio_ms"], s["endpointing_from_acoustic_end_audio_ms"]
                line += (
                    f" endpointing p50 {_f(ep['p50']).strip()} p95 {_f(ep['p95']).strip()} ms"
                    f" (from acoustic end p50 {_f(ac['p50']).strip()}), split {s['split']},"
                    f" ended by {s['ended_by']}"
                )
            m, d, w = s["model_ms"], s["final_decode_ms"], s["words_wait_ms"]
            line += (
                f"; model {_f(m['p50']).strip()}/{_f(m['p95']).strip()} ms (n={m['n']}),"
                f" beam decodes {_f(d['p50']).strip()}/{_f(d['p95']).strip()} ms,"
                f" words-check wait {_f(w['p50']).strip()}/{_f(w['p95']).strip()} ms"
            )
            print(line)


def summarize(rows: list[dict], base: list[dict], load_start: float) -> dict:
    """Medians, p95 and counts of every part, the load average and the baseline."""
    loads = [load_start] + [r["load_average_1m"] for r in rows]
    summary: dict = {
        "n": len(rows),
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "load_average_1m": {"start": load_start, "median": statistics.median(loads), "max": max(loads)},
        "parts": {},
    }
    for key in ("client_voice_to_voice_ms", *PARTS):
        vals = [r[key] for r in rows if r.get(key) is not None]
        summary["parts"][key] = {
            "median": statistics.median(vals) if vals else None,
            "p95": pct(vals, 0.95),
            "n": len(vals),
        }
    if base:
        totals = [b["endpointing_ms"] + b["asr_ms"] + b["llm_ms"] + b["tts_ms"] for b in base]
        summary["baseline"] = {
            k: {"median": statistics.median([b[k] for b in base]), "p95": pct([b[k] for b in base], 0.95)}
            for k in ("asr_ms", "llm_ms", "tts_ms")
        }
        summary["baseline"]["total_ms"] = {"median": statistics.median(totals), "p95": pct(totals, 0.95)}
    return summary


def print_summary(summary: dict) -> None:
    load, cpus = summary["load_average_1m"], summary["cpus"]
    if load["max"] > (cpus or 1):
        print(
            f"\nwarning: the machine was oversubscribed (load average {load['start']:.1f} at the start, "
            f"median {load['median']:.1f}, max {load['max']:.1f} on {cpus} CPUs); latencies are inflated"
        )
    print(
        f"\nvoice-to-voice latency over {summary['n']} utterances (ms; median / p95), "
        f"load average median {load['median']:.1f}:"
    )
    for key, v in summary["parts"].items():
        print(f"  {key:28s} {_f(v['median'])} {_f(v['p95'])}   (n={v['n']})")
    med = summary["parts"]["client_voice_to_voice_ms"]["median"]
    if "baseline" in summary:
        for key, v in summary["baseline"].items():
            print(f"  baseline {key:19s} {_f(v['median'])} {_f(v['p95'])}")
        ratio = med / summary["baseline"]["total_ms"]["median"] if med else float("nan")
        print(f"\nstreaming / non-streaming median ratio: {ratio:.2f}")
    print(f"target: median voice-to-voice <= 1000 ms; got {_f(med).strip()} ms")


def markdown_report(summary: dict) -> str:
    """A section for docs/daemon.md: the table plus the conditions it was measured in."""
    load = summary["load_average_1m"]
    lines = [
        f"Measured with `scripts/bench_voice.py --utterances {summary['n']}` at commit {summary['commit']} "
        f"on {summary['cpus']} CPUs; load average (1 min) {load['start']:.1f} at the start, "
        f"median {load['median']:.1f}, max {load['max']:.1f} during the run. One fresh session per "
        "utterance; parts are server-side marks, each measured from the end of the previous part.",
        "",
        "| part (ms) | median | p95 | n |",
        "|---|---|---|---|",
    ]
    for key, v in summary["parts"].items():
        lines.append(f"| {LABELS[key]} | {_f(v['median']).strip()} | {_f(v['p95']).strip()} | {v['n']} |")
    if "baseline" in summary:
        b = summary["baseline"]["total_ms"]
        lines.append(
            f"| non-streaming cascade, same run (one-shot whisper + whole reply + whole synthesis) | "
            f"{_f(b['median']).strip()} | {_f(b['p95']).strip()} | {summary['n']} |"
        )
    return "\n".join(lines) + "\n"


def _f(value: float | None) -> str:
    return f"{value:8.0f}" if value is not None and value == value else "     n/a"


def _commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
