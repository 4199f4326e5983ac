"""The shared ASR engine (edge_rtgi.asr.batch) against whisper decoding alone, on Piper audio.

whisper tiny.en, greedy partials and beam-5 finals, on the project's sentences spoken by the
Piper voice: a batched step must give every stream the words (and segment times) that
``WhisperAsr.transcribe`` gives it alone. Then the engine's bookkeeping: a session that closes
while its decode is queued frees the slot, and a decode that fails fails only its own session.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edge_rtgi.asr import AsrConfig, WhisperAsr
from edge_rtgi.asr.batch import AsrEngineClosed, DecodeJob, SharedWhisper, StepStats
from edge_rtgi.asr.turn import DEFAULT_TALKOVER_PROMPT
from edge_rtgi.asr.whisper import Hypothesis
from edge_rtgi.errors import AudioError
from tests.integration.native_client import steady_clips

pytestmark = pytest.mark.slow

SENTENCES = [
    s.strip()
    for s in (Path(__file__).parents[1] / "data" / "sentences_en.txt").read_text().splitlines()
    if s.strip()
][:6]


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return steady_clips(SENTENCES)


@pytest.fixture(scope="module")
def asr() -> WhisperAsr:
    return WhisperAsr(AsrConfig(model="whisper-tiny.en", cpu_threads=2), num_workers=1)


def _same(a: Hypothesis, b: Hypothesis) -> bool:
    def spans(h: Hypothesis) -> list[tuple[str, float, float]]:
        return [(s.text, s.start_s, s.end_s) for s in h.segments]

    return a.text == b.text and spans(a) == spans(b)


def _jobs(clips: list[np.ndarray]) -> list[dict]:
    """Per clip the three kinds of streaming decode: a partial of the first 60 %, a final, and a
    final with the first words forced as the prefix (what LocalAgreement commits). One of the
    two finals carries the talkover prompt (speech over a reply): the plain final on odd clips,
    the one with a prefix on even clips."""
    specs = []
    for i, (text, audio) in enumerate(zip(SENTENCES, clips, strict=True)):
        specs.append(
            dict(
                audio=audio[: int(len(audio) * 0.6)], prefix=None, timestamps=False, beam_size=1, prompt=None
            )
        )
        prompt = DEFAULT_TALKOVER_PROMPT if i % 2 else None
        specs.append(dict(audio=audio, prefix=None, timestamps=True, beam_size=5, prompt=prompt))
        prefix = " ".join(text.split()[:2])
        prompt = None if i % 2 else DEFAULT_TALKOVER_PROMPT
        specs.append(dict(audio=audio, prefix=prefix, timestamps=True, beam_size=5, prompt=prompt))
    return specs


@pytest.fixture(scope="module")
def short_window_asr() -> WhisperAsr:
    return WhisperAsr(AsrConfig(model="whisper-tiny.en", cpu_threads=2, encoder_window_s=10.0))


@pytest.mark.parametrize("window", ["30 s", "10 s"])
def test_batched_step_gives_the_words_of_a_decode_alone(window, request, clips):
    """Whisper's own window, and the short one (one ``generate`` per window length)."""
    asr = request.getfixturevalue("asr" if window == "30 s" else "short_window_asr")
    specs = _jobs(clips)
    # about 9.4 s of speech: the short window is 20 s for it, 10 s for the others
    specs.append(
        dict(audio=np.concatenate(clips[:3]), prefix=None, timestamps=True, beam_size=5, prompt=None)
    )
    alone = [asr.transcribe(**s) for s in specs]
    decoder = asr.window_decoder
    windows = [
        decoder.prepare(
            DecodeJob(
                s["audio"],
                s["prefix"],
                "en",
                s["timestamps"],
                s["beam_size"],
                False,
                True,
                0.0,
                0.0,
                s["prompt"],
            )
        )
        for s in specs
    ]
    # a prompt goes in as whisper's "previous text", as WhisperModel.transcribe puts initial_prompt
    assert all((w.prompt[0] == w.tokenizer.sot_prev) == bool(w.job.prompt) for w in windows)
    lengths = {1000, 2000} if window == "10 s" else {3000}
    assert {w.window_frames for w in windows} == lengths
    batched = decoder.generate(windows)  # one generate per beam size and length over 19 windows
    if window == "30 s":
        assert all(h is not None for h in batched)
    else:  # a doubtful short window goes to whisper's own decode, in the engine as alone
        assert sum(h is None for h in batched) <= 2, batched
    got = [h if h is not None else asr.transcribe_whole(**s) for h, s in zip(batched, specs, strict=True)]
    diffs = [(a.text, b.text) for a, b in zip(alone, got, strict=True) if not _same(a, b)]
    assert not diffs
    assert all(a.text for a in alone[1::3])  # real speech, not an empty comparison


def test_sessions_through_the_engine_get_their_own_words(asr, clips):
    """Concurrent sessions, each its own client, in steps that take every queued window."""
    engine = SharedWhisper(asr, max_batch=8)
    steps: list[StepStats] = []
    engine.add_step_listener(steps.append)
    try:
        specs = _jobs(clips)
        # partials apart from finals: a partial asked for while a final waits is skipped
        for group in (specs[0::3], specs[1::3] + specs[2::3]):
            alone = [asr.transcribe(**s) for s in group]
            clients = [engine.session() for _ in group]
            with ThreadPoolExecutor(len(group)) as pool:
                got = list(pool.map(lambda cs: cs[0].transcribe(**cs[1]), zip(clients, group, strict=True)))
            assert all(_same(a, b) for a, b in zip(alone, got, strict=True))
        assert sum(s.batch_size for s in steps) == len(specs)
        assert max(s.batch_size for s in steps) > 1  # they did share steps
        timing = clients[0].last_timing()
        assert timing is None  # that client's decode ran on a pool thread, not this one
    finally:
        engine.close()


def _pause_after_first_step(engine: SharedWhisper) -> tuple[threading.Event, threading.Event]:
    """The engine thread blocks after its first step until ``release`` is set."""
    paused, release = threading.Event(), threading.Event()

    def listener(_: StepStats) -> None:
        if not paused.is_set():
            paused.set()
            release.wait(60)

    engine.add_step_listener(listener)
    return paused, release


def test_a_session_that_closes_while_queued_frees_its_slot(asr, clips):
    engine = SharedWhisper(asr, max_batch=1)
    paused, release = _pause_after_first_step(engine)
    first, leaving, next_one = engine.session(), engine.session(), engine.session()
    pool = ThreadPoolExecutor(3)
    try:
        pool.submit(first.transcribe, clips[0]).result(120)
        assert paused.wait(10)
        queued = pool.submit(leaving.transcribe, clips[1], timestamps=True, beam_size=5)
        while engine.queued == 0:
            threading.Event().wait(0.01)
        leaving.detach()  # the session closes while its final is queued
        assert engine.queued == 0
        with pytest.raises(AsrEngineClosed):
            queued.result(10)
        with pytest.raises(AsrEngineClosed):
            leaving.transcribe(clips[1])  # and it cannot queue more
        release.set()
        got = pool.submit(next_one.transcribe, clips[2], timestamps=True, beam_size=5).result(120)
        assert _same(got, asr.transcribe(clips[2], timestamps=True, beam_size=5))
    finally:
        release.set()
        pool.shutdown()
        engine.close()


def test_a_failing_decode_fails_only_its_own_session(asr, clips):
    """A stream that sends bad audio gets the error; the sessions decoding with it get their words."""
    engine = SharedWhisper(asr, max_batch=8)
    paused, release = _pause_after_first_step(engine)
    steps: list[StepStats] = []
    engine.add_step_listener(steps.append)
    clients = [engine.session() for _ in range(4)]
    pool = ThreadPoolExecutor(4)
    try:
        pool.submit(clients[0].transcribe, clips[0]).result(120)
        assert paused.wait(10)
        bad = np.zeros((2, 16000), np.float32)  # not mono
        audios = [clips[1], bad, clips[2]]
        futures = [
            pool.submit(c.transcribe, a, timestamps=True, beam_size=5)
            for c, a in zip(clients[1:], audios, strict=True)
        ]
        with pytest.raises(AudioError, match="mono"):
            futures[1].result(120)
        while engine.queued < 2:
            threading.Event().wait(0.01)
        release.set()  # the two good ones go in one step
        for f, audio in ((futures[0], clips[1]), (futures[2], clips[2])):
            assert _same(f.result(120), asr.transcribe(audio, timestamps=True, beam_size=5))
        assert steps[-1].batch_size == 2
        # the failed session and the engine go on
        assert clients[2].transcribe(clips[3]).text == asr.transcribe(clips[3]).text
    finally:
        release.set()
        pool.shutdown()
        engine.close()


def test_batch_size_below_one_is_a_config_error_naming_the_key():
    from edge_rtgi.config import from_dict
    from edge_rtgi.errors import ConfigError

    for key in ("batch_size", "cpu_threads"):
        with pytest.raises(ConfigError, match=key):
            from_dict(AsrConfig, {key: 0})


def test_the_daemon_shares_one_engine_per_model(clips):
    """``Resources.asr``: ``shared: true`` sessions get clients of one engine, whose steps reach the
    daemon's listeners (its /metrics); ``shared: false`` sessions get the model itself."""
    from edge_rtgi.asr.batch import AsrClient
    from edge_rtgi.pipeline.resources import Resources

    resources = Resources()
    seen: list[tuple[str, StepStats]] = []
    resources.add_asr_step_listener(lambda model, stats: seen.append((model, stats)))
    try:
        cfg = AsrConfig(model="whisper-tiny.en", shared=True)
        a, b = resources.asr(cfg), resources.asr(cfg)
        assert isinstance(a, AsrClient) and isinstance(b, AsrClient) and a.engine is b.engine
        assert a.transcribe(clips[0]).text
        assert seen and seen[-1][0] == "whisper-tiny.en" and seen[-1][1].batch_size == 1
        timing = a.last_timing()
        assert timing is not None and timing.queue_wait_ms >= 0 and timing.decode_ms > 0
        assert isinstance(resources.asr(AsrConfig(model="whisper-tiny.en")), WhisperAsr)
    finally:
        resources.close()


def test_a_doubtful_short_window_does_not_hold_back_the_rest_of_its_step(short_window_asr, clips):
    """Silence in a short window goes to whisper's own 30 s decode; the speech decoded in the
    same step is delivered first, not after that decode."""
    engine = SharedWhisper(short_window_asr, max_batch=8)
    paused, release = _pause_after_first_step(engine)
    steps: list[StepStats] = []
    engine.add_step_listener(steps.append)
    done: list[str] = []
    silent, speaking, first = engine.session(), engine.session(), engine.session()
    pool = ThreadPoolExecutor(3)
    try:
        pool.submit(first.transcribe, clips[0]).result(120)
        assert paused.wait(10)
        quiet = pool.submit(silent.transcribe, np.zeros(3 * 16000, np.float32), timestamps=True, beam_size=1)
        while engine.queued < 1:
            threading.Event().wait(0.01)
        speech = pool.submit(speaking.transcribe, clips[1], timestamps=True, beam_size=5)
        while engine.queued < 2:
            threading.Event().wait(0.01)
        quiet.add_done_callback(lambda _: done.append("silence"))
        speech.add_done_callback(lambda _: done.append("speech"))
        release.set()  # both in one step, the silence first in it
        assert quiet.result(120).text == ""
        assert speech.result(120).text
        assert steps[-1].batch_size == 2 and done == ["speech", "silence"]
    finally:
        release.set()
        pool.shutdown()
        engine.close()
