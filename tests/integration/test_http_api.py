"""The OpenAI-compatible text API over loopback, on a tiny seeded model (quick): the official
``openai`` client, SSE, stop strings, seeds, usage, a client that disconnects mid-stream, bad
requests that never reach the engine, the auth rules, browser tickets and the static page.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.config import parse_pipeline
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.server.app import Daemon
from edge_rtgi.server.config import DaemonConfig, ServerConfig
from tests.integration.native_client import aborted_requests, http_get, metric
from tests.tiny_models import make_tiny_hf_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.asyncio(loop_scope="module")
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "an-http-test-token-of-good-length"
PROMPT = "The quick brown fox"
SYSTEM = "Be brief."
USER = "Hello! How are you today?"
MAX_TOKENS = 12


class CliAnswer:
    """``edge-rtgi ARGS`` started at once in its own process (its own engine and empty prefix
    cache, as a user runs it), so it loads while the tests run; ``text()`` waits for its stdout."""

    def __init__(self, *args: str, stdin: str = ""):
        self.stdin = stdin.encode()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_rtgi.cli", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def text(self) -> str:
        out, err = self.proc.communicate(self.stdin, timeout=600)
        assert self.proc.returncode == 0, err.decode()
        return out.decode().removesuffix("\n")  # bytes: no newline translation of the model's text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("http"), seed=3))


@pytest.fixture(scope="module")
def cli_answers(tiny):
    # the daemon's engine settings (tiny_daemon), on the command line
    flags = [
        "--model",
        tiny,
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--quant",
        "none",
        "--max-tokens",
        str(MAX_TOKENS),
    ]
    answers = {
        "generate": CliAnswer("generate", *flags, PROMPT),
        "chat": CliAnswer("chat", *flags, "--system", SYSTEM, stdin=USER + "\n"),
    }
    yield answers
    for answer in answers.values():
        if answer.proc.poll() is None:
            answer.proc.kill()
            answer.proc.communicate()


def tiny_daemon(tiny, resources: Resources | None = None, **server) -> Daemon:
    pipe = parse_pipeline(
        f"name: tiny-chat\nstages:\n  - asr: {{}}\n  - assistant:\n      model: {tiny}\n", "t.yaml"
    )
    engine = EngineConfig(device="cpu", dtype="fp32", quant="none", kv_cache_memory_mb=16)
    cfg = DaemonConfig(server=ServerConfig(port=0, **server), default_pipeline="tiny-chat", engine=engine)
    return Daemon(cfg, {"tiny-chat": pipe}, resources or Resources(engine))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tiny, cli_answers):  # the CLI processes start first and load meanwhile
    d = tiny_daemon(tiny)
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)
    d.resources.close()


def client(daemon, api_key="local"):
    return openai.AsyncOpenAI(api_key=api_key, base_url=f"http://127.0.0.1:{daemon.port}/v1", max_retries=0)


async def post(port: int, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()

    def call():
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    return await asyncio.to_thread(call)


async def test_official_client_greedy_output_equals_the_cli(daemon, tiny, cli_answers):
    c = client(daemon)
    engine = daemon.resources.llm(tiny)
    assert [m.id for m in (await c.models.list()).data] == [tiny]
    generated, chatted = await asyncio.gather(
        asyncio.to_thread(cli_answers["generate"].text), asyncio.to_thread(cli_answers["chat"].text)
    )
    assert generated and chatted

    engine.reset_prefix_cache()  # as the CLI's fresh engine: no earlier request's blocks
    whole = await c.completions.create(model=tiny, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == generated
    u = whole.usage
    assert u.completion_tokens <= MAX_TOKENS and u.total_tokens == u.prompt_tokens + u.completion_tokens
    engine.reset_prefix_cache()
    stream = await c.completions.create(
        model=tiny, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text async for chunk in stream]
    assert "".join(pieces) == generated and len([p for p in pieces if p]) >= 2

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    engine.reset_prefix_cache()
    chat = await c.chat.completions.create(
        model=tiny, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == chatted and chat.choices[0].message.role == "assistant"
    engine.reset_prefix_cache()
    stream = await c.chat.completions.create(
        model=tiny,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chatted
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == chat.choices[0].finish_reason


async def test_max_tokens_stop_strings_and_seeds(daemon, tiny):
    c = client(daemon)
    cut = await c.completions.create(model=tiny, prompt=PROMPT, max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    full = (
        (await c.completions.create(model=tiny, prompt=PROMPT, max_tokens=24, temperature=0)).choices[0].text
    )
    stop = full.strip()[len(full.strip()) // 2 :][:2]  # a string from the middle of the greedy text
    stopped = await c.completions.create(model=tiny, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert full.startswith(stopped.choices[0].text)
    sampled = [
        (
            await c.completions.create(
                model=tiny, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=s
            )
        )
        .choices[0]
        .text
        for s in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1], "the same seed samples the same text"
    assert len({sampled[0], sampled[2], full[: len(sampled[0])]}) >= 2, "sampling is not greedy decoding"


async def test_bad_requests_get_openai_errors_and_never_reach_the_engine(daemon, tiny):
    engine = daemon.resources.llm(tiny)
    await post(daemon.port, "/v1/completions", {"model": tiny, "prompt": "warm", "max_tokens": 1})
    _, before = await http_get(daemon.port, "/metrics")
    steps = engine.stats().num_steps
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (b'{"model": "x", "messages": [', None, "not valid JSON"),
        ({"model": tiny}, "messages", "'messages' is required"),
        (
            {"model": tiny, "messages": messages, "max_tokens": 1000},
            "max_tokens",
            "context window of 256 tokens",
        ),
        ({"model": "gpt-4o", "messages": messages}, "model", "unknown model 'gpt-4o'"),
        (
            {"model": tiny, "messages": [{"role": "user", "content": "word " * 400}]},
            "messages",
            "context window",
        ),
    ]
    for body, param, words in cases:
        status, answer = await post(daemon.port, "/v1/chat/completions", body)
        err = answer["error"]
        assert status == 400 and err["type"] == "invalid_request_error", answer
        assert err["param"] == param and words in err["message"], err
    c = client(daemon)
    with pytest.raises(openai.BadRequestError, match="max_tokens is 999"):
        await c.chat.completions.create(model=tiny, messages=messages, max_tokens=999)
    _, after = await http_get(daemon.port, "/metrics")
    assert engine.stats().num_steps == steps
    assert metric(after, "edge_rtgi_llm_requests_total") == metric(before, "edge_rtgi_llm_requests_total")
    assert 'edge_rtgi_http_requests_total{route="chat.completions",status="400"} 6.0' in after


async def test_a_client_that_disconnects_mid_stream_aborts_its_request(daemon, tiny):
    engine = daemon.resources.llm(tiny)
    _, before = await http_get(daemon.port, "/metrics")
    body = {"model": tiny, "prompt": PROMPT, "max_tokens": 230, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"http://127.0.0.1:{daemon.port}/v1/completions", json=body)
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        first = await resp.content.readline()
        assert first.startswith(b"data: {")
        resp.connection.transport.abort()  # gone without a word, mid-stream
        resp.close()
    for _ in range(200):
        if engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.05)
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0
    _, after = await http_get(daemon.port, "/metrics")

    assert aborted_requests(after) == aborted_requests(before) + 1


async def test_page_and_its_files_are_served_with_nothing_from_elsewhere(daemon):
    status, page = await http_get(daemon.port, "/")
    assert status == 200 and "<title>edge-rtgi</title>" in page and "/static/app.js" in page
    for name in ("app.js", "app.css", "pcm-worklet.js"):
        status, text = await http_get(daemon.port, f"/static/{name}")
        assert status == 200 and text
        assert "http://" not in text and "https://" not in text and "cdn" not in text.lower(), name
    assert (await http_get(daemon.port, "/static/../app.py"))[0] == 404
    status, body = await http_get(daemon.port, "/v1/nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


@pytest.mark.slow  # opens a session, so whisper tiny.en loads
async def test_token_rules_and_browser_tickets(tiny, daemon):
    d = tiny_daemon(tiny, daemon.resources, token=TOKEN)  # the module daemon's models, shared
    await d.start()
    try:
        port = d.port
        with pytest.raises(openai.AuthenticationError):
            await client(d, "wrong-key").models.list()
        assert (await http_get(port, "/v1/models"))[0] == 401  # no key at all
        assert [m.id for m in (await client(d, TOKEN).models.list()).data] == [tiny]
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        status, answer = await post(
            port, "/v1/chat/completions", {"model": tiny}, {**bearer, "Origin": "https://evil.example"}
        )
        assert status == 403 and answer["error"]["code"] == "origin"
        status, answer = await post(port, "/v1/tickets", b"")
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        status, answer = await post(port, "/v1/tickets", b"", bearer)
        assert status == 200 and answer["expires_in_s"] > 0
        url = f"ws://127.0.0.1:{port}/v1/native?ticket={answer['ticket']}"
        async with connect(url, origin=f"http://127.0.0.1:{port}") as ws:  # as the page connects
            assert json.loads(await ws.recv())["type"] == "session.created"
            assert ws.response.headers["Server"] == "edge-rtgi"
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url):  # the same ticket again
                pass
        assert refused.value.response.status_code == 401
        _, answer = await post(port, "/v1/tickets", b"", bearer)
        async with connect(f"ws://127.0.0.1:{port}/?ticket={answer['ticket']}") as ws:  # "/" upgrades too
            assert json.loads(await ws.recv())["type"] == "session.created"
    finally:
        await d.drain(timeout_s=0.5)


async def test_drain_answers_503_and_lets_a_request_in_flight_finish(tiny, daemon):
    d = tiny_daemon(tiny, daemon.resources)
    await d.start()
    port = d.port
    body = json.dumps({"model": tiny, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body[:10])  # admitted, and still sending its body when the drain starts
    await writer.drain()
    for _ in range(200):
        if d.http_in_flight:
            break
        await asyncio.sleep(0.02)
    assert d.http_in_flight == 1
    drain = asyncio.create_task(d.drain(timeout_s=60))
    try:
        status, health = await http_get(port, "/healthz")
        assert status == 503 and json.loads(health)["status"] == "draining"
        status, answer = await post(port, "/v1/chat/completions", {"model": tiny, "messages": []})
        assert status == 503 and "shutting down" in answer["error"]["message"]
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"ws://127.0.0.1:{port}/v1/native"):
                pass
        assert refused.value.response.status_code == 503
        assert not drain.done(), "the drain waits for the request in flight"
        writer.write(body[10:])
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 60)
        assert response.startswith(b"HTTP/1.1 200") and b'"text_completion"' in response
        await asyncio.wait_for(drain, 30)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        writer.close()
        if not drain.done():
            await drain


async def test_responses_name_the_server_without_versions(daemon):
    def head(path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}{path}", timeout=10) as resp:
            return resp.headers["Server"]

    assert await asyncio.to_thread(head, "/healthz") == "edge-rtgi"
    assert await asyncio.to_thread(head, "/") == "edge-rtgi"
