"""The remote LLM backend against real servers on loopback: our own daemon's
``/v1/chat/completions`` (on a tiny seeded model), and small aiohttp servers that fail the
ways real ones do (down, slow, busy, malformed, dropped mid-answer).

The edge side is a second daemon whose assistant runs on the first one; its replies are
spoken (espeak-ng) through the same clause segmenter and TTS as a local engine's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time

import pytest
import pytest_asyncio
from aiohttp import web

from edge_rtgi import frames as F
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.config import parse_pipeline
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.pipeline.session import SessionSettings
from edge_rtgi.server.app import Daemon
from edge_rtgi.server.config import DaemonConfig, ServerConfig
from tests.integration.native_client import aborted_requests, http_get
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.asyncio(loop_scope="module")
ENGINE = EngineConfig(device="cpu", dtype="fp32", quant="none", kv_cache_memory_mb=16)
QUESTION = "Hello! How are you today?"
EVENT_TIMEOUT_S = 120.0


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pipeline(name: str, assistant: str) -> str:
    return (
        f"name: {name}\nstages:\n  - asr: {{model: whisper-tiny.en}}\n"
        f"  - assistant:\n{assistant}\n  - tts: {{voice: 'espeak:en'}}\n"
    )


class FaultServer:
    """An OpenAI-shaped server on loopback that fails on purpose; counts requests per route."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.runner: web.AppRunner | None = None
        self.port = 0

    def _count(self, request: web.Request) -> str:
        kind = request.match_info["kind"]
        self.hits[kind] = self.hits.get(kind, 0) + 1
        return kind

    async def chat(self, request: web.Request) -> web.StreamResponse:
        kind = self._count(request)
        if kind == "busy":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if kind == "refuse":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if kind == "slow":
            await asyncio.sleep(60)  # cancelled when the client leaves
        elif kind == "malformed":
            await resp.write(b"data: {this is not json\n\n")
            await asyncio.sleep(60)
        elif kind == "drop":
            chunk = b'{"choices": [{"index": 0, "delta": {"content": "Half an"}, "finish_reason": null}]}'
            await resp.write(b"data: " + chunk + b"\n\n")
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()  # gone mid-answer
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{kind}/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.port}/{kind}/v1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("remote"), seed=3))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny):
    """Our own daemon as the remote engine (its OpenAI-compatible text API)."""
    pipe = parse_pipeline(f"name: chat\nstages:\n  - asr: {{}}\n  - assistant: {{model: {tiny}}}\n", "s.yaml")
    d = Daemon(
        DaemonConfig(server=ServerConfig(port=0), default_pipeline="chat", engine=ENGINE),
        {"chat": pipe},
        Resources(ENGINE),
    )
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)
    d.resources.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def faults():
    f = FaultServer()
    await f.start()
    yield f
    assert f.runner is not None
    await f.runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def edge(tiny, server, faults):
    """The device: sessions whose assistant is remote (or local, for comparison)."""
    base = f"http://127.0.0.1:{server.port}/v1"
    quick = (
        "      remote: {connect_timeout_s: 1, first_token_timeout_s: 1.5, idle_timeout_s: 1,"
        " retry_backoff_ms: 10}"
    )
    texts = {
        "local": f"      model: {tiny}\n      max_reply_tokens: 12\n      system_prompt: Be brief.",
        "remote": f"      backend: openai\n      base_url: {base}\n      model: {tiny}\n"
        "      max_reply_tokens: 12\n      system_prompt: Be brief.",
        "down": f"      backend: openai\n      base_url: http://127.0.0.1:{closed_port()}/v1\n"
        f"      model: m\n{quick}",
    }
    for kind in ("slow", "busy", "malformed", "drop", "refuse"):
        texts[kind] = f"      backend: openai\n      base_url: {faults.url(kind)}\n      model: m\n{quick}"
    pipes = {name: parse_pipeline(pipeline(name, body), f"{name}.yaml") for name, body in texts.items()}
    d = Daemon(
        DaemonConfig(server=ServerConfig(port=0), default_pipeline="local", engine=ENGINE),
        pipes,
        Resources(ENGINE),
    )
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)
    d.resources.close()


async def turn(session, text: str = QUESTION, settle_s: float = 0.0) -> list:
    """Every event of one typed turn, up to its response.done."""
    rid = (await session.add_user_text(text)).response_id
    events = []
    while True:
        ev = await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S)
        events.append(ev)
        if isinstance(ev, F.ResponseDone) and ev.response_id == rid:
            break
    return events


def done(events) -> F.ResponseDone:
    return next(e for e in events if isinstance(e, F.ResponseDone))


def spoken_s(events) -> float:
    return sum(e.duration_s for e in events if isinstance(e, F.AudioOut))


async def test_a_remote_reply_is_the_local_reply_spoken(edge, server, tiny):
    local = await edge.open_session(SessionSettings(pipeline="local"))
    remote = await edge.open_session(SessionSettings(pipeline="remote"))
    try:
        here, there = done(await turn(local)), None
        events = await turn(remote)
        there = done(events)
    finally:
        await edge.close_session(local)
        await edge.close_session(remote)
    assert here.status == there.status == "completed"
    assert there.text and there.text == here.text  # greedy on the same model: the same reply
    assert spoken_s(events) > 0.3 and any(isinstance(e, F.TextDelta) for e in events)
    s = there.stats
    assert s.backend == f"openai:{tiny}@127.0.0.1:{server.port}" and s.backend_attempts == 1
    assert s.completion_tokens == here.stats.completion_tokens and s.prompt_tokens == here.stats.prompt_tokens
    assert (
        s.backend_connect_ms is not None and s.backend_connect_ms <= s.backend_ttft_ms <= s.backend_total_ms
    )
    assert there.usage["total_tokens"] == s.prompt_tokens + s.completion_tokens
    _, models = await http_get(edge.port, "/v1/models")  # the remote's model is not served here
    assert '"id": "m"' not in models.replace('":"', '": "') and tiny in models
    _, text = await http_get(edge.port, "/metrics")
    assert f'edge_rtgi_backend_requests_total{{backend="{s.backend}",outcome="length"}} 1.0' in text
    assert f'edge_rtgi_backend_requests_total{{backend="local:{tiny}",outcome="length"}} 1.0' in text


async def test_barge_in_closes_the_remote_stream(edge, server, tiny, monkeypatch):
    engine = server.resources.llm(tiny)
    execute = engine.runner.execute

    def paced_execute(*args, **kwargs):
        # The tiny model could finish all 200 tokens before the barge-in reaches the server;
        # 30 ms a step keeps the request running while the interrupt travels.
        time.sleep(0.03)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", paced_execute)
    _, before = await http_get(server.port, "/metrics")
    session = await edge.open_session(SessionSettings(pipeline="remote", max_reply_tokens=200))
    try:
        rid = (await session.add_user_text(QUESTION)).response_id
        while not isinstance(
            ev := await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S), F.TextDelta
        ):
            pass
        assert ev.response_id == rid
        assert session.interrupt(rid, "barge_in")
        for _ in range(200):  # the server sees the client leave and aborts its request
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats().num_running == 0
    finally:
        await edge.close_session(session)
    _, after = await http_get(server.port, "/metrics")

    assert aborted_requests(after) == aborted_requests(before) + 1


@pytest.mark.parametrize(
    "kind, code, tries",
    [
        ("down", "backend_unavailable", 2),
        ("slow", "backend_timeout", 1),
        ("busy", "backend_unavailable", 3),
        ("malformed", "backend_error", 1),
        ("drop", "backend_unavailable", 1),  # after a token: never retried
        ("refuse", "backend_error", 1),
    ],
)
async def test_a_failing_remote_gives_an_error_event_and_the_session_goes_on(
    edge, faults, kind, code, tries, caplog
):
    caplog.set_level(logging.INFO)
    session = await edge.open_session(SessionSettings(pipeline=kind))
    try:
        events = await turn(session)
        err = next(e for e in events if isinstance(e, F.ErrorEvent))
        assert err.code == code and err.message.startswith("assistant: openai:m@") and err.hint
        assert not re.search(r"[A-Z]\w*(Error|Exception)\b", err.message)  # no Python names
        # the operator sees it as a warning, without a traceback
        logged = [r for r in caplog.records if r.name == "edge_rtgi.pipeline.stage"]
        assert [r.levelno for r in logged] == [logging.WARNING] and not any(r.exc_info for r in logged)
        assert done(events).status == "failed" and not err.fatal
        if kind != "down":
            assert faults.hits[kind] == tries
        # the user's turn is kept: the next one is answered with it in the history
        await session.update({"pipeline": "local"})
        again = done(await turn(session, "And now?"))
        assert again.status == "completed" and again.text
        users = [t.text for t in session.history if t.role == "user"]
        assert users == [QUESTION, "And now?"]
    finally:
        await edge.close_session(session)
    status, _ = await http_get(edge.port, "/healthz")
    assert status == 200
    _, text = await http_get(edge.port, "/metrics")
    assert f'outcome="{code}"' in text  # edge_rtgi_backend_requests_total, by backend


async def test_an_unreachable_remote_at_start_up_is_a_warning(edge, caplog):
    caplog.set_level(logging.WARNING, logger="edge_rtgi.pipeline.resources")
    fresh = Resources(ENGINE)
    await fresh.prepare(edge.pipelines["down"])  # no exception: the remote may come up later
    await fresh.aclose_backends()
    assert any(
        "not reachable" in r.getMessage() and "backend_unavailable" in r.getMessage() for r in caplog.records
    )


@pytest.mark.slow
async def test_a_llama_cpp_server_on_the_same_gguf_gives_a_spoken_reply(edge):
    """llama.cpp's OpenAI server (llama-cpp-python[server]) as a real third-party engine."""
    try:
        import llama_cpp.server  # noqa: F401
        import uvicorn  # noqa: F401 - the [server] extra's own dependencies, not pulled by the base package
    except ImportError as exc:
        pytest.skip(
            f"llama-cpp-python[server] is not installed ({exc}); build it as DESIGN.md says "
            "(CMAKE_ARGS with the AMX flags off on this CPU)"
        )
    import subprocess
    import sys

    from edge_rtgi.catalog import resolve_model

    gguf = resolve_model("smollm2-135m-instruct", role="llm")  # a GGUF LLM resolves to the file itself
    port = closed_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):  # until it answers (loading the model), or it exits
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            try:
                status, _ = await http_get(port, "/v1/models")
                if status == 200:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.2)
        else:
            pytest.fail("llama.cpp's server did not answer /v1/models within 120 s")
        body = (
            f"      backend: openai\n      base_url: http://127.0.0.1:{port}/v1\n      model: {gguf.name}\n"
        )
        pipe = parse_pipeline(pipeline("llama-cpp", body), "llama-cpp.yaml")
        edge.pipelines["llama-cpp"] = pipe
        session = await edge.open_session(SessionSettings(pipeline="llama-cpp"))
        try:
            events = await turn(session, "What do plants need to grow?")
        finally:
            await edge.close_session(session)
        reply = done(events)
        errors = [e for e in events if isinstance(e, F.ErrorEvent)]
        assert reply.status == "completed" and reply.text and spoken_s(events) > 0.3, errors
        assert reply.stats.backend.startswith("openai:") and reply.stats.completion_tokens
    finally:
        proc.terminate()
        proc.wait(timeout=30)
