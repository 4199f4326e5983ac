"""The daemon: one process, one set of shared models, many WebSocket sessions.

Routes on one port (websockets' ``process_request`` hook answers plain HTTP):

- ``GET /healthz``: JSON liveness (503 while draining);
- ``GET /metrics``: Prometheus text;
- ``/`` and ``/v1/native``: the native protocol (``edge_rtgi.server.native``);
- ``/v1/realtime``: the OpenAI Realtime adapter, when ``edge_rtgi.server.openai_realtime``
  provides ``serve_connection(daemon, websocket)``.

Every WebSocket handshake passes ``_admit``: Origin allow-list (cross-site WebSocket
hijacking), token when one is configured, session limit, draining. A session that fails
is closed on its own; the daemon and the other sessions carry on.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import json
import logging
from http import HTTPStatus
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from edge_rtgi.pipeline.config import PipelineConfig
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.pipeline.session import Session, SessionLimits, SessionSettings
from edge_rtgi.server.config import DaemonConfig
from edge_rtgi.server.connection import query_param, request_path
from edge_rtgi.server.metrics import Metrics, daemon_metrics

log = logging.getLogger(__name__)

NATIVE_PATHS = ("/", "/v1/native")
REALTIME_PATHS = ("/v1/realtime", "/v1/realtime/")


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """Exact match, or match ignoring the port (``http://localhost`` allows ``http://localhost:3000``)."""
    origin = origin.rstrip("/").lower()
    parts = urlsplit(origin)
    bare = f"{parts.scheme}://{parts.hostname}" if parts.hostname else origin
    return any(origin == a.rstrip("/").lower() or bare == a.rstrip("/").lower() for a in allowed)


def _response(status: HTTPStatus, body: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    data = body.encode()
    headers = Headers(
        [("Content-Type", content_type), ("Content-Length", str(len(data))), ("Cache-Control", "no-store")]
    )
    return Response(status.value, status.phrase, headers, data)


class Daemon:
    """Serves sessions over WebSocket until ``drain()``. Start with ``await daemon.start()``."""

    def __init__(self, config: DaemonConfig, pipelines: dict[str, PipelineConfig], resources: Resources):
        if config.default_pipeline not in pipelines:
            from edge_rtgi.errors import ConfigError

            raise ConfigError(
                f"default_pipeline {config.default_pipeline!r} is not among the loaded pipelines",
                hint=f"loaded: {', '.join(pipelines)}",
            )
        self.config = config
        # the default pipeline first: a session that names none gets it
        self.pipelines = {config.default_pipeline: pipelines[config.default_pipeline], **pipelines}
        self.resources = resources
        self.metrics: Metrics = daemon_metrics()
        self.sessions: set[Session] = set()
        self.connections: set[ServerConnection] = set()
        self.draining = False
        self._token: str | None = None
        self._server: Server | None = None
        self.metrics.add_collector(resources.collect_metrics)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Check the bind is safe, then listen. Raises ConfigError for an unsafe bind."""
        srv = self.config.server
        self._token = srv.check_bind()
        self._server = await serve(
            self._handle,
            srv.host,
            srv.port,
            process_request=self._process_request,
            max_size=srv.max_message_bytes,
            max_queue=16,
            compression=None,
            ping_interval=20,
            ping_timeout=60,
            server_header="edge-rtgi",
        )
        log.info("listening on ws://%s:%d", srv.host, self.port)

    @property
    def port(self) -> int:
        """The port actually bound (the configured one, or the OS's pick for port 0)."""
        if self._server is None:
            raise RuntimeError("the daemon is not listening yet: await start() first")
        return int(next(iter(self._server.sockets)).getsockname()[1])

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop accepting, let responses in flight finish (up to the timeout), then close all."""
        self.draining = True
        timeout_s = self.config.server.drain_timeout_s if timeout_s is None else timeout_s
        if self._server is not None:
            self._server.close(close_connections=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and any(
            not st.finished for s in self.sessions for st in s.responses.values()
        ):
            await asyncio.sleep(0.05)
        for ws in list(self.connections):
            await ws.close(1001, "server shutting down")
        for s in list(self.sessions):
            await s.close()
        if self._server is not None:
            await self._server.wait_closed()
        self.metrics.set("edge_rtgi_up", 0)

    # ------------------------------------------------------------------ sessions

    async def open_session(self, settings: SessionSettings, session_id: str | None = None) -> Session:
        """A session on this daemon's pipelines and shared models (used by every adapter)."""
        srv = self.config.server
        session = await Session.open(
            self.pipelines,
            self.resources,
            settings,
            SessionLimits(srv.stage_queue_frames, srv.outbox_events),
            session_id,
        )
        self.sessions.add(session)
        self.metrics.inc("edge_rtgi_sessions_total")
        self.metrics.set("edge_rtgi_sessions_active", len(self.sessions))
        return session

    async def close_session(self, session: Session) -> None:
        await session.close()
        self.sessions.discard(session)
        self.metrics.set("edge_rtgi_sessions_active", len(self.sessions))

    # ------------------------------------------------------------------ HTTP + handshake

    def _reject(self, reason: str, status: HTTPStatus, message: str) -> Response:
        self.metrics.inc("edge_rtgi_connections_rejected_total", reason=reason)
        log.warning("refused connection: %s", message)
        return _response(status, message + "\n")

    def _token_ok(self, request: Request) -> bool:
        if self._token is None:
            return True
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if given is None:
            given = query_param(request.path, "token")
        return given is not None and hmac.compare_digest(given.encode(), self._token.encode())

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/healthz":
            status = HTTPStatus.SERVICE_UNAVAILABLE if self.draining else HTTPStatus.OK
            body = {
                "status": "draining" if self.draining else "ok",
                "sessions": len(self.sessions),
                "pipelines": list(self.pipelines),
            }
            return _response(status, json.dumps(body), "application/json")
        if path == "/metrics":
            if not self._token_ok(request):
                return self._reject("token", HTTPStatus.UNAUTHORIZED, "missing or wrong token")
            return _response(HTTPStatus.OK, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        if path not in NATIVE_PATHS + REALTIME_PATHS:
            return _response(HTTPStatus.NOT_FOUND, f"no route {path}; try /healthz, /metrics, /v1/native\n")
        return self._admit(request)

    def _admit(self, request: Request) -> Response | None:
        srv = self.config.server
        origin = request.headers.get("Origin")
        if origin is not None and not origin_allowed(origin, srv.allowed_origins):
            return self._reject(
                "origin", HTTPStatus.FORBIDDEN, f"origin {origin} is not allowed (server.allowed_origins)"
            )
        if not self._token_ok(request):
            return self._reject(
                "token",
                HTTPStatus.UNAUTHORIZED,
                "missing or wrong token (send 'Authorization: Bearer <token>' or ?token=)",
            )
        if self.draining:
            return self._reject("draining", HTTPStatus.SERVICE_UNAVAILABLE, "server is shutting down")
        if len(self.connections) >= srv.max_sessions:
            return self._reject(
                "capacity", HTTPStatus.SERVICE_UNAVAILABLE, f"session limit reached ({srv.max_sessions})"
            )
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections.add(ws)
        try:
            path = urlsplit(request_path(ws)).path
            if path in REALTIME_PATHS:
                module = importlib.import_module("edge_rtgi.server.openai_realtime")
                serve_connection = getattr(module, "serve_connection", None)
                if serve_connection is None:
                    await ws.close(1011, "the OpenAI Realtime adapter is not available")
                    return
                await serve_connection(self, ws)
            else:
                from edge_rtgi.server.native import serve_native

                await serve_native(self, ws)
        except Exception:  # one session's failure must not reach the server loop
            log.exception("session handler failed")
            try:
                await ws.close(1011, "internal error")
            except Exception:  # noqa: BLE001 - already gone
                pass
        finally:
            self.connections.discard(ws)
