"""The native wire protocol, ``edge-rtgi.v1``: JSON events plus binary PCM frames.

Like wyoming, a message is a small JSON header and, when there is audio, a binary payload;
over WebSocket the two are separate frames. The client sends its microphone as bare binary
frames (mono s16le at the session's input rate; interleaved stereo with the played audio as
the second channel when the session has ``echo_reference``). The server sends each audio chunk as a
``response.audio`` JSON event immediately followed by one binary frame with
``num_bytes`` bytes. The codec is one table per direction (``CLIENT_EVENTS``) and
one function per server event, so the docs (docs/protocol.md) and tests follow the code.

Bad input never closes the connection: ``decode_client`` raises ``ProtocolError`` with a
code (``invalid_json``, ``unknown_event``, ``invalid_event``, ``invalid_audio``) and the
server answers with an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_rtgi import frames as F
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.server.wire_json import WireJsonError, parse_client_json

PROTOCOL_VERSION = "edge-rtgi.v1"
AUDIO_FORMAT = "pcm_s16le"


class ProtocolError(EdgeRtgiError):
    """A client message the server cannot accept; it becomes an ``error`` event."""

    def __init__(self, code: str, message: str, hint: str | None = None, event_type: str | None = None):
        super().__init__(message, hint)
        self.code = code
        self.event_type = event_type


# --------------------------------------------------------------------------- client -> server


@dataclass(frozen=True)
class SessionUpdate:
    session: dict


@dataclass(frozen=True)
class AudioCommit:
    pass


@dataclass(frozen=True)
class AudioClear:
    pass


@dataclass(frozen=True)
class TextInput:
    text: str
    respond: bool = True


@dataclass(frozen=True)
class ResponseCreate:
    pass


@dataclass(frozen=True)
class ResponseCancel:
    response_id: str | None = None


@dataclass(frozen=True)
class Ping:
    id: Any = None


@dataclass(frozen=True)
class AudioChunk:
    pcm: np.ndarray  # int16 [N]


ClientEvent = (
    SessionUpdate | AudioCommit | AudioClear | TextInput | ResponseCreate | ResponseCancel | Ping | AudioChunk
)

# type -> (class, {field: (python type, required)})
CLIENT_EVENTS: dict[str, tuple[type, dict[str, tuple[type | tuple, bool]]]] = {
    "session.update": (SessionUpdate, {"session": (dict, True)}),
    "input_audio.commit": (AudioCommit, {}),
    "input_audio.clear": (AudioClear, {}),
    "text.input": (TextInput, {"text": (str, True), "respond": (bool, False)}),
    "response.create": (ResponseCreate, {}),
    "response.cancel": (ResponseCancel, {"response_id": (str, False)}),
    "ping": (Ping, {"id": ((str, int), False)}),
}


def decode_client(message: str | bytes) -> ClientEvent:
    """One WebSocket message from a client -> a typed event, or ``ProtocolError``."""
    if isinstance(message, (bytes, bytearray, memoryview)):
        data = bytes(message)
        if len(data) % 2:
            raise ProtocolError(
                "invalid_audio",
                f"binary audio frame has an odd byte count ({len(data)})",
                hint="send mono 16-bit little-endian PCM: 2 bytes per sample",
            )
        return AudioChunk(np.frombuffer(data, dtype="<i2").astype(np.int16, copy=False))
    try:
        obj = parse_client_json(message)
    except WireJsonError as exc:
        raise ProtocolError(
            "invalid_json",
            f"message is not acceptable JSON: {exc.reason}",
            hint="text frames must be JSON objects with a 'type'",
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("invalid_event", "a JSON message must be an object with a string 'type'")
    kind = obj["type"]
    if kind not in CLIENT_EVENTS:
        raise ProtocolError(
            "unknown_event",
            f"unknown event type {kind!r}",
            event_type=kind,
            hint=f"client events: {', '.join(CLIENT_EVENTS)}",
        )
    cls, spec = CLIENT_EVENTS[kind]
    kwargs = {}
    for key, value in obj.items():
        if key in ("type", "event_id"):
            continue
        if key not in spec:
            raise ProtocolError(
                "invalid_event",
                f"{kind}: unknown field {key!r}",
                event_type=kind,
                hint=f"fields: {', '.join(spec) or 'none'}",
            )
        tp, _ = spec[key]
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            raise ProtocolError(
                "invalid_event",
                f"{kind}: field {key!r} has the wrong type ({type(value).__name__})",
                event_type=kind,
            )
        kwargs[key] = value
    missing = [k for k, (_, required) in spec.items() if required and k not in kwargs]
    if missing:
        raise ProtocolError("invalid_event", f"{kind}: missing field {missing[0]!r}", event_type=kind)
    return cls(**kwargs)


def encode_client(event: ClientEvent) -> str | bytes:
    """The inverse of ``decode_client`` (used by the CLI's ``--connect`` client)."""
    if isinstance(event, AudioChunk):
        return event.pcm.astype("<i2").tobytes()
    kind = next(k for k, (cls, _) in CLIENT_EVENTS.items() if cls is type(event))
    fields = {k: v for k, v in vars(event).items() if v is not None}
    return json.dumps({"type": kind, **fields})


# --------------------------------------------------------------------------- server -> client


def _stats(stats: F.TurnStats) -> dict:
    return {k: v for k, v in vars(stats).items() if v is not None}


def encode_server(event: F.SessionEvent, ms: Callable[[float], int]) -> list[str | bytes]:
    """A typed session event -> the WebSocket messages for it (JSON, then PCM for audio).

    ``ms(t_s)`` converts a monotonic time to milliseconds since the session started.
    """
    e = event
    t = {"t_ms": ms(e.t_s)}
    body: dict[str, Any]
    if isinstance(e, F.AudioOut):
        pcm = e.pcm.astype("<i2").tobytes()
        head = {
            "type": "response.audio",
            "response_id": e.response_id,
            "sample_rate_hz": e.sample_rate_hz,
            "format": AUDIO_FORMAT,
            "num_bytes": len(pcm),
            **t,
        }
        return [json.dumps(head), pcm]
    if isinstance(e, F.SessionStarted):
        body = {
            "type": "session.created",
            "protocol": PROTOCOL_VERSION,
            "session_id": e.session_id,
            "pipeline": e.pipeline,
            "session": e.config,
            "audio": {
                "format": AUDIO_FORMAT,
                # 2 with an echo reference: microphone left, played audio right (docs/protocol.md)
                "channels": 2 if e.config.get("echo_reference") else 1,
                "input_sample_rate_hz": e.input_sample_rate_hz,
                "output_sample_rate_hz": e.output_sample_rate_hz,
            },
        }
    elif isinstance(e, F.Pong):
        body = {"type": "pong", "id": e.id}
    elif isinstance(e, F.SessionUpdated):
        body = {"type": "session.updated", "session": e.config}
    elif isinstance(e, F.SpeechStarted):
        body = {"type": "input.speech_started", "turn_id": e.turn_id, "audio_ms": e.audio_ms}
    elif isinstance(e, F.SpeechStopped):
        body = {"type": "input.speech_stopped", "turn_id": e.turn_id, "audio_ms": e.audio_ms}
    elif isinstance(e, F.WakeDetected):
        body = {"type": "wake.detected", "name": e.name, "phrase": e.phrase, "audio_ms": e.audio_ms}
    elif isinstance(e, F.Transcript):
        body = {
            "type": "transcript.final" if e.final else "transcript.partial",
            "turn_id": e.turn_id,
            "text": e.text,
        }
        if e.language:
            body["language"] = e.language
        if e.final and e.end_reason:
            body["end_reason"] = e.end_reason
        if e.backchannel:
            body["backchannel"] = True
    elif isinstance(e, F.AudioCommitted):
        body = {"type": "input_audio.committed"}
    elif isinstance(e, F.ResponseStarted):
        body = {
            "type": "response.created",
            "response_id": e.response_id,
            "turn_id": e.turn_id,
            "kind": e.kind,
            "source_text": e.source_text,
        }
    elif isinstance(e, F.TextDelta):
        body = {"type": "response.text.delta", "response_id": e.response_id, "delta": e.delta}
    elif isinstance(e, F.TextDone):
        body = {"type": "response.text.done", "response_id": e.response_id, "text": e.text}
        if e.source_text is not None:
            body["source_text"] = e.source_text
    elif isinstance(e, F.AudioDone):
        body = {"type": "response.audio.done", "response_id": e.response_id}
    elif isinstance(e, F.ResponseInterrupted):
        body = {
            "type": "response.interrupted",
            "response_id": e.response_id,
            "reason": e.reason,
            "played_ms": e.played_ms,
        }
    elif isinstance(e, F.ResponseDone):
        body = {
            "type": "response.done",
            "response_id": e.response_id,
            "status": e.status,
            "text": e.text,
            "stats": _stats(e.stats),
        }
        if e.usage:
            body["usage"] = e.usage
    elif isinstance(e, F.ErrorEvent):
        body = {"type": "error", "code": e.code, "message": e.message}
        body.update(
            {
                k: v
                for k, v in (("hint", e.hint), ("event_type", e.event_type), ("response_id", e.response_id))
                if v is not None
            }
        )
        if e.fatal:
            body["fatal"] = True
    else:
        raise TypeError(f"no wire form for {type(e).__name__}")
    return [json.dumps({**body, **t})]


def error_event(exc: BaseException, event_type: str | None = None) -> F.ErrorEvent:
    """The ``error`` event for a user error raised while handling a client message."""
    if isinstance(exc, ProtocolError):
        return F.ErrorEvent(exc.code, exc.message, exc.hint, event_type=exc.event_type or event_type)
    if isinstance(exc, EdgeRtgiError):
        return F.ErrorEvent("invalid_request", exc.message, exc.hint, event_type=event_type)
    # a bug of ours: the log has the traceback, the client gets no Python internals
    return F.ErrorEvent(
        "internal_error",
        "the server failed on this message; the session goes on",
        "if it happens again, report it with the server log",
        event_type=event_type,
    )
