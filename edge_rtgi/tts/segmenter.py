"""Cut a stream of text deltas into speakable chunks, as early as sense allows.

A voice reply should start after the first clause, not after the whole answer. The rules:

- The first chunk may end at a clause mark (``,`` ``;`` ``:`` or an ellipsis) once it has
  ``min_first_clause_words`` words; later chunks end at sentence marks (``.`` ``!`` ``?``),
  which keeps the prosody natural once audio is already flowing.
- The first chunk may also end just before a conjunction or relative word (``and``, ``but``,
  ``because``, ``which``, ...), or before ``is``/``are``/``was``/``were`` after a subject of
  three or more words that does not end in a pronoun, once it has ``first_break_after_words``
  words and no quote or bracket is open: where a speaker would naturally pause. A first
  sentence without commas then does not hold back the voice until its period. (Time to first
  audio is LLM time to that cut plus TTS time for that chunk, and both grow with its length.)
- A mark only ends a chunk when whitespace follows it, so ``3.14``, ``1,000`` and ``e.g.x``
  never split, and text still arriving is never cut mid-token. Closing quotes and brackets
  stay with the chunk they close.
- A period after a title (``Dr.``), an initialism (``U.S.``, ``e.g.``), a single initial
  (``J.``) or a list number at the start of a line is not a sentence end.
- A line break ends a chunk (LLM lists and headings); markdown emphasis, heading and
  bullet marks are dropped.
- Text without any mark is cut at a word boundary after ``max_chunk_chars`` so a run-on
  reply still reaches the speaker.
- ``flush()`` returns whatever is left (unfinished text is spoken as it is).
"""

from __future__ import annotations

import re

_TITLES = frozenset(
    {
        "dr",
        "mr",
        "mrs",
        "ms",
        "prof",
        "st",
        "sr",
        "jr",
        "mt",
        "ft",
        "vs",
        "no",
        "fig",
        "gen",
        "gov",
        "sen",
        "rep",
        "rev",
        "capt",
        "col",
        "lt",
        "sgt",
        "approx",
        "dept",
        "est",
        "inc",
        "ltd",
        "co",
        "corp",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "cf",
        "al",
    }
)
_INITIALISM = re.compile(r"^(?:[A-Za-z]\.)+[A-Za-z]?$")  # e.g / i.e / U.S
_MARKS = re.compile(r"(\.\.\.|…|[.!?]+|[,;:])([\"'”’)\]]*)(?=\s)|\n\s*\n|\n")
_MARKDOWN = re.compile(r"[*#`_]+|^\s*[-•]\s+", re.MULTILINE)
_SPEAKABLE = re.compile(r"\w", re.UNICODE)
_CLOSERS = "\"'”’)]"
# Words before which a first chunk may end: a speaker can pause there without the cut
# sounding wrong. Conjunctions and relative words start a clause. Before "is"/"are"/... is
# the boundary between a long subject and its predicate ("The capital of Australia | is
# Canberra."), but not after a pronoun ("because they | are"). Lower case only: at a
# sentence start they follow a period anyway.
CLAUSE_WORDS = (
    "and",
    "but",
    "or",
    "because",
    "which",
    "who",
    "where",
    "when",
    "while",
    "although",
    "though",
    "unless",
    "until",
    "whereas",
    "since",
)
COPULAS = ("is", "are", "was", "were")
_BREAK = re.compile(r"(?<=\s)(" + "|".join(CLAUSE_WORDS + COPULAS) + r")(?=\s)")
_PRONOUNS = frozenset(
    {
        "i",
        "you",
        "he",
        "she",
        "it",
        "we",
        "they",
        "this",
        "that",
        "these",
        "those",
        "there",
        "here",
        "what",
        "which",
        "who",
        "where",
        "when",
        "how",
        "why",
        "one",
    }
)
_MIN_SUBJECT_WORDS = 3


class ClauseSegmenter:
    """Incremental text -> speakable chunks. ``push`` deltas, then ``flush`` at the end."""

    def __init__(
        self,
        min_first_clause_words: int = 3,
        max_chunk_chars: int = 220,
        first_break_after_words: int | None = 3,
    ):
        """``first_break_after_words`` None: the first chunk ends only at a mark."""
        if min_first_clause_words < 1 or max_chunk_chars < 1:
            raise ValueError("min_first_clause_words and max_chunk_chars must be >= 1")
        if first_break_after_words is not None and first_break_after_words < 1:
            raise ValueError(f"first_break_after_words must be >= 1 or None, got {first_break_after_words}")
        self.min_first_clause_words = min_first_clause_words
        self.max_chunk_chars = max_chunk_chars
        self.first_break_after_words = first_break_after_words
        self._buf = ""
        self._emitted = 0

    def reset(self) -> None:
        """Drop buffered text (e.g. the reply was interrupted)."""
        self._buf, self._emitted = "", 0

    def push(self, text_delta: str) -> list[str]:
        """Add text; return the chunks that are now complete (possibly none)."""
        self._buf += text_delta
        out: list[str] = []
        while True:
            cut = self._find_cut()
            if cut is None:
                break
            self._take(cut, out)
        while len(self._buf) > self.max_chunk_chars:
            space = self._buf.rfind(" ", 0, self.max_chunk_chars)
            if space <= 0:
                break
            self._take(space, out)
        return out

    def flush(self) -> list[str]:
        """Return the rest of the text as a final chunk (if it has anything to say)."""
        out: list[str] = []
        self._take(len(self._buf), out)
        self._emitted = 0
        return out

    def _take(self, end: int, out: list[str]) -> None:
        chunk, self._buf = self._buf[:end], self._buf[end:]
        chunk = " ".join(_MARKDOWN.sub(" ", chunk).split())
        if _SPEAKABLE.search(chunk):
            out.append(chunk)
            self._emitted += 1
        elif chunk and out:
            out[-1] += chunk  # stray punctuation belongs to the chunk before

    def _find_cut(self) -> int | None:
        cut = self._mark_cut()
        min_words = self.first_break_after_words
        if self._emitted == 0 and min_words is not None:
            # Only a break word that comes before the mark cut matters; each cut depends only on
            # the text up to the whitespace after it, so delta sizes never change the result.
            for match in _BREAK.finditer(self._buf, 0, len(self._buf) if cut is None else cut):
                if self._is_break(self._buf[: match.start()], match.group(1), min_words):
                    return match.start()
        return cut

    def _is_break(self, head: str, word: str, min_words: int) -> bool:
        """May the first chunk be ``head`` (``min_words`` words at least), ``word`` starting the next?"""
        words = head.split()
        if len(words) < min_words or _inside_quote(head):
            return False
        if word in COPULAS:
            subject = re.split(r"[,;:]\s", head)[-1].split()
            return len(subject) >= _MIN_SUBJECT_WORDS and subject[-1].lower() not in _PRONOUNS
        return True

    def _mark_cut(self) -> int | None:
        for match in _MARKS.finditer(self._buf):
            mark = match.group(1)
            if mark is None:  # a line break
                if _SPEAKABLE.search(self._buf[: match.start()]):
                    return match.end()
                continue
            end = match.end()
            if mark in ("...", "…") or mark in ",;:":
                if self._emitted == 0 and len(self._buf[:end].split()) >= self.min_first_clause_words:
                    return end
                continue
            if mark == "." and not self._is_sentence_period(match.start()):
                continue
            return end
        return None

    def _is_sentence_period(self, dot_index: int) -> bool:
        """False when the period belongs to an abbreviation, an initial or a list number."""
        head = self._buf[:dot_index]
        token = head.split()[-1] if head.split() else ""
        token = token.lstrip("(\"'“‘[")
        if not token:
            return True
        if is_abbreviation(token):
            return False
        line_start = head.rfind("\n") + 1
        if token.isdigit() and not head[line_start:].strip()[: -len(token)].strip():
            return False  # "1. First item" at the start of a line
        return True


def _inside_quote(text: str) -> bool:
    """True when ``text`` leaves a quote or bracket open ("Romeo and Juliet" is one name)."""
    return (
        text.count('"') % 2 == 1
        or text.count("“") > text.count("”")
        or text.count("(") > text.count(")")
        or text.count("[") > text.count("]")
    )


def is_abbreviation(token: str) -> bool:
    """True for a title ("Dr"), an initialism ("U.S", "e.g") or an initial ("J"), without the final period."""
    if len(token) == 1:
        return token.isupper() and token != "I"  # "J. R. Tolkien", but "It was I."
    return token.lower() in _TITLES or bool(_INITIALISM.match(token))


def split_sentences(text: str) -> list[str]:
    """Split complete text into sentences with the segmenter's rules (no early clause)."""
    seg = ClauseSegmenter(min_first_clause_words=10**9, first_break_after_words=None)
    return seg.push(text) + seg.flush()
