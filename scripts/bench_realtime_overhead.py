"""What the OpenAI Realtime adapter costs over the native protocol, on one daemon, in one run.

Both protocols run the same turn on the same in-process daemon: a Piper-voiced question is
sent, committed by hand, and a response is requested. For each turn it measures, from the
commit: the final transcript, the first reply text, the first reply audio and the end of the
response. Turns alternate between the protocols so drift in machine load hits both alike.
Prints medians over ``--turns`` turns per protocol and the ratio realtime / native.

    .venv/bin/python scripts/bench_realtime_overhead.py --turns 5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time

import numpy as np
from openai import AsyncOpenAI
from websockets.asyncio.client import connect

from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample
from edge_rtgi.catalog import resolve_model

QUESTION = "What is the capital of France?"
MARKS = ("transcript_ms", "first_text_ms", "first_audio_ms", "done_ms")


def speech(rate_hz: int) -> np.ndarray:
    from edge_rtgi.tts.piper import PiperVoice

    voice = PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"), intra_op_threads=1)
    pcm = np.concatenate(list(voice.synthesize_stream(QUESTION)))
    audio = resample(pcm16_to_float32(pcm), voice.sample_rate_hz, rate_hz)
    return float32_to_pcm16(np.concatenate([np.zeros(rate_hz // 5, np.float32), audio]))


def _mark(marks: dict, key: str, t0: float) -> None:
    marks.setdefault(key, (time.perf_counter() - t0) * 1000.0)


async def native_turn(port: int, pcm16k: np.ndarray) -> dict:
    async with connect(f"ws://127.0.0.1:{port}/v1/native", max_size=1 << 22) as ws:
        await ws.send(
            json.dumps(
                {"type": "session.update", "session": {"turn_detection": False, "auto_response": False}}
            )
        )
        for i in range(0, len(pcm16k), 3200):
            await ws.send(pcm16k[i : i + 3200].astype("<i2").tobytes())
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "input_audio.commit"}))
        marks: dict = {}
        async for msg in ws:
            if isinstance(msg, bytes):
                continue
            kind = json.loads(msg)["type"]
            if kind == "error":
                raise RuntimeError(f"native error: {msg}")
            if kind == "transcript.final":
                _mark(marks, "transcript_ms", t0)
                # the native protocol answers the conversation so far: ask once the turn is in it
                await ws.send(json.dumps({"type": "response.create"}))
            elif kind == "response.text.delta":
                _mark(marks, "first_text_ms", t0)
            elif kind == "response.audio":
                _mark(marks, "first_audio_ms", t0)
            elif kind == "response.done":
                _mark(marks, "done_ms", t0)
                return marks
    raise RuntimeError("native connection ended early")


async def realtime_turn(port: int, pcm24k: np.ndarray) -> dict:
    client = AsyncOpenAI(api_key="local", websocket_base_url=f"ws://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="edge-rtgi") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        for i in range(0, len(pcm24k), 4800):
            await conn.input_audio_buffer.append(
                audio=base64.b64encode(pcm24k[i : i + 4800].tobytes()).decode()
            )
        t0 = time.perf_counter()
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        marks: dict = {}
        async for event in conn:
            if event.type == "error":
                raise RuntimeError(f"realtime error: {event.error}")
            if event.type == "conversation.item.input_audio_transcription.completed":
                _mark(marks, "transcript_ms", t0)
            elif event.type == "response.output_audio_transcript.delta":
                _mark(marks, "first_text_ms", t0)
            elif event.type == "response.output_audio.delta":
                _mark(marks, "first_audio_ms", t0)
            elif event.type == "response.done":
                _mark(marks, "done_ms", t0)
                return marks
    raise RuntimeError("realtime connection ended early")


async def main(turns: int) -> None:
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, ServerConfig

    pipelines = load_pipelines([builtin_pipelines_dir()])
    config = DaemonConfig(server=ServerConfig(port=0))
    daemon = Daemon(config, pipelines, Resources(config.engine))
    await daemon.resources.prepare(pipelines["voice-assistant"])
    await daemon.start()
    pcm16k, pcm24k = speech(16000), speech(24000)
    try:
        await native_turn(daemon.port, pcm16k)  # warm-up, not counted
        await realtime_turn(daemon.port, pcm24k)
        results: dict[str, list[dict]] = {"native": [], "realtime": []}
        for i in range(turns):
            results["native"].append(await asyncio.wait_for(native_turn(daemon.port, pcm16k), 300))
            results["realtime"].append(await asyncio.wait_for(realtime_turn(daemon.port, pcm24k), 300))
            print(
                f"turn {i + 1}/{turns}: native {results['native'][-1]['done_ms']:.0f} ms, "
                f"realtime {results['realtime'][-1]['done_ms']:.0f} ms",
                flush=True,
            )
    finally:
        await daemon.drain(timeout_s=1.0)
    print(f"commit -> event, median of {turns} turns per protocol (ms); same daemon, alternating turns")
    print(f"{'mark':<16}{'native':>10}{'realtime':>10}{'ratio':>8}")
    for mark in MARKS:
        native = statistics.median(r[mark] for r in results["native"])
        realtime = statistics.median(r[mark] for r in results["realtime"])
        print(f"{mark:<16}{native:>10.1f}{realtime:>10.1f}{realtime / native:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    asyncio.run(main(parser.parse_args().turns))
