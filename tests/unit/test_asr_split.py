"""Cutting long speech (issue 4): the cut never falls before a committed word, and no word
is on both sides of it. Pure logic on hand-made word timings and VAD probabilities, plus
the word-time regrouping and the split check of the stability helper."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from edge_rtgi.asr.evaluation import stability_problems
from edge_rtgi.asr.events import FinalTranscript, SpeechEnded
from edge_rtgi.asr.split import MIN_SPLIT_SAMPLES, SAMPLE_RATE_HZ, choose_split
from edge_rtgi.asr.whisper import DecodedSegment, Hypothesis, TimedWord, _timed_words

FRAME = 512
START = 8000  # the utterance starts 0.5 s into the stream


def _hyp(words: list[tuple[str, float, float]]) -> Hypothesis:
    text = " ".join(w for w, _, _ in words)
    timed = tuple(TimedWord(w, s, e) for w, s, e in words)
    return Hypothesis(text, (DecodedSegment(text, 0.0, words[-1][2], -0.2, 0.01, 1.2),), "en", 1.0, timed)


def _vad(quiet: dict[float, float], default: float = 0.95):
    """A ``quietest_frame`` over frames with probability ``default`` except at the given
    utterance-relative times (seconds) -> probability."""
    probs = np.full(2000, default)
    for t_s, p in quiet.items():
        probs[(START + round(t_s * SAMPLE_RATE_HZ)) // FRAME] = p

    def quietest_frame(lo: int, hi: int) -> tuple[int, float]:
        frames = range(-(-lo // FRAME), -(-hi // FRAME))
        best = min(frames, key=lambda f: probs[f])
        return best * FRAME, float(probs[best])

    return quietest_frame


# "Please turn off the kitchen lights before you leave the house. My sister bought a green
# bicycle at the market", with a pause between the sentences (2.68-2.88 s) and a short gap
# after "bicycle" (4.22-4.28 s).
WORDS = [
    ("Please", 0.0, 0.46),
    ("turn", 0.46, 0.62),
    ("off", 0.62, 0.86),
    ("the", 0.86, 1.1),
    ("kitchen", 1.1, 1.2),
    ("lights", 1.2, 1.52),
    ("before", 1.52, 1.86),
    ("you", 1.86, 2.04),
    ("leave", 2.04, 2.24),
    ("the", 2.24, 2.42),
    ("house.", 2.42, 2.68),
    ("My", 2.88, 2.96),
    ("sister", 2.96, 3.24),
    ("bought", 3.24, 3.48),
    ("a", 3.48, 3.66),
    ("green", 3.66, 3.88),
    ("bicycle", 3.88, 4.22),
    ("at", 4.28, 4.56),
    ("the", 4.56, 4.78),
    ("market.", 4.78, 4.98),
]
END = START + 5 * SAMPLE_RATE_HZ


def at(t_s: float) -> int:
    return START + round(t_s * SAMPLE_RATE_HZ)


def _texts(n: int) -> list[str]:
    return [w for w, _, _ in WORDS[:n]]


def test_cut_never_falls_before_a_committed_word():
    """The bug: the quietest frame (the sentence pause) lay before the last committed words,
    so the next utterance heard "My sister" again. Now the cut comes after them."""
    committed = _texts(13)  # ... "house. My sister"
    vad = _vad({2.8: 0.01, 4.25: 0.3})
    split = choose_split(committed, _hyp(WORDS), START, END, vad)
    assert split.words[:13] == committed
    assert split.cut_index >= at(3.24)  # the end of "sister"
    assert split.words == _texts(17)  # up to "bicycle": the quietest boundary after "sister"
    assert split.cut_index == at(4.25) // FRAME * FRAME


def test_pause_between_sentences_wins_when_nothing_after_it_is_committed():
    split = choose_split(_texts(9), _hyp(WORDS), START, END, _vad({2.8: 0.01, 4.25: 0.3}))
    assert split.words == _texts(11)  # "... leave the house."
    assert at(2.68) <= split.cut_index < at(2.88)  # in the pause


def test_equal_boundaries_prefer_the_later_one():
    split = choose_split(_texts(13), _hyp(WORDS), START, END, _vad({}))
    assert split.boundary == 19  # before the last word, which runs to the end of the audio


def test_a_last_word_running_to_the_end_of_the_audio_is_not_closed_by_the_cut():
    # "market." ends 20 ms before the audio does: it may be cut off, so no cut after it
    # even where the VAD is quietest (just after it).
    split = choose_split(_texts(13), _hyp(WORDS), START, at(5.0), _vad({5.01: 0.0, 4.25: 0.5}))
    assert "market." not in split.words and split.cut_index < at(4.78)
    # A last word followed by half a second of audio is complete: the cut may follow it.
    split = choose_split(_texts(13), _hyp(WORDS), START, at(5.5), _vad({5.01: 0.0, 4.25: 0.5}))
    assert split.words[-1] == "market." and split.boundary == len(WORDS)


def test_whisper_stopping_early_leaves_the_unheard_rest_to_the_next_utterance():
    # The decode ended after the committed words although speech went on to 5 s: the cut
    # goes right after the last word, never to the end of the audio.
    words = WORDS[:11]
    split = choose_split(_texts(11), _hyp(words), START, END, _vad({}))
    assert split.words == _texts(11)
    assert at(2.68) <= split.cut_index < at(2.68) + FRAME


def test_no_cut_in_the_first_second():
    split = choose_split([], _hyp(WORDS), START, END, _vad({0.5: 0.0, 3.0: 0.4}))
    assert split.cut_index >= START + MIN_SPLIT_SAMPLES


def test_without_word_times_everything_decoded_stays():
    hyp = Hypothesis("a b c", (), "en", 1.0, ())
    split = choose_split(["a"], hyp, START, END, _vad({}))
    assert split.words == ["a", "b", "c"] and split.cut_index == END and split.boundary is None


def test_word_pieces_are_regrouped_into_whitespace_words():
    piece = SimpleNamespace
    segment = SimpleNamespace(
        words=[
            piece(word=" at", start=0.0, end=0.2),
            piece(word=" half", start=0.2, end=0.4),
            piece(word="-past", start=0.4, end=0.7),
            piece(word=" seven.", start=0.7, end=1.0),
        ]
    )
    assert _timed_words(segment) == [
        TimedWord("at", 0.0, 0.2),
        TimedWord("half-past", 0.2, 0.7),
        TimedWord("seven.", 0.7, 1.0),
    ]


def test_stability_check_flags_a_word_on_both_sides_of_a_forced_split():
    def final(uid: int, text: str) -> FinalTranscript:
        return FinalTranscript(uid, text, (), 0.0, 1.0, 1.0, "en", 0.0)

    repeated = [
        SpeechEnded(0, 1.0, 1.0, "max_length"),
        final(0, "my sister bought a"),
        SpeechEnded(1, 2.0, 2.0, "silence"),
        final(1, "a green bicycle"),
    ]
    assert len(stability_problems(repeated)) == 1
    clean = [
        SpeechEnded(0, 1.0, 1.0, "max_length"),
        final(0, "my sister bought"),
        SpeechEnded(1, 2.0, 2.0, "silence"),
        final(1, "a green bicycle"),
    ]
    assert stability_problems(clean) == []
    # Two utterances separated by a pause may well share a word.
    paused = [
        SpeechEnded(0, 1.0, 1.0, "silence"),
        final(0, "say it again"),
        SpeechEnded(1, 2.0, 2.0, "silence"),
        final(1, "again and again"),
    ]
    assert stability_problems(paused) == []


def test_vad_history_gives_the_quietest_frame_of_a_range():
    from edge_rtgi.asr.vad import SileroVad

    vad = SileroVad()
    rng = np.random.default_rng(3)
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000) * (1 + 0.5 * rng.standard_normal(16000))
    vad.process(np.concatenate([tone, np.zeros(16000), tone]).astype(np.float32))
    index, probability = vad.quietest_frame(0, 48000)
    assert index % FRAME == 0 and 16000 <= index < 32000 and probability < 0.5  # in the silent second
    assert vad.quietest_frame(16000, 16000 + FRAME) == (32 * FRAME, float(vad.recent_probabilities[32]))
    assert vad.quietest_frame(60000, 70000) == (60000, 1.0)  # not heard yet: no known quiet place
