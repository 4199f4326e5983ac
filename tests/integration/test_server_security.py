"""The daemon's safety rules and its handling of bad input, over real loopback connections.

A light daemon (whisper tiny.en + Apertium + espeak-ng, no LLM) keeps this module quick.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import pytest_asyncio
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from edge_rtgi.errors import ConfigError
from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.server.app import Daemon, origin_allowed
from edge_rtgi.server.config import DaemonConfig, ServerConfig, is_loopback
from tests.integration.native_client import NativeClient, http_get, metric

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
TOKEN = "a-test-token-of-sufficient-length"


def light_pipelines():
    pipes = load_pipelines([builtin_pipelines_dir()])
    return {k: v for k, v in pipes.items() if k in ("translate-en-es", "transcribe")}


@pytest.fixture(scope="module")
def resources():
    res = Resources()
    yield res
    res.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(resources):
    cfg = DaemonConfig(
        server=ServerConfig(port=0, max_message_bytes=65536), default_pipeline="translate-en-es"
    )
    d = Daemon(cfg, light_pipelines(), resources)
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)


async def test_origin_matching_rules():
    allowed = ("http://localhost", "https://app.example")
    assert origin_allowed("http://localhost:3000", allowed)
    assert origin_allowed("https://app.example", allowed)
    assert not origin_allowed("https://evil.example", allowed)
    assert not origin_allowed("http://localhost.evil.example", allowed)
    assert not origin_allowed("null", allowed)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("myhost")


async def test_cross_site_origin_is_refused(daemon):
    url = f"ws://127.0.0.1:{daemon.port}/v1/native"
    with pytest.raises(InvalidStatus) as err:
        async with connect(url, origin="https://evil.example"):
            pass
    assert err.value.response.status_code == 403
    async with connect(url, origin="http://localhost:5173") as ws:  # an allowed page
        assert json.loads(await ws.recv())["type"] == "session.created"
    async with connect(url) as ws:  # a native client sends no Origin
        assert json.loads(await ws.recv())["type"] == "session.created"
    _, body = await http_get(daemon.port, "/metrics")
    assert 'edge_rtgi_connections_rejected_total{reason="origin"} 1' in body


async def test_non_loopback_bind_needs_a_token(resources, monkeypatch):
    monkeypatch.delenv("EDGE_RTGI_TOKEN", raising=False)
    d = Daemon(
        DaemonConfig(server=ServerConfig(host="0.0.0.0", port=0), default_pipeline="transcribe"),
        light_pipelines(),
        resources,
    )
    with pytest.raises(
        ConfigError, match="refusing to listen on 0.0.0.0: a non-loopback address needs a token"
    ):
        await d.start()


async def test_token_is_required_when_configured(resources):
    d = Daemon(
        DaemonConfig(server=ServerConfig(host="0.0.0.0", port=0, token=TOKEN), default_pipeline="transcribe"),
        light_pipelines(),
        resources,
    )
    await d.start()
    try:
        url = f"ws://127.0.0.1:{d.port}/v1/native"
        for kwargs in ({}, {"additional_headers": {"Authorization": "Bearer wrong-token-wrong-token"}}):
            with pytest.raises(InvalidStatus) as err:
                async with connect(url, **kwargs):
                    pass
            assert err.value.response.status_code == 401
        async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
        with pytest.raises(InvalidStatus) as err:  # never from a URL (logs, histories): tickets
            async with connect(url + f"?token={TOKEN}"):
                pass
        assert err.value.response.status_code == 401
        assert (await http_get(d.port, "/metrics"))[0] == 401
        assert (await http_get(d.port, "/metrics", {"Authorization": f"Bearer {TOKEN}"}))[0] == 200
        assert (await http_get(d.port, "/healthz"))[0] == 200
    finally:
        await d.drain(timeout_s=0.5)


async def test_bad_messages_get_error_events_and_the_session_continues(daemon):
    c = await NativeClient.open(daemon.port)
    try:
        await c.wait_type("session.created")
        bad = [
            ("{this is not json", "invalid_json"),
            ('{"type": "session.explode"}', "unknown_event"),
            (b"\x01\x02\x03", "invalid_audio"),
            ('{"type": "text.input"}', "invalid_event"),
            ('{"type": "session.update", "session": {"max_reply_tokns": 5}}', "invalid_request"),
            ('{"type": "session.update", "session": {"pipeline": "nope"}}', "invalid_request"),
        ]
        for i, (message, code) in enumerate(bad):
            await c.ws.send(message)
            err = await c.wait_for(lambda h, code=code: h["type"] == "error" and h["code"] == code)
            assert err["message"]
            await c.send(type="ping", id=i)  # still alive after each bad message
            await c.wait_type("pong", id=i)
        assert "session.explode" in c.of("error")[1]["message"]
        assert "max_reply_tokns" in c.of("error")[4]["message"]
        # and a real turn still works
        await c.send(type="text.input", text="Good morning.")
        done = await c.wait_type("response.done")
        assert done["status"] == "completed" and "buenos" in done["text"].lower()
        assert c.audio(done["response_id"])[0].size > 0
    finally:
        await c.close()


async def test_oversized_message_closes_only_that_connection(daemon):
    other = await NativeClient.open(daemon.port)
    big = await NativeClient.open(daemon.port)
    try:
        await other.wait_type("session.created")
        await big.wait_type("session.created")
        with pytest.raises(ConnectionClosed):
            await big.ws.send(np.zeros(70000, np.int16).tobytes())  # 140 kB > 64 kB limit
            await asyncio.wait_for(big.ws.wait_closed(), 10)
            await big.ws.send(b"\x00\x00")
        assert big.ws.close_code == 1009
        await other.send(type="text.input", text="Thank you.")
        done = await other.wait_type("response.done")
        assert done["status"] == "completed"
    finally:
        await other.close()
        await big.close()
    status, body = await http_get(daemon.port, "/healthz")
    assert status == 200


async def test_unknown_pipeline_in_url_is_an_error_not_a_crash(daemon):
    async with connect(f"ws://127.0.0.1:{daemon.port}/v1/native?pipeline=klingon") as ws:
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and "klingon" in err["message"]
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    status, body = await http_get(daemon.port, "/metrics")
    assert status == 200 and metric(body, "edge_rtgi_up") == 1
