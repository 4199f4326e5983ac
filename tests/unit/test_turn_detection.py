"""Semantic turn detection without the model: settings, errors, the Realtime mapping, features,
the decision rule and the fallback when the model file is missing or corrupt."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edge_rtgi.asr.turn import (
    DEFAULT_TALKOVER_PROMPT,
    SemanticEndpointer,
    TalkoverMeter,
    TurnDetectionConfig,
    is_backchannel,
    is_fragment,
    is_question,
    talkover_cuts,
    talkover_speech_samples,
    transcript_unfinished,
    turn_features,
)
from edge_rtgi.errors import ConfigError
from edge_rtgi.pipeline.config import parse_pipeline
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.pipeline.session import SessionSettings
from edge_rtgi.server.openai_realtime.adapter import core_settings
from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.openai_realtime.session_config import RealtimeSessionConfig, apply_session_update


def _asr_pipeline(turn: str) -> str:
    return f"name: t\nstages:\n  - asr:\n      model: whisper-tiny.en\n      turn_detection: {turn}\n"


def test_pipeline_yaml_takes_turn_detection():
    p = parse_pipeline(_asr_pipeline("{mode: semantic, min_silence_ms: 120, max_silence_ms: 900}"), "t.yaml")
    turn = p.stages[0].turn_detection
    assert (turn.mode, turn.semantic_min_ms, turn.semantic_max_ms, turn.threshold) == (
        "semantic",
        120,
        900,
        0.5,
    )
    assert turn.silence_ms(300) == 900  # the VAD's timer becomes the cap
    assert TurnDetectionConfig().silence_ms(300) == 300  # silence mode: the VAD's own timer


@pytest.mark.parametrize(
    ("turn", "key"),
    [
        ("{mode: semantic, threshold: 1.5}", "threshold"),
        ("{mode: semantic, threshold: -0.1}", "threshold"),
        ("{mode: semantic, min_silence_ms: 400, max_silence_ms: 200}", "max_silence_ms"),
        ("{mode: smart}", "mode"),
        ("{mode: semantic, fragment_hold_ms: -1}", "fragment_hold_ms"),
    ],
)
def test_bad_turn_settings_in_a_pipeline_name_the_key(turn, key):
    with pytest.raises(ConfigError, match=key) as err:
        parse_pipeline(_asr_pipeline(turn), "t.yaml")
    assert "turn_detection" in str(err.value)


def test_session_update_takes_the_object_and_names_bad_keys():
    s = SessionSettings().merged({"turn_detection": {"mode": "semantic", "threshold": 0.7}})
    assert (s.turn_detection, s.turn_mode, s.turn_threshold) == (True, "semantic", 0.7)
    assert s.turn_config(TurnDetectionConfig()).mode == "semantic"
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*threshold"):
        SessionSettings().merged({"turn_detection": {"threshold": 2}})
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*max_silence_ms"):
        SessionSettings().merged({"turn_detection": {"min_silence_ms": 500, "max_silence_ms": 100}})
    with pytest.raises(ConfigError, match="unknown key 'eagerness'"):
        SessionSettings().merged({"turn_detection": {"eagerness": "high"}})
    # a max below the pipeline's own min is caught against the pipeline's settings
    with pytest.raises(ValueError, match="max_silence_ms"):
        s.merged({"turn_max_silence_ms": 100}).turn_config(
            TurnDetectionConfig(mode="semantic", min_silence_ms=200)
        )
    assert SessionSettings().merged({"turn_detection": False}).turn_detection is False
    # a switch to silence mode runs the VAD's timer, not the semantic check time of the pipeline
    pipeline_turn = TurnDetectionConfig(mode="semantic", min_silence_ms=100, max_silence_ms=1200)
    silence = SessionSettings().merged({"turn_detection": {"mode": "silence"}}).turn_config(pipeline_turn)
    assert silence.silence_ms(300) == 300
    timed = SessionSettings().merged({"turn_detection": {"mode": "silence", "min_silence_ms": 500}})
    assert timed.turn_config(pipeline_turn).silence_ms(300) == 500
    off = SessionSettings().merged({"turn_detection": {"text_check": False}})
    assert off.turn_config(TurnDetectionConfig(mode="semantic")).text_check is False
    assert s.turn_config(TurnDetectionConfig(mode="semantic")).text_check is True  # the default
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*text_check"):
        SessionSettings().merged({"turn_detection": {"text_check": "no"}})
    # rechecks per session: on over a pipeline that has them off, and a bad value named
    rechecked = SessionSettings().merged({"turn_detection": {"recheck_ms": 500}})
    assert rechecked.turn_recheck_ms == 500
    assert rechecked.turn_config(TurnDetectionConfig(mode="semantic")).recheck_ms == 500
    assert s.turn_config(TurnDetectionConfig(mode="semantic", recheck_ms=300)).recheck_ms == 300
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*recheck_ms"):
        SessionSettings().merged({"turn_detection": {"recheck_ms": 5}})
    # the talkover prompt per session: "" turns it off, an oversized one is named
    assert s.turn_config(TurnDetectionConfig(mode="semantic")).talkover_prompt == DEFAULT_TALKOVER_PROMPT
    unprompted = SessionSettings().merged({"turn_detection": {"talkover_prompt": ""}})
    assert unprompted.turn_config(TurnDetectionConfig(mode="semantic")).talkover_prompt == ""
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*talkover_prompt"):
        SessionSettings().merged({"turn_detection": {"talkover_prompt": "Mm-hmm. " * 100}})
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*talkover_prompt"):
        SessionSettings().merged({"turn_detection": {"talkover_prompt": "<|endoftext|> Yes."}})
    # the preemptive reply per session: on by default, off for one session, a bad value named
    assert s.turn_config(TurnDetectionConfig(mode="semantic")).preemptive_reply is True
    waiting = SessionSettings().merged({"turn_detection": {"preemptive_reply": False}})
    assert waiting.turn_config(TurnDetectionConfig(mode="semantic")).preemptive_reply is False
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*preemptive_reply"):
        SessionSettings().merged({"turn_detection": {"preemptive_reply": "soon"}})


def test_realtime_semantic_vad_maps_eagerness():
    cfg = apply_session_update(
        RealtimeSessionConfig(), {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}
    )
    wire = cfg.to_wire("s", "m")["audio"]["input"]["turn_detection"]
    assert wire == {
        "type": "semantic_vad",
        "eagerness": "auto",
        "create_response": True,
        "interrupt_response": True,
    }
    settings = {}
    for level in ("low", "medium", "high", "auto"):
        c = apply_session_update(cfg, {"turn_detection": {"type": "semantic_vad", "eagerness": level}})
        settings[level] = core_settings(c)
        assert settings[level]["turn_mode"] == "semantic" and settings[level]["turn_detection"] is True
        SessionSettings(**core_settings(c))  # valid session settings
    lo, med, hi = settings["low"], settings["medium"], settings["high"]
    # eager ends sooner and on a lower bar; low lets the user take their time
    assert hi["turn_min_silence_ms"] <= med["turn_min_silence_ms"] <= lo["turn_min_silence_ms"]
    assert hi["turn_max_silence_ms"] < med["turn_max_silence_ms"] < lo["turn_max_silence_ms"]
    assert hi["turn_threshold"] < med["turn_threshold"] < lo["turn_threshold"]
    assert settings["auto"] == med
    # server_vad is the silence timer, with its own silence_duration_ms
    sv = core_settings(
        apply_session_update(cfg, {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}})
    )
    assert (sv["turn_mode"], sv["turn_min_silence_ms"], sv["vad_min_silence_ms"]) == ("silence", 400, 400)
    with pytest.raises(RealtimeProtocolError, match="eagerness"):
        apply_session_update(cfg, {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}})
    with pytest.raises(RealtimeProtocolError, match="silence_duration_ms"):
        apply_session_update(cfg, {"turn_detection": {"type": "semantic_vad", "silence_duration_ms": 3}})


def test_features_are_the_last_8_s_zero_padded_at_the_front():
    rng = np.random.default_rng(0)
    short = rng.standard_normal(16000).astype(np.float32) * 0.1
    f = turn_features(short)
    assert f.shape == (1, 80, 800) and f.dtype == np.float32
    # the audio sits at the right edge: the first 7 s are the (normalised) padding, the same
    # frame over and over
    assert np.ptp(f[0, :, :600], axis=1).max() < 1e-3 < np.ptp(f[0, :, -90:], axis=1).max()
    long = rng.standard_normal(16000 * 10).astype(np.float32) * 0.1
    np.testing.assert_allclose(turn_features(long), turn_features(long[-16000 * 8 :]), atol=1e-5)


class _Scorer:
    def __init__(self, p: float | Exception):
        self.p = p

    def probability(self, audio: np.ndarray) -> float:
        if isinstance(self.p, Exception):
            raise self.p
        return self.p


def test_decision_uses_the_threshold_and_survives_a_failing_model(caplog):
    audio = np.zeros(16000, np.float32)
    assert SemanticEndpointer(_Scorer(0.6), 0.5, 100).decide(audio, 0).complete
    assert not SemanticEndpointer(_Scorer(0.4), 0.5, 100).decide(audio, 0).complete
    broken = SemanticEndpointer(_Scorer(RuntimeError("boom")), 0.5, 100)
    with caplog.at_level(logging.WARNING):
        d1, d2 = broken.decide(audio, 0), broken.decide(audio, 5)
    assert (d1.complete, d1.probability, d2.complete) == (False, None, False)
    assert len([r for r in caplog.records if "turn detection model failed" in r.getMessage()]) == 1


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_missing_or_corrupt_model_falls_back_with_one_warning(tmp_path, caplog, kind):
    path = tmp_path / "smart-turn.onnx"
    if kind == "corrupt":
        path.write_bytes(b"\x08\x07not an onnx graph" * 100)
    resources = Resources()
    with caplog.at_level(logging.WARNING):
        first, second = resources.turn_model(str(path)), resources.turn_model(str(path))
    assert first.model is None and first.error and second is first
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "silence only" in r.getMessage()
    ]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Mm-hmm.", True),
        ("Yeah, right.", True),
        ("Okay", True),
        ("I see.", True),
        ("Uh-huh", True),
        ("All right.", True),
        ("Mmmm", True),
        ("Hmmmm.", True),
        ("Mmm-hmmm.", True),
        ("Uhhh, yeah.", True),
        ("Okay. Yeah. Okay. Yeah.", True),
        ("Yeah, yeah, yeah, yeah.", True),
        ("I see. I see.", True),
        ("Stop. Stop.", False),
        ("Yeah, okay, yeah, right.", True),  # three different words
        ("Yup. Yup. Yup. Yep. Yup.", True),  # whisper looping on a "yup"
        ("Yes, I see, got it, right.", False),  # more than three different words
        ("Stop.", False),
        ("Them.", False),
        ("Hum.", False),
        ("Yes, but what about Paris?", False),
        ("", False),
    ],
)
def test_backchannels(text, expected):
    assert is_backchannel(text) is expected


@pytest.mark.parametrize(
    ("text", "unfinished"),
    [
        ("Add milk,", True),  # a trailing comma
        ("Call my sister and...", True),
        ("Set a timer for um", True),  # a filler, after a preposition
        ("I need to buy bread and", True),
        ("If it rains tomorrow.", True),  # a fronted clause with no main clause yet
        ("After the meeting.", True),
        ("On Saturday morning.", True),
        ("which", True),  # the soak's cut: "Which | planet is closest to the sun?" (issue #18)
        ("Tell me whose", True),
        ("Which?", False),
        ("Which planet is closest to the sun?", False),
        ("If it rains tomorrow, remind me to take an umbrella.", False),
        ("When does the sun set today?", False),  # a question, not a fronted clause
        ("When does the sun set today", False),
        ("What is it for?", False),
        ("Turn the light on.", False),
        ("Play some relaxing music.", False),
        ("Add milk.", False),  # complete words: the model's verdict stands
        ("", False),
        ("Wake me up at 6 30.", False),  # digits are words: the sentence ends in "30", not "at"
        ("Set an alarm for 7.", False),
        ("Set an alarm for", True),
        ("On Saturday morning. Wake me up at 9.", False),  # the fronted phrase has its own sentence
        ("On Saturday morning. Wake me up at", True),
    ],
)
def test_words_that_leave_a_sentence_unfinished(text, unfinished):
    assert transcript_unfinished(text) is unfinished


def test_the_words_check_overrules_only_a_finished_verdict():
    audio = np.zeros(16000, np.float32)
    ep = SemanticEndpointer(_Scorer(0.9), 0.5, 100)
    finished = ep.decide(audio, 0)
    held = ep.check_words(finished, "If it rains tomorrow.")
    assert (held.complete, held.unfinished_text, held.probability) == (False, True, 0.9)
    assert held.decided_t_s >= finished.decided_t_s
    kept = ep.check_words(finished, "Remind me to take an umbrella.")
    assert (kept.complete, kept.unfinished_text) == (True, False)
    waiting = SemanticEndpointer(_Scorer(0.1), 0.5, 100).decide(audio, 0)
    assert ep.check_words(waiting, "Play some music.").complete is False


def test_pipeline_yaml_takes_the_fragment_hold():
    p = parse_pipeline(_asr_pipeline("{mode: semantic, fragment_hold_ms: 450}"), "t.yaml")
    assert p.stages[0].turn_detection.fragment_hold_ms == 450
    assert TurnDetectionConfig().fragment_hold_ms == 600


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("Add milk.", True), ("Tell me.", True), ("Can you?", True), ("Stop.", True), ("", False)]
    + [("Pause the movie.", False), ("Wake me up at 6 30.", False)],
)
def test_fragments_are_one_or_two_words(text, fragment):
    assert is_fragment(text) is fragment


def test_a_fragment_waits_for_the_hold_then_is_asked_again():
    audio = np.zeros(16000, np.float32)
    ep = SemanticEndpointer(_Scorer(0.9), 0.5, 100, fragment_hold_ms=600)
    early = ep.check_words(ep.decide(audio, 0), "Add milk.", silence_samples=1600)
    assert (early.complete, early.retry_silence_samples, early.unfinished_text) == (False, 9600, False)
    later = ep.check_words(ep.decide(audio, 0), "Add milk.", silence_samples=9600)
    assert (later.complete, later.retry_silence_samples) == (True, None)
    # longer words end at the first check; unfinished words wait for the cap, not the hold
    assert ep.check_words(ep.decide(audio, 0), "Add milk and eggs.", 1600).complete
    held = ep.check_words(ep.decide(audio, 0), "Add milk and", 1600)
    assert (held.complete, held.retry_silence_samples) == (False, None)
    # the hold off: the model's verdict on the fragment stands
    off = SemanticEndpointer(_Scorer(0.9), 0.5, 100, fragment_hold_ms=0)
    assert off.check_words(off.decide(audio, 0), "Add milk.", 1600).complete


def test_talkover_counts_speech_not_the_pause_after_it():
    # "Yes." over a reply: 0.4 s of speech, then a pause the VAD (semantic mode: cap 1.2 s) still
    # counts as in speech; 0.7 s later that is 1.1 s of audio but 0.4 s of speech
    start, pause = 16000, 16000 + 6400
    assert talkover_speech_samples(start, pause + 11200, silence_start=pause) == 6400
    assert talkover_speech_samples(start, start + 12000, silence_start=None) == 12000  # still talking
    assert talkover_speech_samples(start, start + 100, silence_start=start - 50) == 0


def test_words_that_are_not_a_question_wait_for_the_continuation_hold():
    # "Remind me about the dentist, | the bank, ...": whisper writes the first item as a whole
    # command and the model calls the comma's pause finished (0.98 at 100 ms on Piper's render)
    audio = np.zeros(16000, np.float32)
    ep = SemanticEndpointer(_Scorer(0.9), 0.5, 100, fragment_hold_ms=600, continuation_hold_ms=400)
    early = ep.check_words(ep.decide(audio, 0), "Remind me about the dentist.", silence_samples=1600)
    assert (early.complete, early.retry_silence_samples, early.unfinished_text) == (False, 6400, False)
    later = ep.check_words(ep.decide(audio, 0), "Remind me about the dentist.", silence_samples=6400)
    assert (later.complete, later.retry_silence_samples) == (True, None)
    # a question ends at the first check; a fragment waits for the longer of the two holds
    assert ep.check_words(ep.decide(audio, 0), "What is the capital of Australia?", 1600).complete
    assert ep.check_words(ep.decide(audio, 0), "Add milk.", 1600).retry_silence_samples == 9600
    assert ep.check_words(ep.decide(audio, 0), "Add milk.", 6400).retry_silence_samples == 9600
    assert ep.check_words(ep.decide(audio, 0), "Can you?", 1600).retry_silence_samples == 9600
    # unfinished words still wait for the cap, not a hold; an "unfinished" verdict is not held
    held = ep.check_words(ep.decide(audio, 0), "Add milk and", 1600)
    assert (held.complete, held.retry_silence_samples) == (False, None)
    waiting = SemanticEndpointer(_Scorer(0.1), 0.5, 100, continuation_hold_ms=400).decide(audio, 0)
    assert ep.check_words(waiting, "Play some music.", 1600).retry_silence_samples is None
    # the hold off: the model's verdict on the statement stands at the first check
    off = SemanticEndpointer(_Scorer(0.9), 0.5, 100, fragment_hold_ms=600, continuation_hold_ms=0)
    assert off.check_words(off.decide(audio, 0), "Remind me about the dentist.", 1600).complete


def test_an_unfinished_verdict_on_a_question_is_asked_again_after_the_question_recheck():
    audio = np.zeros(16000, np.float32)
    ep = SemanticEndpointer(_Scorer(0.1), 0.5, 100, continuation_hold_ms=400, question_recheck_ms=300)
    unfinished = ep.decide(audio, 0, silence_samples=1600)
    assert unfinished.retry_silence_samples is None  # the words decide
    asked = ep.recheck_question(unfinished, "Why is the sky blue?", 1600)
    assert (asked.complete, asked.retry_silence_samples) == (False, 1600 + 4800)
    # a statement, a model failure, or the feature off: waits for the cap as before
    assert ep.recheck_question(unfinished, "Find a recipe for soup and", 1600) is unfinished
    failed = SemanticEndpointer(_Scorer(RuntimeError("onnx")), 0.5, 100, question_recheck_ms=300)
    assert failed.recheck_question(failed.decide(audio, 0, 1600), "Why?", 1600).retry_silence_samples is None
    off = SemanticEndpointer(_Scorer(0.1), 0.5, 100)
    assert off.recheck_question(off.decide(audio, 0, 1600), "Why?", 1600).retry_silence_samples is None
    with pytest.raises(ConfigError, match=r"session\.turn_detection.*question_recheck_ms"):
        SessionSettings().merged({"turn_detection": {"question_recheck_ms": 5}})
    session = SessionSettings().merged({"turn_detection": {"question_recheck_ms": 300}})
    assert session.turn_config(TurnDetectionConfig(mode="semantic")).question_recheck_ms == 300


def test_an_unfinished_verdict_is_asked_again_after_the_recheck_time():
    # "Why is the sky blue?" on Piper: 0.09 at 100 ms of silence, 0.68 at 500, 0.94 at 700
    audio = np.zeros(16000, np.float32)
    ep = SemanticEndpointer(_Scorer(0.1), 0.5, 100, continuation_hold_ms=400, recheck_ms=300)
    first = ep.decide(audio, 0, silence_samples=1600)
    assert (first.complete, first.retry_silence_samples) == (False, 1600 + 4800)
    assert ep.decide(audio, 0, silence_samples=6400).retry_silence_samples == 6400 + 4800
    # off (the default): an "unfinished" verdict waits for the cap
    assert SemanticEndpointer(_Scorer(0.1), 0.5, 100).decide(audio, 0, 1600).retry_silence_samples is None
    # a model that fails is not asked again; a "finished" verdict goes to the words check
    broken = SemanticEndpointer(_Scorer(RuntimeError("onnx")), 0.5, 100, recheck_ms=300)
    assert broken.decide(audio, 0, 1600).retry_silence_samples is None
    finished = SemanticEndpointer(
        _Scorer(0.9), 0.5, 100, fragment_hold_ms=600, continuation_hold_ms=400, recheck_ms=300
    )
    decided = finished.decide(audio, 0, 6400)
    assert (decided.complete, decided.retry_silence_samples) == (True, None)
    # a recheck past the continuation hold ends a statement at once; a fragment still waits
    assert finished.check_words(decided, "Remind me about the dentist.", 6400).complete
    assert finished.check_words(decided, "Add milk.", 6400).retry_silence_samples == 9600
    p = parse_pipeline(_asr_pipeline("{mode: semantic, recheck_ms: 250}"), "t.yaml")
    assert SemanticEndpointer.from_config(_Scorer(0.1), p.stages[0].turn_detection).recheck_samples == 4000
    for bad in (-1, 10):
        with pytest.raises(ConfigError, match="recheck_ms"):
            parse_pipeline(_asr_pipeline(f"{{mode: semantic, recheck_ms: {bad}}}"), "t.yaml")


@pytest.mark.parametrize(
    ("text", "question"),
    [("How far away is the moon?", True), ("Can you? ", True), ("Play some music.", False), ("", False)],
)
def test_questions_end_in_a_question_mark(text, question):
    assert is_question(text) is question


def test_the_continuation_hold_comes_from_the_config():
    p = parse_pipeline(_asr_pipeline("{mode: semantic, continuation_hold_ms: 350}"), "t.yaml")
    turn = p.stages[0].turn_detection
    assert turn.continuation_hold_ms == 350
    assert TurnDetectionConfig().continuation_hold_ms == 400
    ep = SemanticEndpointer.from_config(_Scorer(0.9), turn)
    assert (ep.continuation_hold_samples, ep.fragment_hold_samples, ep.check_samples) == (5600, 9600, 2400)
    with pytest.raises(ConfigError, match="continuation_hold_ms"):
        parse_pipeline(_asr_pipeline("{mode: semantic, continuation_hold_ms: -5}"), "t.yaml")


@pytest.mark.parametrize(
    ("heard_ms", "text", "pending", "cuts"),
    [
        (400, "", False, False),  # shorter than any barge-in
        (400, "Stop the music", False, False),  # its final will cut it, not its length
        (700, "", False, True),  # long, no words yet: length alone, as before
        (700, "No, I meant", False, True),
        (700, "Yes.", False, False),  # "Yes, | yes.": a backchannel's words so far
        (1200, "Right, right.", False, False),
        (700, "", True, False),  # the decode of a pause inside it is on its way
        (700, "Okay", True, False),
        (1500, "Yes, yes, yes.", False, True),  # past any backchannel's length
        (1500, "", True, True),
    ],
)
def test_talkover_cuts_at_its_length_unless_its_words_are_a_backchannel(heard_ms, text, pending, cuts):
    assert talkover_cuts(heard_ms, text, pending, 700, 1500) is cuts


@pytest.mark.parametrize(
    ("heard_ms", "pause_words", "cuts"),
    [
        (300, "Stop.", True),  # a short request cuts at its first pause, not at its final
        (300, "Wait, what?", True),
        (300, "Mm-hmm.", False),  # a backchannel's words: the reply goes on
        (500, "Okay.", False),  # "Okay, | yeah.": its first part
        (300, "", False),  # the pause held no words
        (300, None, False),  # no pause, or its decode is not in: as before
    ],
)
def test_talkover_cuts_at_a_pause_whose_words_are_not_a_backchannel(heard_ms, pause_words, cuts):
    assert talkover_cuts(heard_ms, "", False, 700, 1500, pause_words) is cuts


def test_barge_in_max_speech_is_checked_against_the_min():
    assert TurnDetectionConfig().barge_in_max_speech_ms == 1500
    with pytest.raises(ValueError, match="barge_in_max_speech_ms"):
        TurnDetectionConfig(barge_in_min_speech_ms=800, barge_in_max_speech_ms=600)
    with pytest.raises(ConfigError, match="barge_in_max_speech_ms"):
        parse_pipeline(_asr_pipeline("{mode: semantic, barge_in_max_speech_ms: 20000}"), "t.yaml")


def test_the_talkover_meter_counts_speech_not_the_pauses_inside_it():
    # "Yes, | yes." over a reply: 0.35 s, a 0.3 s comma pause, 0.35 s: 1.0 s from the first word
    # to the last, 0.7 s of speech; the VAD reports the pause from its first silent sample
    start = 16000
    m = TalkoverMeter(start)
    assert m.heard_samples(start + 4800, None) == 4800
    pause = start + 5600
    assert m.heard_samples(pause + 1600, pause) == 5600  # the pause in progress is not speech
    assert m.heard_samples(pause + 4800, pause) == 5600
    # speech resumed: the pause ends where the VAD first reports speech again (the chunk it was
    # found in counts as pause, a chunk's under-count)
    assert m.heard_samples(pause + 4800 + 320, None) == 5600
    assert m.heard_samples(pause + 4800 + 5600, None) == 5600 + 5600 - 320
    assert m.heard_samples(pause + 4800 + 5600 + 3200, pause + 4800 + 5600) == 5600 + 5600 - 320
    # no pause: the whole span, as before
    assert TalkoverMeter(0).heard_samples(12000, None) == 12000
    # a silence that began before the talkover (the VAD's index after a forced split) is not a pause in it
    assert TalkoverMeter(start).heard_samples(start + 3200, start - 800) == 0
