"""The live client behind ``edge-rtgi translate`` and ``edge-rtgi voice``.

One code path for both modes: in-process (a ``Session`` on local models) and
``--connect ws://...`` (a running daemon). Either way the client sees native-protocol
messages, as dicts plus PCM payloads, so the in-process mode exercises the same codec.

The client streams audio (microphone or WAV file), prints captions (partials overwrite
one terminal line; finals and replies get their own lines), plays and/or records the
returned audio, and on end of input commits the turn and waits for the last response.
With echo cancellation (``LiveOutput.playout``), each microphone chunk goes with the audio
the speaker was given meanwhile, so the session removes the device's own voice from it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import numpy as np

from edge_rtgi.audio.aec import PlayoutReference, join_reference
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.server import protocol as P

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

    from edge_rtgi.audio.devices import SpeakerSink
    from edge_rtgi.pipeline.session import Session


@dataclass(frozen=True)
class WireMessage:
    """One server event as the native protocol sends it: the JSON header and, for
    ``response.audio``, the PCM payload that follows it."""

    head: dict[str, Any]
    payload: bytes | None = None


class Transport(Protocol):
    """A native-protocol connection: to a daemon (``WebSocketTransport``) or a local session."""

    async def send_audio(self, pcm: np.ndarray, reference: np.ndarray | None = None) -> None:
        """Microphone PCM; ``reference``: what the speaker played meanwhile (echo_reference)."""
        ...

    async def send(self, event: dict[str, Any]) -> None: ...
    def messages(self) -> AsyncIterator[WireMessage]: ...
    async def close(self) -> None: ...


class InProcessTransport:
    """Drives a local ``Session``; events are encoded to the wire form and decoded back."""

    def __init__(self, session: Session):
        self.session = session

    async def send_audio(self, pcm: np.ndarray, reference: np.ndarray | None = None) -> None:
        await self.session.push_audio(pcm, reference=reference)

    async def send(self, event: dict) -> None:
        kind = event["type"]
        if kind == "input_audio.commit":
            await self.session.commit_audio()
        elif kind == "session.update":
            await self.session.update(event["session"])
        elif kind == "text.input":
            await self.session.add_user_text(event["text"])
        else:
            raise ValueError(f"in-process transport does not send {kind}")

    async def messages(self) -> AsyncIterator[WireMessage]:
        async for event in self.session.events():
            wire = P.encode_server(event, self.session.ms)
            payload = wire[1] if len(wire) > 1 else None
            yield WireMessage(json.loads(wire[0]), payload if isinstance(payload, bytes) else None)

    async def close(self) -> None:
        await self.session.close()


class WebSocketTransport:
    """A native-protocol connection to a daemon."""

    def __init__(self, ws: ClientConnection):
        self.ws = ws

    @classmethod
    async def connect(
        cls, url: str, token: str | None = None, pipeline: str | None = None
    ) -> WebSocketTransport:
        from websockets.asyncio.client import connect

        if pipeline:
            url += ("&" if "?" in url else "?") + f"pipeline={pipeline}"
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            ws = await connect(url, additional_headers=headers, max_size=1 << 22)
        except Exception as exc:  # noqa: BLE001 - connection refused, handshake refused...
            raise EdgeRtgiError(
                f"cannot connect to {url}: {exc}",
                hint="is `edge-rtgi serve` running there? does it need a token?",
            ) from None
        return cls(ws)

    async def send_audio(self, pcm: np.ndarray, reference: np.ndarray | None = None) -> None:
        if reference is not None:  # stereo frames: microphone left, played audio right
            pcm = join_reference(pcm, reference)
        await self.ws.send(pcm.astype("<i2").tobytes())

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def messages(self) -> AsyncIterator[WireMessage]:
        from websockets.exceptions import ConnectionClosed

        try:
            async for msg in self.ws:
                head = json.loads(msg)
                payload = await self.ws.recv() if head.get("type") == "response.audio" else None
                yield WireMessage(head, payload if isinstance(payload, bytes) else None)
        except ConnectionClosed:
            return

    async def close(self) -> None:
        await self.ws.close()


@dataclass
class LiveOutput:
    """What the client shows and keeps: captions to ``out``, audio to a speaker and a buffer."""

    mode: str  # "translate" | "voice"
    out: TextIO = sys.stdout
    speaker: SpeakerSink | None = None
    # what the speaker was given, the echo reference for the microphone (echo cancellation)
    playout: PlayoutReference | None = None
    keep_audio: bool = True
    audio: list[np.ndarray] = field(default_factory=list)
    sample_rate_hz: int | None = None
    finals: list[str] = field(default_factory=list)
    responses: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    open_responses: set[str] = field(default_factory=set)
    playback_end_s: float | None = None  # when the speaker should have played everything
    _partial_shown: bool = False

    def _line(self, text: str) -> None:
        if self._partial_shown:
            self.out.write("\r\033[K" if self.out.isatty() else "\n")
            self._partial_shown = False
        self.out.write(text + "\n")
        self.out.flush()

    def handle(self, head: dict, payload: bytes | None) -> None:
        kind = head["type"]
        src_tag, dst_tag = ("you", "assistant") if self.mode == "voice" else ("source", "translation")
        if kind == "transcript.partial" and self.out.isatty():
            self.out.write("\r\033[K… " + head["text"])
            self.out.flush()
            self._partial_shown = True
        elif kind == "transcript.final":
            self.finals.append(head["text"])
            self._line(f"[{src_tag}] {head['text']}")
        elif kind == "response.created":
            self.open_responses.add(head["response_id"])
        elif kind == "response.text.done":
            self._line(f"[{dst_tag}] {head['text']}")
        elif kind == "response.audio" and payload is not None:
            pcm = np.frombuffer(payload, dtype="<i2").astype(np.int16)
            self.sample_rate_hz = head["sample_rate_hz"]
            if self.keep_audio:
                self.audio.append(pcm)
            if self.speaker is not None:
                self.speaker.write(pcm)
                if self.playout is not None:
                    self.playout.played(pcm, head["sample_rate_hz"])
                now = time.monotonic()
                self.playback_end_s = max(self.playback_end_s or now, now) + len(pcm) / head["sample_rate_hz"]
        elif kind == "response.interrupted" and self.speaker is not None:
            self.speaker.clear()
            if self.playout is not None:
                self.playout.clear()
            self.playback_end_s = None
        elif kind == "response.done":
            self.open_responses.discard(head["response_id"])
            self.responses.append(head)
            stats = head.get("stats", {})
            if stats:
                parts = ", ".join(
                    f"{k.removesuffix('_ms')} {v:.0f} ms" for k, v in stats.items() if k.endswith("_ms")
                )
                self._line(f"  ({head['status']}: {parts})")
        elif kind == "error":
            self.errors.append(head)
            self._line(f"[error] {head.get('code')}: {head.get('message')}")

    def audio_pcm(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.int16)


def _reference(output: LiveOutput, samples: int) -> np.ndarray | None:
    return output.playout.take(samples) if output.playout is not None else None


async def run_live(
    transport: Transport,
    source: AsyncIterator[np.ndarray],
    output: LiveOutput,
    trailing_silence_s: float = 0.6,
    input_rate_hz: int = 16000,
    settle_timeout_s: float = 120.0,
) -> LiveOutput:
    """Stream ``source`` to ``transport`` while handling its messages; at the end of the
    source, commit and wait for every response to finish."""
    committed = asyncio.Event()

    async def reader() -> None:
        async for message in transport.messages():
            head = message.head
            output.handle(head, message.payload)
            if head["type"] == "input_audio.committed":
                committed.set()
            if committed.is_set() and not output.open_responses:
                return

    read_task = asyncio.create_task(reader())
    try:
        async for chunk in source:
            await transport.send_audio(chunk, _reference(output, len(chunk)))
            if read_task.done():
                break
        # silence lets the VAD end the last turn naturally; the commit catches the rest
        tail = np.zeros(int(trailing_silence_s * input_rate_hz), dtype=np.int16)
        await transport.send_audio(tail, _reference(output, len(tail)))
        await transport.send({"type": "input_audio.commit"})
        await asyncio.wait_for(read_task, settle_timeout_s)
    except asyncio.TimeoutError:
        raise EdgeRtgiError(f"no end of the last response after {settle_timeout_s:.0f} s") from None
    finally:
        read_task.cancel()
        await asyncio.gather(read_task, return_exceptions=True)
    return output
