"""The Wyoming server: Home Assistant's protocol for speech services, inside the daemon.

Enabled by ``wyoming: {uri: tcp://127.0.0.1:10300}`` in the daemon's config or
``edge-rtgi serve --wyoming tcp://...``. One server offers four services on the daemon's
shared models and engine (docs/wyoming.md):

- ``asr``: ``transcribe`` + audio -> streamed ``transcript-chunk`` events and a ``transcript``;
- ``tts``: ``synthesize`` (or ``synthesize-start``/``-chunk``/``-stop``) -> audio;
- ``wake``: ``detect`` + audio -> ``detection`` / ``not-detected`` (microWakeWord);
- ``handle``: a ``transcript`` -> the assistant's ``handled`` answer (streamed first).

Built on the ``wyoming`` library: its event types, its framing (read here with limits:
``framing``), and its async TCP and Unix servers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.server import AsyncEventHandler, AsyncServer, AsyncTcpServer

from edge_rtgi.server.config import WyomingConfig
from edge_rtgi.server.wyoming.framing import linger
from edge_rtgi.server.wyoming.handler import WyomingHandler
from edge_rtgi.server.wyoming.services import WyomingServices

if TYPE_CHECKING:
    from edge_rtgi.server.app import Daemon

__all__ = ["WyomingHandler", "WyomingServer"]

log = logging.getLogger(__name__)


class _Refused(AsyncEventHandler):
    """A connection over the limit or during the drain: one error event, then the close."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reason: str):
        super().__init__(reader, writer)
        self.reason = reason

    async def handle_event(self, event: Event) -> bool:
        return False

    async def run(self) -> None:
        try:
            await async_write_event(Error(text=self.reason, code="unavailable").event(), self.writer)
            await linger(self.reader, self.writer)  # the client's first event must not reset it
        except ConnectionError:
            pass
        finally:
            self.writer.close()


class WyomingServer:
    """Serves Wyoming connections for a daemon until ``stop``."""

    def __init__(self, daemon: Daemon, config: WyomingConfig):
        config.check_bind()
        self.daemon, self.config = daemon, config
        self.services = WyomingServices.build(daemon, config)
        self._server: AsyncServer | None = None
        self._open: set[WyomingHandler] = set()

    async def start(self) -> None:
        self._server = AsyncServer.from_uri(self.config.uri or "")
        await self._server.start(self._connect)
        log.info("Wyoming server on %s", self.uri)

    @property
    def uri(self) -> str:
        """The address served; with port 0 in the config, the port the OS picked."""
        server = self._server
        listening = server._server if isinstance(server, AsyncTcpServer) else None  # the library's
        if isinstance(listening, asyncio.Server) and listening.sockets:
            host, port = listening.sockets[0].getsockname()[:2]
            return f"tcp://{host}:{port}"
        return self.config.uri or ""

    @property
    def port(self) -> int:
        return int(self.uri.rsplit(":", 1)[1])

    def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> AsyncEventHandler:
        limit = self.daemon.config.server.max_sessions
        if self.daemon.draining:
            return _Refused(reader, writer, "the daemon is shutting down")
        if len(self._open) >= limit:
            return _Refused(reader, writer, f"connection limit reached ({limit})")
        return WyomingHandler(reader, writer, self.services, self._open)

    async def stop(self) -> None:
        """Stop listening and end every connection (their sessions close)."""
        if self._server is not None:
            await self._server.stop()
            self._server = None
        for _ in range(100):  # the handlers' tasks close their sessions as they end
            if not self._open:
                break
            await asyncio.sleep(0.02)
