"""ClauseSegmenter: speakable chunks from streamed text (pure logic)."""

from __future__ import annotations

import pytest

from edge_rtgi.tts.segmenter import ClauseSegmenter, split_sentences


def _stream(text: str, step: int = 1, **kwargs) -> list[str]:
    seg = ClauseSegmenter(**kwargs)
    out = []
    for i in range(0, len(text), step):
        out += seg.push(text[i : i + step])
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
        "Yes, of course I can help you with that.",
        "Ok.",
    ]


def test_chunk_is_emitted_as_soon_as_the_boundary_is_certain():
    seg = ClauseSegmenter()
    assert seg.push("The answer is four.") == []  # "four.5" could still follow
    assert seg.push(" ") == ["The answer is four."]
    assert seg.push("Next") == []
    assert seg.flush() == ["Next"]


@pytest.mark.parametrize(
    "text",
    [
        "Pi is about 3.14 and e is about 2.72 today.",
        "We sold 1,000 tickets and 2,500 drinks at the show.",
        "Dr. Smith and Mrs. Jones met Prof. Brown at St. Mary.",
        "Use a tool, e.g. a hammer, or i.e. something heavy.",
        "He moved to the U.S. with J. R. Tolkien's books.",
    ],
)
def test_numbers_and_abbreviations_do_not_split(text):
    assert _stream(text, min_first_clause_words=100, first_break_after_words=None) == [text]


def test_ellipsis_and_question_marks():
    assert split_sentences("Well... I am not sure. Are you? Yes!") == [
        "Well... I am not sure.",
        "Are you?",
        "Yes!",
    ]
    assert _stream("Well, well, well... that is odd. Indeed.") == [
        "Well, well, well...",
        "that is odd.",
        "Indeed.",
    ]


def test_quotes_and_brackets_stay_with_their_sentence():
    assert split_sentences('He said "Stop." Then he left (quickly.) Done.') == [
        'He said "Stop."',
        "Then he left (quickly.)",
        "Done.",
    ]


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
    text = (
        "Okay, so here is the plan: we meet at 10.30 near the U.S. embassy. Bring 1,500 dollars! "
        "Dr. Who will be there... probably. Any questions?"
    )
    expected = _stream(text, step=len(text))
    for step in (1, 2, 3, 5, 11):
        assert _stream(text, step=step) == expected
    assert "".join(expected).replace(" ", "") == text.replace(" ", "")


def test_long_first_sentence_breaks_before_a_conjunction():
    text = "The sky looks blue to us because air scatters blue light more than red light. It is simple."
    assert _stream(text) == [
        "The sky looks blue to us",
        "because air scatters blue light more than red light.",
        "It is simple.",
    ]


def test_break_word_needs_enough_words_and_only_for_the_first_chunk():
    # "and" after one word is too early; later sentences keep whole (natural prosody)
    assert _stream("Tea and cake. Then add milk and eggs and flour and stir well.") == [
        "Tea and cake.",
        "Then add milk and eggs and flour and stir well.",
    ]
    assert _stream("Salt and pepper are fine.", first_break_after_words=4) == ["Salt and pepper are fine."]
    assert _stream("Salt and pepper are fine.") == ["Salt and pepper", "are fine."]
    # a clause mark that comes first still wins
    assert _stream("Well, here we go now, and then we will see.") == [
        "Well, here we go now,",
        "and then we will see.",
    ]


def test_long_subject_breaks_before_its_verb_but_not_after_a_pronoun():
    assert _stream("The capital of Australia is Canberra. It is small.") == [
        "The capital of Australia",
        "is Canberra.",
        "It is small.",
    ]
    assert _stream("Cats purr because they are happy and calm.") == [
        "Cats purr because they are happy",
        "and calm.",
    ]
    # the subject counts from the last clause mark: "the weather" is too short
    assert _stream("In spring, the weather is mild.") == ["In spring, the weather is mild."]
    assert _stream("My dog is here.") == ["My dog is here."]  # a subject of fewer than three words


def test_no_break_inside_quotes_or_brackets():
    assert _stream('The famous old play "Romeo and Juliet" was written by Shakespeare.') == [
        'The famous old play "Romeo and Juliet"',
        "was written by Shakespeare.",
    ]
    assert _stream("We saw four big cats (lions and tigers) and left.") == [
        "We saw four big cats (lions and tigers)",
        "and left.",
    ]


def test_break_word_must_be_a_whole_word():
    assert _stream("The old android stands near the orange tree.") == [
        "The old android stands near the orange tree."
    ]
    assert _stream("One two three four five six andante slowly.") == [
        "One two three four five six andante slowly."
    ]
    seg = ClauseSegmenter()
    assert seg.push("One two three four five six and") == []  # "and" or "android"? wait for the space
    assert seg.push(" seven.") == ["One two three four five six"]
    assert seg.flush() == ["and seven."]


@pytest.mark.parametrize(
    "text",
    [
        "It costs 3.50 dollars or 1,000 yen and 2.5 euros in the U.S. today.",
        "Dr. Smith met Mrs. Jones and Prof. Brown at St. Mary with J. R. Tolkien.",
    ],
)
def test_break_cut_keeps_numbers_and_abbreviations_whole(text):
    chunks = _stream(text)
    assert " ".join(chunks) == text
    for piece in (
        "3.50",
        "1,000",
        "2.5",
        "U.S.",
        "Dr. Smith",
        "Mrs. Jones",
        "Prof. Brown",
        "St. Mary",
        "J. R.",
    ):
        if piece in text:
            assert any(piece in c for c in chunks), (piece, chunks)


def test_first_break_setting_is_validated():
    with pytest.raises(ValueError, match="first_break_after_words"):
        ClauseSegmenter(first_break_after_words=0)
