"""The Realtime adapter's wire translation, on in-memory event streams.

Every server event the adapter emits is validated against the official ``openai`` package's
``RealtimeServerEvent`` schema, so the field names and shapes are the ones real clients parse.
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from pydantic import TypeAdapter

from edge_rtgi import frames as F
from edge_rtgi.pipeline.session import TextTurn
from edge_rtgi.server.openai_realtime.adapter import RealtimeAdapter, core_settings
from edge_rtgi.server.openai_realtime.codecs import ulaw_encode
from edge_rtgi.server.openai_realtime.session_config import RealtimeSessionConfig

openai_types = pytest.importorskip("openai.types.realtime")
SERVER_EVENT = TypeAdapter(openai_types.RealtimeServerEvent)


# A scripted stand-in for the session core: it records the adapter's calls and lets a test push the
# typed events a real edge_rtgi.pipeline.session.Session emits. The real core runs end to end in
# tests/integration/test_openai_realtime*.py; these tests pin the wire translation alone.
class ScriptedCore:
    def __init__(self) -> None:
        self.session_id = "sess_test"
        self.pipeline_name = "voice-assistant"
        self.turn_detection_status: dict[str, object] | None = {"mode": "silence", "requested": "silence"}
        self.calls: list[tuple] = []
        self.history: dict[int, tuple[str, str]] = {}  # entry id -> (role, text), as the core keeps it
        self.entries_by_response: dict[str, int] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.update_error: Exception | None = None

    async def push_audio(self, pcm, sample_rate_hz=None):
        self.calls.append(("push_audio", pcm.copy(), sample_rate_hz))

    async def commit_audio(self):
        self.calls.append(("commit_audio",))

    async def clear_audio(self):
        self.calls.append(("clear_audio",))

    async def add_user_text(self, text, respond=True, echo=True):
        self.calls.append(("add_user_text", text, respond))
        entry = self.remember("user", text, turn_id=99)
        if echo:
            self.queue.put_nowait(F.Transcript(turn_id=99, text=text, final=True))
        return TextTurn(99, entry, None)

    def remember(self, role, text, *, turn_id=None, response_id=None):
        entry = len(self.history) + 1
        self.history[entry] = (role, text)
        if response_id is not None:
            self.entries_by_response[response_id] = entry
        return entry

    def revise(self, entry_id, text):
        if entry_id not in self.history:
            return False
        if text:
            self.history[entry_id] = (self.history[entry_id][0], text)
        else:
            del self.history[entry_id]
        return True

    def find_entry(self, *, turn_id=None, response_id=None):
        return self.entries_by_response.get(response_id)

    async def create_response(self, turn_id=None, source_text=None, timing=None):
        self.calls.append(("create_response", source_text))
        return "resp_x"

    async def cancel_response(self, response_id=None, reason="client_cancel"):
        self.calls.append(("cancel_response", response_id, reason))
        return True

    async def update(self, changes):
        if self.update_error is not None:
            raise self.update_error
        self.calls.append(("update", dict(changes)))
        self.queue.put_nowait(F.SessionUpdated(config=dict(changes)))

    def push(self, *frames):
        for frame in frames:
            self.queue.put_nowait(frame)

    async def events(self):
        while (frame := await self.queue.get()) is not None:
            yield frame

    def named(self, name):
        return [c for c in self.calls if c[0] == name]


class Harness:
    def __init__(self):
        self.core = ScriptedCore()
        self.sent: list[dict] = []
        self.adapter = RealtimeAdapter(self.core, self._send, model="edge-rtgi")

    async def _send(self, event: dict) -> None:
        SERVER_EVENT.validate_python(json.loads(json.dumps(event)))  # the official schema accepts it
        self.sent.append(event)

    async def client(self, event: dict | str) -> None:
        await self.adapter.handle_message(event if isinstance(event, str) else json.dumps(event))
        await self.flush()

    async def core_emits(self, *frames) -> None:
        self.core.push(*frames)
        await self.flush()

    async def flush(self) -> None:
        while not self.core.queue.empty():
            await self.adapter.on_frame(self.core.queue.get_nowait())

    def types(self) -> list[str]:
        return [e["type"] for e in self.sent]

    def take(self) -> list[dict]:
        out, self.sent = self.sent, []
        return out

    def last_error(self) -> dict:
        errors = [e for e in self.sent if e["type"] == "error"]
        assert errors, f"no error event in {self.types()}"
        return errors[-1]["error"]


def pcm_b64(n_samples: int, rate_hz: int = 24000) -> str:
    t = np.arange(n_samples) / rate_hz
    pcm = (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


@pytest.fixture
async def h():
    harness = Harness()
    await harness.core_emits(F.SessionStarted("sess_test", "voice-assistant", {}, 24000, 24000))
    return harness


async def test_session_created_and_update_maps_to_core_settings(h):
    created = h.take()[0]
    assert created["type"] == "session.created"
    assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    await h.client(
        {
            "type": "session.update",
            "event_id": "c1",
            "session": {
                "type": "realtime",
                "instructions": "Be brief.",
                "output_modalities": ["text"],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcmu"},
                        "turn_detection": {
                            "type": "server_vad",
                            "threshold": 0.6,
                            "prefix_padding_ms": 200,
                            "silence_duration_ms": 700,
                        },
                    },
                    "output": {"format": {"type": "audio/pcma"}, "voice": "alloy"},
                },
                "edge_rtgi": {"pipeline": "translate-en-es"},
            },
        }
    )
    changes = h.core.named("update")[-1][1]
    assert changes["system_prompt"] == "Be brief."
    assert changes["input_sample_rate_hz"] == 8000 and changes["output_sample_rate_hz"] == 8000
    assert changes["audio_output"] is False
    assert (changes["vad_threshold"], changes["vad_prefix_padding_ms"], changes["vad_min_silence_ms"]) == (
        0.6,
        200,
        700,
    )
    assert changes["turn_detection"] is True and changes["auto_response"] is True
    assert changes["pipeline"] == "translate-en-es"
    updated = h.take()[-1]
    assert updated["type"] == "session.updated"
    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    assert updated["session"]["edge_rtgi"]["pipeline"] == "translate-en-es"
    assert updated["session"]["edge_rtgi"]["turn_detection_status"]["mode"] == "silence"
    # null turn detection: manual commits, no automatic responses
    await h.client(
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
        }
    )
    changes = h.core.named("update")[-1][1]
    assert changes["turn_detection"] is False and changes["auto_response"] is False


async def test_unknown_pipeline_is_an_error_and_keeps_the_session(h):
    from edge_rtgi.errors import ConfigError

    h.take()
    h.core.update_error = ConfigError("unknown pipeline 'klingon'", hint="available: voice-assistant")
    await h.client(
        {
            "type": "session.update",
            "event_id": "u1",
            "session": {"type": "realtime", "edge_rtgi": {"pipeline": "klingon"}},
        }
    )
    err = h.last_error()
    assert (
        err["param"] == "session.edge_rtgi.pipeline"
        and "klingon" in err["message"]
        and err["event_id"] == "u1"
    )
    assert h.adapter.config.pipeline is None


async def test_beta_session_shape_is_accepted(h):
    await h.client(
        {
            "type": "session.update",
            "session": {
                "modalities": ["text", "audio"],
                "input_audio_format": "g711_ulaw",
                "output_audio_format": "pcm16",
                "voice": "alloy",
                "turn_detection": None,
                "input_audio_transcription": {"model": "whisper-1"},
            },
        }
    )
    assert "error" not in h.types(), h.sent
    cfg = h.adapter.config
    assert cfg.input_format.type == "audio/pcmu" and cfg.output_format.type == "audio/pcm"
    assert cfg.turn_detection is None and cfg.output_modalities == ("text", "audio")


async def test_manual_turn_full_lifecycle(h):
    await h.client(
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
        }
    )
    h.take()
    await h.client({"type": "input_audio_buffer.append", "audio": pcm_b64(4800)})
    ((_, pcm, rate),) = h.core.named("push_audio")
    assert rate == 24000 and len(pcm) == 4800 and pcm.dtype == np.int16
    await h.client({"type": "input_audio_buffer.commit"})
    assert h.core.named("commit_audio")
    assert h.types() == ["input_audio_buffer.committed", "conversation.item.added"]
    user_item = h.sent[0]["item_id"]
    h.take()
    await h.client({"type": "response.create"})
    assert not h.core.named("create_response"), "must wait for the committed turn's transcript"
    await h.core_emits(
        F.Transcript(turn_id=1, text="What is the capital", final=False),
        F.Transcript(turn_id=1, text="What is the capital of France?", final=True),
    )
    assert h.types() == [
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
    ]
    deltas = "".join(e["delta"] for e in h.sent if e["type"].endswith("transcription.delta"))
    assert deltas == "What is the capital of France?"
    assert all(e["item_id"] == user_item for e in h.sent if "item_id" in e)
    assert h.core.named("create_response") == [("create_response", "What is the capital of France?")]
    h.take()

    voice = (np.sin(np.arange(2205) / 10) * 5000).astype(np.int16)  # 100 ms at 22.05 kHz
    await h.core_emits(
        F.ResponseStarted("resp_1", 1, "reply", "What is the capital of France?"),
        F.TextDelta("resp_1", "Paris"),
        F.AudioOut("resp_1", voice, 22050),
        F.TextDelta("resp_1", " is."),
        F.AudioOut("resp_1", voice, 22050),
        F.AudioDone("resp_1"),
        F.TextDone("resp_1", "Paris is.", usage={"prompt_tokens": 30, "completion_tokens": 4}),
        F.ResponseDone(
            "resp_1",
            "completed",
            "Paris is.",
            F.TurnStats(llm_ttft_ms=80.0),
            usage={"prompt_tokens": 30, "completion_tokens": 4},
        ),
    )
    types = h.types()
    assert types[:4] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert types[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    text = "".join(e["delta"] for e in h.sent if e["type"] == "response.output_audio_transcript.delta")
    assert text == "Paris is."
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in h.sent if e["type"] == "response.output_audio.delta"
    )
    assert abs(len(audio) // 2 - 4800) <= 2  # 200 ms resampled 22.05 -> 24 kHz
    done = h.sent[-1]["response"]
    assert done["status"] == "completed"
    assert done["usage"]["input_tokens"] == 30 and done["usage"]["output_tokens"] == 4
    assert done["output"][0]["content"][0] == {"type": "output_audio", "transcript": "Paris is."}
    assert done["edge_rtgi"]["stats"]["llm_ttft_ms"] == 80.0


async def test_commit_of_silence_completes_with_empty_transcript(h):
    await h.client(
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
        }
    )
    await h.client({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(9600)).decode()})
    await h.client({"type": "input_audio_buffer.commit"})
    await h.client({"type": "response.create", "event_id": "c5"})
    h.take()
    await h.core_emits(F.AudioCommitted())  # the core processed the commit and heard no speech
    types = h.types()
    assert types[:2] == ["conversation.item.input_audio_transcription.completed", "conversation.item.done"]
    assert h.sent[0]["transcript"] == ""
    assert h.last_error()["code"] == "input_audio_buffer_commit_empty"
    assert h.last_error()["event_id"] == "c5"  # it answers the deferred response.create
    assert not h.core.named("create_response")
    await h.client(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hola"}]},
        }
    )
    # the session is still usable; beta per-response fields are accepted (and ignored)
    await h.client({"type": "response.create", "response": {"modalities": ["text"], "instructions": "x"}})
    assert h.core.named("create_response") == [("create_response", "Hola")]


async def test_text_only_modality_emits_output_text(h):
    await h.client({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}})
    h.take()
    await h.core_emits(
        F.ResponseStarted("r", 1, "reply", "hi"),
        F.TextDelta("r", "Hello"),
        F.ResponseDone("r", "completed", "Hello", F.TurnStats()),
    )
    types = h.types()
    assert "response.output_text.delta" in types and "response.output_text.done" in types
    assert not any("audio" in t for t in types)


async def test_server_vad_turn_and_barge_in(h):
    h.take()
    await h.core_emits(F.SpeechStarted(turn_id=1, audio_ms=120))
    started = h.take()[0]
    assert started["type"] == "input_audio_buffer.speech_started" and started["audio_start_ms"] == 120
    await h.core_emits(F.SpeechStopped(turn_id=1, audio_ms=1500))
    assert h.types() == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
    ]
    assert {e["item_id"] for e in h.sent[:2]} == {started["item_id"]}
    h.take()
    await h.core_emits(
        F.Transcript(turn_id=1, text="Tell me a story.", final=True),
        F.ResponseStarted("r1", 1, "reply", "Tell me a story."),
        F.TextDelta("r1", "Once"),
    )
    h.take()
    # the user talks over the reply: the core cancels it, the client sees a cancelled response
    await h.core_emits(
        F.SpeechStarted(turn_id=2, audio_ms=3000),
        F.ResponseInterrupted("r1", "barge_in", played_ms=400),
        F.ResponseDone("r1", "interrupted", "Once", F.TurnStats()),
    )
    assert h.types()[0] == "input_audio_buffer.speech_started"
    done = h.sent[-1]
    assert done["type"] == "response.done"
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}


async def test_vad_turn_without_words_completes_empty(h):
    h.take()
    await h.core_emits(F.SpeechStarted(turn_id=3, audio_ms=100), F.SpeechStopped(turn_id=3, audio_ms=400))
    item_id = h.sent[0]["item_id"]
    h.take()
    await h.core_emits(F.Transcript(turn_id=3, text="", final=True))  # noise: the core ends the turn empty
    assert h.types() == ["conversation.item.input_audio_transcription.completed", "conversation.item.done"]
    assert h.sent[0]["item_id"] == item_id and h.sent[0]["transcript"] == ""
    assert not h.adapter._awaiting_transcript  # a later response.create does not wait on it


async def test_response_cancel_and_conflicts(h):
    await h.client({"type": "response.cancel", "event_id": "c9"})
    err = h.last_error()
    assert err["code"] == "response_cancel_not_active" and err["event_id"] == "c9"
    await h.core_emits(F.ResponseStarted("r1", 1, "reply", "x"))
    await h.client({"type": "response.create"})
    assert h.last_error()["code"] == "conversation_already_has_active_response"
    await h.client({"type": "response.cancel"})
    assert h.core.named("cancel_response") == [("cancel_response", "r1", "client_cancel")]
    await h.core_emits(F.ResponseDone("r1", "cancelled", "", F.TurnStats()))
    assert h.sent[-1]["response"]["status_details"]["reason"] == "client_cancelled"


async def test_user_text_item(h):
    h.take()
    await h.client(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hello there"}],
            },
        }
    )
    assert h.core.named("add_user_text") == [("add_user_text", "Hello there", False)]
    assert h.types() == ["conversation.item.added", "conversation.item.done"]  # the core sends no echo
    await h.client({"type": "response.create"})
    assert h.core.named("create_response")


async def test_spoken_words_equal_to_a_typed_item_are_not_taken_for_its_echo(h):
    # Typed turns are told apart by the core (no echo), not by comparing texts: the same words
    # spoken afterwards are a turn of their own.
    await h.client(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Yes"}]},
        }
    )
    h.take()
    await h.core_emits(F.SpeechStarted(5, 0), F.SpeechStopped(5, 400), F.Transcript(5, "Yes", final=True))
    done = [e for e in h.sent if e["type"] == "conversation.item.done"]
    assert done and done[-1]["item"]["content"][0]["transcript"] == "Yes"


@pytest.mark.parametrize(
    "message, code, param",
    [
        ("{not json", "invalid_json", None),
        ({"type": "response.dance"}, "unknown_event", "type"),
        ({"type": "response.audio.delta", "delta": ""}, "unknown_event", "type"),
        ({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}, "invalid_base64", "audio"),
        (
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()},
            "invalid_audio",
            "audio",
        ),
        (
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/opus"}}}},
            },
            "unsupported_audio_format",
            "session.audio.input.format.type",
        ),
        (
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
                },
            },
            "unsupported_audio_format",
            "session.audio.input.format.rate",
        ),
        (
            {"type": "session.update", "session": {"type": "realtime", "voise": "x"}},
            "unknown_parameter",
            "session.voise",
        ),
        ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),
        (
            {"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 10},
            "item_not_found",
            "item_id",
        ),
        (
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "system",
                    "content": [{"type": "input_text", "text": "be nice"}],
                },
            },
            "invalid_value",
            "item.role",
        ),
        (
            {"type": "conversation.item.create", "item": {"type": "function_call", "name": "f"}},
            "invalid_value",
            "item.type",
        ),
        (
            {"type": "response.create", "response": {"input": [{"type": "message"}]}},
            "invalid_value",
            "response.input",
        ),
    ],
)
async def test_bad_input_gets_error_and_session_stays_usable(h, message, code, param):
    h.take()
    if isinstance(message, dict):
        message = {**message, "event_id": "evt_client_1"}
    await h.client(message)
    (event,) = h.take()
    assert event["type"] == "error"
    err = event["error"]
    assert err["code"] == code and err["param"] == param and err["message"]
    if isinstance(message, dict):
        assert err["event_id"] == "evt_client_1"
    if code == "unknown_event":
        assert repr(message["type"]) in err["message"]  # the unknown type is named
    assert h.adapter.config.input_format.type == "audio/pcm"  # a rejected update changes nothing
    await h.client({"type": "input_audio_buffer.append", "audio": pcm_b64(2400)})
    await h.client({"type": "input_audio_buffer.commit"})
    assert h.types() == ["input_audio_buffer.committed", "conversation.item.added"]


async def test_g711_input_is_decoded_at_8khz(h):
    await h.client(
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
        }
    )
    pcm = (np.sin(np.arange(800) / 5) * 10000).astype(np.int16)
    await h.client(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(ulaw_encode(pcm)).decode()}
    )
    ((_, got, rate),) = h.core.named("push_audio")
    assert rate == 8000 and len(got) == 800
    assert np.max(np.abs(got.astype(int) - pcm)) < 700  # mu-law quantisation step at this level


async def test_truncate_keeps_heard_text(h):
    await h.core_emits(F.ResponseStarted("r1", 1, "reply", "x"))
    one_s = np.zeros(24000, dtype=np.int16)
    await h.core_emits(
        F.TextDelta("r1", "First clause."),
        F.AudioOut("r1", one_s, 24000),
        F.TextDelta("r1", " Second clause."),
        F.AudioOut("r1", one_s, 24000),
        F.ResponseDone("r1", "completed", "First clause. Second clause.", F.TurnStats()),
    )
    item_id = h.sent[-1]["response"]["output"][0]["id"]
    h.core.remember("assistant", "First clause. Second clause.", response_id="r1")  # as the core does
    h.take()
    await h.client(
        {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": 1000}
    )  # half the audio: about half the characters
    assert h.types() == ["conversation.item.truncated"]
    assert list(h.core.history.values())[-1] == ("assistant", "First clause.")
    await h.client({"type": "conversation.item.retrieve", "item_id": item_id})
    assert h.sent[-1]["item"]["content"][0]["transcript"] == "First clause."


def test_core_settings_defaults_match_protocol_defaults():
    s = core_settings(RealtimeSessionConfig())
    assert s["turn_detection"] and s["auto_response"] and s["barge_in"]
    assert (s["vad_threshold"], s["vad_prefix_padding_ms"], s["vad_min_silence_ms"]) == (0.5, 300, 500)
    assert s["input_sample_rate_hz"] == 24000 and s["output_sample_rate_hz"] == 24000


def test_connection_url_picks_model_and_pipeline():
    from edge_rtgi.server.openai_realtime.connection import initial_config

    pipelines = {"voice-assistant": None, "translate-en-es": None}
    config, model = initial_config("/v1/realtime?model=gpt-realtime", pipelines)
    assert model == "gpt-realtime" and config.pipeline is None  # any model name works; default pipeline
    config, model = initial_config("/v1/realtime?model=translate-en-es", pipelines)
    assert config.pipeline == "translate-en-es"
    config, model = initial_config("/v1/realtime?pipeline=translate-en-es", pipelines)
    assert model == "edge-rtgi" and config.pipeline == "translate-en-es"
