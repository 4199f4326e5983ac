"""LocalAgreement: commit the words that consecutive hypotheses agree on.

whisper_streaming's rule (Macháček et al., 2023): re-decode the growing utterance every
chunk and commit the longest common prefix of the last ``n`` hypotheses. Two changes here:

- The committed words are passed back to whisper as a forced ``prefix`` for the next
  decode, so every later hypothesis *starts with* them. Comparing hypotheses then needs no
  word timestamps (which cost 1-4 s stalls inside faster-whisper), and the final transcript
  is exactly ``committed + tail``: nothing committed can be dropped or repeated.
- The last ``holdback_words`` of the newest hypothesis are never committed while the
  speaker is still talking, because whisper often guesses a word from its first syllable.

Words are compared after normalisation (case, punctuation), and the surface form of the
newest hypothesis is what gets committed.
"""

from __future__ import annotations

import re
from collections import deque

_STRIP = re.compile(r"[^\w']+", re.UNICODE)


def normalize_word(word: str) -> str:
    """Lower-case a word and strip punctuation around it ("Hello," -> "hello")."""
    return _STRIP.sub("", word.lower()).strip("'")


def split_words(text: str) -> list[str]:
    return text.split()


def without_repeats(words: list[str]) -> list[str]:
    """``words`` that are one phrase said several times back to back, as that phrase said once
    ("okay yeah okay yeah" -> "okay yeah"); other word lists unchanged. Compares words as given:
    normalise them first."""
    for n in range(1, len(words) // 2 + 1):
        if len(words) % n == 0 and words == words[:n] * (len(words) // n):
            return words[:n]
    return words


def common_prefix_len(a: list[str], b: list[str]) -> int:
    """Number of leading words equal after normalisation."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if normalize_word(x) != normalize_word(y):
            break
        n += 1
    return n


def strip_prefix_words(committed: list[str], hypothesis: list[str]) -> list[str]:
    """The words of ``hypothesis`` after the ``committed`` words it starts with.

    With a forced prefix the hypothesis repeats the committed words exactly; if a decode
    did not (e.g. it stopped early), the longest agreeing prefix is removed instead so that
    no committed word can be emitted twice.
    """
    k = common_prefix_len(committed, hypothesis)
    if k == len(committed):
        return hypothesis[k:]
    # The decode diverged inside the committed words: keep only what lies beyond them.
    return hypothesis[len(committed) :] if len(hypothesis) > len(committed) else []


def tail_after(committed: list[str], hypothesis: list[str]) -> list[str] | None:
    """Words of a free (unprefixed) ``hypothesis`` that follow the ``committed`` words.

    The hypothesis may word the committed part slightly differently, so after an exact
    prefix match fails, the last three (then two) committed words are looked up and the
    words after the occurrence nearest to where they should be are returned. None if the
    committed words cannot be located.
    """
    if common_prefix_len(committed, hypothesis) == len(committed):
        return hypothesis[len(committed) :]
    norm_h = [normalize_word(w) for w in hypothesis]
    for n in (3, 2):
        if len(committed) < n:
            continue
        gram = [normalize_word(w) for w in committed[-n:]]
        hits = [i for i in range(len(norm_h) - n + 1) if norm_h[i : i + n] == gram]
        if hits:
            best = min(hits, key=lambda i: abs(i - (len(committed) - n)))
            return hypothesis[best + n :]
    return None


class LocalAgreement:
    """Commit policy over successive hypotheses of one utterance."""

    def __init__(self, n: int = 2, holdback_words: int = 1):
        if n < 2:
            raise ValueError("LocalAgreement needs n >= 2")
        self.n, self.holdback_words = n, holdback_words
        self.committed: list[str] = []
        self._history: deque[list[str]] = deque(maxlen=n - 1)  # previous tails (uncommitted words)
        self.tentative: list[str] = []

    @property
    def committed_text(self) -> str:
        return " ".join(self.committed)

    @property
    def tentative_text(self) -> str:
        return " ".join(self.tentative)

    def update(self, hypothesis_words: list[str]) -> list[str]:
        """Take a new hypothesis of the whole utterance; return the newly committed words."""
        tail = strip_prefix_words(self.committed, hypothesis_words)
        new: list[str] = []
        if len(self._history) == self.n - 1:
            k = min(common_prefix_len(prev, tail) for prev in self._history)
            k = min(k, max(0, len(tail) - self.holdback_words))
            new = tail[:k]
            self.committed.extend(new)
            tail = tail[k:]
            # Earlier tails lose the words just committed, so they line up with the new tail.
            self._history = deque((prev[k:] for prev in self._history), maxlen=self.n - 1)
        self._history.append(tail)
        self.tentative = tail
        return new

    def final_words(self, hypothesis_words: list[str]) -> list[str]:
        """Committed words plus the uncommitted tail of the final hypothesis."""
        return self.committed + strip_prefix_words(self.committed, hypothesis_words)
