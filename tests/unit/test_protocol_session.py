"""Session machinery without models: the outbox's control lane, response book-keeping,
per-response cancellation in a stage, and generators consumed off the event loop."""

import asyncio

import numpy as np
import pytest

from edge_rtgi import frames as F
from edge_rtgi.errors import ConfigError
from edge_rtgi.pipeline.outbox import Outbox
from edge_rtgi.pipeline.responses import ResponseState
from edge_rtgi.pipeline.session import SessionSettings
from edge_rtgi.pipeline.stage import Stage


async def test_control_events_jump_the_queue_and_drop_removes_a_response():
    box = Outbox(max_data_events=8)
    for i in range(3):
        await box.put(F.TextDelta("r1", str(i)))
    await box.put(F.TextDelta("r2", "keep"))
    box.put_control(F.ResponseInterrupted("r1", "barge_in", 0))
    assert box.drop("r1") == 3
    first = await box.get()
    assert isinstance(first, F.ResponseInterrupted)
    assert (await box.get()).delta == "keep"


async def test_full_outbox_pushes_back_until_read():
    box = Outbox(max_data_events=2)
    await box.put(F.TextDelta("r", "a"))
    await box.put(F.TextDelta("r", "b"))
    blocked = asyncio.create_task(box.put(F.TextDelta("r", "c")))
    for _ in range(20):  # let the producer run as far as it can
        await asyncio.sleep(0)
    assert not blocked.done(), "a full outbox must make the producer wait"
    assert (await box.get()).delta == "a"
    await asyncio.wait_for(blocked, 1)
    box.close()
    assert [(await box.get()).delta, (await box.get()).delta] == ["b", "c"]
    assert await box.get() is None


def test_response_is_active_while_its_audio_plays():
    st = ResponseState("r", 1, "reply", "hi")
    assert st.active()
    st.done = True
    assert not st.active(), "done and no audio: nothing is playing"
    st.audio_sent(F.AudioOut("r", np.zeros(22050, np.int16), 22050), now_s=100.0)  # 1 s of audio
    assert st.active(100.5) and not st.active(101.5)
    assert st.played_ms(100.25) == 250 and st.played_ms(200.0) == 1000


def test_turn_stats_from_marks():
    final = F.Transcript(1, "hi", final=True, t_s=10.4, speech_end_t_s=10.0, endpoint_t_s=10.3)
    st = ResponseState("r", 1, "reply", "hi", timing=final)
    st.observe(F.TextDelta("r", "Hello", t_s=10.5))
    st.marks.update(first_clause=10.6, first_audio=10.7)
    st.audio_sent(F.AudioOut("r", np.zeros(100, np.int16), 22050), now_s=10.75)
    s = st.stats()
    assert (s.endpointing_ms, s.asr_final_ms, s.llm_ttft_ms) == (300.0, 100.0, 100.0)
    assert (s.first_clause_ms, s.tts_first_chunk_ms, s.voice_to_voice_ms) == (100.0, 100.0, 750.0)


def test_session_settings_are_strict():
    s = SessionSettings().merged({"max_reply_tokens": 20, "barge_in": False})
    assert s.max_reply_tokens == 20 and s.barge_in is False
    with pytest.raises(ConfigError, match="unknown key 'max_reply_tokns'"):
        SessionSettings().merged({"max_reply_tokns": 20})
    with pytest.raises(ConfigError, match="max_reply_tokens must be in"):
        SessionSettings().merged({"max_reply_tokens": 0})


class _Ctx:
    def __init__(self):
        self.cancelled: set[str] = set()
        self.failures: list = []

    def is_cancelled(self, rid):
        return rid in self.cancelled

    def stage_failed(self, stage, frame, exc):
        self.failures.append((frame, exc))


class _SlowStage(Stage):
    """Handles each frame by waiting until released; records what it finished."""

    name = "slow"

    def __init__(self, ctx):
        super().__init__(ctx, inbox_frames=4)
        self.finished: list[str] = []
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.first_started = asyncio.Event()
        self.last_finished = asyncio.Event()

    async def handle(self, frame):
        self.started.append(frame.delta)
        self.first_started.set()
        if frame.delta == "boom":
            raise RuntimeError("bad frame")
        await self.release.wait()
        self.finished.append(frame.delta)
        if frame.delta == "c":
            self.last_finished.set()


async def test_stage_cancels_one_response_and_keeps_going():
    ctx = _Ctx()
    stage = _SlowStage(ctx)
    await stage.start()
    await stage.inbox.put(F.TextDelta("r1", "a"))
    await stage.inbox.put(F.TextDelta("r1", "b"))
    await stage.inbox.put(F.TextDelta("r2", "boom"))
    await stage.inbox.put(F.TextDelta("r3", "c"))
    await asyncio.wait_for(stage.first_started.wait(), 5)
    assert stage.started == ["a"]
    ctx.cancelled.add("r1")
    stage.cancel("r1")  # cancels "a" in flight; "b" is skipped when dequeued
    stage.release.set()
    await asyncio.wait_for(stage.last_finished.wait(), 5)
    assert stage.started == ["a", "boom", "c"]
    assert stage.finished == ["c"]
    assert len(ctx.failures) == 1 and ctx.failures[0][0].delta == "boom"
    await stage.close()


async def test_stage_closes_even_right_after_a_response_cancel():
    # Both cancellations land on the same await; the close must win (no Task.cancelling() on 3.10).
    stage = _SlowStage(_Ctx())
    await stage.start()
    await stage.inbox.put(F.TextDelta("r1", "a"))
    await asyncio.wait_for(stage.first_started.wait(), 5)
    stage.cancel("r1")
    await asyncio.wait_for(stage.close(), 5)
    assert stage._worker is not None and stage._worker.done()
