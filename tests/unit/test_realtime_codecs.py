"""G.711 tables, base64 and format parsing, client-event parsing and session.update mapping."""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np
import pytest

from edge_rtgi.server.openai_realtime import codecs
from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.openai_realtime.events import BETA_ALIASES, SERVER_EVENTS, parse_client_event
from edge_rtgi.server.openai_realtime.session_config import RealtimeSessionConfig, apply_session_update

# sha256 of the four tables; they were checked bit for bit against CPython's audioop
# (lin2ulaw / lin2alaw over all 65,536 int16 values, ulaw2lin / alaw2lin over all 256 codes).
TABLE_SHA256 = {
    "_ULAW_ENCODE": "81d633c9e6972a18c74a58720b96cb8ca0bdd096d4060b646dd708c3b846019a",
    "_ALAW_ENCODE": "38488f6fd710f4686360edc4d38639f96c491595ef93f8eb8d62d5e07ca6ce7b",
    "_ULAW_DECODE": "3dab54339e520bb2c924826e3b72a917a2b612e9fd12fc867500f1d983a75827",
    "_ALAW_DECODE": "e04788d110e58ff8c70c93b8480190d973e3b67876b6119abbaec766cc75c174",
}


@pytest.mark.parametrize("name", sorted(TABLE_SHA256))
def test_g711_tables_are_the_reference_tables(name):
    assert hashlib.sha256(getattr(codecs, name).tobytes()).hexdigest() == TABLE_SHA256[name]


def test_g711_matches_audioop_when_available():
    audioop = pytest.importorskip("audioop")  # removed in Python 3.13; the sha256 pins cover that
    x = np.arange(-32768, 32768, dtype=np.int16)
    assert codecs.ulaw_encode(x) == audioop.lin2ulaw(x.tobytes(), 2)
    assert codecs.alaw_encode(x) == audioop.lin2alaw(x.tobytes(), 2)
    codes = bytes(range(256))
    assert codecs.ulaw_decode(codes).tobytes() == audioop.ulaw2lin(codes, 2)
    assert codecs.alaw_decode(codes).tobytes() == audioop.alaw2lin(codes, 2)


def test_g711_known_values_and_round_trip():
    silence = np.zeros(4, dtype=np.int16)
    assert codecs.ulaw_encode(silence) == b"\xff" * 4  # G.711: mu-law zero is 0xFF
    assert codecs.alaw_encode(silence) == b"\xd5" * 4  # A-law zero is 0xD5 (0x80 ^ 0x55)
    x = (np.sin(np.arange(8000) / 7) * 20000).astype(np.int16)
    for enc, dec in ((codecs.ulaw_encode, codecs.ulaw_decode), (codecs.alaw_encode, codecs.alaw_decode)):
        y = dec(enc(x)).astype(np.float64)
        snr_db = 10 * np.log10(np.sum(x.astype(np.float64) ** 2) / np.sum((y - x) ** 2))
        assert snr_db > 30  # G.711 gives ~38 dB on a loud sine


def test_formats_and_base64():
    assert codecs.parse_format({"type": "audio/pcm", "rate": 24000}, "p").sample_rate_hz == 24000
    assert codecs.parse_format("g711_alaw", "p").type == "audio/pcma"
    assert codecs.parse_format({"type": "audio/pcmu"}, "p").sample_rate_hz == 8000
    with pytest.raises(RealtimeProtocolError) as err:
        codecs.parse_format({"type": "audio/flac"}, "session.audio.input.format")
    assert err.value.code == "unsupported_audio_format" and "audio/flac" in err.value.message
    with pytest.raises(RealtimeProtocolError) as err:
        codecs.decode_base64("abc$", "audio")
    assert err.value.code == "invalid_base64" and err.value.param == "audio"
    pcm = np.array([1, -2, 32767, -32768], dtype=np.int16)
    fmt = codecs.AudioFormat("audio/pcm")
    wire = codecs.encode_base64(pcm, fmt)
    assert base64.b64decode(wire) == pcm.astype("<i2").tobytes()
    assert np.array_equal(codecs.bytes_to_pcm(base64.b64decode(wire), fmt, "audio"), pcm)


def test_client_event_parsing():
    assert parse_client_event(json.dumps({"type": "response.create"})).type == "response.create"
    beta = parse_client_event(json.dumps({"type": "transcription_session.update", "session": {}}))
    assert beta.type == "session.update" and beta.original_type == "transcription_session.update"
    assert all(ga in SERVER_EVENTS or ga == "session.update" for ga in BETA_ALIASES.values())
    for message, code in (
        ("[1, 2]", "invalid_json"),
        ('{"event_id": "x"}', "missing_required_parameter"),
        (b"\xff\xfe", "invalid_json"),
        ('{"type": "nope.nope"}', "unknown_event"),
    ):
        with pytest.raises(RealtimeProtocolError) as err:
            parse_client_event(message)
        assert err.value.code == code


def test_session_update_ga_and_errors():
    cfg = apply_session_update(
        RealtimeSessionConfig(),
        {
            "type": "realtime",
            "instructions": "Hi",
            "max_output_tokens": 40,
            "audio": {
                "input": {"transcription": None, "noise_reduction": None},
                "output": {"voice": {"id": "joe"}, "speed": 1.0},
            },
        },
    )
    assert cfg.instructions == "Hi" and cfg.max_output_tokens == 40 and cfg.voice == "joe"
    assert cfg.transcription is None
    wire = cfg.to_wire("s", "m")
    assert wire["audio"]["input"]["transcription"] is None and wire["max_output_tokens"] == 40
    bad = [
        (
            {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "magic_vad"}}}},
            "session.audio.input.turn_detection.type",
        ),
        (
            {
                "type": "realtime",
                "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}},
            },
            "session.audio.input.turn_detection.eagerness",
        ),
        (
            {"type": "realtime", "audio": {"input": {"turn_detection": {"threshold": 1.5}}}},
            "session.audio.input.turn_detection.threshold",
        ),
        ({"type": "realtime", "output_modalities": ["video"]}, "session.output_modalities"),
        ({"type": "realtime", "edge_rtgi": {"pipe": "x"}}, "session.edge_rtgi.pipe"),
        ({"type": "transcription"}, "session.type"),
    ]
    for session, param in bad:
        with pytest.raises(RealtimeProtocolError) as err:
            apply_session_update(cfg, session)
        assert err.value.param == param, err.value


def test_heard_prefix_keeps_whole_words():
    from edge_rtgi.server.openai_realtime.conversation import heard_prefix

    text = "The capital of France is Paris."
    assert heard_prefix(text, 1.0) == text
    assert heard_prefix(text, 0.0) == ""
    assert heard_prefix(text, 0.5) == "The capital of"  # 15 of 31 characters
    assert heard_prefix(text, 0.02) == ""  # never half a word
