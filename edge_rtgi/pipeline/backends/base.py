"""What a text stage asks of an LLM backend, and the records they hand each other.

A backend turns one ``BackendRequest`` (chat messages, or a raw completion prompt) into a stream
of ``BackendDelta``s, the last of which carries the call's ``BackendResult``. The local engine,
a remote OpenAI-compatible server and the router all satisfy ``LlmBackend``, so the assistant
and translate stages stream any of them into the same clause segmenter and TTS.

Cancelling the task that reads a stream (barge-in, a client's cancel, a closed session), or
closing the stream, ends the call: the local engine aborts the request and frees its KV
blocks, a remote backend closes its HTTP connection, which the server sees as a disconnect.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from edge_rtgi.llm.request import RequestClass, RequestSLO


@dataclass(frozen=True)
class Message:
    """One chat message: ``role`` is system, user or assistant."""

    role: str
    content: str


@dataclass(frozen=True)
class BackendRequest:
    """One generation: chat ``messages``, or a raw completion prompt ``text`` (code).

    ``logprobs`` asks for per-token entropies (``BackendDelta.entropies_nats``); only local
    engines report them. ``priority``, ``request_class`` and ``slo`` go to a local engine's
    scheduler (a remote engine schedules by its own rules).
    ``stop`` strings end the generation (not included in the text); ``add_special_tokens`` lets
    a local tokenizer put its BOS before a raw ``text`` prompt (base models expect it).
    """

    request_id: str
    max_tokens: int
    messages: tuple[Message, ...] = ()
    text: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    priority: int = 0
    request_class: RequestClass = RequestClass.DIALOGUE
    slo: RequestSLO | None = None
    # dynamic stopping on a local engine (SamplingParams.token_budget / deadline_ms)
    token_budget: int | None = None
    deadline_ms: float | None = None
    logprobs: bool = False
    stop: tuple[str, ...] = ()
    add_special_tokens: bool = False
    # a local engine's speculative decoding for this request (SamplingParams.speculative)
    speculative: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (not self.messages):
            raise ValueError("a backend request has either messages or text")

    @property
    def user_text(self) -> str:
        """What the user said last (the router's turn features); the prompt for raw text."""
        if self.text is not None:
            return self.text
        return next((m.content for m in reversed(self.messages) if m.role == "user"), "")


@dataclass(frozen=True)
class RouteDecision:
    """Why a router sent a turn where it did.

    ``reason`` is a short fixed word for /metrics (``confident``, ``low_confidence``,
    ``failed``, ``answered``, ``last``, ``long_turn``, ``keyword``, ``plain_turn``); ``detail`` says it in a
    sentence for the log. ``tried`` holds the results of the backends tried first and dropped.
    """

    router: str
    rule: str
    chosen: str
    reason: str
    detail: str
    tried: tuple[BackendResult, ...] = ()
    mean_entropy_nats: float | None = None
    probe_ms: float | None = None


@dataclass(frozen=True)
class BackendResult:
    """What one call produced and cost. Times are ms from sending the request."""

    backend: str
    model: str
    finish_reason: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    connect_ms: float | None = None  # to the remote's response headers; None for a local engine
    ttft_ms: float | None = None
    total_ms: float | None = None
    attempts: int = 1
    route: RouteDecision | None = None

    def usage(self) -> dict[str, int | float]:
        """The JSON-ready token counts (and time to first token) a response reports; unknown
        ones left out."""
        counts: dict[str, int | float | None] = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": self.ttft_ms,
        }
        out = {k: v for k, v in counts.items() if v is not None}
        if self.prompt_tokens is not None and self.completion_tokens is not None:
            out["total_tokens"] = self.prompt_tokens + self.completion_tokens
        return out


@dataclass(frozen=True)
class BackendDelta:
    """New text (possibly empty), the entropies of the tokens it came from when asked, and on
    the last delta of a call, ``result``."""

    text: str
    num_tokens: int = 0
    entropies_nats: tuple[float, ...] = ()
    result: BackendResult | None = None


class BackendObserver(Protocol):
    """Who hears about every call and routing decision (the daemon's metrics). Called on the
    event loop; keep it short."""

    def on_result(self, result: BackendResult) -> None:
        """A call finished (for a router: the chosen backend's result, ``route`` set)."""

    def on_failure(self, backend: str, outcome: str) -> None:
        """A call ended without a result: ``cancelled``, or a ``BackendError`` code."""

    def on_route(self, decision: RouteDecision) -> None:
        """A router decided where a turn goes."""


class LlmBackend(Protocol):
    """An LLM that streams text for the text stages (local engine, remote server, router)."""

    @property
    def name(self) -> str:
        """The label in logs and /metrics (``local:<model>``, ``openai:<model>@<host>``...)."""

    @property
    def context_tokens(self) -> int:
        """The context window to fit prompts into."""

    def count_tokens(self, prompt: Sequence[Message] | str) -> int:
        """Tokens of a chat prompt (with its template) or of plain text: exact where the
        backend's tokenizer is at hand, a generous estimate otherwise."""

    def stream(self, request: BackendRequest) -> AsyncGenerator[BackendDelta, None]:
        """Run one request; the last delta carries the result. Raises ``RequestError``
        (``BackendError`` for a remote's failures) naming what went wrong."""

    async def check(self) -> str | None:
        """None when ready; otherwise a warning to log (a remote not answering yet)."""

    async def aclose(self) -> None:
        """Release connections held for this event loop."""
