"""The native protocol adapter: a WebSocket connection <-> a protocol-neutral ``Session``.

Two tasks per connection. The reader decodes each message and calls the session; a bad
message becomes an ``error`` event and reading goes on. The writer is the only task that
sends, so a ``response.audio`` header and its binary payload are always adjacent.
A disconnect closes the session, which aborts its engine requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.exceptions import ConnectionClosed

from edge_rtgi import frames as F
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.session import Session, SessionSettings
from edge_rtgi.server import protocol as P

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pong:
    id: Any = None
    t_s: float = field(default_factory=F.now_s)


def _initial_settings(path: str) -> SessionSettings:
    """``?pipeline=NAME`` on the URL picks the pipeline before the first message."""
    query = parse_qs(urlsplit(path).query)
    pipeline = (query.get("pipeline") or [None])[0]
    return SessionSettings(pipeline=pipeline)


def _count(daemon: Any, event: Any) -> None:
    m = daemon.metrics
    if isinstance(event, F.ErrorEvent):
        m.inc("edge_rtgi_errors_total", code=event.code)
    elif isinstance(event, F.ResponseDone):
        m.inc("edge_rtgi_responses_total", status=event.status)
        if event.stats.voice_to_voice_ms is not None:
            m.inc("edge_rtgi_voice_to_voice_ms_sum", event.stats.voice_to_voice_ms)
            m.inc("edge_rtgi_voice_to_voice_ms_count")
    elif isinstance(event, F.AudioOut):
        m.inc("edge_rtgi_audio_out_seconds_total", event.duration_s)


async def _writer(daemon: Any, session: Session, ws: Any) -> None:
    async for event in session.events():
        _count(daemon, event)
        if isinstance(event, Pong):
            await ws.send(P.json.dumps({"type": "pong", "id": event.id, "t_ms": session.ms(event.t_s)}))
            continue
        for message in P.encode_server(event, session.ms):
            await ws.send(message)


async def _dispatch(session: Session, event: P.ClientEvent, daemon: Any) -> None:
    if isinstance(event, P.AudioChunk):
        daemon.metrics.inc("edge_rtgi_audio_in_seconds_total", len(event.pcm) / session.input_sample_rate_hz)
        await session.push_audio(event.pcm)
    elif isinstance(event, P.SessionUpdate):
        await session.update(event.session)
    elif isinstance(event, P.AudioCommit):
        await session.commit_audio()
    elif isinstance(event, P.AudioClear):
        await session.clear_audio()
    elif isinstance(event, P.TextInput):
        await session.add_user_text(event.text, respond=event.respond)
    elif isinstance(event, P.ResponseCreate):
        await session.create_response()
    elif isinstance(event, P.ResponseCancel):
        await session.cancel_response(event.response_id)
    elif isinstance(event, P.Ping):
        session.outbox.put_control(Pong(event.id))


async def serve_native(daemon: Any, ws: Any) -> None:
    """Run one native-protocol connection until the client leaves or the daemon drains."""
    try:
        session = await daemon.open_session(_initial_settings(ws.request.path))
    except EdgeRtgiError as exc:
        await ws.send(P.encode_server(P.error_event(exc), lambda t: 0)[0])
        await ws.close(1008, "cannot open session")
        return
    writer = asyncio.create_task(_writer(daemon, session, ws), name=f"writer-{session.session_id}")
    try:
        async for message in ws:
            try:
                await _dispatch(session, P.decode_client(message), daemon)
            except EdgeRtgiError as exc:
                session.outbox.put_control(P.error_event(exc))
            if writer.done():
                break  # the client stopped reading: nothing more to do
    except ConnectionClosed:
        pass
    finally:
        await daemon.close_session(session)  # aborts engine requests, stops the stages
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            exc = writer.exception()
            if not isinstance(exc, ConnectionClosed):
                log.error("writer for %s failed: %r", session.session_id, exc)
