"""``/v1/realtime``: one OpenAI Realtime WebSocket connection on the daemon.

The daemon (``edge_rtgi.server.app``) has already admitted the handshake: Origin
allow-list, ``Authorization: Bearer`` token (the official clients send their ``api_key``
there), session limit, message size limit. This opens a core session through the daemon,
so it shares the models, limits and metrics of every other session, and runs two tasks:
the reader feeds client events to the adapter, the writer pumps the session's events out.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.exceptions import ConnectionClosed

from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.session import SessionSettings
from edge_rtgi.server.openai_realtime.adapter import RealtimeAdapter, core_settings
from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.openai_realtime.events import IdMaker, error_event
from edge_rtgi.server.openai_realtime.session_config import RealtimeSessionConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL = "edge-rtgi"


def initial_config(path: str, pipelines: dict[str, Any]) -> tuple[RealtimeSessionConfig, str]:
    """The session config and model name for a connection URL.

    ``?model=`` is echoed back as the session's model; when it (or ``?pipeline=``, our
    extension) names one of the daemon's pipelines, that pipeline is used from the start.
    """
    query = parse_qs(urlsplit(path).query)
    model = (query.get("model") or [DEFAULT_MODEL])[0]
    pipeline = (query.get("pipeline") or [None])[0]
    if pipeline is None and model in pipelines:
        pipeline = model
    return RealtimeSessionConfig(pipeline=pipeline), model


async def serve_connection(daemon: Any, ws: Any) -> None:
    """Run one Realtime connection until the client leaves or the daemon drains."""
    config, model = initial_config(ws.request.path, daemon.pipelines)

    async def send(event: dict) -> None:
        await ws.send(json.dumps(event, separators=(",", ":")))

    try:
        session = await daemon.open_session(SessionSettings(**core_settings(config)))
    except EdgeRtgiError as exc:
        err = RealtimeProtocolError("session_failed", f"cannot open a session: {exc}", "model")
        await send(error_event(err, None, IdMaker()("event")))
        await ws.close(1008, "cannot open session")
        return
    adapter = RealtimeAdapter(session, send, model=model, config=config, metrics=daemon.metrics)
    await adapter.on_frame(await session.next_event())  # session.created before any reply
    writer = asyncio.create_task(_pump(daemon, adapter), name=f"realtime-writer-{session.session_id}")
    try:
        async for message in ws:
            await adapter.handle_message(message)
            if writer.done():
                break  # the client stopped reading
    except ConnectionClosed:
        pass
    finally:
        await daemon.close_session(session)  # aborts engine requests, frees KV blocks
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)


async def _pump(daemon: Any, adapter: RealtimeAdapter) -> None:
    from edge_rtgi.server.native import _count  # the daemon's per-event metrics, shared with native

    await adapter.pump_events(observe=lambda frame: _count(daemon, frame))
