"""The official ``openai`` Realtime client against the daemon's ``/v1/realtime``, end to end.

Real models throughout: Piper speaks the question (resampled to 24 kHz), the daemon runs
silero VAD + whisper tiny.en, SmolLM2-135M and the Piper voice, and the reply audio that comes
back is transcribed again with tiny.en and compared with the reply text.
"""

from __future__ import annotations

import asyncio
import base64

import jiwer
import numpy as np
import pytest
import pytest_asyncio

from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample
from edge_rtgi.catalog import resolve_model
from tests.integration.native_client import steady_voice

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

QUESTION = "What is the capital of France?"
CHUNK_SAMPLES = 4800  # 200 ms at 24 kHz per append event
EVENT_TIMEOUT_S = 120.0


def _norm(text: str) -> str:
    return jiwer.RemovePunctuation()(text.lower()).strip()


def wer(reference: str, hypothesis: str) -> float:
    return jiwer.wer(_norm(reference), _norm(hypothesis))


def cer(reference: str, hypothesis: str) -> float:
    # For the short replies: whisper tiny.en hears "France is" as "Francis", which is a
    # third of a six-word reply by WER but one space by characters.
    return jiwer.cer(_norm(reference), _norm(hypothesis))


@pytest.fixture(scope="module")
def piper():
    from edge_rtgi.tts.piper import PiperVoice

    return steady_voice(PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"), intra_op_threads=1))


@pytest.fixture(scope="module")
def whisper():
    from edge_rtgi.asr.config import AsrConfig
    from edge_rtgi.asr.whisper import WhisperAsr

    return WhisperAsr(AsrConfig(model="whisper-tiny.en"))


def speak_24k(piper, text: str, tail_silence_s: float = 0.0) -> np.ndarray:
    """Piper speech of ``text`` as int16 at 24 kHz, with optional trailing silence."""
    pcm = np.concatenate(list(piper.synthesize_stream(text)))
    audio = resample(pcm16_to_float32(pcm), piper.sample_rate_hz, 24000)
    audio = np.concatenate(
        [np.zeros(4800, np.float32), audio, np.zeros(int(tail_silence_s * 24000), np.float32)]
    )
    return float32_to_pcm16(audio)


def transcribe_24k(whisper, pcm: np.ndarray) -> str:
    return whisper.transcribe(resample(pcm16_to_float32(pcm), 24000, 16000)).text


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon():
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, ServerConfig

    pipelines = load_pipelines([builtin_pipelines_dir()])
    config = DaemonConfig(server=ServerConfig(port=0))
    d = Daemon(config, pipelines, Resources())
    # Load the models first, as `edge-rtgi serve` does (preload): a session opened on a cold daemon
    # waits for them, and meanwhile the client's keepalive pings go unread.
    await d.resources.prepare(pipelines["voice-assistant"])
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)


def client_for(daemon):
    return openai.AsyncOpenAI(api_key="local", websocket_base_url=f"ws://127.0.0.1:{daemon.port}/v1")


async def stream_audio(conn, pcm: np.ndarray, paced: bool = False) -> None:
    for i in range(0, len(pcm), CHUNK_SAMPLES):
        chunk = pcm[i : i + CHUNK_SAMPLES].astype("<i2").tobytes()
        await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
        if paced:
            await asyncio.sleep(0.1)  # faster than real time, but the VAD sees a stream


async def collect_turn(conn) -> dict:
    """Events up to ``response.done``: transcript, text deltas, audio, the final response."""
    out = {"types": [], "transcript": None, "text": "", "audio": [], "errors": [], "response": None}
    while True:
        event = await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)
        out["types"].append(event.type)
        if event.type == "conversation.item.input_audio_transcription.completed":
            out["transcript"] = event.transcript
        elif event.type in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            out["text"] += event.delta
        elif event.type == "response.output_audio.delta":
            out["audio"].append(base64.b64decode(event.delta))  # bytes in the session's output format
        elif event.type == "error":
            out["errors"].append(event.error)
        elif event.type == "response.done":
            out["response"] = event.response
            return out


def check_spoken_reply(turn: dict, whisper) -> None:
    assert turn["errors"] == [], turn["errors"]
    assert wer(QUESTION, turn["transcript"] or "") <= 0.2, turn["transcript"]
    assert turn["response"].status == "completed"
    assert turn["types"].count("response.output_audio_transcript.delta") >= 2, "text must stream as deltas"
    reply = turn["text"].strip()
    assert reply and turn["response"].output[0].content[0].transcript == turn["text"]
    audio = np.frombuffer(b"".join(turn["audio"]), dtype="<i2")
    assert len(audio) > 24000 * 0.5
    heard = transcribe_24k(whisper, audio)
    assert cer(reply, heard) <= 0.15, (reply, heard)
    assert turn["response"].usage.output_tokens > 0 and turn["response"].usage.input_tokens > 0


async def test_manual_commit_turn_with_official_client(daemon, piper, whisper):
    speech = speak_24k(piper, QUESTION)
    async with client_for(daemon).realtime.connect(model="edge-rtgi") as conn:
        created = await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)
        assert created.type == "session.created"
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 24000},
                        "turn_detection": None,
                        "transcription": {"model": "whisper-1"},
                    },
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}},
                },
            }
        )
        updated = await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)
        assert updated.type == "session.updated" and updated.session.audio.input.turn_detection is None
        await stream_audio(conn, speech)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        turn = await collect_turn(conn)
    check_spoken_reply(turn, whisper)
    assert "input_audio_buffer.speech_started" not in turn["types"]  # manual mode: no VAD events


async def test_server_vad_turn_ends_by_silence(daemon, piper, whisper):
    speech = speak_24k(piper, QUESTION, tail_silence_s=1.5)
    async with client_for(daemon).realtime.connect(model="edge-rtgi") as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {
                        "turn_detection": {
                            "type": "server_vad",
                            "threshold": 0.5,
                            "prefix_padding_ms": 300,
                            "silence_duration_ms": 500,
                        }
                    }
                },
            }
        )
        await stream_audio(conn, speech, paced=True)  # no commit, no response.create
        turn = await collect_turn(conn)
    for kind in (
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
    ):
        assert kind in turn["types"], kind
    assert turn["types"].index("input_audio_buffer.speech_stopped") < turn["types"].index("response.created")
    check_spoken_reply(turn, whisper)


async def test_bad_input_then_good_turn(daemon, piper, whisper):
    speech = speak_24k(piper, QUESTION)
    bad = [
        ("{this is not json", "invalid_json"),
        ('{"type": "response.dance", "event_id": "e2"}', "unknown_event"),
        ('{"type": "input_audio_buffer.append", "audio": "***", "event_id": "e3"}', "invalid_base64"),
        (
            '{"type": "session.update", "event_id": "e4", "session": {"type": "realtime", '
            '"audio": {"input": {"format": {"type": "audio/opus"}}}}}',
            "unsupported_audio_format",
        ),
    ]
    async with client_for(daemon).realtime.connect(model="edge-rtgi") as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {"input": {"turn_detection": None}},
            }
        )
        for raw, code in bad:
            await conn.send_raw(raw)
            while (event := await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)).type != "error":
                pass
            assert event.error.code == code, event.error
            if code == "unknown_event":
                assert "response.dance" in event.error.message and event.error.event_id == "e2"
            # the session is still usable: a good turn after each bad event
            await stream_audio(conn, speech)
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            turn = await collect_turn(conn)
            assert turn["errors"] == [] and turn["response"].status == "completed"
            assert wer(QUESTION, turn["transcript"] or "") <= 0.2
            assert turn["text"].strip() and "response.output_text.delta" in turn["types"]
        # a typed user turn works in the same session
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
        )
        await conn.response.create()
        turn = await collect_turn(conn)
        assert turn["errors"] == [] and turn["response"].status == "completed"
        assert "conversation.item.input_audio_transcription.completed" not in turn["types"]
        assert "paris" in _norm(turn["text"]), turn["text"]


async def test_barge_in_cancels_the_reply(daemon, piper):
    question = speak_24k(piper, "Tell me a long story about a dragon and a brave knight.", tail_silence_s=1.0)
    interruption = speak_24k(piper, "Stop, please stop.", tail_silence_s=1.0)
    async with client_for(daemon).realtime.connect(model="edge-rtgi") as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "max_output_tokens": 300,
                "instructions": "You tell long, detailed stories.",
            }
        )
        await stream_audio(conn, question, paced=True)
        while (
            event := await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)
        ).type != "response.output_audio.delta":
            assert event.type != "response.done", "the reply ended before any audio"
        await stream_audio(conn, interruption, paced=True)  # the user talks over the reply
        seen = []
        while (event := await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)).type != "response.done":
            seen.append(event.type)
    assert "input_audio_buffer.speech_started" in seen
    assert event.response.status == "cancelled"
    assert event.response.status_details.reason == "turn_detected"
    assert "response.output_audio.done" in seen  # the closing events a client expects are all there


async def test_translation_session_extension(daemon, piper):
    speech = speak_24k(piper, "Good morning, my friend.")
    async with client_for(daemon).realtime.connect(model="edge-rtgi") as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "edge_rtgi": {"pipeline": "translate-en-es"},
                "audio": {"input": {"turn_detection": None}},
            }
        )
        while (event := await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)).type != "session.updated":
            pass
        extension = event.to_dict()["session"]["edge_rtgi"]
        assert extension["pipeline"] == "translate-en-es"
        # the pipeline's own turn detection, reported beside it (issue 23): the silence timer here
        assert extension["turn_detection_status"]["mode"] == "silence"
        await stream_audio(conn, speech)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        turn = await collect_turn(conn)
    assert turn["errors"] == [] and turn["response"].status == "completed"
    assert wer("Good morning, my friend.", turn["transcript"] or "") <= 0.25
    translation = _norm(turn["text"])
    assert "amigo" in translation and "buenos" in translation, turn["text"]
    assert sum(len(a) for a in turn["audio"]) > 2 * 24000 * 0.5  # spoken by the Spanish voice


async def test_token_origin_and_g711_audio(daemon, piper, whisper):
    """The daemon's admission rules hold for /v1/realtime; G.711 in and out works with real speech."""
    from websockets.exceptions import InvalidStatus

    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, ServerConfig
    from edge_rtgi.server.openai_realtime.codecs import ulaw_decode, ulaw_encode

    token = "realtime-test-token-0123456789"
    guarded = Daemon(
        DaemonConfig(server=ServerConfig(port=0, token=token)), daemon.pipelines, daemon.resources
    )
    await guarded.start()
    base = f"ws://127.0.0.1:{guarded.port}/v1"
    try:
        with pytest.raises(InvalidStatus) as refused:
            async with openai.AsyncOpenAI(api_key="wrong", websocket_base_url=base).realtime.connect(
                model="x"
            ):
                pass
        assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus) as refused:
            async with openai.AsyncOpenAI(api_key=token, websocket_base_url=base).realtime.connect(
                model="x", extra_headers={"Origin": "https://evil.example"}
            ):
                pass
        assert refused.value.response.status_code == 403

        speech_8k = float32_to_pcm16(resample(pcm16_to_float32(speak_24k(piper, QUESTION)), 24000, 8000))
        async with openai.AsyncOpenAI(api_key=token, websocket_base_url=base).realtime.connect(
            model="x"
        ) as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "audio": {
                        "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                        "output": {"format": {"type": "audio/pcmu"}},
                    },
                }
            )
            for i in range(0, len(speech_8k), 1600):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(ulaw_encode(speech_8k[i : i + 1600])).decode()
                )
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            turn = await collect_turn(conn)
    finally:
        await guarded.drain(timeout_s=1.0)
    assert turn["errors"] == [] and turn["response"].status == "completed"
    assert wer(QUESTION, turn["transcript"] or "") <= 0.2, turn["transcript"]
    mulaw = b"".join(turn["audio"])  # one byte per sample at 8 kHz
    heard = whisper.transcribe(resample(pcm16_to_float32(ulaw_decode(mulaw)), 8000, 16000)).text
    assert cer(turn["text"], heard) <= 0.2, (turn["text"], heard)
