#!/usr/bin/env python
"""Home Assistant's voice flow against the daemon's Wyoming server, with the ``wyoming``
library's own async TCP client (as Home Assistant's Wyoming integration uses it):

1. ``describe``: the services, models, languages and voices the daemon has loaded;
2. ``detect``: a Piper rendering of "Okay Nabu." followed by a question is streamed until
   the wake word is detected;
3. ``transcribe``: the audio after the detection (the question) -> its transcript;
4. ``handle``: the transcript -> the assistant's answer;
5. ``synthesize``: the answer, streamed as text chunks -> the spoken answer.

Each step is its own connection, as Home Assistant makes them. Run it against a daemon
serving Wyoming (``edge-rtgi serve --wyoming tcp://127.0.0.1:10300``)::

    .venv/bin/python scripts/wyoming_example.py --uri tcp://127.0.0.1:10300

or with no ``--uri``: it starts a daemon in this process first (the voice-assistant-wake
pipeline on the default models) and stops it at the end. ``--out answer.wav`` keeps the
spoken answer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wyoming.asr import Transcribe, Transcript, TranscriptChunk  # noqa: E402
from wyoming.audio import AudioChunk, AudioStart, AudioStop  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.event import Event  # noqa: E402
from wyoming.handle import Handled, HandledChunk  # noqa: E402
from wyoming.info import Describe, Info  # noqa: E402
from wyoming.tts import (  # noqa: E402
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)
from wyoming.wake import Detect, Detection  # noqa: E402

from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample  # noqa: E402

RATE_HZ, WIDTH, CHANNELS = 16000, 2, 1  # what Home Assistant sends
SAMPLES_PER_CHUNK = 1024
TIMEOUT_S = 120.0
WAKE_TEXT = "Okay Nabu."
QUESTION = "What is the capital of France?"


@dataclass
class FlowResult:
    """What each step of the flow returned."""

    info: Info
    wake_word: str | None = None
    wake_timestamp_ms: int | None = None
    transcript: str = ""
    transcript_chunks: list[str] = field(default_factory=list)
    answer: str = ""
    answer_chunks: list[str] = field(default_factory=list)
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))
    audio_rate_hz: int = 0
    step_s: dict[str, float] = field(default_factory=dict)


def spoken_request(voice, wake_text: str = WAKE_TEXT, question: str = QUESTION) -> np.ndarray:
    """The wake word, a short pause, the question: 16 kHz int16, as a microphone hears it."""

    def say(text: str) -> np.ndarray:
        pcm = np.concatenate(list(voice.synthesize_stream(text)))
        return resample(pcm16_to_float32(pcm), voice.sample_rate_hz, RATE_HZ)

    silence = lambda s: np.zeros(int(s * RATE_HZ), np.float32)  # noqa: E731
    return float32_to_pcm16(
        np.concatenate([silence(0.5), say(wake_text), silence(0.4), say(question), silence(1.0)])
    )


async def _read_until(client: AsyncTcpClient, *types: str) -> list[Event]:
    """Every event up to and including the first of ``types``."""
    events: list[Event] = []
    while True:
        event = await asyncio.wait_for(client.read_event(), TIMEOUT_S)
        if event is None:
            raise ConnectionError(f"the server closed the connection; got {[e.type for e in events]}")
        events.append(event)
        if event.type in types:
            return events


def _chunks(pcm: np.ndarray) -> list[AudioChunk]:
    return [
        AudioChunk(
            rate=RATE_HZ, width=WIDTH, channels=CHANNELS, audio=pcm[i : i + SAMPLES_PER_CHUNK].tobytes()
        )
        for i in range(0, len(pcm), SAMPLES_PER_CHUNK)
    ]


async def describe(host: str, port: int) -> Info:
    async with AsyncTcpClient(host, port) as client:
        await client.write_event(Describe().event())
        return Info.from_event((await _read_until(client, "info"))[-1])


async def detect(host: str, port: int, pcm: np.ndarray, name: str = "okay_nabu") -> Detection | None:
    """Stream ``pcm`` until the wake word is heard (Home Assistant stops streaming there)."""
    async with AsyncTcpClient(host, port) as client:
        await client.write_event(Detect(names=[name]).event())
        await client.write_event(AudioStart(rate=RATE_HZ, width=WIDTH, channels=CHANNELS).event())
        reader = asyncio.create_task(_read_until(client, "detection", "not-detected"))
        for chunk in _chunks(pcm):
            if reader.done():
                break
            await client.write_event(chunk.event())
            await asyncio.sleep(0)  # let the detection in
        if not reader.done():
            await client.write_event(AudioStop().event())
        last = (await reader)[-1]
        return Detection.from_event(last) if Detection.is_type(last.type) else None


async def transcribe(host: str, port: int, pcm: np.ndarray) -> tuple[str, list[str]]:
    async with AsyncTcpClient(host, port) as client:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=RATE_HZ, width=WIDTH, channels=CHANNELS).event())
        for chunk in _chunks(pcm):
            await client.write_event(chunk.event())
        await client.write_event(AudioStop().event())
        events = await _read_until(client, "transcript")
    chunks = [TranscriptChunk.from_event(e).text for e in events if TranscriptChunk.is_type(e.type)]
    return Transcript.from_event(events[-1]).text, chunks


async def handle(host: str, port: int, text: str) -> tuple[str, list[str]]:
    async with AsyncTcpClient(host, port) as client:
        await client.write_event(Transcript(text=text, language="en").event())
        events = await _read_until(client, "handled", "not-handled")
    if not Handled.is_type(events[-1].type):
        raise RuntimeError(f"not handled: {events[-1].data}")
    chunks = [HandledChunk.from_event(e).text for e in events if HandledChunk.is_type(e.type)]
    return Handled.from_event(events[-1]).text or "", chunks


async def synthesize(host: str, port: int, text: str, voice: str | None = None) -> tuple[np.ndarray, int]:
    """Streamed text in, as Home Assistant sends an LLM's answer: start, word chunks, the whole
    text for older servers, stop."""
    async with AsyncTcpClient(host, port) as client:
        synth_voice = SynthesizeVoice(name=voice) if voice else None
        await client.write_event(SynthesizeStart(voice=synth_voice).event())
        for word in text.split(" "):
            await client.write_event(SynthesizeChunk(text=word + " ").event())
        await client.write_event(Synthesize(text=text, voice=synth_voice).event())
        await client.write_event(SynthesizeStop().event())
        events = await _read_until(client, SynthesizeStopped().event().type)
    starts = [AudioStart.from_event(e) for e in events if AudioStart.is_type(e.type)]
    audio = [AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type)]
    rate = starts[0].rate if starts else 0
    return np.frombuffer(b"".join(audio), "<i2").astype(np.int16), rate


async def run_flow(host: str, port: int, speech: np.ndarray) -> FlowResult:
    """The whole flow on ``speech`` (wake word, then question, 16 kHz int16)."""
    t0 = time.perf_counter()
    result = FlowResult(info=await describe(host, port))
    t1 = time.perf_counter()
    found = await detect(host, port, speech)
    t2 = time.perf_counter()
    if found is None:
        return dataclasses.replace(result, step_s={"describe": t1 - t0, "detect": t2 - t1})
    result.wake_word, result.wake_timestamp_ms = found.name, found.timestamp
    question = speech[int((found.timestamp or 0) * RATE_HZ / 1000) :]  # what follows the wake word
    result.transcript, result.transcript_chunks = await transcribe(host, port, question)
    t3 = time.perf_counter()
    result.answer, result.answer_chunks = await handle(host, port, result.transcript)
    t4 = time.perf_counter()
    result.audio, result.audio_rate_hz = await synthesize(host, port, result.answer)
    t5 = time.perf_counter()
    result.step_s = {
        "describe": t1 - t0,
        "detect": t2 - t1,
        "transcribe": t3 - t2,
        "handle": t4 - t3,
        "synthesize": t5 - t4,
    }
    return result


def _report(result: FlowResult) -> None:
    info = result.info
    print("services:")
    for kind in ("asr", "tts", "wake", "handle"):
        for program in getattr(info, kind):
            models = getattr(program, "models", None) or getattr(program, "voices", [])
            print(f"  {kind}: " + ", ".join(f"{m.name} ({'/'.join(m.languages)})" for m in models))
    print(f"wake word: {result.wake_word} at {result.wake_timestamp_ms} ms")
    print(f"transcript: {result.transcript!r} (streamed in {len(result.transcript_chunks)} chunks)")
    print(f"answer: {result.answer!r} (streamed in {len(result.answer_chunks)} chunks)")
    if result.audio_rate_hz:
        print(f"spoken answer: {len(result.audio) / result.audio_rate_hz:.1f} s at {result.audio_rate_hz} Hz")
    print("step times: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.step_s.items()))


async def _main(args: argparse.Namespace) -> int:
    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.tts.piper import PiperVoice

    voice = PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"), intra_op_threads=1)
    speech = spoken_request(voice)
    daemon = None
    if args.uri:
        host, _, port = args.uri.removeprefix("tcp://").rpartition(":")
    else:
        daemon = await _start_daemon()
        assert daemon.wyoming is not None
        host, port = "127.0.0.1", str(daemon.wyoming.port)
    try:
        result = await run_flow(host, int(port), speech)
    finally:
        if daemon is not None:
            await daemon.drain(timeout_s=1.0)
            daemon.resources.close()
    _report(result)
    if args.out and result.audio_rate_hz:
        from edge_rtgi.audio.wav import write_wav

        write_wav(args.out, result.audio, result.audio_rate_hz)
        print(f"wrote {args.out}")
    return 0 if result.wake_word and result.transcript and result.answer and len(result.audio) else 1


async def _start_daemon():
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipeline
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, ServerConfig, WyomingConfig

    pipeline = load_pipeline(builtin_pipelines_dir() / "voice-assistant-wake.yaml")
    config = DaemonConfig(
        server=ServerConfig(port=0),
        default_pipeline=pipeline.name,
        wyoming=WyomingConfig(uri="tcp://127.0.0.1:0"),
    )
    print("loading models...", file=sys.stderr, flush=True)
    daemon = Daemon(config, {pipeline.name: pipeline}, Resources(config.engine))
    await daemon.resources.prepare(pipeline)
    await daemon.start()
    return daemon


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", help="tcp://HOST:PORT of a daemon serving Wyoming (default: start one)")
    parser.add_argument("--out", metavar="FILE.wav", help="write the spoken answer here")
    sys.exit(asyncio.run(_main(parser.parse_args())))
