"""Events produced by streaming ASR, one typed record per kind.

Two clocks: ``*_audio_s`` fields are positions in the input stream (seconds of audio since
the transcriber started), and ``t_s`` is ``time.monotonic()`` when the event was made, so
wall-clock latencies can be measured by whoever feeds audio in real time.

Per utterance the order is: ``SpeechStarted`` (the one speech-start event of the whole
project, from ``edge_rtgi.frames``: its ``turn_id`` is the utterance id here, and the session's
turn id once the ASR stage has mapped it), zero or more ``PartialTranscript``,
``SpeechEnded``, then ``FinalTranscript`` (absent when nothing was recognised, e.g. a
cough or a suppressed hallucination). Where the transcriber is asked to (``likely_ends``), a
``TurnLikelyEnded`` may come before ``SpeechEnded`` (a pause whose words are decoded, while a
timer or the model decides), withdrawn by a ``TurnResumed`` if the speech goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from edge_rtgi.frames import SpeechStarted


def _now() -> float:
    return time.monotonic()


@dataclass(frozen=True)
class TranscriptSegment:
    """A piece of a final transcript with its position in the stream."""

    text: str
    start_audio_s: float
    end_audio_s: float


@dataclass(frozen=True)
class PartialTranscript:
    """The utterance so far. ``committed_text`` never changes once emitted (it only grows);
    ``tentative_text`` is the rest of the newest hypothesis and may still be revised."""

    utterance_id: int
    committed_text: str
    tentative_text: str
    audio_end_s: float  # how far into the stream the hypothesis has heard
    t_s: float = field(default_factory=_now)

    @property
    def text(self) -> str:
        return " ".join(p for p in (self.committed_text, self.tentative_text) if p)


@dataclass(frozen=True)
class SpeechEnded:
    """The utterance ended: speech stopped at ``speech_end_audio_s`` and the endpoint fired
    (after the configured silence, or a forced split or commit) at ``endpoint_audio_s``."""

    utterance_id: int
    speech_end_audio_s: float
    endpoint_audio_s: float
    reason: str = "silence"  # "silence" | "semantic" | "max_length" | "commit" | "finish"
    # Semantic turn detection: when the model ended the turn (time.monotonic(); None when the
    # silence timer or anything else did) and what its verdict on the last pause cost.
    decided_t_s: float | None = None
    turn_decision_ms: float | None = None
    t_s: float = field(default_factory=_now)


@dataclass(frozen=True)
class FinalTranscript:
    """The text of one utterance: every committed word, then the tail decoded at the end.

    ``final_decode_ms`` is the time spent decoding after the endpoint (0 when a decode made
    during the trailing silence could be reused). ``decided_t_s`` and ``turn_decision_ms`` are
    ``SpeechEnded``'s.
    """

    utterance_id: int
    text: str
    segments: tuple[TranscriptSegment, ...]
    start_audio_s: float
    speech_end_audio_s: float
    endpoint_audio_s: float
    language: str | None
    final_decode_ms: float
    decided_t_s: float | None = None
    turn_decision_ms: float | None = None
    # With the shared ASR engine (edge_rtgi.asr.batch): of the time after the endpoint, how
    # long the final's decode waited for a step (``final_decode_ms`` then excludes it).
    final_queue_ms: float = 0.0
    t_s: float = field(default_factory=_now)


@dataclass(frozen=True)
class TurnLikelyEnded:
    """A pause's words (``text``, its speculative final) are decoded and do not read as cut off,
    and the turn has not ended yet: a hold, a recheck, the cap or the silence timer waits. Most
    such turns end with these words; a reply can be started now and held until the final
    confirms them."""

    utterance_id: int
    text: str
    t_s: float = field(default_factory=_now)


@dataclass(frozen=True)
class TurnResumed:
    """Speech went on after a ``TurnLikelyEnded``: its words were not the end of the turn."""

    utterance_id: int
    t_s: float = field(default_factory=_now)


AsrEvent = SpeechStarted | PartialTranscript | SpeechEnded | FinalTranscript | TurnLikelyEnded | TurnResumed
