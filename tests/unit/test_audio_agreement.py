"""LocalAgreement commit policy (pure logic; the ASR model is not involved)."""

from __future__ import annotations

from edge_rtgi.asr.agreement import (
    LocalAgreement,
    common_prefix_len,
    normalize_word,
    strip_prefix_words,
    without_repeats,
)


def _w(text: str) -> list[str]:
    return text.split()


def test_normalisation_ignores_case_and_punctuation():
    assert normalize_word("Hello,") == "hello"
    assert normalize_word("don't") == "don't"
    assert common_prefix_len(_w("The cat, sat"), _w("the cat sat down")) == 3


def test_commits_only_what_two_hypotheses_agree_on_minus_the_growing_word():
    la = LocalAgreement(n=2, holdback_words=1)
    assert la.update(_w("the quick")) == []  # first hypothesis: nothing to agree with
    # Both agree on "the quick"; "brown" is the newest word of the newest hypothesis, held back.
    assert la.update(_w("the quick brown")) == ["the", "quick"]
    assert la.update(_w("the quick brown fox")) == ["brown"]
    assert la.committed == ["the", "quick", "brown"] and la.tentative == ["fox"]


def test_holdback_keeps_the_last_word_of_the_newest_hypothesis_tentative():
    la = LocalAgreement(n=2, holdback_words=1)
    la.update(_w("the quick brown"))
    new = la.update(_w("the quick brown"))
    assert new == ["the", "quick"]
    assert la.tentative == ["brown"]
    la2 = LocalAgreement(n=2, holdback_words=0)
    la2.update(_w("the quick brown"))
    assert la2.update(_w("the quick brown")) == ["the", "quick", "brown"]


def test_committed_words_never_change_and_final_is_committed_plus_tail():
    la = LocalAgreement(n=2, holdback_words=1)
    for hyp in [
        "That's it.",
        "The quick round 5",
        "The quick roundfire system.",
        "The quick round fox jumps",
    ]:
        before = list(la.committed)
        la.update(_w(hyp))
        assert la.committed[: len(before)] == before
    assert la.committed == ["The", "quick"]
    # Later hypotheses start with the committed words (forced prefix); the final keeps them.
    assert la.final_words(_w("The quick brown fox jumps.")) == _w("The quick brown fox jumps.")


def test_disagreeing_hypotheses_commit_nothing():
    la = LocalAgreement(n=2, holdback_words=1)
    la.update(_w("I scream"))
    assert la.update(_w("ice cream for all")) == []
    assert la.tentative_text == "ice cream for all"


def test_n3_needs_three_agreeing_hypotheses():
    la = LocalAgreement(n=3, holdback_words=0)
    la.update(_w("a b c"))
    assert la.update(_w("a b c")) == []
    assert la.update(_w("a b x")) == ["a", "b"]


def test_strip_prefix_never_repeats_committed_words():
    assert strip_prefix_words(_w("a b"), _w("a b c d")) == ["c", "d"]
    assert strip_prefix_words(_w("a b"), _w("A, b. c")) == ["c"]
    # A decode that diverged inside the committed words contributes only what lies beyond them.
    assert strip_prefix_words(_w("a b c"), _w("a x")) == []
    assert strip_prefix_words(_w("a b c"), _w("a x c d")) == ["d"]


def test_tail_after_locates_committed_words_in_a_free_hypothesis():
    from edge_rtgi.asr.agreement import tail_after

    assert tail_after(_w("leave the house."), _w("Leave the house. My sister")) == ["My", "sister"]
    # Worded differently at the start, but the last committed words are found.
    assert tail_after(_w("Please turn off the lights"), _w("Please switch off the lights now")) == ["now"]
    assert tail_after(_w("a b c"), _w("x y z")) is None


def test_without_repeats_keeps_a_phrase_said_again_once():
    assert without_repeats("okay yeah okay yeah".split()) == ["okay", "yeah"]
    assert without_repeats("yeah yeah yeah".split()) == ["yeah"]
    assert without_repeats("okay yeah okay".split()) == ["okay", "yeah", "okay"]  # not whole repeats
    assert without_repeats("stop talking".split()) == ["stop", "talking"]
    assert without_repeats([]) == []
