"""Text scorers of the graded task sets: answer containment, line similarity, chrF and BLEU.

Torch-free and below every layer that measures quality. Definitions in docs/task-sets.md:

- ``contains_answer``: an accepted answer appears in the reply, on word boundaries, after
  ``normalise_answer`` (case, accents, punctuation, spelled numbers 0-999 as digits);
- ``first_line`` / ``exact_match`` / ``edit_similarity``: the first generated line of code
  against the true next line;
- ``chrf_score`` / ``bleu_score``: corpus scores against per-item reference lists (sacrebleu),
  and per-item chrF statistics from which corpus chrF is recomputed for any resample.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_ONES = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen".split()
    )
}
_TENS = {
    w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)
}


def _number_words_to_digits(tokens: Sequence[str]) -> list[str]:
    """Spelled numbers 0-999 ("twenty four", "two hundred and six", "a hundred") as digits."""
    out: list[str] = []
    i = 0

    def tens_ones(j: int) -> tuple[int, int] | None:  # (value, tokens used) of "forty two", "seven"...
        if j < len(tokens) and tokens[j] in _TENS:
            value = _TENS[tokens[j]]
            if j + 1 < len(tokens) and tokens[j + 1] in _ONES and 0 < _ONES[tokens[j + 1]] < 10:
                return value + _ONES[tokens[j + 1]], 2
            return value, 1
        if j < len(tokens) and tokens[j] in _ONES:
            return _ONES[tokens[j]], 1
        return None

    while i < len(tokens):
        head = tens_ones(i)
        hundreds = None
        if (
            head is not None
            and head[0] in range(1, 10)
            and i + head[1] < len(tokens)
            and tokens[i + head[1]] == "hundred"
        ):
            hundreds, used = head[0] * 100, head[1] + 1
        elif tokens[i] == "hundred":
            hundreds, used = 100, 1
        if hundreds is not None:
            j = i + used
            j_and = j + 1 if j < len(tokens) and tokens[j] == "and" else j
            rest = tens_ones(j_and)
            if rest is not None and 0 < rest[0] < 100:
                hundreds, j = hundreds + rest[0], j_and + rest[1]
            out.append(str(hundreds))
            i = j
        elif head is not None:
            out.append(str(head[0]))
            i += head[1]
        else:
            out.append(tokens[i])
            i += 1
    return out


def normalise_answer(text: str) -> str:
    """Lower case, accents and punctuation removed, whitespace collapsed, number words as digits.

    "Twenty-Four!" -> "24", "Café, s'il vous plaît" -> "cafe sil vous plait", "1,000" -> "1000",
    "4:30pm" -> "4 30 pm", "B17" -> "b 17", "3.5" and "three point five" -> "3 point 5".
    """
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # thousands separators
    text = re.sub(r"(?<=\d)\.(?=\d)", " point ", text)  # decimal points
    text = re.sub(r"['\u2019\u2018`]", "", text)  # apostrophes join: "don't" -> "dont"
    text = re.sub(r"[\W_]+", " ", text)
    text = re.sub(r"(?<=\d)(?=[^\W\d])|(?<=[^\W\d])(?=\d)", " ", text)  # "5pm" -> "5 pm", "b17" -> "b 17"
    return " ".join(_number_words_to_digits(text.split()))


def contains_answer(reply: str, answers: Sequence[str]) -> bool:
    """Whether any accepted answer occurs in ``reply``, normalised, on word boundaries."""
    haystack = f" {normalise_answer(reply)} "
    for answer in answers:
        needle = normalise_answer(answer)
        if needle and f" {needle} " in haystack:
            return True
    return False


# --- Code matching ----------------------------------------------------------------------------


def first_line(text: str) -> str:
    """The first line of ``text`` holding anything but whitespace, with trailing whitespace
    stripped and indentation kept; "" if there is none."""
    for line in text.splitlines():
        if line.strip():
            return line.rstrip()
    return ""


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len(a), len(b)) on the lines with trailing whitespace stripped.

    1 for identical lines (two empty lines included), 0 when nothing can be kept.
    """
    a, b = a.rstrip(), b.rstrip()
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def exact_match(a: str, b: str) -> bool:
    """Whether two lines are equal once trailing whitespace is stripped (indentation counts)."""
    return a.rstrip() == b.rstrip()


# --- Translation metrics ----------------------------------------------------------------------


def _reference_streams(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> Any:
    """Per-item reference lists -> sacrebleu's reference streams, padded with None (variable count).

    sacrebleu skips None references; its type hints do not say so, hence ``Any``.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every hypothesis needs at least one reference")
    width = max((len(refs) for refs in references), default=1)
    return [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]


def chrf_statistics(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> list[tuple[int, ...]]:
    """Per-item chrF sufficient statistics (sacrebleu's n-gram match counts, best reference per item).

    Corpus chrF is a function of the *sum* of these rows, so a resample of the items is scored
    by summing rows instead of re-running the tokenizer (``chrf_from_statistics``): that is what
    makes a bootstrap over items cheap.
    """
    from sacrebleu.metrics import CHRF

    rows = CHRF()._extract_corpus_statistics(list(hypotheses), _reference_streams(hypotheses, references))
    return [tuple(int(v) for v in row) for row in rows]


def chrf_from_statistics(rows: Sequence[Sequence[int]] | npt.NDArray[np.int64]) -> float:
    """Corpus chrF (0..100) from ``chrf_statistics`` rows (summed); equals ``chrf_score`` on the
    same items."""
    from sacrebleu.metrics import CHRF

    total = [sum(col) for col in zip(*rows, strict=True)]
    return float(CHRF()._compute_score_from_stats(total).score)


def chrf_score(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus chrF (sacrebleu defaults: character 6-grams, beta 2) against per-item reference lists."""
    import sacrebleu

    return float(sacrebleu.corpus_chrf(list(hypotheses), _reference_streams(hypotheses, references)).score)


def bleu_score(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (sacrebleu defaults, 13a tokenisation) against per-item reference lists."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), _reference_streams(hypotheses, references)).score)
