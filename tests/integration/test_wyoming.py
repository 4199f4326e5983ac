"""Home Assistant's Wyoming flow against a running daemon, with the ``wyoming`` library's own
async TCP client (``scripts/wyoming_example.py`` holds the client side; this runs it).

Real models throughout: Piper speaks "Okay Nabu." and a question, the daemon's Wyoming server
detects the wake word (microWakeWord), transcribes the question (silero VAD + whisper tiny.en),
answers it (SmolLM2-135M) and speaks the answer (Piper); the spoken answer is transcribed again
and compared with the answer text. Bad input: unknown events, oversized payloads, unreadable
frames and unsupported audio get an ``error`` event (and a close where the stream cannot go
on), and the daemon keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys

import numpy as np
import pytest
import pytest_asyncio
from wyoming.asr import Transcribe
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.event import Event, async_write_event
from wyoming.ping import Ping

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.catalog import resolve_model
from tests.integration.native_client import NativeClient, speak_16k, steady_voice, transcribe, wer
from tests.scripts import load_script

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

flow = load_script("wyoming_example")
TIMEOUT_S = 120.0
WAKE_YAML = "voice-assistant-wake.yaml"


@pytest.fixture(scope="module")
def piper():
    from edge_rtgi.tts.piper import PiperVoice

    return steady_voice(PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"), intra_op_threads=1))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon():
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipeline
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, ServerConfig, WyomingConfig

    # the same models twice: behind the wake word, and the plain assistant
    files = (WAKE_YAML, "voice-assistant.yaml")
    pipelines = {p.name: p for p in (load_pipeline(builtin_pipelines_dir() / f) for f in files)}
    config = DaemonConfig(
        server=ServerConfig(port=0),
        default_pipeline="voice-assistant-wake",
        wyoming=WyomingConfig(uri="tcp://127.0.0.1:0", max_payload_bytes=65536, max_audio_s=20.0),
    )
    d = Daemon(config, pipelines, Resources())
    for p in pipelines.values():
        await d.resources.prepare(p)
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)
    d.resources.close()


@contextlib.contextmanager
def tight_timeouts(daemon):
    """The daemon's Wyoming timeouts cut to a few seconds for connections opened inside (the
    fixture keeps the defaults: a short one could fire on a valid client of a loaded machine)."""
    services = daemon.wyoming.services
    before = services.config
    services.config = dataclasses.replace(before, frame_timeout_s=2.0, request_idle_s=3.0)
    try:
        yield
    finally:
        services.config = before


def _asr(daemon):
    return daemon.resources.whisper(daemon.pipelines["voice-assistant-wake"].stage(AsrConfig))


async def _read(client: AsyncTcpClient) -> Event | None:
    return await asyncio.wait_for(client.read_event(), TIMEOUT_S)


async def test_home_assistant_flow(daemon, piper):
    """describe, detect on "Okay Nabu. <question>", transcribe, handle, synthesize."""
    speech = flow.spoken_request(piper)
    result = await asyncio.wait_for(flow.run_flow("127.0.0.1", daemon.wyoming.port, speech), 300)

    info = result.info
    assert [m.name for p in info.asr for m in p.models] == ["whisper-tiny.en"]
    assert [v.name for p in info.tts for v in p.voices] == ["piper-en_US-joe-medium"]
    assert [m.name for p in info.handle for m in p.models] == ["smollm2-135m-instruct"]
    assert {m.name for p in info.wake for m in p.models} == {
        "okay_nabu",
        "hey_jarvis",
        "alexa",
        "hey_mycroft",
    }
    assert info.asr[0].supports_transcript_streaming and info.tts[0].supports_synthesize_streaming

    # the wake word is detected after it was said and before the question ends
    wake_pcm = np.concatenate(list(piper.synthesize_stream(flow.WAKE_TEXT)))
    wake_end_s = 0.5 + len(wake_pcm) / piper.sample_rate_hz  # spoken_request's lead-in, the word
    assert result.wake_word == "okay_nabu"
    assert wake_end_s - 0.6 < result.wake_timestamp_ms / 1000 < wake_end_s + 1.5, result.wake_timestamp_ms
    assert wer(flow.QUESTION, result.transcript) <= 1 / 6, result.transcript
    assert "paris" in result.answer.lower(), result.answer
    assert "".join(result.answer_chunks).strip() == result.answer.strip()
    assert result.audio_rate_hz == 22050 and len(result.audio) > 0.5 * 22050
    heard = await asyncio.to_thread(transcribe, _asr(daemon), result.audio, result.audio_rate_hz)
    assert wer(result.answer, heard) <= 0.25, (result.answer, heard)


async def test_transcript_streams_while_the_audio_comes(daemon, piper):
    """Audio paced as a microphone sends it (real time): the words LocalAgreement commits go out
    as transcript-start / transcript-chunk events, transcript-stop and transcript end the
    request, and the chunks joined are the transcript. (How many chunks come before audio-stop
    depends on how fast the CPU decodes partials, so that is not asserted.)"""
    text = (
        "Please turn on the lights in the kitchen and set the heating to twenty degrees. "
        "Then play some quiet music in the living room until nine o'clock."
    )
    pcm = speak_16k(piper, text, tail_s=0.5)
    async with AsyncTcpClient("127.0.0.1", daemon.wyoming.port) as client:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        events: list[Event] = []

        async def reader() -> None:
            while (event := await client.read_event()) is not None:
                events.append(event)
                if event.type == "transcript":
                    return

        task = asyncio.create_task(reader())
        for chunk in flow._chunks(pcm):
            await client.write_event(chunk.event())
            await asyncio.sleep(len(chunk.audio) / 2 / 16000)
        await client.write_event(AudioStop().event())
        await asyncio.wait_for(task, TIMEOUT_S)
    types = [e.type for e in events]
    final = events[-1].data["text"]
    assert types[-1] == "transcript" and wer(text, final) <= 0.2, (types, final)
    if len(types) > 1:  # streamed: start, chunks, stop, then the transcript
        assert types[0] == "transcript-start" and types[-2] == "transcript-stop", types
        assert set(types[1:-2]) == {"transcript-chunk"}, types
        chunks = "".join(e.data["text"] for e in events if e.type == "transcript-chunk")
        assert chunks.strip() == final.strip()


async def test_unknown_events_and_bad_audio_get_errors_and_the_connection_goes_on(daemon):
    async with AsyncTcpClient("127.0.0.1", daemon.wyoming.port) as client:
        await client.write_event(Event(type="no-such-event", data={"x": 1}))
        error = await _read(client)
        assert error.type == "error" and error.data["code"] == "unknown_event", error
        assert "transcribe" in error.data["text"]  # it lists what is handled

        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=4, channels=1).event())
        error = await _read(client)
        assert error.data["code"] == "unsupported_audio" and "width 4" in error.data["text"], error
        # the rest of the refused stream is ignored quietly, up to its audio-stop
        await client.write_event(AudioChunk(rate=16000, width=4, channels=1, audio=bytes(4096)).event())
        await client.write_event(AudioStop().event())

        await client.write_event(Transcribe(language="de").event())
        error = await _read(client)
        assert error.data["code"] == "unsupported_language", error

        await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=bytes(640)).event())
        error = await _read(client)
        assert error.data["code"] == "no_request", error

        await client.write_event(Event(type="synthesize", data={"voice": {"name": "nobody"}, "text": "Hi."}))
        error = await _read(client)
        assert error.data["code"] == "unknown_voice" and "piper-en_US-joe-medium" in error.data["text"]

        await client.write_event(Ping(text="still there").event())
        pong = await _read(client)
        assert pong.type == "pong" and pong.data["text"] == "still there"


async def _raw(port: int, data: bytes) -> list[dict]:
    """Send raw bytes; every event header the server sends back until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    heads = []
    while line := await asyncio.wait_for(reader.readline(), TIMEOUT_S):
        head = json.loads(line)
        if head.get("data_length"):
            head["data"] = json.loads(await reader.readexactly(head["data_length"]))
        heads.append(head)
    writer.close()
    return heads


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b'{"type": "audio-chunk", "payload_length": 10000000}\n', "payload_too_large"),
        (b'{"type": "describe", "data_length": 1000000}\n', "event_too_large"),
        (b"this is not json\n", "invalid_json"),
        (b'{"no": "type"}\n', "invalid_event"),
        (b"x" * 70000, "event_too_large"),
        # nested past Python's recursion limit (a Python that parses it sees no object)
        (b"[" * 60000 + b"\n", "invalid_json|invalid_event"),
        pytest.param(
            b'{"type": "ping", "x": ' + b"9" * 5000 + b"}\n",
            "invalid_json",
            marks=pytest.mark.skipif(
                not getattr(sys, "get_int_max_str_digits", lambda: 0)(), reason="no int digit limit"
            ),
        ),
        (b"not json\n" + b"y" * 300000, "invalid_json"),  # more input after it: must not reset the reply
        (b'{"type": "describe", "data_length": 100}\n{', "timeout"),  # stalls inside the event
    ],
    ids=["payload", "data", "not-json", "no-type", "long-line", "deep", "huge-int", "then-more", "stall"],
)
async def test_unreadable_frames_get_an_error_and_a_clean_close(daemon, data, code):
    with tight_timeouts(daemon):
        heads = await _raw(daemon.wyoming.port, data)
    assert [h["type"] for h in heads] == ["error"] and heads[0]["data"]["code"] in code.split("|"), heads
    # the daemon carries on
    async with AsyncTcpClient("127.0.0.1", daemon.wyoming.port) as client:
        await client.write_event(Event(type="describe"))
        assert (await _read(client)).type == "info"


async def test_too_much_audio_in_one_request_is_refused(daemon):
    async with AsyncTcpClient("127.0.0.1", daemon.wyoming.port) as client:
        await client.write_event(Transcribe().event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        second = np.zeros(16000, np.int16).tobytes()
        for _ in range(21):  # max_audio_s is 20 in this daemon
            await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=second).event())
        error = await _read(client)
        assert error.data["code"] == "audio_too_long", error
        await client.write_event(AudioStop().event())
        await client.write_event(Ping().event())
        assert (await _read(client)).type == "pong"
        assert not daemon.sessions  # the refused request's session was closed


async def test_native_session_wakes_on_the_wake_word(daemon, piper):
    """The voice-assistant-wake pipeline over the native protocol: speech without the wake word
    reaches nobody; "Okay Nabu." opens the gate (wake.detected), the question is answered."""
    c = await NativeClient.open(daemon.port, "?pipeline=voice-assistant-wake")
    try:
        await c.wait_type("session.created")
        await c.stream(speak_16k(piper, "What is the capital of France?"), speed=4.0)
        await c.stream(flow.spoken_request(piper), speed=4.0)
        detected = await c.wait_type("wake.detected")
        assert detected["name"] == "okay_nabu" and detected["phrase"] == "Okay Nabu"
        final = await c.wait_type("transcript.final")
        assert wer(flow.QUESTION, final["text"]) <= 1 / 6, final
        assert len(c.of("transcript.final")) == 1  # the question before the wake word went unheard
        done = await c.wait_type("response.done")
        assert done["status"] == "completed"
    finally:
        await c.close()


async def test_echo_of_the_reply_is_cancelled_with_a_reference_channel(daemon, piper):
    """Stereo frames (microphone, played audio): the device's own reply, heard at -6 dB 100 ms
    late, starts no speech; the user's question spoken over it is heard and transcribed."""
    from edge_rtgi.audio.aec import join_reference

    reply = speak_16k(piper, "The capital of France is Paris, a large city on the river Seine.", tail_s=0)
    question = speak_16k(piper, flow.QUESTION, lead_s=0, tail_s=0)
    n = len(reply) + 16000 + len(question) + 16000
    played = np.zeros(n, np.int16)
    played[: len(reply)] = reply
    played[len(reply) + 8000 : 2 * len(reply) + 8000] = reply[: n - len(reply) - 8000]  # a second reply
    delay = 1600  # 100 ms
    echo = np.concatenate([np.zeros(delay, np.int16), played[:-delay] // 2])
    user = np.zeros(n, np.int16)
    start = len(reply) + 16000  # the user speaks over the second reply
    user[start : start + len(question)] = question
    mic = np.clip(echo.astype(np.int32) + user, -32768, 32767).astype(np.int16)

    c = await NativeClient.open(daemon.port, "?pipeline=voice-assistant")
    try:
        await c.wait_type("session.created")
        await c.send(type="session.update", session={"echo_reference": True, "auto_response": False})
        updated = await c.wait_type("session.updated")
        assert updated["session"]["echo_reference"] is True
        await c.stream(join_reference(mic, played), chunk_ms=40, speed=4.0)  # 40 ms stereo = 20 ms
        await c.stream(np.zeros(2 * 16000, np.int16), speed=4.0)
        final = await c.wait_type("transcript.final")
        started = c.of("input.speech_started")
        assert len(started) == 1 and started[0]["audio_ms"] >= 1000 * (start - 8000) / 16000, started
        assert wer(flow.QUESTION, final["text"]) <= 1 / 6, final
    finally:
        await c.close()


async def test_malformed_fields_get_errors_and_the_connection_goes_on(daemon):
    """Fields of the wrong type, and events out of order, get an ``error`` naming what was wrong;
    nothing reaches a traceback, and the connection carries on."""
    async with AsyncTcpClient("127.0.0.1", daemon.wyoming.port) as client:
        bad = [
            Event(type="transcribe", data={"language": 123}),
            Event(type="synthesize", data={"text": "Hi.", "voice": "nonexistent"}),
            Event(type="synthesize", data={"text": "Hi.", "voice": {"language": 5}}),
            Event(type="detect", data={"names": "okay_nabu"}),
            Event(type="transcript", data={"text": 123}),
        ]
        for event in bad:
            await client.write_event(event)
            error = await _read(client)
            assert error.type == "error" and error.data["code"] == "invalid_event", (event, error)
        await client.write_event(Transcribe().event())
        await client.write_event(
            Event(type="audio-start", data={"rate": float("inf"), "width": 2, "channels": 1})
        )
        error = await _read(client)
        assert error.data["code"] == "invalid_event" and "integer" in error.data["text"], error
        await client.write_event(AudioStop().event())

        # a second synthesize-start is refused; the open stream goes on and ends properly
        await client.write_event(Event(type="synthesize-start", data={}))
        await client.write_event(Event(type="synthesize-chunk", data={"text": "Hello there."}))
        await client.write_event(Event(type="synthesize-start", data={}))
        await client.write_event(Event(type="synthesize-stop", data={}))
        kinds: list[str] = []
        while not kinds or kinds[-1] != "synthesize-stopped":
            kinds.append((await _read(client)).type)
        assert "error" in kinds and kinds.count("audio-start") == 1 and kinds.count("audio-stop") == 1, kinds

        await client.write_event(Ping(text="still there").event())
        assert (await _read(client)).type == "pong"
    assert not daemon.sessions


async def _sessions_closed(daemon, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if not daemon.sessions:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_repeated_audio_start_or_a_close_after_audio_stop_leaves_no_session(daemon, piper):
    """A second ``audio-start`` inside a stream is an error that drops the request, and a client
    that leaves right after ``audio-stop`` (before its transcript) still has its session closed,
    with silence and with speech (whose streamed transcript chunks then meet a closed socket)."""
    second = np.zeros(16000, np.int16).tobytes()
    speech = speak_16k(piper, "What time is it in Tokyo?", tail_s=0.3).tobytes()
    async with AsyncTcpClient("127.0.0.1", daemon.wyoming.port) as client:
        await client.write_event(Transcribe().event())
        for _ in range(3):
            await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        error = await _read(client)
        assert error.data["code"] == "invalid_event" and "inside an audio stream" in error.data["text"], error
        await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=second).event())
        await client.write_event(AudioStop().event())
        await client.write_event(Ping().event())
        assert (await _read(client)).type == "pong"
        assert not daemon.sessions
    for audio in (second, second, speech, speech):
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.wyoming.port)
        await async_write_event(Transcribe().event(), writer)
        await async_write_event(AudioStart(rate=16000, width=2, channels=1).event(), writer)
        for i in range(0, len(audio), 6400):  # 200 ms chunks at 4x real time
            await async_write_event(
                AudioChunk(rate=16000, width=2, channels=1, audio=audio[i : i + 6400]).event(), writer
            )
            await asyncio.sleep(0.05)
        await async_write_event(AudioStop().event(), writer)
        writer.close()  # gone before the transcript
    assert await _sessions_closed(daemon)


async def test_a_client_that_stalls_inside_a_request_is_closed_and_its_session_freed(daemon):
    """``request_idle_s`` (3 s here): a stream left open without events ends with a ``timeout``
    error and the close; between requests a connection may stay idle."""
    with tight_timeouts(daemon):
        await _stall(daemon)
    assert await _sessions_closed(daemon)


async def _stall(daemon) -> None:
    async with AsyncTcpClient("127.0.0.1", daemon.wyoming.port) as client:
        await asyncio.sleep(3.5)  # idle between requests: fine
        await client.write_event(Ping().event())
        assert (await _read(client)).type == "pong"
        await client.write_event(Transcribe().event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        error = await _read(client)  # nothing more is sent
        assert error.type == "error" and error.data["code"] == "timeout", error
        assert await _read(client) is None  # closed
