"""Speculative decoding: drafts that propose tokens, and the policy that picks draft and length.

The engine calls one ``Speculator`` before each schedule: it asks the policy, per running decode,
which draft to run and how many tokens to propose, and puts the proposal on the request
(``Request.draft_token_ids``). The scheduler counts those tokens against the step's budget, the
runner verifies them (``ModelRunner._verify``: exact match for greedy requests, rejection sampling
for sampled ones) and the scheduler keeps the accepted ones. After the step the speculator
learns from what was accepted and what the step cost.

Drafts are classes behind the ``Draft`` protocol; the engine never knows which one runs. Every
draft here is deterministic (a function of the request's tokens), so its draft distribution is
one-hot and verification needs no draft probabilities.

Torch-free: proposals are token lists, the policy is arithmetic.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from edge_rtgi.llm.request import Request, RequestClass

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

MAX_DRAFT_TOKENS = 16
SPECULATIVE_MODES = ("off", "auto")


class Draft(Protocol):
    """Proposes up to ``k`` tokens to follow a request's tokens."""

    @property
    def name(self) -> str: ...

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` draft tokens after ``request.all_token_ids`` (fewer when unsure, or none)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        ...


@runtime_checkable
class FeatureDraft(Draft, Protocol):
    """A draft that runs a model of its own over the target's features (``eagle``): it is fed
    the target's final hidden state of every position the runner computed, and its measured
    cost per drafted token is charged against what it promises."""

    @property
    def cost_ms_per_token(self) -> float | None:
        """Measured run time per drafted token (None before the first proposal)."""
        ...

    def add_features(self, request_id: str, start_position: int, features: Tensor) -> None:
        """The target's features [T, H] of positions ``start_position`` on."""
        ...


@dataclass(frozen=True)
class FeatureRows:
    """The target's final hidden states of one request's positions computed in a step."""

    start_position: int
    rows: Tensor  # [T, hidden]


# --- settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeConfig:
    """``mode``: "off", "auto" (the adaptive policy picks draft and k per request) or "fixed"
    (always ``draft`` with up to ``k`` tokens). ``draft`` is a name from ``DRAFTS``."""

    mode: str = "off"
    draft: str = "ngram"
    k: int = 4
    # the file of a draft that needs one (the trained draft's weights, the retrieval draft's reply
    # store; catalogue name or path); None: the catalogue's for the model
    draft_model: str | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def as_setting(self) -> str:
        """The short string form: "off", "auto" or "<draft>:<k>" (``SamplingParams.speculative``)."""
        return f"{self.draft}:{self.k}" if self.mode == "fixed" else self.mode


def runs_model(draft: Draft) -> bool:
    """Whether ``draft`` runs a model over the target's features (``FeatureDraft``)."""
    return isinstance(draft, FeatureDraft)


def parse_speculative(
    value: str | bool | Mapping[str, object], key: str = "speculative"
) -> SpeculativeConfig:
    """``auto`` | ``off`` | ``{draft: <name>, k: <1..16>}`` -> ``SpeculativeConfig``; a string
    ``<draft>:<k>`` (``ngram:4``, for command lines and ablations) is the mapping's short form.

    Raises ValueError naming ``key`` (and its sub-key) and what is allowed.
    """
    if isinstance(value, bool):  # YAML 1.1 reads a bare off / on as a boolean
        return SpeculativeConfig(mode="auto" if value else "off")
    if isinstance(value, str) and ":" in value:
        name, _, size = value.partition(":")
        return parse_speculative({"draft": name, "k": int(size) if size.isdigit() else size}, key)
    if isinstance(value, str):
        if value not in SPECULATIVE_MODES:
            raise ValueError(f"{key} must be 'auto', 'off' or {{draft: ..., k: ...}}, got {value!r}")
        return SpeculativeConfig(mode=value)
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be 'auto', 'off' or a mapping {{draft: ..., k: ...}}, got {value!r}")
    unknown = sorted(set(value) - {"draft", "k", "draft_model"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in {key}; allowed: draft, k, draft_model")
    draft_model = value.get("draft_model")
    if draft_model is not None and not isinstance(draft_model, str):
        raise ValueError(f"{key}.draft_model must be a catalogue name or a path, got {draft_model!r}")
    draft = value.get("draft", "ngram")
    if draft == "auto":  # {draft: auto, draft_model: ...}: the adaptive policy over every draft
        return SpeculativeConfig(mode="auto", draft_model=draft_model)
    if draft not in DRAFT_NAMES:
        raise ValueError(f"{key}.draft: unknown draft {draft!r}; choose one of {', '.join(DRAFT_NAMES)}")
    k = value.get("k", 4)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"{key}.k must be an integer in 1..{MAX_DRAFT_TOKENS}, got {k!r}")
    return SpeculativeConfig(mode="fixed", draft=str(draft), k=k, draft_model=draft_model)


# --- the n-gram (prompt lookup) draft ------------------------------------------------------------


@dataclass
class _NgramIndex:
    """For each n-gram of the request's tokens: the token after its latest occurrence, and how
    often each token followed it (its confidence)."""

    indexed: int = 0  # tokens whose preceding n-grams are in the tables
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    counts: dict[tuple[int, ...], dict[int, int]] = field(default_factory=dict)


class NgramDraft:
    """Prompt lookup: continue the longest recent n-gram match in the prompt and the output.

    From the longest suffix (``max_n`` down to ``min_n`` tokens) seen before, proposes the token
    that followed its latest occurrence, then repeats from the extended suffix. A token's
    confidence is the share of earlier occurrences of that n-gram that the same token followed;
    drafting stops below ``min_confidence`` (dynamic k). The index is incremental: each step
    adds only the new tokens.
    """

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 5, min_confidence: float = 0.5):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.min_confidence = min_n, max_n, min_confidence
        self._index: dict[str, _NgramIndex] = {}
        # the last proposal per request, by (tokens seen, k): the retrieval draft asks for the same
        # proposal as the policy within one step (tokens only grow, so the count names the text)
        self._last: dict[str, tuple[int, int, list[int]]] = {}

    def _update(self, request: Request) -> _NgramIndex:
        index = self._index.setdefault(request.request_id, _NgramIndex())
        tokens = request.all_token_ids
        for i in range(max(index.indexed, 1), len(tokens)):
            nxt = tokens[i]
            for n in range(self.min_n, min(self.max_n, i) + 1):
                key = tuple(tokens[i - n : i])
                index.latest[key] = nxt
                seen = index.counts.setdefault(key, {})
                seen[nxt] = seen.get(nxt, 0) + 1
        index.indexed = len(tokens)
        return index

    def propose(self, request: Request, k: int) -> list[int]:
        last = self._last.get(request.request_id)
        if last is not None and last[0] == request.num_tokens and last[1] == k:
            return list(last[2])
        index = self._update(request)
        context = request.all_token_ids[-self.max_n :]
        out: list[int] = []
        while len(out) < k:
            guess = self._next(index, context)
            if guess is None:
                break
            out.append(guess)
            context = [*context[1:], guess] if len(context) >= self.max_n else [*context, guess]
        self._last[request.request_id] = (request.num_tokens, k, out)
        return list(out)

    def _next(self, index: _NgramIndex, context: list[int]) -> int | None:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            key = tuple(context[-n:])
            token = index.latest.get(key)
            if token is None:
                continue
            seen = index.counts[key]
            if seen[token] / sum(seen.values()) < self.min_confidence:
                return None
            return token
        return None

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
        self._last.pop(request_id, None)


# Drafts the speculator builds itself (no model run); ``retrieval`` (a store file made for the
# model, ``llm.retrieval``) and ``eagle`` (the target model it reads, ``llm.eagle``) are built by
# the engine.
DRAFTS: dict[str, type[NgramDraft]] = {"ngram": NgramDraft}
DRAFT_NAMES = ("ngram", "retrieval", "eagle")


# --- cost and acceptance models -----------------------------------------------------------------


def _median(values: list[float]) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification step yields with ``k`` drafts each accepted with probability
    ``acceptance`` until the first rejection, plus the target's own token."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class StepSize:
    """A decode-only step's shape: the sequences it holds and the tokens they carry (one each,
    plus their drafts). Both matter: the same tokens cost differently as more sequences or as
    more drafts."""

    sequences: int
    tokens: int


class StepCostTable:
    """Measured run time of decode-only steps by their size (``StepSize``: sequences, tokens).

    Sizes are kept apart by their sequences as well as their tokens: eight plain decodes and six
    decodes carrying two drafts both carry eight tokens, but do not cost the same (the six cost
    more on the CPU here: docs/benchmarks.md), and a table by tokens alone priced the six's drafts
    at the eight's plain step, nearly free.

    A drafted step is timed against the plain steps of its own sequences nearest before it: the
    median of those of the last ``PLAIN_STEPS`` that are at most ``PAIR_WINDOW_STEPS`` steps
    old. A drafted step with none (a batch's first steps) waits for the ``PLAIN_STEPS`` plain
    steps after it, if they come within the window; else it teaches nothing. Each size keeps an
    EMA of that ratio (plain sizes: 1). Pairs cancel what the two steps share: the machine's
    speed, which drifts by tens of percent within minutes on a shared host, and mostly the
    requests' contexts (a table by size alone set drafted steps of one batch against plain
    steps of another and read the difference as the drafts' price). The median shrugs off one
    stalled plain step; a ratio is clipped to ``CLIP`` times its size's estimate before it
    counts (a new size's: what the table would have said of it), so one stalled drafted step
    moves the table a little. A size priced too dear is not drafted, so not timed again: a
    drafted size not timed for ``FORGET_AFTER_STEPS`` steps is forgotten and priced from the
    sizes around it again. ``cost_ms`` is a size's ratio times its recent plain step.
    ``follow_speed=False`` keeps plain per-size EMAs of the times (the ablation).

    A size not yet timed is interpolated between the sizes of the same sequences, or
    extrapolated from the largest of them at the cost per extra token of the nearest sequences
    with two sizes timed (``_slope``; also for sequences with nothing timed yet); with none, at
    ``prior_ratio_per_token`` of a one-token step. No draft is ever priced below
    ``MIN_SHARE_OF_PRIOR`` of that prior (per token, as a share of the plain step).
    """

    CLIP = (0.5, 3.0)
    PLAIN_STEPS = 3
    PAIR_WINDOW_STEPS = 256
    # A drafted size not timed for this many steps is forgotten, so it is priced from the sizes
    # around it again and, where that pays, drafted and timed anew: a size priced too dear (a
    # stall on its first sample, a machine that has since changed) is otherwise never re-timed.
    FORGET_AFTER_STEPS = 4096
    # the floor under a draft token's price: a quarter of the prior's, below every cost measured
    # here (docs/benchmarks.md, "Step costs by sequences"); it only keeps a noisy pair from
    # making drafts free
    MIN_SHARE_OF_PRIOR = 0.25

    def __init__(
        self, prior_ratio_per_token: float = 0.25, smoothing: float = 0.1, follow_speed: bool = True
    ):
        self.prior_ratio_per_token = prior_ratio_per_token
        self.smoothing = smoothing
        self.follow_speed = follow_speed
        # following: time over the plain step of the same sequences (that step's own: 1.0);
        # not following: an EMA of the time itself
        self.relative: dict[StepSize, float] = {}
        self.count: dict[StepSize, int] = {}  # samples per size (their EMA weights)
        self._steps = 0  # decode-only steps observed
        self._plain: dict[int, deque[tuple[int, float]]] = {}  # sequences -> (step, ms) of recent plain steps
        self._tokens: dict[int, list[int]] = {}  # sequences -> the token counts timed, sorted
        # sequences -> (step, size, ms) of drafted steps waiting for plain steps to pair with
        self._unpaired: dict[int, deque[tuple[int, StepSize, float]]] = {}
        # ratio() and _slope() answer until the table changes: the policy asks the same few many
        # times a step, and a plain step (ratio 1 to itself) changes nothing but the speed
        self._ratios: dict[tuple[int, int, int], float] = {}
        self._slopes_known: dict[int, float] | None = None
        self._updated: dict[StepSize, int] = {}  # drafted sizes: the step they were last timed

    def observe(self, tokens: int, run_ms: float, sequences: int = 1) -> None:
        """Learn from one decode-only step of ``sequences`` sequences carrying ``tokens`` tokens."""
        # a clock that did not move (or NaN) says nothing; nor does a step that is not decodes
        if not run_ms > 0 or sequences < 1 or tokens < sequences:
            return
        size = StepSize(sequences, tokens)
        self._steps += 1
        if self._steps % 512 == 0:
            self._forget_stale()
        if not self.follow_speed:
            self._average(size, run_ms)
            return
        if tokens == sequences:
            recent = self._plain.setdefault(sequences, deque(maxlen=self.PLAIN_STEPS))
            recent.append((self._steps, run_ms))
            if size not in self.relative:  # its ratio to itself: 1, for good
                self._average(size, 1.0)
            self._pair_waiting(sequences, recent)
            return
        plain_ms = self._plain_ms(sequences)
        if plain_ms is None:
            self._unpaired.setdefault(sequences, deque(maxlen=self.PLAIN_STEPS)).append(
                (self._steps, size, run_ms)
            )
            return
        self._add_pair(size, run_ms / plain_ms)

    def _pair_waiting(self, sequences: int, recent: deque[tuple[int, float]]) -> None:
        """Price the drafted steps that had no plain step of their sequences before them against
        the ``PLAIN_STEPS`` after them, once those are in (within the window, else drop them)."""
        waiting = self._unpaired.get(sequences)
        if not waiting:
            return
        while waiting and self._steps - waiting[0][0] > self.PAIR_WINDOW_STEPS:
            waiting.popleft()
        if len(recent) < self.PLAIN_STEPS:
            return
        median = _median([ms for _, ms in recent])
        while waiting and waiting[0][0] < recent[0][0]:
            _, size, ms = waiting.popleft()
            self._add_pair(size, ms / median)

    def _add_pair(self, size: StepSize, ratio: float) -> None:
        # a new size's first sample is clipped against what the table says of it now
        old = (
            self.relative.get(size)
            or self._relative(size)
            or self._prior(size.sequences, size.tokens - size.sequences)
        )
        low, high = self.CLIP
        self._average(size, min(max(ratio, low * old), high * old))

    def _forget_stale(self) -> None:
        stale = [size for size, step in self._updated.items() if self._steps - step > self.FORGET_AFTER_STEPS]
        for size in stale:
            del self._updated[size], self.relative[size], self.count[size]
            self._tokens[size.sequences].remove(size.tokens)
        if stale:
            self._ratios.clear()
            self._slopes_known = None

    def _average(self, size: StepSize, value: float) -> None:
        if size.tokens > size.sequences:
            self._updated[size] = self._steps
        self._ratios.clear()
        self._slopes_known = None
        if size not in self.relative:
            bisect.insort(self._tokens.setdefault(size.sequences, []), size.tokens)
        self.count[size] = self.count.get(size, 0) + 1
        # the first few samples average plainly so one noisy step does not set the table
        weight = max(self.smoothing, 1.0 / self.count[size])
        old = self.relative.get(size, value)
        self.relative[size] = old + weight * (value - old)

    def _plain_ms(self, sequences: int) -> float | None:
        """The median of the recent plain steps of ``sequences`` within the window (None: none)."""
        recent = [
            ms for step, ms in self._plain.get(sequences, ()) if self._steps - step <= self.PAIR_WINDOW_STEPS
        ]
        return _median(recent) if recent else None

    def _min_share(self, sequences: int) -> float:
        """The least a draft token may cost, as a share of the plain step of ``sequences``."""
        return self.MIN_SHARE_OF_PRIOR * self.prior_ratio_per_token / sequences

    def _prior(self, sequences: int, extra_tokens: int) -> float:
        """A step's cost with ``extra_tokens`` drafts over its plain step, before any is timed."""
        return 1.0 + self.prior_ratio_per_token * extra_tokens / sequences

    def _slope(self, sequences: int) -> float | None:
        """Cost per extra token as a share of the plain step (the smallest size timed): from it
        to the largest size timed with these sequences, else with the nearest sequences that
        have two sizes (the larger of two as near); never below ``_min_share``. None where no
        sequences have two sizes timed. Over the whole range, not between the two largest: those
        two are often close, and a noisy pair gave a slope of 0, which made every further draft
        free."""
        slopes = self._slopes_known
        if slopes is None:
            slopes = {}
            for seqs, sizes in self._tokens.items():
                if len(sizes) >= 2:
                    plain = self.relative[StepSize(seqs, sizes[0])]
                    top = self.relative[StepSize(seqs, sizes[-1])]
                    slopes[seqs] = (top - plain) / plain / (sizes[-1] - sizes[0])
            self._slopes_known = slopes
        if not slopes:
            return None
        nearest = slopes[min(slopes, key=lambda seqs: (abs(seqs - sequences), -seqs))]
        return max(nearest, self._min_share(sequences))

    def _relative(self, size: StepSize) -> float | None:
        if size in self.relative:
            return self.relative[size]
        same = self._tokens.get(size.sequences, [])
        at = bisect.bisect(same, size.tokens)
        if at == 0:
            return None
        below = same[at - 1]
        low = self.relative[StepSize(size.sequences, below)]
        if at < len(same):
            above = same[at]
            f = (size.tokens - below) / (above - below)
            return low + f * (self.relative[StepSize(size.sequences, above)] - low)
        plain = self.relative[StepSize(size.sequences, same[0])]
        slope = self._slope(size.sequences)
        if slope is None:  # one size of these sequences timed, none with two anywhere
            slope = self.prior_ratio_per_token / same[0]
        return low + slope * plain * (size.tokens - below)

    def cost_ms(self, tokens: int, sequences: int = 1) -> float | None:
        """The run time of a step of ``sequences`` carrying ``tokens`` tokens at the machine's
        current speed (None: unknown, or no plain step of those sequences lately)."""
        relative = self._relative(StepSize(sequences, tokens))
        if relative is None or not self.follow_speed:
            return relative
        plain_ms = self._plain_ms(sequences)
        return None if plain_ms is None else relative * plain_ms

    def ratio(self, base_tokens: int, extra_tokens: int, sequences: int | None = None) -> float:
        """Cost of a step with ``extra_tokens`` more than ``base_tokens``, relative to it;
        ``sequences``: the step's sequences (None: one per base token, no drafts placed yet)."""
        if extra_tokens == 0:
            return 1.0
        seqs = max(1, base_tokens if sequences is None else sequences)
        key = (seqs, base_tokens, extra_tokens)
        known = self._ratios.get(key)
        if known is not None:
            return known
        base = self._relative(StepSize(seqs, base_tokens))
        more = self._relative(StepSize(seqs, base_tokens + extra_tokens))
        if base is not None and more is not None and base > 0:
            value = more / base
        elif (slope := self._slope(seqs)) is not None:  # none of these sequences: the nearest's cost
            value = 1.0 + slope * extra_tokens
        else:
            value = 1.0 + self.prior_ratio_per_token * extra_tokens / max(base_tokens, 1)
        value = max(value, 1.0 + self._min_share(seqs) * extra_tokens)
        self._ratios[key] = value
        return value


# --- the policy ---------------------------------------------------------------------------------

# Per-token acceptance priors by request class (Beta pseudo-counts: accepted, rejected); each
# class's running totals replace them as requests finish.
CLASS_PRIORS: dict[RequestClass, tuple[float, float]] = {
    RequestClass.VOICE: (1.0, 2.0),
    RequestClass.TRANSLATION: (2.0, 2.0),
    RequestClass.DIALOGUE: (1.0, 2.0),
    RequestClass.BULK: (2.0, 2.0),
}
PRIOR_WEIGHT = 4.0  # pseudo-observations of the class prior a request's estimate starts with
# At most this many pseudo-observations of its class's measured acceptance are added to them: a
# class whose drafts keep failing starts its next request pessimistic, not at the prior again.
CLASS_EVIDENCE_WEIGHT = 24.0
K_CHOICES = (1, 2, 3, 4, 6, 8)
MIN_GAIN = 1.03  # a draft must promise this speed-up over plain decoding, or the step goes plain
# A model-running draft's cost per token against a plain step before either has been measured.
UNMEASURED_DRAFT_COST_RATIO = 0.1


@dataclass
class _RequestArm:
    """One request's acceptance estimate for one draft (Beta posterior, per token)."""

    accepted: float
    rejected: float
    pending: list[int] = field(default_factory=list)  # a shadow proposal to score next step
    start: tuple[float, float] = (0.0, 0.0)  # the pseudo-counts it started with (not evidence)

    @property
    def mean(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def optimistic(self) -> float:
        """Upper confidence bound: an arm tried little still gets its chance."""
        n = self.accepted + self.rejected
        return min(1.0, self.mean + math.sqrt(self.mean * (1 - self.mean) / (n + 1)))


@dataclass
class SpeculationStats:
    """Counters for /metrics and benchmarks: steps that verified drafts, draft tokens verified
    and accepted, and per draft the same two."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    plain_steps: int = 0  # decode steps where the policy chose no draft
    per_draft: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification step beyond the one plain decoding gives."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


class AdaptivePolicy:
    """Per request, picks (draft, k) maximising expected tokens per unit of step cost.

    A model-based bandit: each (request, draft) keeps a Beta estimate of per-token acceptance,
    started from its class's prior (``CLASS_PRIORS``) plus what earlier requests of the class
    observed (``CLASS_EVIDENCE_WEIGHT`` at most), and each candidate k, up to what the draft
    actually proposed, is scored ``expected_tokens(optimistic acceptance, k) / cost ratio(k)``
    with the cost ratio from measured step times. In a batch the step is shared: its tokens
    (``step_yield_tokens``, the decodes and the drafts already placed) grow by this request's
    expected extra tokens, and every request in it waits for the extra rows, so the score is
    the step's tokens per unit of cost against a step without this draft (at batch 1 the same
    number). With no candidate above ``MIN_GAIN`` the
    step is plain; the cheap drafts' (no model run) proposals are then scored in the shadow by
    the next token, so a request whose text turns repetitive is noticed without paying for a
    verification.
    ``fixed`` pins the draft and k (the ablation and the ``{draft, k}`` setting).
    """

    def __init__(self, drafts: Iterable[Draft], costs: StepCostTable, fixed: tuple[str, int] | None = None):
        self.drafts = {d.name: d for d in drafts}
        # names of the drafts that run a model (a runtime_checkable isinstance costs ~10 us)
        self.model_drafts = {n for n, d in self.drafts.items() if runs_model(d)}
        self.costs = costs
        self.fixed = fixed
        self._arms: dict[str, dict[str, _RequestArm]] = {}
        self._class_totals: dict[tuple[RequestClass, str], list[float]] = {}

    def _arm(self, request: Request, draft: str) -> _RequestArm:
        arms = self._arms.setdefault(request.request_id, {})
        if draft not in arms:
            a, r = CLASS_PRIORS[request.request_class]
            scale = PRIOR_WEIGHT / (a + r)
            a, r = a * scale, r * scale
            seen_a, seen_r = self._class_totals.get((request.request_class, draft), (0.0, 0.0))
            if seen_a + seen_r > 0:
                weight = min(1.0, CLASS_EVIDENCE_WEIGHT / (seen_a + seen_r))
                a, r = a + seen_a * weight, r + seen_r * weight
            arms[draft] = _RequestArm(a, r, start=(a, r))
        return arms[draft]

    def acceptance(self, request: Request, draft: str) -> float:
        """The estimated per-token acceptance of ``draft``'s tokens for ``request``."""
        return self._arm(request, draft).mean

    def pinned(self, fixed: tuple[str, int] | None = None, adaptive: bool = False) -> tuple[str, int] | None:
        """The (draft, k) a request's own setting (``fixed``) or the policy's pins, None when
        the policy chooses (``adaptive``: the request asked for ``auto`` over a fixed policy)."""
        if fixed is not None:
            return fixed
        return self.fixed if not adaptive else None

    def choose(
        self,
        request: Request,
        base_tokens: int,
        fixed: tuple[str, int] | None = None,
        adaptive: bool = False,
        available: Mapping[str, int] | None = None,
        step_yield_tokens: float | None = None,
        sequences: int | None = None,
    ) -> tuple[str, int] | None:
        """(draft, k) for this request's next step, or None for a plain step. ``base_tokens``:
        tokens the step carries without this request's drafts; ``fixed`` / ``adaptive``: the
        request's own setting over the policy's; ``available``: how many tokens each draft has
        proposed (None: as many as asked), so that no k is paid for on the promise of tokens the
        draft does not have. A draft that proposed nothing is not a candidate.
        ``step_yield_tokens``: the tokens the step is expected to give without this request's
        drafts (None: one per row of ``base_tokens``). ``sequences``: the step's sequences (None:
        one per token of ``base_tokens``, no drafts placed yet)."""
        pinned = self.pinned(fixed, adaptive)
        if pinned is not None:
            return pinned
        step_yield = float(base_tokens) if step_yield_tokens is None else step_yield_tokens
        step_yield = max(step_yield, 1.0)
        seqs = base_tokens if sequences is None else sequences
        best: tuple[float, str, int] | None = None
        for name in self.drafts:
            most = MAX_DRAFT_TOKENS if available is None else available.get(name, 0)
            if most <= 0:
                continue
            alpha = self._arm(request, name).optimistic()
            per_token = self.draft_cost_ratio(name, base_tokens, seqs)
            for k in sorted({min(k, most) for k in K_CHOICES}):
                more = (step_yield + expected_tokens(alpha, k) - 1.0) / step_yield
                gain = more / (self.costs.ratio(base_tokens, k, seqs) + per_token * k)
                if gain >= MIN_GAIN and (best is None or gain > best[0]):
                    best = (gain, name, k)
        return None if best is None else (best[1], best[2])

    def could_pay(self, sequences: int) -> bool:
        """Whether drafts that always hold could pay for their rows in a step of ``sequences``
        plain decodes, at any k ``choose`` may take (a proposal's length caps it below the
        choices), no draft's own cost counted: where not, no request's drafts could."""
        return any(
            (sequences + k) / sequences / self.costs.ratio(sequences, k, sequences) >= MIN_GAIN
            for k in range(1, max(K_CHOICES) + 1)
        )

    def draft_cost_ratio(self, name: str, base_tokens: int, sequences: int | None = None) -> float:
        """A draft's own cost per proposed token relative to a step of ``sequences`` (None: one
        per token) carrying ``base_tokens`` (0 for drafts that run no model)."""
        draft = self.drafts[name]
        if name not in self.model_drafts or not isinstance(draft, FeatureDraft):
            return 0.0
        step_ms = self.costs.cost_ms(base_tokens, base_tokens if sequences is None else sequences)
        cost_ms = draft.cost_ms_per_token
        if step_ms is None or step_ms <= 0 or cost_ms is None:
            return UNMEASURED_DRAFT_COST_RATIO
        return cost_ms / step_ms

    def shadow(self, request: Request, proposals: Mapping[str, list[int]] | None = None) -> None:
        """On a plain step, score each cheap draft's guess of the next token (``observe_plain``):
        the first token of its ``proposals`` entry, or a fresh one-token proposal. Drafts that run
        a model are not asked: a guess would cost a draft pass on every plain step."""
        for name, draft in self.drafts.items():
            if name in self.model_drafts:
                continue
            guess = proposals[name][:1] if proposals is not None else draft.propose(request, 1)
            self._arm(request, name).pending = guess

    def observe_plain(self, request: Request, token: int) -> None:
        for arm in self._arms.get(request.request_id, {}).values():
            if arm.pending:
                hit = arm.pending[0] == token
                arm.accepted += hit
                arm.rejected += not hit
                arm.pending = []

    def observe_declined(self, request: Request, draft: str) -> None:
        """A draft chosen for k tokens proposed fewer (it doubted them): one rejection."""
        self._arm(request, draft).rejected += 1

    def observe(self, request: Request, draft: str, proposed: int, accepted: int) -> None:
        """A verification step: ``accepted`` of ``proposed`` drafts held."""
        arm = self._arm(request, draft)
        arm.accepted += accepted
        arm.rejected += 1 if accepted < proposed else 0

    def release(self, request: Request) -> None:
        """Fold what a finished request observed (not the pseudo-counts it started with) into
        its class's totals."""
        for name, arm in self._arms.pop(request.request_id, {}).items():
            totals = self._class_totals.setdefault((request.request_class, name), [0.0, 0.0])
            totals[0] += arm.accepted - arm.start[0]
            totals[1] += arm.rejected - arm.start[1]
            # forget slowly, so the class prior follows a workload that changes
            if totals[0] + totals[1] > 200:
                totals[0] *= 0.5
                totals[1] *= 0.5


class Speculator:
    """The engine's one entry point to speculation: propose before a step, learn after it."""

    def __init__(self, config: SpeculativeConfig, drafts: Iterable[Draft] | None = None):
        self.config = config
        if drafts is None:
            names = list(DRAFTS) if config.mode == "auto" else [config.draft]
            if any(name not in DRAFTS for name in names):
                raise ValueError(
                    f"draft {config.draft!r} needs a file or the model: build it (engine.build_speculator) "
                    "and pass it in drafts"
                )
            drafts = [DRAFTS[name]() for name in names]
        self.costs = StepCostTable()
        fixed = (config.draft, config.k) if config.mode == "fixed" else None
        self.policy = AdaptivePolicy(drafts, self.costs, fixed)
        self.stats = SpeculationStats()
        self._chosen: dict[str, str] = {}  # request id -> draft of its proposal this step
        self._last_draft: dict[str, str] = {}

    def eligible(
        self,
        request: Request,
        greedy: bool,
        seeded: bool,
        logprobs: bool,
        own: SpeculativeConfig | None = None,
    ) -> bool:
        """Requests that may speculate: not those that want per-token logprobs; under ``auto``
        not seeded sampled ones either (the policy reads step times, so their k, and with it
        which random numbers a sample consumes, would vary from run to run), nor with a draft
        that runs a model (its proposals depend on float features and its cache's history).
        ``own``: the request's own setting (``SamplingParams.speculative``), None to follow the
        engine's."""
        setting = own or self.config
        if logprobs or setting.mode == "off":
            return False
        cheap = setting.draft in DRAFTS or setting.draft in self.policy.drafts
        reproducible = setting.mode == "fixed" and cheap and setting.draft not in self.policy.model_drafts
        return not (seeded and not greedy and not reproducible)

    def propose(
        self,
        decodes: list[tuple[Request, SpeculativeConfig | None]],
        max_draft_tokens: int | None = None,
        step_sequences: int | None = None,
    ) -> None:
        """Put a draft on each of ``decodes`` (running requests one token short, each with its
        own setting or None for the engine's) that should get one. ``max_draft_tokens``: the most
        draft tokens the step may carry in all (None: no limit but the scheduler's budget);
        ``step_sequences``: the decodes the step holds, these and any that may not speculate
        (None: these alone)."""
        self._chosen.clear()
        sequences = max(len(decodes), step_sequences or 0)
        base_tokens = sequences
        # at this batch even drafts that always hold would not pay: ask no one (one check a step;
        # it holds until a pinned request places drafts, which make further rows cheaper)
        hopeless = sequences > 1 and not self.policy.could_pay(sequences)
        step_yield = float(base_tokens)  # tokens the step is expected to give, drafts placed so far
        room = MAX_DRAFT_TOKENS * len(decodes) if max_draft_tokens is None else max_draft_tokens
        for req, own in decodes:
            if room <= 0:
                break
            fixed = None
            if own is not None and own.mode == "fixed":
                fixed = (own.draft, own.k)
                if own.draft not in self.policy.drafts:
                    if own.draft not in DRAFTS:
                        continue  # a draft with a file this engine has not loaded: plain steps
                    self.policy.drafts[own.draft] = DRAFTS[own.draft]()  # a cheap one
            adaptive = own is not None and own.mode == "auto"
            pinned = self.policy.pinned(fixed, adaptive)
            if pinned is not None:
                name, k = pinned
                req.draft_token_ids = self._ask(self.policy.drafts[name], req, min(k, room))[:room]
            elif (hopeless and base_tokens == sequences) or (
                sequences > 1
                and self.policy.choose(req, base_tokens, step_yield_tokens=step_yield, sequences=sequences)
                is None
            ):
                # In a batch, where no draft could pay even proposing all it may, nothing is
                # proposed: the proposals cost more than the step's share of their tokens (the
                # store's lookup most). Alone, the proposal is still made and scored in the shadow.
                continue
            else:
                # Each cheap draft (no model run) proposes as far as it can once; the policy then
                # picks which and how much of it to verify, knowing what it would get, or a plain
                # step, and the proposals are scored in the shadow. A draft that runs a model
                # proposes only when chosen, and only the k it was chosen for; when it then
                # proposes less (it doubts its next token), that counts against it and the
                # policy chooses again with what it really has.
                model_drafts = self.policy.model_drafts
                proposals = {
                    n: d.propose(req, max(K_CHOICES))
                    for n, d in self.policy.drafts.items()
                    if n not in model_drafts
                }
                available = {
                    n: min(len(proposals[n]) if n in proposals else MAX_DRAFT_TOKENS, room)
                    for n in self.policy.drafts
                }
                asked: set[str] = set()
                while True:
                    choice = self.policy.choose(
                        req,
                        base_tokens,
                        available=available,
                        step_yield_tokens=step_yield,
                        sequences=sequences,
                    )
                    if choice is None or choice[0] not in model_drafts or choice[0] in asked:
                        break
                    name, k = choice
                    proposals[name] = self._ask(self.policy.drafts[name], req, k)
                    asked.add(name)
                    available[name] = min(len(proposals[name]), room)
                    if len(proposals[name]) == k:
                        break
                    self.policy.observe_declined(req, name)
                if choice is None:
                    self.policy.shadow(req, proposals)
                    continue
                name, k = choice
                req.draft_token_ids = proposals[name][:k]
            if req.draft_token_ids:
                self._chosen[req.request_id] = name
                # the requests after this one share the step: they pay for these rows too
                drafted = len(req.draft_token_ids)
                room -= drafted
                base_tokens += drafted
                step_yield += expected_tokens(self.policy.acceptance(req, name), drafted) - 1.0

    def observe(
        self,
        requests: Mapping[str, Request],
        drafts: Mapping[str, int],
        accepted: Mapping[str, int],
        new_tokens: Mapping[str, list[int]],
        step: StepSize | None,
        run_ms: float,
    ) -> None:
        """After a step: ``drafts``/``accepted`` per verifying request, ``new_tokens`` per
        request that got tokens, ``step`` the step's size when it held decodes only."""
        if step is not None:
            self.costs.observe(step.tokens, run_ms, step.sequences)
        for rid, tokens in new_tokens.items():
            req = requests.get(rid)
            k = drafts.get(rid, 0)
            name = self._chosen.get(rid)
            if k and name is not None:
                got = accepted.get(rid, 0)
                self.stats.verify_steps += 1
                self.stats.draft_tokens += k
                self.stats.accepted_tokens += got
                p, a = self.stats.per_draft.get(name, (0, 0))
                self.stats.per_draft[name] = (p + k, a + got)
                self._last_draft[rid] = name
                if req is not None:
                    self.policy.observe(req, name, k, got)
            elif tokens:
                self.stats.plain_steps += 1
                if req is not None:
                    self.policy.observe_plain(req, tokens[0])

    def _ask(self, draft: Draft, request: Request, k: int) -> list[int]:
        """``draft.propose``; a draft that runs a model and fails is logged and proposes nothing
        for this request (it starts again from the next features), so one draft's failure never
        fails a step."""
        if draft.name not in self.policy.model_drafts:
            return draft.propose(request, k)
        try:
            return draft.propose(request, k)
        except Exception as exc:  # noqa: BLE001 - a draft is an optimisation, never a failure
            log.warning("draft %s failed for request %s: %s", draft.name, request.request_id, exc)
            draft.release(request.request_id)
            return []

    def add_features(self, features: Mapping[str, FeatureRows]) -> None:
        """Hand the target's features of this step's positions to the drafts that read them."""
        for name in self.policy.model_drafts:
            draft = self.policy.drafts[name]
            if not isinstance(draft, FeatureDraft):
                continue
            for rid, rows in features.items():
                try:
                    draft.add_features(rid, rows.start_position, rows.rows)
                except Exception as exc:  # noqa: BLE001 - as in _ask
                    log.warning("draft %s failed to take features of request %s: %s", name, rid, exc)
                    draft.release(rid)

    @property
    def wants_features(self) -> bool:
        """Whether any draft reads the target's features (the runner then keeps them)."""
        return bool(self.policy.model_drafts)

    def draft_used(self, request_id: str) -> str | None:
        return self._last_draft.get(request_id)

    def release(self, request: Request) -> None:
        self.policy.release(request)
        self._chosen.pop(request.request_id, None)
        self._last_draft.pop(request.request_id, None)
        for draft in self.policy.drafts.values():
            draft.release(request.request_id)
