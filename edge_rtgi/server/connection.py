"""The connection loop every WebSocket protocol of the daemon shares, and the socket it runs on.

``ClientSocket`` is an admitted aiohttp WebSocket as the protocols see it: the URL the client
asked for, ``send``, ``close`` and its messages. Like the websockets server the daemon ran on
before, it reads ahead into a small queue (16 messages), so pings are answered while a session
opens or a protocol handler waits, and a client that floods it is pushed back on.

Two tasks per connection. The reader hands each client message to the protocol's
``on_message``; the writer (``pump``) is the only task that sends, so the messages of one event
(a JSON header and its binary payload) stay adjacent. The loop ends when the client leaves,
stops reading, or the daemon drains; then the session closes, which aborts its engine requests
and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Protocol
from urllib.parse import parse_qs, urlsplit

from aiohttp import WSMsgType, web

if TYPE_CHECKING:
    from edge_rtgi.pipeline.session import Session
    from edge_rtgi.server.app import Daemon

log = logging.getLogger(__name__)

READ_AHEAD_MESSAGES = 16


class ClientGone(Exception):
    """A send found the client's connection closed."""


class FloodLimits:
    """One connection's flood limits: client messages per second (a token bucket that allows a
    burst of two seconds' worth), and audio at most ``audio_speed`` times faster than real time
    (with ``audio_burst_s`` of slack: a client may send a short file at once).

    Past either limit the message is dropped and the client warned, at most once a second, so
    a flood costs neither unbounded buffering nor a flood of warnings back.
    """

    def __init__(self, messages_per_s: float, audio_speed: float, audio_burst_s: float = 30.0):
        self.messages_per_s = messages_per_s
        self.audio_speed = audio_speed
        self.audio_burst_s = audio_burst_s
        self._tokens = 2.0 * messages_per_s
        self._last_s = time.monotonic()
        self._audio_start_s: float | None = None
        self._audio_s = 0.0
        self._warned_s = -1.0
        self.dropped_messages = 0
        self.dropped_audio_s = 0.0

    def admit_message(self) -> bool:
        now = time.monotonic()
        cap = 2.0 * self.messages_per_s
        self._tokens = min(cap, self._tokens + (now - self._last_s) * self.messages_per_s)
        self._last_s = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.dropped_messages += 1
        return False

    def admit_audio(self, seconds: float) -> bool:
        """True when ``seconds`` more audio keeps the client within its speed limit."""
        now = time.monotonic()
        if self._audio_start_s is None:
            self._audio_start_s = now
        allowed_s = (now - self._audio_start_s) * self.audio_speed + self.audio_burst_s
        if self._audio_s + seconds > allowed_s:
            self.dropped_audio_s += seconds
            return False
        self._audio_s += seconds
        return True

    def warn_now(self) -> bool:
        """True at most once a second (when to tell the client what was dropped)."""
        now = time.monotonic()
        if now - self._warned_s >= 1.0:
            self._warned_s = now
            return True
        return False


class ClientSocket:
    """One admitted WebSocket connection: its URL (``path``, with the query), send, close, messages."""

    def __init__(self, ws: web.WebSocketResponse, path: str, limits: FloodLimits | None = None):
        self.ws = ws
        self.path = path
        self.limits = limits or FloodLimits(float("inf"), float("inf"))
        self._inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue(READ_AHEAD_MESSAGES)
        self._ended = False  # the reader has stopped; what is still queued is the rest
        self._reader = asyncio.create_task(self._read(), name="ws-reader")

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if msg.type is WSMsgType.TEXT or msg.type is WSMsgType.BINARY:
                    await self._inbox.put(msg.data)
                else:  # closed, closing, or an error (aiohttp has closed it: 1009 for an oversized one)
                    break
        finally:
            self._ended = True
            if not self._inbox.full():  # wakes a consumer waiting on an empty inbox
                self._inbox.put_nowait(None)

    async def messages(self) -> AsyncIterator[str | bytes]:
        """The client's text (str) and binary (bytes) messages until it leaves."""
        while not (self._ended and self._inbox.empty()):
            message = await self._inbox.get()
            if message is None:
                return
            yield message

    async def send(self, message: str | bytes) -> None:
        """Send one text or binary message; ``ClientGone`` when the connection is closed."""
        try:
            if isinstance(message, str):
                await self.ws.send_str(message)
            else:
                await self.ws.send_bytes(message)
        except ConnectionResetError as exc:  # aiohttp: "Cannot write to closing transport"
            raise ClientGone(str(exc)) from None

    async def close(self, code: int, reason: str) -> None:
        """Close with ``code`` (1001 going away, 1008 policy, 1011 internal error)."""
        await self.ws.close(code=code, message=reason.encode())

    async def finish(self) -> None:
        """Stop reading (after the protocol is done with the connection)."""
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class ProtocolConnection(Protocol):
    """One protocol's side of a connection: decode client messages, encode session events."""

    async def on_message(self, message: str | bytes) -> None:
        """Apply one client message; a bad one becomes an error event, never an exception."""

    async def pump(self) -> None:
        """Send the session's events to the client until the session closes."""

    async def warn(self, code: str, message: str) -> None:
        """Tell the client something it sent was dropped (an error event; the session goes on)."""


async def run_connection(
    daemon: Daemon,
    messages: AsyncIterable[str | bytes],
    session: Session,
    protocol: ProtocolConnection,
    name: str,
    limits: FloodLimits | None = None,
) -> None:
    """Read ``messages`` into ``protocol`` while its writer runs; close the session at the end.
    Messages past the connection's rate limit are dropped with a warning."""
    writer = asyncio.create_task(protocol.pump(), name=f"writer-{name}")
    try:
        async for message in messages:
            if limits is not None and not limits.admit_message():
                if limits.warn_now():
                    log.warning("%s: message rate over %.0f/s, dropping", name, limits.messages_per_s)
                    await protocol.warn(
                        "rate_limited",
                        f"more than {limits.messages_per_s:.0f} messages per second: "
                        f"{limits.dropped_messages} dropped so far; send fewer, larger messages",
                    )
                continue
            await protocol.on_message(message)
            if writer.done():
                break  # the client stopped reading: nothing more to do
    except ClientGone:
        pass
    finally:
        # Aborts engine requests and stops the stages. Shielded: the handler of a client that
        # vanished is cancelled, and that must not cut the close short (a request would run on).
        closing = asyncio.ensure_future(daemon.close_session(session))
        try:
            await asyncio.shield(closing)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        if writer.done() and not writer.cancelled() and (exc := writer.exception()) is not None:
            if not isinstance(exc, ClientGone):
                log.error("writer for %s failed: %r", name, exc)


def query_param(path: str, name: str) -> str | None:
    """The first value of ``name`` in the query string of ``path`` (None when absent)."""
    values = parse_qs(urlsplit(path).query).get(name)
    return values[0] if values else None
