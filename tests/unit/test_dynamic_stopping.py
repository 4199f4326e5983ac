"""Dynamic stopping: a reply past its budget or deadline ends at a clause, never mid-word."""

from __future__ import annotations

import pytest

from edge_rtgi.errors import RequestError
from edge_rtgi.llm.detokenize import BoundaryStopper
from edge_rtgi.llm.sampling import SamplingParams


def run(pieces: list[str], arm_at: int, grace: int = 16) -> tuple[str, bool, int]:
    """Push token texts, arming before piece ``arm_at``; (emitted text, cut, pieces consumed)."""
    stopper = BoundaryStopper(grace)
    out = []
    for i, piece in enumerate(pieces):
        if i >= arm_at:
            stopper.arm()
        text, cut = stopper.push(piece)
        out.append(text)
        if cut:
            return "".join(out), True, i + 1
    return "".join(out), False, len(pieces)


SENTENCE = [
    "The",
    " capital",
    " of",
    " France",
    " is",
    " Paris",
    ",",
    " a",
    " city",
    " of",
    " lights",
    ".",
    " It",
]


def test_unarmed_text_passes_through_unchanged():
    assert run(SENTENCE, arm_at=99) == ("".join(SENTENCE), False, len(SENTENCE))


def test_armed_it_ends_at_the_next_clause_mark():
    assert run(SENTENCE, arm_at=2)[:2] == ("The capital of France is Paris,", True)
    # armed right after a comma the reply ends there; one word later, at the full stop
    assert run(SENTENCE, arm_at=7)[:2] == ("The capital of France is Paris,", True)
    assert run(SENTENCE, arm_at=8)[:2] == ("The capital of France is Paris, a city of lights.", True)


def test_marks_inside_words_and_numbers_do_not_end_it():
    pieces = ["Pi", " is", " 3", ".", "14", " and", " e", ".g", ".,", " more", " text", "!", " Next"]
    text, cut, _ = run(pieces, arm_at=0)
    assert cut and text == "Pi is 3.14 and e.g.,"  # not after "3." nor after "e."


def test_with_no_clause_mark_in_the_grace_it_ends_at_a_word_boundary():
    words = ["Some", "thing", " long", "er", " with", "out", " any", " mark", "s", " at", " all"]
    text, cut, used = run(words, arm_at=0, grace=3)
    assert cut and text == "Something longer"  # never "Some" or "Something long"
    # wherever it is armed, what is emitted is whole words: the text up to a piece that starts one
    word_ends = {"".join(words[:k]) for k in range(1, len(words)) if words[k].startswith(" ")}
    for i in range(len(words)):
        text, cut, _ = run(words, arm_at=i, grace=0)
        assert cut and text in word_ends


def test_multi_character_pieces_are_cut_inside_at_the_boundary():
    assert run(["Yes", ". Then", " more"], arm_at=0)[:2] == ("Yes.", True)
    assert run(["Yes", ".\n\nThen"], arm_at=0)[:2] == ("Yes.", True)


def test_bad_budget_settings_are_refused_naming_the_field():
    with pytest.raises(RequestError, match="token_budget"):
        SamplingParams(token_budget=0)
    with pytest.raises(RequestError, match="deadline_ms"):
        SamplingParams(deadline_ms=-1.0)
    with pytest.raises(RequestError, match="boundary_grace_tokens"):
        SamplingParams(boundary_grace_tokens=-1)
    assert SamplingParams(token_budget=8).stops_at_boundaries and not SamplingParams().stops_at_boundaries
