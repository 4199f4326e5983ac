"""A generation request as the scheduler and KV manager see it.

This module imports no torch: the scheduler and its tests run without a model. The
``params`` field holds a ``SamplingParams`` (from ``sampling.py``); only the plain fields of
``RequestParams`` are read here.

The one number that drives scheduling is ``num_computed_tokens``: how many of
``all_token_ids`` have their keys and values in the KV cache. Each step closes some of the
gap ``num_tokens - num_computed_tokens``; a step that closes it entirely samples one token.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Protocol


class RequestParams(Protocol):
    """The fields of ``sampling.SamplingParams`` that scheduling reads (it stays torch-free)."""

    @property
    def max_tokens(self) -> int: ...

    @property
    def ignore_eos(self) -> bool: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...


class RequestClass(enum.Enum):
    """Who waits on a request. Under the ``slo`` scheduling policy classes are served in this
    order (voice first) and a lower class may be preempted for a higher one."""

    VOICE = "voice"  # a person waits to hear the reply
    TRANSLATION = "translation"  # live captions or translated speech
    DIALOGUE = "dialogue"  # text chat and completions
    BULK = "bulk"  # background work: nobody watches it stream

    @property
    def rank(self) -> int:
        """Higher is more urgent."""
        return _CLASS_RANK[self]

    @classmethod
    def parse(cls, value: str) -> RequestClass:
        """The class named ``value``; ValueError naming the allowed names otherwise."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown request class {value!r}; choose one of {names}") from None


_CLASS_RANK = {
    RequestClass.VOICE: 3,
    RequestClass.TRANSLATION: 2,
    RequestClass.DIALOGUE: 1,
    RequestClass.BULK: 0,
}


@dataclass(frozen=True)
class RequestSLO:
    """A request's latency objective: first token within ``ttft_ms`` of arrival, then one token
    every ``itl_ms`` (the scheduler reads both; the benchmark judges a request by both)."""

    ttft_ms: float
    itl_ms: float

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of milliseconds > 0, got {value!r}")


# The share of a request's inter-token gaps that must keep ``RequestSLO.itl_ms``, in percent: the
# objective is judged at this percentile of the gaps (as the benchmark judges it), not on every gap.
ITL_PERCENTILE = 95.0


# Defaults per class: the interactive ones from the workload table in docs/benchmarks.md; bulk
# work is judged loosely, so that it fills the gaps the others leave.
DEFAULT_SLOS: dict[RequestClass, RequestSLO] = {
    RequestClass.VOICE: RequestSLO(ttft_ms=500.0, itl_ms=50.0),
    RequestClass.TRANSLATION: RequestSLO(ttft_ms=500.0, itl_ms=50.0),
    RequestClass.DIALOGUE: RequestSLO(ttft_ms=500.0, itl_ms=50.0),
    RequestClass.BULK: RequestSLO(ttft_ms=10_000.0, itl_ms=250.0),
}


class RequestStatus(enum.Enum):
    """Where a request is in its life. ``FINISHED_*`` states are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; waits to be recomputed from scratch
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context window reached
    FINISHED_BUDGET = "budget"  # past the token budget, at a clause or word boundary
    FINISHED_DEADLINE = "deadline"  # past the end-to-end deadline, at a clause or word boundary
    FINISHED_ABORTED = "abort"  # the caller aborted or stopped reading
    FINISHED_ERROR = "error"  # this request failed; the others go on

    @property
    def finished(self) -> bool:
        return self.value in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The finish reason ("stop", "length", "budget", "deadline", "abort", "error") or None."""
        return self.value if self.finished else None


_FINISHED = {"stop", "length", "budget", "deadline", "abort", "error"}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``priority``: higher values are served first and preempted last (default 0); it comes
    before the class, so it overrides the class order.
    ``request_class`` and ``slo`` (None: the class's default, ``DEFAULT_SLOS``) are what the
    ``slo`` scheduling policy orders and protects; the ``fcfs`` policy ignores them.
    ``eos_token_ids``: ids that end generation (the model's EOS plus the request's stop ids,
    empty when ``ignore_eos``); the engine fills it in.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: RequestParams
    priority: int = 0
    request_class: RequestClass = RequestClass.DIALOGUE
    slo: RequestSLO | None = None
    may_refuse: bool = True  # False: exempt from the slo policy's busy refusal (batch callers)
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time_s: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens dropped from the KV cache by importance eviction (kv.eviction); the cache holds
    # the other ``num_kv_tokens``, compacted, in order.
    num_evicted_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (reported in usage).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # When the last token was sampled (the ITL clock; None before the first token).
    last_token_time_s: float | None = None
    # When the first token was sampled, and the gaps between tokens longer than the ITL objective.
    first_token_time_s: float | None = None
    num_late_gaps: int = 0
    error: str | None = None
    # Chained hashes of this request's full blocks, filled lazily by the KV manager and kept
    # across preemption so that recomputation finds its own blocks again.
    block_hashes: list[bytes] = field(default_factory=list)
    # Speculative decoding: draft tokens to verify in the next step (set by the engine's
    # speculator before scheduling, cut by the scheduler to the budget, cleared after the step),
    # and counters over the request's life: drafts verified, drafts accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def objective(self) -> RequestSLO:
        """The SLO in force (the class default when none was given)."""
        return self.slo or DEFAULT_SLOS[self.request_class]

    @property
    def ttft_deadline_s(self) -> float:
        """When the first token is due (monotonic seconds)."""
        return self.arrival_time_s + self.objective.ttft_ms / 1e3

    def itl_slack_s(self, now_s: float) -> float:
        """Seconds until the next token is due: from the last token for a decode, from the TTFT
        deadline before the first token."""
        if self.last_token_time_s is None:
            return self.ttft_deadline_s - now_s
        return self.last_token_time_s + self.objective.itl_ms / 1e3 - now_s

    def late_gaps_allowed(self, context_window: int | None = None) -> int:
        """How many gaps past the ITL objective leave the ``ITL_PERCENTILE``-th percentile gap
        (linear interpolation) of the longest reply this request may give (``max_tokens``, or
        what ``context_window`` leaves after the prompt if less) within it: the gaps above the
        percentile's rank may be late, no others (none in a 16-token reply, one in 32, two in
        48). A reply that ends sooner has fewer to spare: this is an upper bound."""
        tokens = self.max_tokens
        if context_window is not None:
            tokens = min(tokens, context_window - self.num_prompt_tokens)
        gaps = tokens - 1
        if gaps < 1:
            return 0
        return gaps - 1 - math.ceil(ITL_PERCENTILE / 100.0 * (gaps - 1))

    def can_take_late_gap(self, context_window: int | None = None) -> bool:
        """Whether one more late gap would still leave the ITL objective kept."""
        return self.num_late_gaps < self.late_gaps_allowed(context_window)

    def missed_objective(self, context_window: int | None = None) -> bool:
        """Whether the SLO is already lost: the first token came late, or more gaps were late than
        the ITL percentile allows."""
        late_first = self.first_token_time_s is not None and self.first_token_time_s > self.ttft_deadline_s
        return late_first or self.num_late_gaps > self.late_gaps_allowed(context_window)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (a live list; do not mutate)."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the KV cache holds for this request (computed, less evicted)."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return int(self.params.max_tokens)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold in the KV cache."""
        # The last sampled token is never fed back, so it needs no KV slot.
        return self.num_prompt_tokens + self.max_tokens - 1

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class Usage:
    """Accounting for one finished request.

    ``cached_tokens``: prompt tokens served from the prefix cache (whole blocks).
    ``token_times_ms``: when each generated token was emitted, in ms since the request arrived
    (the first entry is the time to first token; differences are inter-token latencies).
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    token_times_ms: tuple[float, ...]
    num_preemptions: int = 0
    # speculative decoding: the draft that served the request last (None: none ran), draft
    # tokens verified and accepted
    draft: str | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """How sure the model was of one sampled token, from its raw next-token distribution
    (temperature 1, before top-k/top-p): the token's log-probability and the distribution's
    entropy, both in nats. Filled only for requests that ask (``SamplingParams.logprobs``)."""

    token_id: int
    logprob: float
    entropy_nats: float


@dataclass(frozen=True)
class RequestDelta:
    """One piece of a request's output stream.

    ``text`` is new text only (never splits a multi-byte character); ``token_ids`` the new
    token ids, and ``logprobs`` one ``TokenLogprob`` per new token when the request asked for
    them. The last delta has ``finish_reason`` ("stop", "length", "abort" or "error") and
    ``usage``; ``error`` says what went wrong when ``finish_reason == "error"``.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    # "busy" when the engine refused the request for load (errors.EngineBusy); then
    # ``retry_after_ms`` is its estimate of when to try again
    error_code: str | None = None
    retry_after_ms: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
