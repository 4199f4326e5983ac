"""Helpers for the daemon tests: a recording native-protocol client and Piper-voiced WAVs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request

import jiwer
import numpy as np
from websockets.asyncio.client import connect

from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample

EVENT_TIMEOUT_S = 180.0


_NUMBERS = dict(enumerate("zero one two three four five six seven eight nine ten eleven twelve".split()))


def norm(text: str) -> str:
    """Lower case, no punctuation, small numbers as words ("8" and "eight" are the same word)."""
    words = jiwer.RemovePunctuation()(text.lower()).split()
    return " ".join(_NUMBERS.get(int(w), w) if w.isdigit() else w for w in words)


def wer(reference: str, hypothesis: str) -> float:
    return jiwer.wer(norm(reference), norm(hypothesis))


def steady_voice(voice):
    """``voice`` (a Piper voice) with its prosody noise off, so that a test's input speech is the
    same audio on every run. Piper samples that noise on every call, and a random rendering now
    and then makes tiny.en mishear a word (one clean-clone run heard "public column base" for
    "public holidays"); tests of the audio path should not depend on that draw."""
    voice.config = dataclasses.replace(voice.config, noise_scale=0.0, noise_w=0.0)
    return voice


def steady_clips(texts: list[str], voice_name: str = "piper-en_US-joe-medium") -> list[np.ndarray]:
    """Each of ``texts`` spoken by ``steady_voice`` (the same audio every run), as float32 16 kHz."""
    from edge_rtgi.tts import make_tts

    voice = steady_voice(make_tts(voice_name))
    return [
        resample(
            pcm16_to_float32(np.concatenate(list(voice.synthesize_stream(text)))), voice.sample_rate_hz, 16000
        )
        for text in texts
    ]


def speak_16k(voice, text: str, lead_s: float = 0.3, tail_s: float = 1.0) -> np.ndarray:
    """``text`` spoken by a real TTS voice, as int16 PCM at 16 kHz with silence around it."""
    pcm = np.concatenate(list(voice.synthesize_stream(text)))
    audio = resample(pcm16_to_float32(pcm), voice.sample_rate_hz, 16000)
    audio = np.concatenate(
        [np.zeros(int(lead_s * 16000), np.float32), audio, np.zeros(int(tail_s * 16000), np.float32)]
    )
    return float32_to_pcm16(audio)


def transcribe(whisper, pcm: np.ndarray, rate_hz: int) -> str:
    return whisper.transcribe(resample(pcm16_to_float32(pcm), rate_hz, 16000)).text


async def http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    """A plain HTTP GET on a worker thread (the daemon runs on this test's event loop)."""
    return await asyncio.to_thread(_http_get, port, path, headers)


def _http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class NativeClient:
    """Records every server message as (head, payload) in arrival order."""

    def __init__(self, ws):
        self.ws = ws
        self.messages: list[tuple[dict, bytes | None]] = []
        self.arrival: list[float] = []  # time.monotonic() when each message arrived
        self._changed = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, port: int, query: str = "", **kwargs) -> NativeClient:
        ws = await connect(f"ws://127.0.0.1:{port}/v1/native{query}", max_size=1 << 22, **kwargs)
        return cls(ws)

    async def _read(self) -> None:
        async for msg in self.ws:
            if isinstance(msg, bytes):
                head, _ = self.messages[-1]
                assert head["type"] == "response.audio" and head["num_bytes"] == len(msg)
                self.messages[-1] = (head, msg)
            else:
                self.messages.append((json.loads(msg), None))
                self.arrival.append(time.monotonic())
            async with self._changed:
                self._changed.notify_all()

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    async def stream(self, pcm: np.ndarray, chunk_ms: int = 20, speed: float = 1.0) -> None:
        """Send PCM in binary frames, paced at ``speed`` x real time."""
        step = 16 * chunk_ms
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(0, len(pcm), step):
            await self.ws.send(pcm[i : i + step].astype("<i2").tobytes())
            delay = start + (i + step) / 16000 / speed - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)

    def of(self, kind: str) -> list[dict]:
        return [h for h, _ in self.messages if h["type"] == kind]

    async def wait_for(self, predicate, timeout: float = EVENT_TIMEOUT_S) -> dict:
        """The first recorded message head satisfying ``predicate`` (waits for it)."""

        async def find():
            async with self._changed:
                while True:
                    for head, _ in self.messages:
                        if predicate(head):
                            return head
                    if self._reader.done():
                        raise AssertionError(f"connection ended; got {[h['type'] for h, _ in self.messages]}")
                    await self._changed.wait()

        return await asyncio.wait_for(find(), timeout)

    async def wait_type(self, kind: str, timeout: float = EVENT_TIMEOUT_S, **fields) -> dict:
        return await self.wait_for(
            lambda h: h["type"] == kind and all(h.get(k) == v for k, v in fields.items()), timeout
        )

    def audio(self, response_id: str) -> tuple[np.ndarray, int]:
        chunks = [
            (np.frombuffer(p, "<i2"), h["sample_rate_hz"])
            for h, p in self.messages
            if h["type"] == "response.audio" and h["response_id"] == response_id and p is not None
        ]
        if not chunks:
            return np.zeros(0, np.int16), 0
        return np.concatenate([c for c, _ in chunks]), chunks[0][1]

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


def aborted_requests(metrics_text: str) -> float:
    """Engine requests finished by abort, read from the daemon's /metrics text."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith("edge_rtgi_llm_requests_total{") and 'finish_reason="abort"' in line
    )
