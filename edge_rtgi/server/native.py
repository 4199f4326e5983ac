"""The native protocol adapter: a WebSocket connection <-> a protocol-neutral ``Session``.

Runs on the shared connection loop (``edge_rtgi.server.connection``): each message is decoded
and applied to the session, a bad one becomes an ``error`` event and reading goes on, and the
writer encodes the session's events (a ``response.audio`` header and its binary payload stay
adjacent). Wire format: docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from edge_rtgi import frames as F
from edge_rtgi.audio.aec import split_reference
from edge_rtgi.errors import AudioError, EdgeRtgiError
from edge_rtgi.pipeline.session import Session, SessionSettings
from edge_rtgi.server import protocol as P
from edge_rtgi.server.connection import (
    ClientGone,
    ClientSocket,
    FloodLimits,
    query_param,
    run_connection,
)
from edge_rtgi.server.metrics import Metrics

if TYPE_CHECKING:
    from edge_rtgi.server.app import Daemon

log = logging.getLogger(__name__)


def _initial_settings(path: str) -> SessionSettings:
    """``?pipeline=NAME`` on the URL picks the pipeline before the first message."""
    return SessionSettings(pipeline=query_param(path, "pipeline"))


class NativeConnection:
    """The native protocol's side of ``run_connection``."""

    def __init__(self, daemon: Daemon, session: Session, ws: ClientSocket):
        self.daemon, self.session, self.ws = daemon, session, ws

    async def warn(self, code: str, message: str) -> None:
        self.session.outbox.put_control(F.ErrorEvent(code, message))

    async def on_message(self, message: str | bytes) -> None:
        try:
            event = P.decode_client(message)
            if isinstance(event, P.AudioChunk):
                limits = self.ws.limits
                seconds = len(event.pcm) / self.session.input_sample_rate_hz
                if not limits.admit_audio(seconds):
                    if limits.warn_now():
                        await self.warn("audio_too_fast", _too_fast(limits))
                    return
            await _dispatch(self.session, event, self.daemon.metrics)
        except EdgeRtgiError as exc:  # a client mistake: an error event, logged quietly
            log.info("%s: %.200s", self.session.session_id, exc.message)
            self.session.outbox.put_control(P.error_event(exc))
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug of ours: this session gets an error event, nothing else
            log.exception("%s: failed on a client message", self.session.session_id)
            self.session.outbox.put_control(P.error_event(exc))

    async def pump(self) -> None:
        session = self.session
        metrics = self.daemon.metrics
        async for event in session.events():
            metrics.observe_event(event)
            for message in P.encode_server(event, session.ms):
                await self.ws.send(message)


def _too_fast(limits: FloodLimits) -> str:
    return (
        f"audio is arriving more than {limits.audio_speed:g}x faster than real time: "
        f"{limits.dropped_audio_s:.1f} s dropped so far; stream it at its own pace"
    )


async def _dispatch(session: Session, event: P.ClientEvent, metrics: Metrics) -> None:
    if isinstance(event, P.AudioChunk):
        if session.settings.echo_reference:  # stereo: microphone, then the audio being played
            try:
                mic, reference = split_reference(event.pcm)
            except AudioError as exc:
                raise P.ProtocolError("invalid_audio", exc.message, exc.hint) from None
            metrics.audio_in_s.inc(len(mic) / session.input_sample_rate_hz)
            await session.push_audio(mic, reference=reference)
            return
        metrics.audio_in_s.inc(len(event.pcm) / session.input_sample_rate_hz)
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
        session.outbox.put_control(F.Pong(event.id))


async def serve_native(daemon: Daemon, ws: ClientSocket) -> None:
    """Run one native-protocol connection until the client leaves or the daemon drains."""
    try:
        session = await daemon.open_session(_initial_settings(ws.path))
    except EdgeRtgiError as exc:
        await ws.send(P.encode_server(P.error_event(exc), lambda t: 0)[0])
        await ws.close(1008, "cannot open session")
        return
    await run_connection(
        daemon,
        ws.messages(),
        session,
        NativeConnection(daemon, session, ws),
        session.session_id,
        ws.limits,
    )
