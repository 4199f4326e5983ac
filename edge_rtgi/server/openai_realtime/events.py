"""Event names of the OpenAI Realtime protocol, beta aliases, and client-event parsing.

We speak the GA protocol (``response.output_audio.delta``, ``conversation.item.added``...).
Clients written against the beta accept nothing but their own spellings, so they are named
here; incoming event types are normalised through ``BETA_ALIASES`` and the server always
emits GA names. ``parse_client_event`` turns one WebSocket text message into a
``ClientEvent`` or raises ``RealtimeProtocolError``: malformed JSON, a missing or unknown
``type`` (named in the message, never dropped silently), a server event sent by a client.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.wire_json import WireJsonError, parse_client_json

# Client events this adapter implements.
CLIENT_EVENTS = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.truncate",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "response.create",
    "response.cancel",
    "output_audio_buffer.clear",
)

# Server events this adapter can emit (documented in docs/openai-realtime.md).
SERVER_EVENTS = (
    "error",
    "session.created",
    "session.updated",
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "input_audio_buffer.committed",
    "input_audio_buffer.cleared",
    "conversation.item.added",
    "conversation.item.done",
    "conversation.item.deleted",
    "conversation.item.retrieved",
    "conversation.item.truncated",
    "conversation.item.input_audio_transcription.delta",
    "conversation.item.input_audio_transcription.completed",
    "response.created",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.output_audio_transcript.delta",
    "response.output_audio_transcript.done",
    "response.output_audio.delta",
    "response.output_audio.done",
    "response.done",
    "output_audio_buffer.cleared",
)

# Beta spelling -> GA spelling. Client types are normalised on the way in; the server
# names are listed so a client relaying beta names gets a precise answer.
BETA_ALIASES = {
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
    "response.audio.delta": "response.output_audio.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
    "conversation.item.created": "conversation.item.added",
    "transcription_session.update": "session.update",
}

# GA client events that exist upstream but mean nothing for a local voice pipeline.
_UPSTREAM_ONLY = {"conversation.item.delete.all"}


def normalise_type(event_type: str) -> str:
    """Map a beta event name to its GA name (GA names pass through)."""
    return BETA_ALIASES.get(event_type, event_type)


@dataclass(frozen=True)
class ClientEvent:
    """One parsed client event: its GA type, its payload, and the client's ``event_id``."""

    type: str
    data: dict
    event_id: str | None = None
    original_type: str | None = None  # the spelling the client used, when it was a beta alias


def parse_client_event(message: str | bytes) -> ClientEvent:
    """Parse one WebSocket message into a ``ClientEvent``.

    Raises ``RealtimeProtocolError`` with code ``invalid_json``, ``invalid_event``
    (no type) or ``unknown_event``; the caller turns it into an ``error`` event.
    """
    if isinstance(message, (bytes, bytearray)):
        try:
            message = bytes(message).decode("utf-8")
        except UnicodeDecodeError:
            raise RealtimeProtocolError(
                "invalid_json",
                "binary frames are not part of this protocol; send JSON text events "
                "and put audio in input_audio_buffer.append as base64",
            ) from None
    try:
        data = parse_client_json(message)
    except WireJsonError as exc:
        raise RealtimeProtocolError("invalid_json", f"malformed JSON: {exc.reason}") from None
    if not isinstance(data, dict):
        raise RealtimeProtocolError(
            "invalid_json", f"an event must be a JSON object, got {type(data).__name__}"
        )
    event_id = data.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        raise RealtimeProtocolError("invalid_type", "event_id must be a string", "event_id")
    raw_type = data.get("type")
    if not isinstance(raw_type, str) or not raw_type:
        raise RealtimeProtocolError("missing_required_parameter", "the event has no 'type' field", "type")
    event_type = normalise_type(raw_type)
    try:
        _check_client_type(raw_type, event_type)
    except RealtimeProtocolError as exc:
        exc.client_event_id = event_id  # the error still points at the event it answers
        raise
    return ClientEvent(event_type, data, event_id, raw_type if raw_type != event_type else None)


def _check_client_type(raw_type: str, event_type: str) -> None:
    if event_type not in CLIENT_EVENTS:
        if event_type in SERVER_EVENTS:
            msg = f"{raw_type!r} is a server event; a client cannot send it"
        elif event_type in _UPSTREAM_ONLY:
            msg = f"event type {raw_type!r} is not supported by edge-rtgi"
        else:
            msg = f"unknown event type {raw_type!r}; supported client events: {', '.join(CLIENT_EVENTS)}"
        raise RealtimeProtocolError("unknown_event", msg, "type")


class IdMaker:
    """Short unique ids with the prefixes the protocol uses (``event_``, ``item_``, ``resp_``)."""

    def __init__(self) -> None:
        self._nonce = os.urandom(3).hex()
        self._counter = itertools.count(1)

    def __call__(self, prefix: str) -> str:
        return f"{prefix}_{self._nonce}{next(self._counter):06d}"


def error_event(error: RealtimeProtocolError, client_event_id: str | None, event_id: str) -> dict:
    """The ``error`` server event for ``error``."""
    return {"type": "error", "event_id": event_id, "error": error.to_error(client_event_id)}


def require(data: dict, key: str, kind: type | tuple[type, ...], param: str | None = None):
    """``data[key]`` checked for presence and type; errors name ``param`` (default ``key``)."""
    param = param or key
    if key not in data or data[key] is None:
        raise RealtimeProtocolError(
            "missing_required_parameter", f"missing required parameter {param!r}", param
        )
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RealtimeProtocolError("invalid_type", f"{param} must be of type {names}", param)
    return value


def optional(data: dict, key: str, kind: type | tuple[type, ...], param: str | None = None, default=None):
    """Like ``require`` but an absent or null field gives ``default``."""
    if data.get(key) is None:
        return default
    return require(data, key, kind, param)
