"""Streaming text out of a token stream: incremental detokenisation and stop-string matching.

Shared by plain generation and the engine, so both emit exactly the same text deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# How many prompt tokens to decode along with the first generated ones: enough context for
# tokenizers whose decoders change a token's text depending on what precedes it (SentencePiece
# drops the leading space of the first token), as vLLM does.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns token ids, one at a time, into text deltas that are final.

    Text is produced by decoding a short sliding window of ids and emitting what the newest
    ids added to it, so leading-space rules and BPE byte tokens come out exactly as a full
    decode would. While the window ends in an unfinished UTF-8 character (the decoder yields
    U+FFFD), nothing is emitted; the character comes out whole once its last byte arrives.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        # ids[prefix:read] is already-emitted context; ids[read:] is not yet emitted.
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text that became final (possibly "")."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # an unfinished character, or a token that adds no text (yet)
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text

    def flush(self) -> str:
        """Text still held back at the end of the stream (an unfinished character shows as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    ``push`` returns the text that is safe to show now. A suffix that could still grow into a
    stop string is held back until the next push decides it. When a stop string appears, the
    returned text ends just before it and the matcher reports the hit.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        buffer = self._held + text
        if not self.stops:
            self._held = ""
            return buffer, False
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)], True
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def _longest_partial_suffix(self, buffer: str) -> int:
        # Longest suffix of `buffer` that is a proper prefix of some stop string.
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held-back text, released when the stream ends without a stop string."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held


# Marks that end a clause or a sentence; a cut is made only where whitespace follows one, so
# "3.14", "e.g.," inside a word or a URL never end a reply.
CLAUSE_END_MARKS = frozenset(".!?;:,…。！？；：，")


class BoundaryStopper:
    """Ends a reply cleanly once it is past its token budget or deadline ("armed").

    Armed, it cuts at the first whitespace that follows a clause or sentence mark; if none comes
    within ``grace_tokens`` tokens, at the next word boundary. It never cuts inside a word, so
    the text it lets through is whole words, and a voice reply ends on something TTS can say.
    """

    def __init__(self, grace_tokens: int = 16):
        if grace_tokens < 0:
            raise ValueError(f"grace_tokens must be >= 0, got {grace_tokens}")
        self.grace_tokens = grace_tokens
        self._last_char = ""
        self._armed_tokens: int | None = None  # tokens pushed since arming

    @property
    def armed(self) -> bool:
        return self._armed_tokens is not None

    def arm(self) -> None:
        if self._armed_tokens is None:
            self._armed_tokens = 0

    def push(self, text: str) -> tuple[str, bool]:
        """One token's text; return (text to emit, whether the reply ends here)."""
        if self._armed_tokens is not None:
            self._armed_tokens += 1
            anywhere = self._armed_tokens > self.grace_tokens
            prev = self._last_char
            for i, ch in enumerate(text):
                if ch.isspace() and prev and not prev.isspace() and (anywhere or prev in CLAUSE_END_MARKS):
                    return text[:i], True
                prev = ch
        if text:
            self._last_char = text[-1]
        return text, False
