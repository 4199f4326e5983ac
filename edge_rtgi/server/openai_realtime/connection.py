"""``/v1/realtime``: one OpenAI Realtime WebSocket connection on the daemon.

The daemon (``edge_rtgi.server.app``) has already admitted the handshake: Origin
allow-list, ``Authorization: Bearer`` token (the official clients send their ``api_key``
there), session limit, message size limit. This opens a core session through the daemon,
so it shares the models, limits and metrics of every other session, and runs it on the shared
connection loop (``edge_rtgi.server.connection``): client events go to the adapter, and the
session's events are pumped out through it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING

from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.session import SessionSettings
from edge_rtgi.server.connection import ClientGone, ClientSocket, query_param, run_connection
from edge_rtgi.server.openai_realtime.adapter import RealtimeAdapter, core_settings
from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.openai_realtime.events import IdMaker, error_event
from edge_rtgi.server.openai_realtime.session_config import RealtimeSessionConfig

if TYPE_CHECKING:
    from edge_rtgi.server.app import Daemon

log = logging.getLogger(__name__)

DEFAULT_MODEL = "edge-rtgi"


def initial_config(path: str, pipelines: Collection[str]) -> tuple[RealtimeSessionConfig, str]:
    """The session config and model name for a connection URL.

    ``?model=`` is echoed back as the session's model; when it (or ``?pipeline=``, our
    extension) names one of the daemon's pipelines (``pipelines``: their names), that
    pipeline is used from the start.
    """
    model = query_param(path, "model") or DEFAULT_MODEL
    pipeline = query_param(path, "pipeline")
    if pipeline is None and model in pipelines:
        pipeline = model
    return RealtimeSessionConfig(pipeline=pipeline), model


class RealtimeConnection:
    """The Realtime protocol's side of ``run_connection``."""

    def __init__(self, daemon: Daemon, adapter: RealtimeAdapter):
        self.daemon, self.adapter = daemon, adapter

    async def on_message(self, message: str | bytes) -> None:
        await self.adapter.handle_message(message)

    async def pump(self) -> None:
        await self.adapter.pump_events(observe=self.daemon.metrics.observe_event)

    async def warn(self, code: str, message: str) -> None:
        await self.adapter.send_error(RealtimeProtocolError(code, message), None)


async def serve_connection(daemon: Daemon, ws: ClientSocket) -> None:
    """Run one Realtime connection until the client leaves or the daemon drains."""
    config, model = initial_config(ws.path, daemon.pipelines)

    async def send(event: dict) -> None:
        await ws.send(json.dumps(event, separators=(",", ":")))

    try:
        session = await daemon.open_session(SessionSettings(**core_settings(config)))
    except EdgeRtgiError as exc:
        err = RealtimeProtocolError("session_failed", f"cannot open a session: {exc}", "model")
        await send(error_event(err, None, IdMaker()("event")))
        await ws.close(1008, "cannot open session")
        return
    adapter = RealtimeAdapter(
        session, send, model=model, config=config, metrics=daemon.metrics, limits=ws.limits
    )
    try:
        created = await session.next_event()
        if created is not None:  # session.created before any reply
            await adapter.on_frame(created)
    except BaseException:
        # gone right after the handshake (ClientGone, or the handler cancelled): without this
        # close the session outlived its connection and escaped max_sessions
        await asyncio.shield(daemon.close_session(session))
        if isinstance(sys.exc_info()[1], ClientGone):
            return
        raise
    await run_connection(
        daemon,
        ws.messages(),
        session,
        RealtimeConnection(daemon, adapter),
        session.session_id,
        ws.limits,
    )
