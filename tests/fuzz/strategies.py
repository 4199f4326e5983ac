"""Hypothesis strategies for hostile client frames of both WebSocket protocols.

Shared by the CI fuzz tests (``tests/fuzz/``, a few hundred examples) and ``scripts/fuzz.py``
(tens of thousands against a daemon on loopback). A frame is a ``str`` (a text message) or
``bytes`` (a binary message). What is covered (issue #18): malformed JSON, wrong types, missing
fields, unknown events, huge strings and deep nesting, binary where text is expected and the
reverse, odd-length PCM and base64 garbage, NaN and Infinity, events out of order, and
``session.update`` with absurd values (negative rates, unknown pipelines, path-like names).
"""

from __future__ import annotations

import base64
import json

from hypothesis import strategies as st

from edge_rtgi.server.openai_realtime.events import CLIENT_EVENTS

# JSON values of every kind, including the ones a strict parser must refuse in text form
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "../../etc/passwd", "/etc/shadow", "~/.ssh/id_rsa", "C:\\x", "\x00", "🙂" * 8]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
absurd_numbers = st.sampled_from(
    [-1, -100000, 0, 1, 10**12, -(10**12), 2**63, -0.5, 1e308, -1e308, 3.5, 10**40]
)
path_like = st.sampled_from(
    [
        "../../etc/passwd",
        "/etc/passwd",
        "..",
        "/",
        "~root",
        "file:///etc/passwd",
        "a/../../b",
        "nul",
        "\\\\srv\\x",
    ]
)

# frames that are not JSON at all, or JSON the parser must refuse
RAW_TEXT = [
    "{",
    "}",
    "[]",
    "null",
    "42",
    '"type"',
    "{'type': 'ping'}",
    '{"type": "ping", "id": NaN}',
    '{"type": "ping", "id": Infinity}',
    '{"type": "ping", "id": -Infinity}',
    '{"type": "ping", "id": 1e999}',
    '{"type": "ping", "id": ' + "9" * 5000 + "}",
    '{"type": "text.input", "text": "\\ud800"}',
    '{"type": "text.input", "text": "\\udfff\\ud800"}',
    '{"type": "ping"' + " " * 100 + "",
    "[" * 10_000 + "]" * 10_000,
    '{"a":' * 5_000 + "1" + "}" * 5_000,
    '{"type": "session.update", "session": ' + '{"x": ' * 200 + "1" + "}" * 200 + "}",
    "\ufeff{}",
]


def _json(obj: object) -> str:
    return json.dumps(obj, allow_nan=True)


raw_text = st.one_of(st.sampled_from(RAW_TEXT), st.text(max_size=200))
raw_binary = st.one_of(
    st.binary(max_size=64),
    st.binary(min_size=1, max_size=33).map(lambda b: b if len(b) % 2 else b + b"\x00"),  # odd length
    st.just(b"\xff\xfe\x00"),
    st.just(b'{"type": "ping"}'),  # JSON in a binary frame
)
huge_string = st.integers(min_value=1_000, max_value=200_000).map(lambda n: "x" * n)


def _event(kind: st.SearchStrategy[str], fields: st.SearchStrategy[dict]) -> st.SearchStrategy[str]:
    return st.builds(lambda k, f: _json({"type": k, **f}), kind, fields)


# --------------------------------------------------------------------------- native protocol

NATIVE_TYPES = [
    "session.update",
    "input_audio.commit",
    "input_audio.clear",
    "text.input",
    "response.create",
    "response.cancel",
    "ping",
]
NATIVE_SETTINGS = [
    "pipeline",
    "input_sample_rate_hz",
    "output_sample_rate_hz",
    "turn_detection",
    "auto_response",
    "barge_in",
    "audio_output",
    "partials",
    "system_prompt",
    "max_reply_tokens",
    "temperature",
    "vad_threshold",
    "vad_min_silence_ms",
    "vad_prefix_padding_ms",
]
native_settings = st.dictionaries(
    st.sampled_from(NATIVE_SETTINGS) | st.text(max_size=10),
    values | absurd_numbers | path_like,
    max_size=4,
)
native_events = st.one_of(
    _event(
        st.sampled_from(NATIVE_TYPES) | st.text(max_size=20),
        st.dictionaries(st.text(max_size=10), values, max_size=3),
    ),
    _event(st.just("session.update"), st.builds(lambda s: {"session": s}, native_settings)),
    _event(st.just("session.update"), st.builds(lambda v: {"session": v}, values)),
    _event(
        st.just("text.input"),
        st.builds(
            lambda t, r: {"text": t, "respond": r}, st.text(max_size=60) | huge_string, st.booleans() | values
        ),
    ),
    _event(st.just("response.cancel"), st.builds(lambda r: {"response_id": r}, values)),
    _event(st.just("ping"), st.builds(lambda i: {"id": i}, values)),
    st.builds(lambda v: _json(v), values),  # JSON that is no event
)
native_frame = st.one_of(native_events, raw_text, raw_binary, huge_string)
native_frames = st.lists(native_frame, min_size=1, max_size=5)


# --------------------------------------------------------------------------- Realtime

REALTIME_TYPES = [
    *CLIENT_EVENTS,
    "response.done",  # a server event
    "transcription_session.update",  # a beta alias
]
base64_garbage = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=48).map(lambda b: base64.b64encode(b).decode()),  # odd-length PCM too
    st.binary(max_size=48).map(lambda b: base64.b64encode(b).decode()[:-1]),
    st.just("!!!!"),
    st.just("===="),
)
formats = st.one_of(
    values,
    st.sampled_from(["pcm16", "g711_ulaw", "g711_alaw", "opus"]),
    st.builds(
        lambda t, r: {"type": t, "rate": r},
        st.sampled_from(["audio/pcm", "audio/pcmu", "x"]) | values,
        absurd_numbers | values,
    ),
)
turn_detection = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["server_vad", "semantic_vad"]) | values,
            "threshold": absurd_numbers | values,
            "prefix_padding_ms": absurd_numbers | values,
            "silence_duration_ms": absurd_numbers | values,
            "create_response": values,
            "interrupt_response": values,
        },
    ),
)
realtime_session = st.fixed_dictionaries(
    {},
    optional={
        "type": st.just("realtime") | values,
        "instructions": st.text(max_size=40) | values,
        "output_modalities": st.lists(st.sampled_from(["text", "audio", "x"]), max_size=3) | values,
        "max_output_tokens": absurd_numbers | st.just("inf") | values,
        "audio": st.fixed_dictionaries(
            {},
            optional={
                "input": st.fixed_dictionaries(
                    {},
                    optional={
                        "format": formats,
                        "turn_detection": turn_detection,
                        "transcription": values,
                    },
                )
                | values,
                "output": st.fixed_dictionaries({}, optional={"format": formats, "voice": values | path_like})
                | values,
            },
        )
        | values,
        "edge_rtgi": st.builds(lambda p: {"pipeline": p}, path_like | values) | values,
        "modalities": values,
        "voice": path_like | values,
        "input_audio_format": formats,
        "turn_detection": turn_detection,
    },
)
content_part = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["input_text", "text", "output_text", "input_audio", "audio"]) | values,
            "text": st.text(max_size=40) | values,
            "transcript": st.text(max_size=20) | values,
            "audio": base64_garbage,
        },
    ),
)
item = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["message", "function_call"]) | values,
            "role": st.sampled_from(["user", "assistant", "system", "tool"]) | values,
            "content": st.lists(content_part, max_size=3) | values,
            "id": st.text(max_size=10) | values,
        },
    ),
)
realtime_events = st.one_of(
    _event(
        st.sampled_from(REALTIME_TYPES) | st.text(max_size=20),
        st.dictionaries(st.text(max_size=10), values, max_size=3),
    ),
    _event(st.just("session.update"), st.builds(lambda s: {"session": s}, realtime_session)),
    _event(st.just("input_audio_buffer.append"), st.builds(lambda a: {"audio": a}, base64_garbage | values)),
    _event(
        st.just("conversation.item.create"),
        st.builds(lambda i, p: {"item": i, "previous_item_id": p}, item, values),
    ),
    _event(
        st.sampled_from(
            ["conversation.item.truncate", "conversation.item.delete", "conversation.item.retrieve"]
        ),
        st.builds(
            lambda i, c, a: {"item_id": i, "content_index": c, "audio_end_ms": a},
            values,
            absurd_numbers | values,
            absurd_numbers | values,
        ),
    ),
    _event(st.just("response.create"), st.builds(lambda r: {"response": r}, values)),
    _event(st.just("response.cancel"), st.builds(lambda r: {"response_id": r}, values)),
    st.builds(lambda e, v: _json({"type": "session.update", "event_id": e, "session": v}), values, values),
    st.builds(lambda v: _json(v), values),
)
realtime_frame = st.one_of(realtime_events, raw_text, raw_binary, huge_string)
realtime_frames = st.lists(realtime_frame, min_size=1, max_size=5)
