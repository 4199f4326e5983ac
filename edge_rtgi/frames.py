"""The typed messages that flow between pipeline stages and out of a session.

Two families:

- **Data frames** travel through the bounded queues between stages, in order:
  ``AudioIn`` (client PCM), ``Transcript`` (ASR output), ``ResponseRequest``, ``TextDelta`` /
  ``TextDone`` (reply or translation text), ``AudioOut`` (synthesised PCM).
- **Session events** are what a protocol adapter turns into wire messages: speech
  start/stop, transcripts, response lifecycle, audio, latency stats and errors.

Control does not travel as frames (pipecat's rule: an interruption must not wait behind the
audio it cancels): barge-in and cancellation call ``Session.interrupt``, which cancels the
response in every stage at once and drops its queued frames.

Every frame that belongs to a response carries its ``response_id`` so that a cancelled
response's leftovers can be dropped wherever they are queued. Times are ``time.monotonic()``
seconds (``t_s``); protocol adapters convert them to milliseconds since session start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

ResponseKind = Literal["reply", "translation"]
ResponseStatus = Literal["completed", "interrupted", "cancelled", "failed"]


def now_s() -> float:
    """The session clock: monotonic seconds."""
    return time.monotonic()


# --------------------------------------------------------------------------- data frames


@dataclass(frozen=True)
class AudioIn:
    """Mono int16 PCM from the user. ``arrival_t_s`` is when its last sample reached us."""

    pcm: np.ndarray  # int16 [N]
    sample_rate_hz: int
    arrival_t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class CommitAudio:
    """The client ends the user's turn by hand (no VAD endpointing)."""

    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class ClearAudio:
    """The client discards the audio of the turn in progress."""

    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class ChatTurn:
    """One finished turn of the conversation the assistant sees.

    ``entry_id`` names the turn in the session's history (``Session.revise``); ``turn_id`` is
    the user turn it records, ``response_id`` the response that spoke it (assistant turns).
    """

    entry_id: int
    role: Literal["user", "assistant"]
    text: str
    turn_id: int | None = None
    response_id: str | None = None


@dataclass(frozen=True)
class ResponseRequest:
    """Ask the response stage (assistant or translator) for one response.

    ``messages`` is the conversation so far for an assistant; a translator uses ``source_text``.
    The ``*_t_s`` times carry the turn's history for latency stats.
    """

    response_id: str
    turn_id: int
    source_text: str
    messages: tuple[ChatTurn, ...] = ()
    system_prompt: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class Transcript:
    """ASR text for one user turn. Partial transcripts may be revised; a final one is not."""

    turn_id: int
    text: str
    final: bool
    language: str | None = None
    t_s: float = field(default_factory=now_s)
    # Set on finals: when the user stopped speaking and when the turn was declared over (by
    # the VAD's silence timer, or by the semantic model: then also what its verdict cost).
    speech_end_t_s: float | None = None
    endpoint_t_s: float | None = None
    turn_decision_ms: float | None = None
    # Of the final's time after the endpoint: waiting for the shared ASR engine, then decoding.
    asr_queue_ms: float | None = None
    asr_decode_ms: float | None = None
    # Set on finals: what ended the turn (silence, semantic, max_length, commit, finish).
    end_reason: str | None = None
    # A final heard over a reply that only said "mm-hm", "yes"...: shown, but not a turn (it
    # neither cuts the reply nor gets an answer).
    backchannel: bool = False
    # Set on partials: the leading words that will not change any more (LocalAgreement).
    committed_text: str | None = None


@dataclass(frozen=True)
class TextDelta:
    """A piece of reply or translation text, as soon as the engine produced it."""

    response_id: str
    delta: str
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class LlmCallStats:
    """Which LLM backend wrote a response and what the call took (the text stage fills it).

    ``backend`` is its label (``local:<model>`` or ``openai:<model>@<host>``), as in /metrics.
    Times are ms from sending the request: ``connect_ms`` to the remote's response headers
    (None for a local engine), ``ttft_ms`` to the first token, ``total_ms`` to the end.
    ``attempts`` counts tries, retries before the first token included. With a router,
    ``route_reason`` says why this backend was picked and ``escalations`` how many cheaper
    backends were tried first (their time is in ``probe_ms``, their output thrown away).
    """

    backend: str
    model: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    connect_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    attempts: int = 1
    route_reason: str | None = None
    escalations: int = 0
    probe_ms: float | None = None


@dataclass(frozen=True)
class TextDone:
    """The full text of a response; ``source_text`` is the translated utterance, if any."""

    response_id: str
    text: str
    source_text: str | None = None
    usage: dict[str, Any] | None = None  # the backend's token counts, as JSON-ready numbers
    llm: LlmCallStats | None = None  # which LLM backend wrote it (None: no LLM, e.g. Apertium)
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class AudioOut:
    """Synthesised mono int16 PCM for one response."""

    response_id: str
    pcm: np.ndarray  # int16 [N]
    sample_rate_hz: int
    t_s: float = field(default_factory=now_s)

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / float(self.sample_rate_hz)


@dataclass(frozen=True)
class AudioDone:
    """No more audio will come for this response."""

    response_id: str
    t_s: float = field(default_factory=now_s)


# --------------------------------------------------------------------------- session events


@dataclass(frozen=True)
class SessionStarted:
    session_id: str
    pipeline: str
    config: dict[str, Any]  # the effective settings, JSON-ready
    input_sample_rate_hz: int
    output_sample_rate_hz: int | None
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class SessionUpdated:
    config: dict[str, Any]  # the effective settings, JSON-ready
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class SpeechStarted:
    """VAD heard the user start speaking; ``audio_ms`` is the position in the input stream.

    The one speech-start event: the streaming transcriber emits it with its utterance id as
    ``turn_id``, and the ASR stage hands the session a copy carrying the session's turn id.
    """

    turn_id: int
    audio_ms: int
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class WakeDetected:
    """The wake-word gate heard its word; ``audio_ms`` is where, in the input stream.

    From here the gate passes audio to ASR until the user's utterance ends (or nobody
    speaks for the gate's listen timeout)."""

    name: str
    phrase: str
    audio_ms: int
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class SpeechStopped:
    turn_id: int
    audio_ms: int
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class AudioCommitted:
    """All audio sent before a commit has been processed: its final transcript (if any)
    and the response it started were emitted before this event."""

    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class ResponseStarted:
    response_id: str
    turn_id: int
    kind: ResponseKind
    source_text: str
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class ResponseInterrupted:
    """A response was cut short. ``played_ms`` estimates how much audio the client played."""

    response_id: str
    reason: str
    played_ms: int
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class TurnStats:
    """Per-turn latencies in milliseconds; ``None`` where a part did not happen."""

    endpointing_ms: float | None = None  # user stopped speaking -> end of turn declared
    turn_decision_ms: float | None = None  # of that, the semantic model's verdict on the pause
    asr_final_ms: float | None = None  # end of turn -> final transcript
    # of that, with the shared ASR engine: waiting for its step, and decoding after the endpoint
    asr_queue_ms: float | None = None
    asr_decode_ms: float | None = None
    llm_ttft_ms: float | None = None  # final transcript -> first text delta
    first_clause_ms: float | None = None  # first text delta -> first speakable clause
    tts_first_chunk_ms: float | None = None  # first clause -> first audio chunk
    voice_to_voice_ms: float | None = None  # user stopped speaking -> first audio sent
    text_total_ms: float | None = None  # final transcript -> text done
    # a response started on the turn's likely final (preemptive reply): how long before the final
    reply_head_start_ms: float | None = None
    completion_tokens: int | None = None
    # The LLM call behind the text (frames.LlmCallStats), where an LLM wrote it.
    backend: str | None = None  # local:<model> or openai:<model>@<host>
    prompt_tokens: int | None = None
    backend_connect_ms: float | None = None  # request sent -> remote's response headers
    backend_ttft_ms: float | None = None  # request sent -> first token, as the backend saw it
    backend_total_ms: float | None = None  # request sent -> last token
    backend_attempts: int | None = None  # tries, retries before the first token included
    route_reason: str | None = None  # why a router picked this backend
    route_escalations: int | None = None  # cheaper backends tried first and dropped
    route_probe_ms: float | None = None  # time spent on those


@dataclass(frozen=True)
class ResponseDone:
    response_id: str
    status: ResponseStatus
    text: str
    stats: TurnStats
    usage: dict[str, Any] | None = None  # the engine's token counts, as JSON-ready numbers
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class ErrorEvent:
    """Something went wrong; the session continues unless ``fatal``."""

    code: str
    message: str
    hint: str | None = None
    event_type: str | None = None
    response_id: str | None = None
    fatal: bool = False
    t_s: float = field(default_factory=now_s)


@dataclass(frozen=True)
class Pong:
    """The answer to a client's ping, queued behind the events sent before it."""

    id: str | int | None = None
    t_s: float = field(default_factory=now_s)


DataFrame = (
    AudioIn
    | CommitAudio
    | ClearAudio
    | ResponseRequest
    | Transcript
    | TextDelta
    | TextDone
    | AudioOut
    | AudioDone
)

SessionEvent = (
    Pong
    | SessionStarted
    | SessionUpdated
    | SpeechStarted
    | SpeechStopped
    | WakeDetected
    | Transcript
    | AudioCommitted
    | ResponseStarted
    | TextDelta
    | TextDone
    | AudioOut
    | AudioDone
    | ResponseInterrupted
    | ResponseDone
    | ErrorEvent
)
