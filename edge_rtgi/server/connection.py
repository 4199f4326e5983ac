"""The connection loop every WebSocket protocol of the daemon shares.

Two tasks per connection. The reader hands each client message to the protocol's
``on_message``; the writer (``pump``) is the only task that sends, so the messages of one event
(a JSON header and its binary payload) stay adjacent. The loop ends when the client leaves,
stops reading, or the daemon drains; then the session closes, which aborts its engine requests
and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING, Protocol
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from edge_rtgi import frames as F
from edge_rtgi.server.metrics import Metrics

if TYPE_CHECKING:
    from edge_rtgi.pipeline.session import Session
    from edge_rtgi.server.app import Daemon

log = logging.getLogger(__name__)


class ProtocolConnection(Protocol):
    """One protocol's side of a connection: decode client messages, encode session events."""

    async def on_message(self, message: str | bytes) -> None:
        """Apply one client message; a bad one becomes an error event, never an exception."""

    async def pump(self) -> None:
        """Send the session's events to the client until the session closes."""


async def run_connection(
    daemon: Daemon,
    messages: AsyncIterable[str | bytes],
    session: Session,
    protocol: ProtocolConnection,
    name: str,
) -> None:
    """Read ``messages`` into ``protocol`` while its writer runs; close the session at the end."""
    writer = asyncio.create_task(protocol.pump(), name=f"writer-{name}")
    try:
        async for message in messages:
            await protocol.on_message(message)
            if writer.done():
                break  # the client stopped reading: nothing more to do
    except ConnectionClosed:
        pass
    finally:
        await daemon.close_session(session)  # aborts engine requests, stops the stages
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        if not writer.cancelled() and (exc := writer.exception()) is not None:
            if not isinstance(exc, ConnectionClosed):
                log.error("writer for %s failed: %r", name, exc)


def query_param(path: str, name: str) -> str | None:
    """The first value of ``name`` in the query string of ``path`` (None when absent)."""
    values = parse_qs(urlsplit(path).query).get(name)
    return values[0] if values else None


def request_path(ws: ServerConnection) -> str:
    """The path (with query) the client asked for in its handshake."""
    if ws.request is None:  # only before the handshake, and handlers run after it
        raise RuntimeError("the WebSocket handshake has not happened yet")
    return ws.request.path


def count_event(metrics: Metrics, event: object) -> None:
    """The daemon's per-event counters, the same for every protocol."""
    if isinstance(event, F.ErrorEvent):
        metrics.inc("edge_rtgi_errors_total", code=event.code)
    elif isinstance(event, F.ResponseDone):
        metrics.inc("edge_rtgi_responses_total", status=event.status)
        if event.stats.voice_to_voice_ms is not None:
            metrics.inc("edge_rtgi_voice_to_voice_ms_sum", event.stats.voice_to_voice_ms)
            metrics.inc("edge_rtgi_voice_to_voice_ms_count")
    elif isinstance(event, F.AudioOut):
        metrics.inc("edge_rtgi_audio_out_seconds_total", event.duration_s)
