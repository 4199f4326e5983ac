"""A reply started on a likely final (``Session.on_likely_final``), on a seeded tiny model spoken
by espeak-ng: nothing of it reaches the client before the final; when the final has the same
words the client gets exactly what a reply started at the final would have given (greedy: the
same text, in the same order of events); when the words differ, or speech goes on, the client
never sees it and the final's own reply follows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from edge_rtgi import frames as F
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.config import parse_pipeline
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.pipeline.session import Session, SessionSettings
from tests.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
ENGINE = EngineConfig(device="cpu", dtype="fp32", quant="none", kv_cache_memory_mb=16)
TEXT = "Remind me to call the bank."
EVENT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tiny = make_tiny_hf_model("llama", tmp_path_factory.mktemp("preempt"), seed=5)
    body = (
        f"name: chat\nstages:\n  - asr: {{model: whisper-tiny.en}}\n"
        f"  - assistant: {{model: '{tiny}', max_reply_tokens: 12, system_prompt: Be brief.}}\n"
        "  - tts: {voice: 'espeak:en'}\n"
    )
    return parse_pipeline(body, "chat.yaml")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def resources():
    res = Resources(ENGINE)
    yield res
    res.close()


async def _session(pipeline, resources) -> Session:
    session = await Session.open({"chat": pipeline}, resources, SessionSettings(pipeline="chat"))
    assert isinstance(await session.next_event(), F.SessionStarted)
    return session


async def _until_done(session: Session) -> list[F.SessionEvent]:
    events: list[F.SessionEvent] = []
    while not (events and isinstance(events[-1], F.ResponseDone)):
        events.append(await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S))
    return events


def _final(turn_id: int, text: str) -> F.Transcript:
    now = F.now_s()
    return F.Transcript(turn_id, text, final=True, t_s=now, speech_end_t_s=now - 0.5, endpoint_t_s=now)


def _shape(events: list[F.SessionEvent]) -> list[str]:
    """Event kinds in order, audio chunks folded into one."""
    kinds: list[str] = []
    for e in events:
        kind = type(e).__name__
        if not (kinds and kinds[-1] == kind == "AudioOut"):
            kinds.append(kind)
    return kinds


async def _held_until_text_done(session: Session, response_id: str) -> None:
    """Wait until the held response has its whole text (and so has run while held)."""
    for _ in range(int(EVENT_TIMEOUT_S * 20)):
        held = session.responses[response_id].held
        assert held is not None
        if any(isinstance(e, F.TextDone) for e, _ in held):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the held response never finished its text")


async def _held_reply(session: Session) -> tuple[int, str]:
    """A new turn guessed to end with ``TEXT``, and its held response, run to its whole text."""
    turn = session.new_turn_id()
    await session.on_likely_final(turn, TEXT)
    (rid,) = [r for r, st in session.responses.items() if st.held is not None]
    await _held_until_text_done(session, rid)
    return turn, rid


async def test_a_confirmed_likely_final_gives_the_reply_the_final_would_have(pipeline, resources):
    plain = await _session(pipeline, resources)
    try:
        turn = plain.new_turn_id()
        await plain.on_final_transcript(_final(turn, TEXT))
        expected = await _until_done(plain)
    finally:
        await plain.close()

    session = await _session(pipeline, resources)
    try:
        turn, rid = await _held_reply(session)
        with pytest.raises(asyncio.TimeoutError):  # nothing of it is the client's yet
            await asyncio.wait_for(session.next_event(), 0.3)
        assert not session.reply_active()  # a held reply is no reply to barge in on
        await session.on_final_transcript(_final(turn, TEXT))
        got = await _until_done(session)
    finally:
        await session.close()
    assert _shape(got) == _shape(expected)
    assert expected[-1].stats is not None and expected[-1].stats.reply_head_start_ms is None
    assert got[-1].text == expected[-1].text and got[-1].text
    assert got[-1].status == "completed" and got[-1].response_id == rid
    assert [t.role for t in session.history] == ["user", "assistant"]


async def test_a_confirmed_likely_final_gives_the_translation_the_final_would_have(tmp_path, resources):
    """A translate pipeline (the LLM backend on the tiny model): the held response is the
    translation, released as the one the final would have started."""
    tiny = make_tiny_hf_model("llama", tmp_path, seed=5)
    body = (
        "name: tr\nstages:\n  - asr: {model: whisper-tiny.en}\n"
        f"  - translate: {{backend: llm, model: '{tiny}', min_budget_tokens: 8}}\n"
        "  - tts: {voice: 'espeak:es'}\n"
    )
    pipelines = {"tr": parse_pipeline(body, "tr.yaml")}

    async def open_session() -> Session:
        session = await Session.open(pipelines, resources, SessionSettings(pipeline="tr"))
        assert isinstance(await session.next_event(), F.SessionStarted)
        return session

    plain = await open_session()
    try:
        await plain.on_final_transcript(_final(plain.new_turn_id(), TEXT))
        expected = await _until_done(plain)
    finally:
        await plain.close()
    session = await open_session()
    try:
        turn, rid = await _held_reply(session)
        await session.on_final_transcript(_final(turn, TEXT))
        got = await _until_done(session)
    finally:
        await session.close()
    assert _shape(got) == _shape(expected)
    assert got[-1].text == expected[-1].text and got[-1].text and got[-1].response_id == rid
    caption = next(e for e in got if isinstance(e, F.TextDone))
    assert caption.source_text == TEXT


async def test_a_likely_final_with_other_words_or_resumed_speech_is_never_seen(pipeline, resources):
    session = await _session(pipeline, resources)
    try:
        # the words differ: the guess is dropped, the final gets its own reply
        turn = session.new_turn_id()
        await session.on_likely_final(turn, "Remind me.")
        (guess,) = session.responses
        await session.on_final_transcript(_final(turn, TEXT))
        events = await _until_done(session)
        started = [e.response_id for e in events if isinstance(e, F.ResponseStarted)]
        assert len(started) == 1 and started[0] != guess
        assert all(getattr(e, "response_id", None) != guess for e in events)
        # speech went on: dropped at once, so even a final with the same words gets a reply of its own
        turn = session.new_turn_id()
        await session.on_likely_final(turn, TEXT)
        guess = next(r for r, st in session.responses.items() if st.held is not None)
        session.drop_likely_final(turn)
        assert session.responses[guess].held is None and session.is_cancelled(guess)
        await session.on_final_transcript(_final(turn, TEXT))
        events = await _until_done(session)
        assert all(getattr(e, "response_id", None) != guess for e in events)
        assert isinstance(events[-1], F.ResponseDone) and events[-1].status == "completed"
    finally:
        await session.close()


async def test_a_guess_whose_turn_never_gets_a_final_is_dropped_by_the_next_one(pipeline, resources):
    """The audio of a held turn can be cleared (or its decode fail): no final and no resume ever
    names it. The next turn's final drops it, unseen, so nothing stays held for good."""
    session = await _session(pipeline, resources)
    try:
        lost = session.new_turn_id()
        await session.on_likely_final(lost, TEXT)
        (guess,) = session.responses
        turn = session.new_turn_id()
        await session.on_final_transcript(_final(turn, "Add apples."))
        events = await _until_done(session)
        assert all(getattr(e, "response_id", None) != guess for e in events)
        assert session.responses[guess].held is None and session.responses[guess].done
    finally:
        await session.close()


async def test_a_released_reply_reports_no_negative_latency(pipeline, resources):
    session = await _session(pipeline, resources)
    try:
        turn, _ = await _held_reply(session)
        await session.on_final_transcript(_final(turn, TEXT))
        stats = (await _until_done(session))[-1].stats
    finally:
        await session.close()
    assert stats is not None and stats.llm_ttft_ms == 0.0 and stats.text_total_ms == 0.0
    assert stats.reply_head_start_ms is not None and stats.reply_head_start_ms > 0


SPOKEN = (
    "name: spoken\nstages:\n  - asr:\n      model: whisper-tiny.en\n      language: en\n"
    "      vad: {min_silence_ms: 300, speech_pad_ms: 100, end_pad_ms: 64}\n"
    "      turn_detection: %s\n"
    "  - assistant: {model: '%s', max_reply_tokens: 12, system_prompt: Be brief.}\n"
    "  - tts: {voice: 'espeak:en'}\n"
)


TURN_DETECTION = {
    "semantic": "{mode: semantic, min_silence_ms: 100, max_silence_ms: 1500}",
    # a long timer: the pause's words are announced after half of it, so a slow decode on a
    # loaded machine still leaves time to announce them before the timer ends the turn
    "silence": "{mode: silence, min_silence_ms: 800}",
}


@pytest.mark.parametrize(
    ("mode", "preemptive"), [("semantic", True), ("semantic", False), ("silence", True), ("silence", False)]
)
async def test_a_spoken_command_starts_its_reply_before_its_final(tmp_path, resources, mode, preemptive):
    """Through the ASR stage on Piper audio: the command waits out the continuation hold (semantic
    mode) or the silence timer, and its response is started once the pause's words are decoded
    (before the final), unless the session turns ``preemptive_reply`` off."""
    from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample
    from edge_rtgi.tts import make_tts
    from tests.integration.native_client import steady_voice

    tiny = make_tiny_hf_model("llama", tmp_path, seed=5)
    pipe = parse_pipeline(SPOKEN % (TURN_DETECTION[mode], tiny), "spoken.yaml")
    voice = steady_voice(make_tts("piper-en_US-joe-medium"))
    pcm = np.concatenate(list(voice.synthesize_stream(TEXT)))
    audio = resample(pcm16_to_float32(pcm), voice.sample_rate_hz, 16000)
    settings = SessionSettings(pipeline="spoken", turn_preemptive_reply=None if preemptive else False)
    session = await Session.open({"spoken": pipe}, resources, settings)
    try:
        lead, tail = np.zeros(4800, np.float32), np.zeros(32000, np.float32)  # the tail: past the cap
        pcm16 = float32_to_pcm16(np.concatenate([lead, audio, tail]))
        loop = asyncio.get_running_loop()
        start = loop.time()
        # At half real time: a stage that falls behind (a loaded machine) takes its queued audio in
        # one step, so the pause's decode lands late, past the hold or timer this test is about.
        for i in range(0, len(pcm16), 320):
            await session.push_audio(pcm16[i : i + 320])
            await asyncio.sleep(max(0.0, start + 2 * (i + 320) / 16000 - loop.time()))
        events: list[F.SessionEvent] = []
        while not any(isinstance(e, F.ResponseDone) for e in events):
            events.append(await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S))
    finally:
        await session.close()
    final = next(e for e in events if isinstance(e, F.Transcript) and e.final and e.text)
    assert final.end_reason == mode and "bank" in final.text.lower(), final
    rid = next(e.response_id for e in events if isinstance(e, F.ResponseStarted))
    created_before_final = session.responses[rid].created_t_s < final.t_s
    assert created_before_final is preemptive
