"""The daemon: one process, one set of shared models, many sessions, one aiohttp server.

Routes on one port (docs/daemon.md):

- ``GET /``: the browser client (``edge_rtgi/server/http/static/``); a WebSocket upgrade
  there is the native protocol, as before;
- ``GET /healthz``: JSON liveness (503 while draining); ``GET /metrics``: Prometheus text;
- ``/v1/native``: the native protocol (``edge_rtgi.server.native``);
- ``/v1/realtime``: the OpenAI Realtime adapter (``edge_rtgi.server.openai_realtime``);
- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``: the
  OpenAI-compatible text API on the shared engines (``edge_rtgi.server.http.openai_api``);
- ``POST /v1/tickets``: a single-use WebSocket ticket for browsers (they cannot send headers).

With ``wyoming.uri`` set, the daemon also serves Home Assistant's Wyoming protocol on its own
TCP port or Unix socket (``edge_rtgi.server.wyoming``), on the same models and engine.

Every WebSocket handshake and API request passes ``admit``: Origin allow-list (cross-site
requests from browser pages), token when one is configured, draining, and for WebSockets the
session limit. A session that fails is closed on its own; the daemon and the other sessions
carry on.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from edge_rtgi.pipeline.config import PipelineConfig
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.pipeline.session import Session, SessionLimits, SessionSettings
from edge_rtgi.server.admission import SINGLE_HEADERS, AuthThrottle, Refusal, origin_allowed
from edge_rtgi.server.config import DaemonConfig
from edge_rtgi.server.connection import ClientSocket, FloodLimits, query_param
from edge_rtgi.server.http import browser, openai_api
from edge_rtgi.server.http.tickets import Tickets
from edge_rtgi.server.memory import CycleCollector, HeapTrimmer
from edge_rtgi.server.metrics import CONTENT_TYPE, Metrics

if TYPE_CHECKING:
    from edge_rtgi.server.wyoming import WyomingServer

__all__ = ["Daemon", "origin_allowed", "start_worker_pool"]

log = logging.getLogger(__name__)

REALTIME_PATHS = ("/v1/realtime", "/v1/realtime/")
# keepalive pings from the server; a client that answers none within half of it is dropped
HEARTBEAT_S = 30.0
# how long handlers still running after the drain (an SSE stream, say) get before cancellation
SHUTDOWN_GRACE_S = 1.0
# how long the drain waits for closed sessions' last events to be sent before the sockets close
FLUSH_S = 1.0

SocketHandler = Callable[["Daemon", ClientSocket], Awaitable[None]]

# Python's own size for the default executor (short blocking work: tokenizing, prompt rendering)
WORKER_THREADS = min(32, (os.cpu_count() or 1) + 4)


def start_worker_pool(loop: asyncio.AbstractEventLoop, workers: int = WORKER_THREADS) -> ThreadPoolExecutor:
    """Give ``loop`` a default executor of ``workers`` threads, all started now.

    ``ThreadPoolExecutor`` adds a thread only when a task finds none idle and never ends one, so
    the daemon's thread count crept up with its busiest moment and looked like a leak in the
    soak. Started at once, the idle thread count is the working one (docs/reliability.md, "Soak").
    Call it before serving: it waits (milliseconds) for every thread to be running.
    """
    pool = ThreadPoolExecutor(workers, thread_name_prefix="edge-rtgi-worker")
    # each task waits for all the others, so no thread is idle when the next is submitted
    barrier = threading.Barrier(workers)
    for started in [pool.submit(barrier.wait, 30.0) for _ in range(workers)]:
        started.result()
    loop.set_default_executor(pool)
    return pool


def text_response(status: HTTPStatus, body: str, content_type: str = "text/plain") -> web.Response:
    """A small uncached text answer."""
    return web.Response(
        status=status.value, text=body, content_type=content_type, headers={"Cache-Control": "no-store"}
    )


class Daemon:
    """Serves sessions and the HTTP API until ``drain()``. Start with ``await daemon.start()``."""

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
        self.metrics = Metrics()
        self.metrics.add_engines(resources.engines)
        resources.add_request_listener(self.metrics.observe_request)
        resources.add_asr_step_listener(self.metrics.observe_asr_step)
        resources.backend_observers.observers.append(self.metrics)
        self.sessions: set[Session] = set()
        self.connections: set[ClientSocket] = set()
        self.http_in_flight = 0  # API requests being answered (the drain waits for them)
        self.draining = False
        self.tickets = Tickets()
        self.auth_throttle = AuthThrottle(config.server.auth_failures_per_min)
        self._token: str | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.wyoming: WyomingServer | None = None  # Home Assistant's protocol, when configured
        interval_s = config.server.heap_trim_interval_s
        self.heap_trimmer = (
            HeapTrimmer(interval_s, self._in_use, self.metrics.observe_heap_trim) if interval_s > 0 else None
        )
        gc_s = config.server.gc_interval_s
        self.cycle_collector = (
            CycleCollector(gc_s, self._in_use, self.metrics.observe_gc) if gc_s > 0 else None
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Check the bind is safe, then listen. Raises ConfigError for an unsafe bind."""
        srv = self.config.server
        self._token = srv.check_bind()
        if self.config.wyoming.uri is not None:
            self.config.wyoming.check_bind()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts
        # the engine request of a chat completion at once (the WebSocket loop shields its close)
        self._runner = web.AppRunner(
            self._app(), access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, srv.host, srv.port)
        await self._site.start()
        log.info("listening on http://%s:%d", srv.host, self.port)
        if self.config.wyoming.uri is not None:
            from edge_rtgi.server.wyoming import WyomingServer

            self.wyoming = WyomingServer(self, self.config.wyoming)
            await self.wyoming.start()
        if self.heap_trimmer is not None:
            self.heap_trimmer.start()
        if self.cycle_collector is not None:
            self.cycle_collector.start()

    def _app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.server.max_message_bytes,
            middlewares=[self._single_headers, self._not_found],
        )
        app.router.add_get("/", self._root)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/tickets", self._ticket)
        app.router.add_get("/v1/native", lambda r: self._websocket(r, _serve_native))  # and "/": _root
        for path in REALTIME_PATHS:
            app.router.add_get(path, lambda r: self._websocket(r, _serve_realtime))
        openai_api.add_routes(app.router, self)
        browser.add_routes(app.router)
        app.on_response_prepare.append(_server_header)
        return app

    @property
    def port(self) -> int:
        """The port actually bound (the configured one, or the OS's pick for port 0)."""
        addresses = self._runner.addresses if self._runner is not None else []
        if not addresses:
            raise RuntimeError("the daemon is not listening: await start() first")
        return int(addresses[0][1])

    def _in_use(self) -> bool:
        return bool(self.sessions) or self.http_in_flight > 0

    def _busy(self) -> bool:
        return self.http_in_flight > 0 or any(
            not st.finished for s in self.sessions for st in s.responses.values()
        )

    async def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new work (503, and /healthz says "draining"), let responses and API requests in
        flight finish (up to the timeout), close every session with 1001, stop listening."""
        self.draining = True
        if self.heap_trimmer is not None:
            await self.heap_trimmer.stop()
        if self.cycle_collector is not None:
            await self.cycle_collector.stop()
        timeout_s = self.config.server.drain_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and self._busy():
            await asyncio.sleep(0.05)
        if self.wyoming is not None:
            await self.wyoming.stop()
            self.wyoming = None
        # Close the sessions first: a reply the timeout cut gets response.interrupted and
        # response.done, and the writers send what is queued before the sockets close.
        for s in list(self.sessions):
            await s.close()
        flush_deadline = loop.time() + FLUSH_S
        while loop.time() < flush_deadline and any(len(s.outbox) for s in self.sessions):
            await asyncio.sleep(0.01)
        for ws in list(self.connections):
            await ws.close(1001, "server shutting down")
        if self._runner is not None:
            await self._runner.cleanup()  # stops listening, then ends what is left
            self._runner = self._site = None
        await self.resources.aclose_backends()
        self.metrics.up.set(0)

    # ------------------------------------------------------------------ sessions

    async def open_session(
        self,
        settings: SessionSettings,
        session_id: str | None = None,
        pipelines: dict[str, PipelineConfig] | None = None,
    ) -> Session:
        """A session on this daemon's pipelines and shared models (used by every adapter);
        ``pipelines`` replaces the daemon's (the Wyoming services use parts of one)."""
        srv = self.config.server
        session = Session(
            pipelines or self.pipelines,
            self.resources,
            settings,
            SessionLimits(srv.stage_queue_frames, srv.outbox_events, srv.history_turns),
            session_id,
        )
        # counted from before its stages start: a client gone mid-open cannot leave it behind
        self.sessions.add(session)
        try:
            await session.start()
        except BaseException:
            self.sessions.discard(session)
            raise
        self.metrics.sessions.inc()
        self.metrics.sessions_active.set(len(self.sessions))
        return session

    async def close_session(self, session: Session) -> None:
        await session.close()
        self.sessions.discard(session)
        self.metrics.sessions_active.set(len(self.sessions))
        if self.heap_trimmer is not None:
            self.heap_trimmer.note_activity()
        if self.cycle_collector is not None:
            self.cycle_collector.note_activity()

    # ------------------------------------------------------------------ admission

    def _token_ok(self, request: web.Request, websocket: bool) -> bool:
        if self._token is None:
            return True
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if given is None and websocket:
            # Browsers cannot set headers: a single-use ticket from POST /v1/tickets. The token
            # itself is never read from a URL (URLs end up in logs and browser histories).
            ticket = query_param(request.path_qs, "ticket")
            if ticket is not None:
                return self.tickets.redeem(ticket)
        return given is not None and hmac.compare_digest(given.encode(), self._token.encode())

    def check_token(self, request: web.Request, websocket: bool = False) -> None:
        """Raise ``Refusal`` (401, or 429 after too many wrong tokens from this address)."""
        if self._token is None:
            return
        address = request.remote or "?"
        wait_s = self.auth_throttle.retry_after_s(address)
        if wait_s > 0:
            raise Refusal(
                HTTPStatus.TOO_MANY_REQUESTS,
                "auth_throttled",
                f"too many wrong tokens from this address; try again in {wait_s:.0f} s",
            )
        if not self._token_ok(request, websocket):
            self.auth_throttle.failed(address)
            how = "'Authorization: Bearer <token>'" + (
                ", or ?ticket= from POST /v1/tickets" if websocket else ""
            )
            raise Refusal(HTTPStatus.UNAUTHORIZED, "token", f"missing or wrong token (send {how})")

    def admit(self, request: web.Request, websocket: bool = False) -> None:
        """Raise ``Refusal`` unless ``request`` may be served (counted by reason in /metrics)."""
        try:
            self._check(request, websocket)
        except Refusal as refusal:
            self.metrics.rejected.labels(reason=refusal.reason).inc()
            log.warning("refused %s: %s", request.path, refusal.message)
            raise

    def admit_text_request(self) -> None:
        """Refuse a text API request beyond ``server.max_text_requests`` in flight: a busy
        answer at once, rather than a queue in front of the engine the voice sessions share."""
        limit = self.config.server.max_text_requests
        if self.http_in_flight >= limit:
            self.metrics.rejected.labels(reason="busy").inc()
            raise Refusal(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "busy",
                f"busy: {limit} text requests are being answered (server.max_text_requests); retry shortly",
            )

    def _check(self, request: web.Request, websocket: bool) -> None:
        srv = self.config.server
        origin = request.headers.get("Origin")
        if origin is not None and not origin_allowed(origin, srv.allowed_origins):
            raise Refusal(
                HTTPStatus.FORBIDDEN, "origin", f"origin {origin} is not allowed (server.allowed_origins)"
            )
        self.check_token(request, websocket)
        if self.draining:
            raise Refusal(HTTPStatus.SERVICE_UNAVAILABLE, "draining", "server is shutting down")
        if websocket and len(self.connections) >= srv.max_sessions:
            raise Refusal(
                HTTPStatus.SERVICE_UNAVAILABLE, "capacity", f"session limit reached ({srv.max_sessions})"
            )

    # ------------------------------------------------------------------ routes

    @web.middleware
    async def _single_headers(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        for name in SINGLE_HEADERS:
            if len(request.headers.getall(name, ())) > 1:
                self.metrics.rejected.labels(reason="duplicate_header").inc()
                log.warning("refused %s: the %s header was sent more than once", request.path, name)
                return text_response(
                    HTTPStatus.BAD_REQUEST, f"the {name} header was sent more than once; send it once\n"
                )
        return await handler(request)

    @web.middleware
    async def _not_found(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:
            if request.path.startswith("/v1/"):
                return openai_api.error_response(
                    HTTPStatus.NOT_FOUND, f"no route {request.method} {request.path}", "not_found"
                )
            return text_response(
                HTTPStatus.NOT_FOUND,
                f"no route {request.path}; try /, /healthz, /metrics, /v1/native, /v1/chat/completions\n",
            )

    def health_problems(self) -> list[str]:
        """What keeps the daemon from serving (empty when healthy): a dead engine thread."""
        return [
            f"the LLM engine thread of {Path(name).name} has stopped; restart the daemon"
            for name, engine in self.resources.engines().items()
            if not engine.closed and not engine.running_in_thread
        ]

    async def _health(self, request: web.Request) -> web.Response:
        problems = self.health_problems()
        body = {
            "status": "draining" if self.draining else "unhealthy" if problems else "ok",
            "sessions": len(self.sessions),
            "pipelines": list(self.pipelines),
        }
        if problems:
            body["problems"] = problems
        status = HTTPStatus.SERVICE_UNAVAILABLE if self.draining or problems else HTTPStatus.OK
        return web.json_response(body, status=status.value, headers={"Cache-Control": "no-store"})

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            self.check_token(request)
        except Refusal as refusal:
            self.metrics.rejected.labels(reason=refusal.reason).inc()
            return text_response(refusal.status, refusal.message + "\n")
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"}
        )

    async def _ticket(self, request: web.Request) -> web.Response:
        try:
            self.admit(request)
        except Refusal as refusal:
            return openai_api.error_response(refusal.status, refusal.message, refusal.reason)
        return web.json_response(
            {"ticket": self.tickets.issue(), "expires_in_s": self.tickets.ttl_s},
            headers={"Cache-Control": "no-store"},
        )

    async def _root(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request, _serve_native)
        return await browser.index(request)

    async def _websocket(self, request: web.Request, serve: SocketHandler) -> web.StreamResponse:
        try:
            self.admit(request, websocket=True)
        except Refusal as refusal:
            return text_response(refusal.status, refusal.message + "\n")
        ws = web.WebSocketResponse(
            max_msg_size=self.config.server.max_message_bytes, compress=False, heartbeat=HEARTBEAT_S
        )
        if not ws.can_prepare(request).ok:
            return text_response(HTTPStatus.UPGRADE_REQUIRED, f"{request.path} is a WebSocket endpoint\n")
        await ws.prepare(request)
        srv = self.config.server
        sock = ClientSocket(ws, request.path_qs, FloodLimits(srv.max_messages_per_s, srv.max_audio_speed))
        self.connections.add(sock)
        try:
            await serve(self, sock)
        except Exception:  # one session's failure must not reach the server loop
            log.exception("session handler failed")
            try:
                await sock.close(1011, "internal error")
            except Exception:  # noqa: BLE001 - already gone
                pass
        finally:
            self.connections.discard(sock)
            await sock.finish()
        return ws


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # as the websockets server said; aiohttp's default names the Python and aiohttp versions
    response.headers["Server"] = "edge-rtgi"


async def _serve_native(daemon: Daemon, ws: ClientSocket) -> None:
    from edge_rtgi.server.native import serve_native

    await serve_native(daemon, ws)


async def _serve_realtime(daemon: Daemon, ws: ClientSocket) -> None:
    from edge_rtgi.server.openai_realtime import serve_connection

    await serve_connection(daemon, ws)
