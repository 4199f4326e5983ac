"""Regression tests for the faults an outside probe found in the daemon (issue #18), each
reproduced over a real loopback connection to a light daemon (whisper tiny.en, a tiny seeded
LLM, espeak-ng): hostile frames, input that used to break a session for good, leaked sessions,
history that froze the event loop, per-session memory, auth and exposure, and the drain.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import weakref

import pytest
import pytest_asyncio
from websockets.asyncio.client import connect

from tests.integration.light_daemon import light_daemon, tiny_model, tracebacks
from tests.integration.native_client import NativeClient, http_get

pytestmark = pytest.mark.asyncio(loop_scope="module")
TOKEN = "a-hardening-test-token-0123456789"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("hardening"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(model):
    d = light_daemon(model)
    for pipeline in d.pipelines.values():
        await d.resources.prepare(pipeline)
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)
    d.resources.close()


async def realtime(port: int, query: str = "", **kwargs):
    ws = await connect(f"ws://127.0.0.1:{port}/v1/realtime{query}", max_size=1 << 22, **kwargs)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created"
    return ws


async def next_of(ws, kind: str, timeout_s: float = 60) -> dict:
    async def find():
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == kind:
                return event

    return await asyncio.wait_for(find(), timeout_s)


async def native_turn_works(c: NativeClient, text: str = "Hello there.") -> dict:
    before = len(c.of("response.done"))
    await c.send(type="text.input", text=text)
    await c.wait_for(lambda h: h["type"] == "response.done" and len(c.of("response.done")) > before)
    return c.of("response.done")[-1]


# ---------------------------------------------------------------------------------- hostile frames

HOSTILE_NATIVE = [
    ("[" * 50_000 + "]" * 50_000, "invalid_json"),  # deep nesting: RecursionError before
    ('{"type": "ping", "id": ' + "7" * 5000 + "}", "invalid_json"),  # past Python's int digit limit
    ('{"type": "session.update", "session": {"temperature": 1' + "0" * 400 + "}}", "invalid_json"),
    ('{"type": "session.update", "session": {"temperature": 1e999}}', "invalid_json"),
    ('{"type": "session.update", "session": {"temperature": NaN}}', "invalid_json"),
    ('{"type": "text.input", "text": "bad \\ud800 text"}', "invalid_json"),
    ('{"type": "session.update", "session": {"vad_min_silence_ms": -5}}', "invalid_request"),
    ('{"type": "session.update", "session": {"vad_prefix_padding_ms": -100}}', "invalid_request"),
    ('{"type": "session.update", "session": {"system_prompt": 7}}', "invalid_request"),
    ('{"type": "session.update", "session": {"pipeline": "../../etc/passwd"}}', "invalid_request"),
]


async def test_hostile_native_frames_get_error_events_and_the_session_goes_on(daemon, caplog):
    caplog.set_level(logging.INFO)
    c = await NativeClient.open(daemon.port)
    try:
        await c.wait_type("session.created")
        for i, (frame, code) in enumerate(HOSTILE_NATIVE):
            await c.ws.send(frame)
            await c.send(type="ping", id=i)
            await c.wait_type("pong", id=i)
            errors = c.of("error")
            assert len(errors) == i + 1 and errors[-1]["code"] == code, (frame[:80], errors[-1:])
            assert "Error" not in errors[-1]["message"], "no Python exception names reach clients"
        assert "-5" in c.of("error")[6]["message"] and "vad_min_silence_ms" in c.of("error")[6]["message"]
        assert "surrogate" in c.of("error")[5]["message"]
        done = await native_turn_works(c)
        assert done["status"] == "completed" and done["text"]
    finally:
        await c.close()
    assert tracebacks(caplog.records) == []


HOSTILE_REALTIME = [
    {"type": "session.update", "session": {"audio": {"input": "format"}}},
    {"type": "session.update", "session": {"audio": {"input": [1]}}},
    {"type": "session.update", "session": {"audio": {"input": {"transcription": {"model": {}}}}}},
    {"type": "session.update", "session": {"audio": {"output": {"format": {"type": ["x"]}}}}},
    {
        "type": "session.update",
        "session": {"audio": {"input": {"turn_detection": {"silence_duration_ms": -1}}}},
    },
    {
        "type": "conversation.item.create",
        "item": {"type": "message", "role": "user", "content": [{"type": ["x"]}]},
    },
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [7]}},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": {"a": 1}}},
    {
        "type": "conversation.item.create",
        "item": {"role": "user", "content": [{"type": "input_text", "text": 5}]},
    },
    {"type": "session.update", "session": {"edge_rtgi": {"pipeline": "/etc/passwd"}}},
]


async def test_hostile_realtime_events_get_error_events(daemon, caplog):
    caplog.set_level(logging.INFO)
    ws = await realtime(daemon.port)
    try:
        for event in HOSTILE_REALTIME:
            await ws.send(json.dumps(event))
            err = await next_of(ws, "error")
            assert err["error"]["type"] == "invalid_request_error", (event, err)
            assert "Error" not in err["error"]["message"]
        for frame in ("[" * 50_000, '{"type": "session.update", "session": {"instructions": "\\udfff"}}'):
            await ws.send(frame)
            assert (await next_of(ws, "error"))["error"]["code"] == "invalid_json"
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
        updated = await next_of(ws, "session.updated")
        assert updated["session"]["instructions"] == "Be brief."
    finally:
        await ws.close()
    assert tracebacks(caplog.records) == []


async def test_a_lone_surrogate_never_poisons_later_replies(daemon):
    """The probe: ``\\ud800`` in a typed turn was remembered, and every later reply failed."""
    ws = await realtime(daemon.port)
    try:
        await ws.send(
            r'{"type": "conversation.item.create", "item": {"type": "message", "role": "user",'
            r' "content": [{"type": "input_text", "text": "hi \ud800"}]}}'
        )
        assert (await next_of(ws, "error"))["error"]["code"] == "invalid_json"
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hello there."}],
        }
        await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create"}))
        done = await next_of(ws, "response.done")
        assert done["response"]["status"] == "completed", done
    finally:
        await ws.close()


# ---------------------------------------------------------------------------------- sessions


async def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


async def test_realtime_clients_that_leave_right_after_the_handshake_leak_no_session(daemon):
    for _ in range(12):
        ws = await connect(f"ws://127.0.0.1:{daemon.port}/v1/realtime")
        ws.transport.abort()  # gone before the daemon sends session.created
    for _ in range(4):
        async with connect(f"ws://127.0.0.1:{daemon.port}/v1/realtime"):
            pass
    assert await wait_until(lambda: not daemon.sessions and not daemon.connections), (
        len(daemon.sessions),
        len(daemon.connections),
    )
    _, body = await http_get(daemon.port, "/healthz")
    assert json.loads(body)["sessions"] == 0


async def test_closed_sessions_are_freed(daemon):
    """About 1.5 MB stayed behind per session: every open froze the heap (gc.freeze), and the
    sessions alive at that moment could never be collected."""
    refs = []
    for _ in range(6):
        c = await NativeClient.open(daemon.port)
        await c.wait_type("session.created")
        refs.extend(weakref.ref(s) for s in daemon.sessions)
        await c.close()
        assert await wait_until(lambda: not daemon.sessions)
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} closed sessions are still in memory"


async def test_history_is_bounded_and_tokenized_off_the_event_loop(daemon, model, monkeypatch):
    """The probe: a client with a long history froze every session for seconds, because each
    turn re-tokenized the whole history, repeatedly, on the event loop."""
    loop_thread = threading.get_ident()
    tokenizer = daemon.resources.llm(model).tokenizer
    calls: list[int] = []
    real = type(tokenizer).encode_chat

    def recording(self, messages, add_generation_prompt=True):
        calls.append(threading.get_ident())
        return real(self, messages, add_generation_prompt)

    monkeypatch.setattr(type(tokenizer), "encode_chat", recording)
    c = await NativeClient.open(daemon.port, "?pipeline=tiny-chat")
    try:
        await c.wait_type("session.created")
        session = next(iter(daemon.sessions))
        limits = session.limits
        for i in range(limits.history_turns + 10):
            session.remember("user" if i % 2 == 0 else "assistant", f"turn {i} " + "word " * 20)
        assert len(session.history) == limits.history_turns
        assert session.history[-1].text.startswith(f"turn {limits.history_turns + 9} ")
        calls.clear()
        done = await native_turn_works(c, "And now?")
        assert done["status"] == "completed"
        assert calls and loop_thread not in calls, "the chat template ran on the event loop"
        calls.clear()
        await native_turn_works(c, "Once more?")
        # each turn is counted once in its life: later turns tokenize the new turns and the prompt
        assert len(calls) <= 4, len(calls)
    finally:
        await c.close()


# ---------------------------------------------------------------------------------- auth
