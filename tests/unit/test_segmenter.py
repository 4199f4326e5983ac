"""ClauseSegmenter: speakable chunks from streamed text (pure logic)."""

from __future__ import annotations

import pytest

from edge_rtgi.tts.segmenter import ClauseSegmenter, split_sentences


def _stream(text: str, step: int = 1, **kwargs) -> list[str]:
    seg = ClauseSegmenter(**kwargs)
    out = []
    for i in range(0, len(text), step):
        out += seg.push(text[i:i + step])
    return out + seg.flush()


def test_first_clause_early_then_whole_sentences():
    text = "Sure thing, here it is: the first step is easy, the second is not. Then we rest, and eat."
    assert _stream(text) == [
        "Sure thing, here it is:",
        "the first step is easy, the second is not.",
        "Then we rest, and eat.",
    ]


def test_first_clause_needs_a_few_words():
    assert _stream("Yes, of course I can help you with that. Ok.") == [
        "Yes, of course I can help you with that.", "Ok."]


def test_chunk_is_emitted_as_soon_as_the_boundary_is_certain():
    seg = ClauseSegmenter()
    assert seg.push("The answer is four.") == []  # "four.5" could still follow
    assert seg.push(" ") == ["The answer is four."]
    assert seg.push("Next") == []
    assert seg.flush() == ["Next"]


@pytest.mark.parametrize("text", [
    "Pi is about 3.14 and e is about 2.72 today.",
    "We sold 1,000 tickets and 2,500 drinks at the show.",
    "Dr. Smith and Mrs. Jones met Prof. Brown at St. Mary.",
    "Use a tool, e.g. a hammer, or i.e. something heavy.",
    "He moved to the U.S. with J. R. Tolkien's books.",
])
def test_numbers_and_abbreviations_do_not_split(text):
    assert _stream(text, min_first_clause_words=100) == [text]


def test_ellipsis_and_question_marks():
    assert split_sentences("Well... I am not sure. Are you? Yes!") == ["Well... I am not sure.", "Are you?", "Yes!"]
    assert _stream("Well, well, well... that is odd. Indeed.") == ["Well, well, well...", "that is odd.", "Indeed."]


def test_quotes_and_brackets_stay_with_their_sentence():
    assert split_sentences('He said "Stop." Then he left (quickly.) Done.') == [
        'He said "Stop."', "Then he left (quickly.)", "Done."]


def test_lines_lists_and_markdown():
    text = "## Plan\n1. Buy **milk**\n2. Walk the dog\n- call mom\nThat is all."
    assert split_sentences(text) == ["Plan", "1. Buy milk", "2. Walk the dog", "call mom", "That is all."]


def test_unfinished_and_empty_text():
    assert _stream("and then the") == ["and then the"]
    assert _stream("") == []
    assert _stream("  ...  ") == []
    seg = ClauseSegmenter()
    seg.push("Hello there, my friend")
    seg.reset()
    assert seg.flush() == []


def test_run_on_text_is_cut_at_a_word_boundary():
    text = " ".join(["word"] * 200)
    chunks = _stream(text, step=7, max_chunk_chars=100)
    assert all(len(c) <= 100 for c in chunks)
    assert " ".join(chunks) == text


def test_delta_size_does_not_change_the_result():
    text = ("Okay, so here is the plan: we meet at 10.30 near the U.S. embassy. Bring 1,500 dollars! "
            "Dr. Who will be there... probably. Any questions?")
    expected = _stream(text, step=len(text))
    for step in (1, 2, 3, 5, 11):
        assert _stream(text, step=step) == expected
    assert "".join(expected).replace(" ", "") == text.replace(" ", "")
