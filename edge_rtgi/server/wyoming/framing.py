"""Reading Wyoming events with limits: the library's framing, bounded, and loud about errors.

A Wyoming event is a JSON header line (``type``, optional ``data``, ``data_length``,
``payload_length``), then ``data_length`` bytes of JSON merged into ``data``, then
``payload_length`` bytes of payload (PCM for audio). ``wyoming.event.async_read_event``
reads any length it is told and turns a malformed header into a silent disconnect; this
reader checks each length against the connection's limits *before* reading, and raises
``FrameError`` with a code, so the server can send an ``error`` event before it closes.
A stream cannot be resynchronised after a bad frame (its lengths are untrusted), so every
``FrameError`` ends the connection.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from wyoming.event import Event

from edge_rtgi.errors import EdgeRtgiError


@dataclass(frozen=True)
class FrameLimits:
    """Bounds on one event: header line plus data JSON, and the payload."""

    max_event_bytes: int = 64 * 1024
    max_payload_bytes: int = 1 << 20
    frame_timeout_s: float = 10.0  # for an event's data and payload, after its header line


class FrameError(EdgeRtgiError):
    """A frame the server cannot read; it is answered with an ``error`` event, then a close."""

    def __init__(self, code: str, message: str, hint: str | None = None):
        super().__init__(message, hint)
        self.code = code


def _length(header: dict[str, Any], key: str, limit: int, code: str) -> int:
    value = header.get(key) or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FrameError("invalid_event", f"{key} must be a non-negative integer, got {value!r}")
    if value > limit:
        raise FrameError(code, f"{key} {value} is over this server's limit of {limit} bytes")
    return value


async def read_event(reader: asyncio.StreamReader, limits: FrameLimits) -> Event | None:
    """The next event, None at a clean end of the stream, ``FrameError`` for a bad frame."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("invalid_event", "the connection ended inside an event header") from None
    except asyncio.LimitOverrunError:
        raise FrameError(
            "event_too_large", f"an event header is longer than {limits.max_event_bytes} bytes"
        ) from None
    if len(line) > limits.max_event_bytes:
        raise FrameError("event_too_large", f"an event header is longer than {limits.max_event_bytes} bytes")
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as exc:  # also deep nesting, and ints past Python's digit limit
        raise FrameError(
            "invalid_json",
            f"an event header is not JSON: {exc}",
            hint="each event starts with one line of JSON with a 'type'",
        ) from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise FrameError("invalid_event", "an event header must be a JSON object with a string 'type'")
    data = header.get("data") or {}
    data_length = _length(header, "data_length", limits.max_event_bytes - len(line), "event_too_large")
    payload_length = _length(header, "payload_length", limits.max_payload_bytes, "payload_too_large")

    async def rest() -> tuple[bytes | None, bytes | None]:
        raw = await reader.readexactly(data_length) if data_length else None
        return raw, (await reader.readexactly(payload_length) if payload_length else None)

    try:
        raw, payload = await asyncio.wait_for(rest(), limits.frame_timeout_s)
        if raw is not None:
            extra = json.loads(raw)
            if not isinstance(extra, dict):
                raise FrameError("invalid_event", "an event's data must be a JSON object")
            data = {**data, **extra} if isinstance(data, dict) else extra
    except asyncio.IncompleteReadError:
        raise FrameError("invalid_event", "the connection ended inside an event") from None
    except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on; 3.10 has its own class
        raise FrameError(
            "timeout",
            f"an event's data or payload did not arrive within {limits.frame_timeout_s:g} s of its header",
            hint="send each event whole: header line, then data_length and payload_length bytes",
        ) from None
    except (ValueError, RecursionError) as exc:
        raise FrameError("invalid_json", f"an event's data is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FrameError("invalid_event", "an event's data must be a JSON object")
    return Event(type=header["type"], data=data, payload=payload)


LINGER_S = 1.0  # how long a connection closing on an error reads what the client still sends
LINGER_BYTES = 4 << 20


async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Before closing on an error: finish sending, then read and drop what the client still sends,
    for at most ``LINGER_S`` and ``LINGER_BYTES``. Closed with unread input, the socket sends a
    reset, which can destroy the error event before the client reads it."""
    loop = asyncio.get_running_loop()
    deadline, read = loop.time() + LINGER_S, 0
    try:
        await asyncio.wait_for(writer.drain(), LINGER_S)
        if writer.can_write_eof():
            writer.write_eof()
        while read < LINGER_BYTES and (left := deadline - loop.time()) > 0:
            chunk = await asyncio.wait_for(reader.read(1 << 16), left)
            if not chunk:
                break
            read += len(chunk)
    except (OSError, asyncio.TimeoutError):  # ConnectionError is an OSError
        pass
