"""The native protocol codec: every client event decodes, every bad message is a coded error."""

import json

import numpy as np
import pytest

from edge_rtgi import frames as F
from edge_rtgi.server.protocol import (
    CLIENT_EVENTS,
    AudioChunk,
    ProtocolError,
    ResponseCancel,
    SessionUpdate,
    TextInput,
    decode_client,
    encode_client,
    encode_server,
    error_event,
)


def ms(t_s: float) -> int:
    return int(t_s * 1000)


def test_client_events_round_trip():
    for event in (
        SessionUpdate({"pipeline": "transcribe"}),
        TextInput("hi", respond=False),
        ResponseCancel("resp_1"),
        ResponseCancel(),
    ):
        assert decode_client(encode_client(event)) == event
    for kind in CLIENT_EVENTS:
        if kind not in ("session.update", "text.input"):
            assert type(decode_client(json.dumps({"type": kind}))) is CLIENT_EVENTS[kind][0]


def test_binary_audio_decodes_little_endian():
    pcm = np.array([0, 1, -1, 32767, -32768], dtype=np.int16)
    event = decode_client(pcm.astype("<i2").tobytes())
    assert isinstance(event, AudioChunk) and np.array_equal(event.pcm, pcm)
    assert np.array_equal(decode_client(encode_client(event)).pcm, pcm)


@pytest.mark.parametrize(
    "message, code",
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_event"),
        ('{"kind": "x"}', "invalid_event"),
        ('{"type": "session.explode"}', "unknown_event"),
        ('{"type": "text.input"}', "invalid_event"),
        ('{"type": "text.input", "text": 5}', "invalid_event"),
        ('{"type": "text.input", "text": "a", "colour": "red"}', "invalid_event"),
        ('{"type": "text.input", "text": "a", "respond": 1}', "invalid_event"),
        (b"\x00\x01\x02", "invalid_audio"),
    ],
)
def test_bad_messages_are_coded_errors(message, code):
    with pytest.raises(ProtocolError) as err:
        decode_client(message)
    assert err.value.code == code
    wire = json.loads(encode_server(error_event(err.value), ms)[0])
    assert wire["type"] == "error" and wire["code"] == code and wire["message"]


def test_unknown_event_error_names_the_type():
    with pytest.raises(ProtocolError) as err:
        decode_client('{"type": "session.explode"}')
    wire = json.loads(encode_server(error_event(err.value), ms)[0])
    assert wire["event_type"] == "session.explode" and "session.explode" in wire["message"]


def test_audio_out_is_header_then_pcm():
    pcm = np.arange(-5, 5, dtype=np.int16)
    head, payload = encode_server(F.AudioOut("resp_1", pcm, 22050, t_s=1.5), ms)
    head = json.loads(head)
    assert head == {
        "type": "response.audio",
        "response_id": "resp_1",
        "sample_rate_hz": 22050,
        "format": "pcm_s16le",
        "num_bytes": 20,
        "t_ms": 1500,
    }
    assert np.array_equal(np.frombuffer(payload, "<i2"), pcm)


def test_server_events_have_types_and_times():
    stats = F.TurnStats(endpointing_ms=300.0, llm_ttft_ms=80.5)
    events = [
        F.SessionStarted("s", "voice-assistant", {"a": 1}, 16000, 22050, t_s=0.0),
        F.SessionUpdated({"a": 2}, t_s=0.1),
        F.SpeechStarted(1, 120, t_s=0.2),
        F.SpeechStopped(1, 900, t_s=0.3),
        F.Transcript(1, "hel", final=False, t_s=0.4),
        F.Transcript(1, "hello", final=True, t_s=0.5),
        F.ResponseStarted("r", 1, "reply", "hello", t_s=0.6),
        F.TextDelta("r", "Hi", t_s=0.7),
        F.TextDone("r", "Hi there.", source_text="hello", t_s=0.8),
        F.AudioDone("r", t_s=0.9),
        F.ResponseInterrupted("r", "barge_in", 300, t_s=1.0),
        F.ResponseDone("r", "completed", "Hi there.", stats, {"completion_tokens": 3}, t_s=1.1),
    ]
    types = []
    for e in events:
        (msg,) = encode_server(e, ms)
        obj = json.loads(msg)
        types.append(obj["type"])
        assert obj["t_ms"] == ms(e.t_s)
    assert types == [
        "session.created",
        "session.updated",
        "input.speech_started",
        "input.speech_stopped",
        "transcript.partial",
        "transcript.final",
        "response.created",
        "response.text.delta",
        "response.text.done",
        "response.audio.done",
        "response.interrupted",
        "response.done",
    ]
    done = json.loads(encode_server(events[-1], ms)[0])
    assert done["stats"] == {"endpointing_ms": 300.0, "llm_ttft_ms": 80.5}
    created = json.loads(encode_server(events[0], ms)[0])
    assert created["protocol"] == "edge-rtgi.v1" and created["audio"]["output_sample_rate_hz"] == 22050
