"""Continuous batching at iteration level (vLLM v1 style). Imports no torch.

There are no prefill and decode phases. Every request has ``num_computed_tokens``; each step
hands out at most ``max_num_batched_tokens`` tokens of work, and a request that receives
its whole gap this step gets a token sampled. That one rule gives:

- chunked prefill: a long prompt takes several steps, ``budget`` tokens at a time;
- decode pacing: requests whose gap is one token (decodes) are served before partial
  prefills, so a long prompt arriving never stalls running streams;
- prefix hits: cached blocks simply start a request with ``num_computed_tokens > 0``;
- preemption: when blocks run out, the lowest-priority then newest running request gives
  back all its blocks and returns to the waiting queue with ``num_computed_tokens = 0``;
  it is recomputed later (mostly from its own still-cached blocks).

Deadlock freedom: a request whose worst case (prompt + max_tokens, or under importance
eviction what its KV budget lets it hold at once, ``SchedulerConfig.max_held_tokens``) cannot fit
in the whole pool is rejected in ``add_request``. Otherwise preemption always ends with the
oldest highest-priority request alone in the pool, where it fits.

Two policies (``SchedulerConfig.policy``):

- ``fcfs``: priority, then arrival. Requests' classes and SLOs are not read.
- ``slo``: waiting requests by priority; those already past their first-token deadline go
  behind the others, by class (voice, translation, dialogue, bulk), then deadline. Those still
  on time go by class, then deadline (``slo_waiting_order: class``, the default) or by deadline
  alone across classes (``edf``). Running decodes by ITL slack. With a ready
  ``StepTimeModel`` it plans steps to their tightest ITL objective less the model's overshoot,
  and (a) sizes each step's prefill tokens so that the running decodes' predicted step keeps
  that target (at least ``min_prefill_chunk_tokens`` where it can, so prompts advance; in steps
  that stay on the fused CPU path where one can, else on the Python layers; with no limit for a
  first token that would be late, but only while every running stream has a late gap to spare
  at its ITL percentile), and (b) admits a new request only while the predicted step with one
  more row and a prompt chunk keeps the target, so those running keep their SLO instead of all
  missing it together. A waiting request may preempt a running one of a strictly lower class
  (for blocks; for a row only bulk work or a request that has not streamed yet or already lost
  its SLO); that can only move work to lower classes, and a request preempted so sits out the
  rest of that step, so it cannot cycle. Late requests going behind is what sheds an overload
  instead of making everyone late; EDF among the others is what meets the most deadlines while
  they can be met.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from edge_rtgi.errors import EngineBusy, RequestError
from edge_rtgi.llm.kv.eviction import KVEviction
from edge_rtgi.llm.kv.manager import KVCacheManager
from edge_rtgi.llm.request import Request, RequestClass, RequestStatus, TokenLogprob
from edge_rtgi.llm.step_model import StepShape, StepTimeModel

POLICIES = ("fcfs", "slo")
# slo: how waiting requests are ordered. "class" (the default, measured in docs/benchmarks.md): by
# class, then deadline, late ones behind; "edf": by first-token deadline across classes while on
# time, late ones behind by class (not yet shown better: scripts/bench_slo_order.py compares them).
WAITING_ORDERS = ("edf", "class")
# Steps (prefill beside running decodes, and the rows admitted) are planned to this many of the
# tightest ITL objective, less the step model's overshoot (``_step_target_ms``). One: a short
# reply's ITL p95 is about its longest gap, so a longer step is a miss for every stream in it
# (2 was measured worse than no sizing at all: docs/benchmarks.md).
PREFILL_STALL_FACTOR = 1.0


def chunk_row_keys(num_tokens: int, start_position: int) -> int:
    """Keys a prompt chunk reads when each of its tokens runs as a row of its own (row i attends
    to positions 0..start + i): what bounds chunks run as fused rows (``runner.CHUNK_ROWS_MAX_KEYS``)."""
    return num_tokens * (2 * start_position + num_tokens + 1) // 2


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. ``max_model_len`` is the context window in tokens.

    ``kv_budget_tokens`` with ``kv_eviction`` (the engine's importance eviction, set together):
    admission counts what a request can hold at once under its budget, not its whole length.
    """

    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    min_prefill_chunk_tokens: int = 16
    # slo admission: refuse a dialogue or bulk request whose estimated queue wait exceeds this
    # many times its TTFT SLO (0: never refuse); voice and translation are never refused
    admission_wait_factor: float = 4.0
    slo_waiting_order: str = "class"
    kv_budget_tokens: int | None = None
    kv_eviction: KVEviction | None = None
    # The runner's fused CPU decode path (0: none), which the slo policy's step sizing predicts
    # apart from the Python layers: decode steps of up to fused_decode_rows rows, and steps with
    # prompt chunks of up to fused_step_tokens tokens whose chunks read at most
    # fused_chunk_max_keys keys (each chunk token runs as a row over its whole context).
    fused_decode_rows: int = 0
    fused_step_tokens: int = 0
    fused_chunk_max_keys: int = 0

    def __post_init__(self) -> None:
        if (self.kv_budget_tokens is None) != (self.kv_eviction is None):
            raise ValueError("kv_budget_tokens and kv_eviction go together: set both or neither")
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens must be >= 1, got {self.kv_budget_tokens}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1, max_model_len >= 2")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.min_prefill_chunk_tokens < 1:
            raise ValueError(f"min_prefill_chunk_tokens must be >= 1, got {self.min_prefill_chunk_tokens}")
        if min(self.fused_decode_rows, self.fused_step_tokens, self.fused_chunk_max_keys) < 0:
            raise ValueError("fused_decode_rows, fused_step_tokens and fused_chunk_max_keys must be >= 0")
        if not self.admission_wait_factor >= 0:
            raise ValueError(f"admission_wait_factor must be >= 0, got {self.admission_wait_factor}")
        if self.slo_waiting_order not in WAITING_ORDERS:
            orders = ", ".join(WAITING_ORDERS)
            raise ValueError(f"slo_waiting_order must be one of {orders}, got {self.slo_waiting_order!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Otherwise a long prompt could never be scheduled in one piece.
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )

    def max_held_tokens(self, num_prompt_tokens: int, num_total_tokens: int) -> int:
        """Most tokens a request of ``num_prompt_tokens`` that may reach ``num_total_tokens``
        holds in the KV cache at once.

        Without eviction: all of them. Under a budget, the engine trims a request after every
        step in which it passed the budget, so between steps it holds at most the budget and
        during a step one step's tokens more. Scores from every query (h2o) trim during
        prefill too; observation scores (snapkv, segment) hold the prompt whole until its last
        queries have scored it, and a recompute after preemption may carry one chunk past the
        prompt before the first trim (``LLMEngine._evict``).
        """
        budget, policy = self.kv_budget_tokens, self.kv_eviction
        if budget is None or policy is None:
            return num_total_tokens
        step = self.max_num_batched_tokens
        held = budget + step if policy.scores_every_query() else max(budget, num_prompt_tokens) + step
        return min(num_total_tokens, held)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: feed ``token_ids`` at ``start_position`` onwards."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[list[int]]  # per KV group, the whole table after allocation; -1 = released block
    sample: bool  # True when this chunk reaches the end of the known tokens
    # the last ``num_draft_tokens`` of ``token_ids`` are draft tokens to verify (speculation)
    num_draft_tokens: int = 0
    # tokens evicted before this step (kv.eviction): the chunk's first token goes to cache
    # index ``start_position - num_evicted_tokens``, while RoPE still sees ``start_position``
    num_evicted_tokens: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """What the runner executes this step."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the runner hands back: a token per sampling request, or that request's error, and
    the sampled token's log-probability for requests that asked for it."""

    sampled_token_ids: dict[str, int]
    errors: dict[str, str] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # requests that verified drafts: how many of their draft tokens were accepted (the sampled
    # token then follows the accepted drafts)
    num_accepted: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestUpdate:
    """What changed for one request in a step (the engine turns it into a stream delta)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


def _serve_key(req: Request) -> tuple[float, ...]:
    # Higher priority first, then first come first served.
    return (-req.priority, req.arrival_time_s)


def _victim_key(req: Request) -> tuple[float, ...]:
    # min() picks the lowest priority, then the newest arrival.
    return (req.priority, -req.arrival_time_s)


def _slo_serve_key(req: Request, now_s: float) -> tuple[float, ...]:
    # Priority; then, while a request can still make its first-token deadline, that deadline
    # alone (EDF across classes: the order that meets the most deadlines while they can be met);
    # a late one goes behind them all, by class, then deadline (under overload the class decides
    # who is served late). A stream preempted after its first token is judged by that deadline
    # too, so it goes behind the fresh requests it was preempted for instead of taking its row
    # back at once.
    deadline_s = req.ttft_deadline_s
    if deadline_s >= now_s:
        return (0, -req.priority, deadline_s, req.arrival_time_s)
    return (1, -req.priority, -req.request_class.rank, deadline_s, req.arrival_time_s)


def _slo_class_serve_key(req: Request, now_s: float) -> tuple[float, ...]:
    # slo_waiting_order: class. Late ones behind; then priority, class, deadline (EDF within a class).
    deadline_s = req.ttft_deadline_s
    return (deadline_s < now_s, -req.priority, -req.request_class.rank, deadline_s, req.arrival_time_s)


def _fcfs_serve_key(req: Request, now_s: float) -> tuple[float, ...]:
    return _serve_key(req)


def _slo_victim_key(req: Request) -> tuple[float, ...]:
    # min() picks the lowest priority, then the lowest class, then the newest arrival.
    return (req.priority, req.request_class.rank, -req.arrival_time_s)


class _PrefillAllowance:
    """Prefill tokens left in this step (None: no limit)."""

    def __init__(self, tokens: int | None):
        self.left = tokens

    def take(self, wanted: int) -> int:
        if self.left is None:
            return wanted
        n = min(wanted, self.left)
        self.left -= n
        return n

    def give_back(self, n: int) -> None:
        if self.left is not None:
            self.left += n


def _is_decode(req: Request) -> bool:
    return req.num_tokens - req.num_computed_tokens == 1


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    ``step_model`` (the engine's, fed with measured steps) lets the ``slo`` policy size steps;
    ``clock`` gives monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        step_model: StepTimeModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.kv = kv
        self.step_model = step_model
        self.clock = clock
        self.slo = config.policy == "slo"
        if not self.slo:
            self._key = _fcfs_serve_key
        elif config.slo_waiting_order == "class":
            self._key = _slo_class_serve_key
        else:
            self._key = _slo_serve_key
        self._victim = _slo_victim_key if self.slo else _victim_key
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by self._key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_lifts_held = 0  # prefill caps kept for running streams with no late gap to spare
        self.num_row_deferrals = 0  # admissions held back to keep running decodes in their ITL SLO
        self.num_prefix_waits = 0  # admissions put off a step to reuse a prefix another is computing
        self.num_refused_busy = 0
        self.num_draft_tokens = 0  # speculation: draft tokens verified, and accepted
        self.num_accepted_draft_tokens = 0

    # --- intake ----------------------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Raise RequestError when the request could never run, naming the sizes."""
        cfg, kv = self.config, self.kv
        if request.num_prompt_tokens == 0:
            raise RequestError("the prompt is empty", hint="send at least one token")
        if request.num_prompt_tokens >= cfg.max_model_len:
            raise RequestError(
                f"the prompt is {request.num_prompt_tokens} tokens but the context window is "
                f"{cfg.max_model_len} tokens (at least one token must be generated)",
                hint="shorten the prompt",
            )
        worst_tokens = min(request.max_total_tokens, cfg.max_model_len)
        held_tokens = cfg.max_held_tokens(request.num_prompt_tokens, worst_tokens)
        worst_blocks = kv.max_blocks_for(held_tokens, cfg.max_num_batched_tokens)
        if worst_blocks <= kv.num_blocks:
            return
        pool = f"the pool holds {kv.num_blocks} blocks ({kv.num_blocks * kv.block_size} tokens)"
        blocks = f"{worst_blocks} blocks of {kv.block_size} over {kv.num_groups} KV group(s)"
        if held_tokens == worst_tokens:
            raise RequestError(
                f"request needs up to {worst_tokens} tokens of KV cache ({blocks}) but {pool}",
                hint="lower max_tokens, shorten the prompt, or give the engine more kv blocks",
            )
        policy = cfg.kv_eviction
        assert policy is not None and cfg.kv_budget_tokens is not None  # held < worst only under a budget
        if policy.scores_every_query() or request.num_prompt_tokens <= cfg.kv_budget_tokens:
            what = (
                f"kv_budget_tokens {cfg.kv_budget_tokens} plus one step's "
                f"{cfg.max_num_batched_tokens} tokens (max_num_batched_tokens)"
            )
            hint = "lower kv_budget_tokens or max_num_batched_tokens, or give the engine more kv blocks"
        else:
            what = (
                f"its {request.num_prompt_tokens}-token prompt, held whole until kv_eviction "
                f"{policy.mode} scores it, plus one step's {cfg.max_num_batched_tokens} tokens"
            )
            hint = (
                "shorten the prompt, use kv_eviction mode h2o (it trims during prefill), "
                "or give the engine more kv blocks"
            )
        raise RequestError(
            f"request holds up to {held_tokens} tokens of KV cache under eviction ({what}; "
            f"{blocks}) but {pool}",
            hint=hint,
        )

    def check_admission(self, request: Request) -> None:
        """Under ``slo``, raise EngineBusy for a dialogue or bulk request that would wait longer
        than ``admission_wait_factor`` times its TTFT SLO: the prompt work queued ahead of it (at
        its class or above) at the step-time model's cost per prefill token. A capacity estimate:
        the rate requests happen to finish at says nothing about an engine that is not full.
        Voice and translation always queue."""
        factor = self.config.admission_wait_factor
        model = self.step_model
        if (
            not self.slo
            or not request.may_refuse
            or factor == 0
            or request.request_class.rank > RequestClass.DIALOGUE.rank
            or model is None
            or not model.ready
        ):
            return
        rank = request.request_class.rank
        ahead = [r for r in self.waiting if r.request_class.rank >= rank]
        tokens = sum(r.num_tokens - r.num_computed_tokens for r in ahead) + request.num_prompt_tokens
        wait_ms = tokens * model.marginal_ms("per_prefill_token")
        if wait_ms > factor * request.objective.ttft_ms:
            self.num_refused_busy += 1
            raise EngineBusy(
                f"busy: {len(ahead)} requests ({tokens} prompt tokens with this one) are queued ahead "
                f"of this {request.request_class.value} request, an estimated {wait_ms / 1e3:.1f} s "
                f"against its {request.objective.ttft_ms:.0f} ms time-to-first-token objective",
                retry_after_ms=wait_ms,
            )

    def add_request(self, request: Request) -> None:
        """Queue a request (raises RequestError if it can never fit, EngineBusy if refused)."""
        if request.request_id in self.requests:
            raise RequestError(f"duplicate request id {request.request_id!r}")
        self.check_fits(request)
        self.check_admission(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        now = self.clock()
        keys = [self._key(r, now) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._key(request, now)), request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (decodes before chunks), then admissions."""
        budget = self.config.max_num_batched_tokens
        num_new: dict[str, int] = {}
        preempted: list[Request] = []
        now = self.clock()
        if self.slo:  # the order moves with the clock as requests become late
            self.waiting.sort(key=lambda r: self._key(r, now))
        prefill = _PrefillAllowance(self._prefill_allowance(now))
        budget = self._schedule_running(budget, num_new, preempted, now, prefill)
        if not preempted:  # after a preemption, blocks are scarce: admit nobody this step
            self._schedule_waiting(budget, num_new, preempted, prefill)
        scheduled = []
        for req in self.running:
            n = num_new.get(req.request_id)
            if n is None:
                req.draft_token_ids.clear()
                continue
            start = req.num_computed_tokens
            drafts = max(0, start + n - req.num_tokens)  # what reaches past the known tokens
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids[start : start + n - drafts] + req.draft_token_ids[:drafts],
                    start_position=start,
                    block_ids=self.kv.block_ids(req.request_id),
                    sample=start + n - drafts == req.num_tokens,
                    num_draft_tokens=drafts,
                    num_evicted_tokens=req.num_evicted_tokens,
                )
            )
        return SchedulerOutput(scheduled, sum(num_new.values()), [r.request_id for r in preempted])

    def _running_order(self, now: float) -> list[Request]:
        if self.slo:  # decodes first, the one closest to missing its next token first
            return sorted(
                self.running,
                key=lambda r: (not _is_decode(r), r.itl_slack_s(now), -r.priority, -r.request_class.rank),
            )
        return sorted(self.running, key=lambda r: (not _is_decode(r), *_serve_key(r)))

    def _schedule_running(
        self,
        budget: int,
        num_new: dict[str, int],
        preempted: list[Request],
        now: float,
        prefill: _PrefillAllowance,
    ) -> int:
        # every decode gets its one token before any gets draft tokens to verify
        decodes_left = sum(1 for r in self.running if _is_decode(r))
        for req in self._running_order(now):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted a moment ago to make room for an earlier one
            gap = req.num_tokens - req.num_computed_tokens
            if gap == 1:
                decodes_left -= 1
                self._cap_drafts(req, budget - 1 - decodes_left)
                n = 1 + len(req.draft_token_ids)
            else:
                req.draft_token_ids.clear()
                n = prefill.take(min(gap, budget))
            if n == 0:
                continue
            if n > 1 and req.draft_token_ids and not self.kv.allocate_slots(req, n):
                req.draft_token_ids.clear()  # no blocks to spare: verify nothing rather than preempt
                n = 1
            while not self.kv.allocate_slots(req, n):
                victim = min((r for r in self.running if r.status is RequestStatus.RUNNING), key=self._victim)
                self._preempt(victim)
                preempted.append(victim)
                budget += num_new.pop(victim.request_id, 0)
                if victim is req:
                    break
            else:
                num_new[req.request_id] = n
                budget -= n
        return budget

    def _schedule_waiting(
        self, budget: int, num_new: dict[str, int], preempted: list[Request], prefill: _PrefillAllowance
    ) -> None:
        # requests passed over this step because another one computes their next prefix block
        # (under eviction blocks stop being cached, so there is nothing to wait for)
        waits_for_prefix: list[Request] = []
        share_prefixes = self.config.kv_eviction is None
        while budget > 0 and len(self.running) + len(waits_for_prefix) < self.config.max_num_seqs:
            # a request preempted for another in this step sits it out (it could sort ahead of
            # the one it made room for, which would preempt it again)
            req = next((r for r in self.waiting if r not in preempted and r not in waits_for_prefix), None)
            if req is None:
                break
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = hits.num_tokens
            if share_prefixes and self.kv.prefix_in_flight(
                req, num_hit_tokens, (r for r in self.running if r.request_id in num_new)
            ):
                # checked before the slo row test, which may preempt a lower class for it
                waits_for_prefix.append(req)
                self.num_prefix_waits += 1
                continue
            if self.slo and not self._row_fits(req):
                if self._preempt_lower_class(req, num_new, preempted, for_row=True):
                    budget = self._budget_left(num_new)
                    continue
                self.num_row_deferrals += 1
                break
            n = req.num_tokens - num_hit_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = prefill.take(min(n, budget))
            if n == 0:
                break
            if not self.kv.allocate_slots(req, n, hits):
                prefill.give_back(n)
                if self.slo and self._preempt_lower_class(req, num_new, preempted):
                    budget = self._budget_left(num_new)
                    continue
                break  # strict priority order: no overtaking by smaller requests
            self.waiting.remove(req)
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.num_cached_tokens < 0:  # first admission, not a recompute after preemption
                req.num_cached_tokens = num_hit_tokens
                self.kv.record_prefix_lookup(req.num_prompt_tokens, num_hit_tokens)
            num_new[req.request_id] = n
            budget -= n

    def _cap_drafts(self, req: Request, spare_tokens: int) -> None:
        """Cut a decode's draft to the step's spare budget, to what its ``max_tokens`` can still
        use (the bonus token always comes on top) and to the context window."""
        room = min(
            spare_tokens,
            req.max_tokens - req.num_output_tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        del req.draft_token_ids[max(0, room) :]

    def _budget_left(self, num_new: dict[str, int]) -> int:
        """The step's token budget not yet handed out (after a preemption took some back)."""
        return self.config.max_num_batched_tokens - sum(num_new.values())

    # --- the slo policy's step sizing --------------------------------------------------------

    def _python_layers(self, rows: int, prefill: int) -> bool:
        """Whether a step of ``rows`` one-token rows and ``prefill`` chunk tokens would run on
        the Python layers (the chunk keys aside: ``_fused_chunk_tokens``)."""
        if prefill == 0:
            return rows > self.config.fused_decode_rows
        return rows + prefill > self.config.fused_step_tokens

    def _fused_chunk_tokens(self, room: int) -> int:
        """How many of ``room`` prompt tokens the next prompt in line can take in a step that
        stays on the fused path: its chunk's rows each read the context up to themselves, so
        past a short context fewer do (``fused_chunk_max_keys``)."""
        running = [r for r in self.running if not _is_decode(r) and r.status is RequestStatus.RUNNING]
        if running:
            start = min(running, key=lambda r: r.num_computed_tokens).num_computed_tokens
        elif self.waiting:
            start = self.kv.get_computed_blocks(self.waiting[0]).num_tokens
        else:
            return room
        limit = self.config.fused_chunk_max_keys
        while room > 0 and chunk_row_keys(room, start) > limit:
            room -= 1
        return room

    def _prefill_allowance(self, now: float) -> int | None:
        """Prefill tokens this step may carry so that the running decodes' step keeps the target
        of ``_step_target_ms`` (None: no limit, under ``fcfs``, with no decode running, a model
        still learning, or a prompt whose first token is due before it could be prefilled at that
        pace while every running stream has a late gap to spare: TTFT comes first then).

        First as many tokens as keep the step on the fused path, where at least
        ``min_prefill_chunk_tokens`` do and that step keeps the target: at these sizes it costs
        less per prompt token than the Python layers, and it stays well inside the target where a
        Python-layer step is sized to end right at it (so a prediction a few ms short is a miss).
        Else, since a step on the Python layers pays their fixed cost whatever it carries, as
        many tokens as keep such a step within the target, where at least that many do; else no
        limit if the streams can take a late gap (one step that misses the target beats several
        that each miss it), or the fused size that keeps it, however small (0: the prompts wait
        for a decode to end)."""
        model = self.step_model
        if not self.slo or model is None or not model.ready:
            return None
        decodes = [r for r in self.running if _is_decode(r) and r.last_token_time_s is not None]
        per_token_ms = model.marginal_ms("per_prefill_token")
        if not decodes or per_token_ms <= 0.0:
            return None
        itl_ms = min(r.objective.itl_ms for r in decodes)
        # a decode verifying drafts runs as one row per token
        rows = sum(1 + len(r.draft_token_ids) for r in decodes)
        context = sum(r.num_tokens for r in decodes)

        def predict(prefill: int, python: bool) -> float:
            return model.predict_ms(StepShape(rows, prefill, context, python)) or 0.0

        if predict(0, self._python_layers(rows, 0)) > itl_ms:
            # the decodes miss their ITL with no prefill at all (a machine slowed by other work):
            # holding prompts back cannot save them and would only starve every first token
            return None
        target_ms = self._step_target_ms(itl_ms, model)
        floor = self.config.min_prefill_chunk_tokens
        # the fused path's room, cut to what keeps the target there
        fused = self._fused_chunk_tokens(self.config.fused_step_tokens - rows)
        fused = max(0, min(fused, int((target_ms - predict(0, False)) / per_token_ms)))
        python = int((target_ms - predict(0, True)) / per_token_ms)
        # (tokens, predicted ms) of each step size that carries enough and keeps the target
        sizes = [(fused, predict(fused, False)), (python, predict(python, True))]
        sizes = [(n, ms) for n, ms in sizes if n >= floor and ms <= target_ms]
        # a first token that would be late at one size may be on time at the other (a Python-layer
        # step under a loose objective carries more per ms); only when it is late at every size
        # is the cap lifted. Only a first token that can still be on time lifts it: under
        # overload a late one would only take the running streams down with it.
        first_tokens = []  # (prompt tokens left, ms until the first token is due)
        # a waiting prompt that no row would be given this step cannot use a lifted cap: they are
        # admitted in order until one does not fit
        admissible: list[Request] = []
        for r in self.waiting[: min(4, self.config.max_num_seqs - len(self.running))]:
            if not self._row_fits(r):
                break
            admissible.append(r)
        for r in (*self.running, *admissible):
            left = r.num_tokens - r.num_computed_tokens
            if r.last_token_time_s is None and left > 1 and r.ttft_deadline_s > now:
                first_tokens.append((left, (r.ttft_deadline_s - now) * 1e3))
        for room, step_ms in sizes:
            # ceil(left / room): steps the prompt needs at this pace
            if all(slack_ms >= -(-left // room) * step_ms for left, slack_ms in first_tokens):
                return room
        # Lifting the cap makes every running stream's next gap late. While a stream's ITL
        # percentile has no late gap to spare (and its objective is not lost already), the lift
        # would trade its objective for one first token (under overload, a lift for every arrival
        # makes every stream miss): the prompts go on at the pace that keeps the target, at worst
        # waiting for a decode to end.
        window = self.config.max_model_len
        if all(r.can_take_late_gap(window) or r.missed_objective(window) for r in decodes):
            return None
        if first_tokens:
            self.num_lifts_held += 1
        return max((n for n, _ in sizes), default=fused)

    def _row_fits(self, req: Request) -> bool:
        """Whether one more decoding request keeps the predicted step within the tightest ITL SLO
        of those running and of ``req`` (planned to ``_step_target_ms``), with room left in that
        step for a prompt chunk of ``min_prefill_chunk_tokens`` (so later prompts still advance
        without a stall). Holds also when the rows running already miss it: a newcomer would only
        deepen their miss, and the rows drain. Always true with nothing running, and where a
        single row and a chunk miss the target (a machine slowed by other work, or a model whose
        margin has grown past the objective): holding rows back could not bring anyone within it."""
        model = self.step_model
        rows = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if model is None or not model.ready or not rows:
            return True
        target_ms = self._step_target_ms(min(r.objective.itl_ms for r in (*rows, req)), model)
        context, n = sum(r.num_tokens for r in rows) + req.num_tokens, len(rows) + 1
        chunk = self.config.min_prefill_chunk_tokens
        one = StepShape(1, chunk, context // n, self._python_layers(1, chunk))
        if (model.predict_ms(one) or 0.0) > target_ms:
            return True  # not even one row keeps the target: holding rows back would save no one
        n += sum(len(r.draft_token_ids) for r in rows)  # a decode verifying drafts: a row per token
        wider = StepShape(n, chunk, context, self._python_layers(n, chunk))
        return (model.predict_ms(wider) or 0.0) <= target_ms

    @staticmethod
    def _step_target_ms(itl_ms: float, model: StepTimeModel) -> float:
        """The run time a step is planned to: ``PREFILL_STALL_FACTOR`` times the ITL objective,
        less the model's overshoot (how far steps run past their prediction, 97 times in 100),
        so that a step planned to it keeps the objective; never below half the objective."""
        return max(PREFILL_STALL_FACTOR * itl_ms - model.overshoot_ms(), 0.5 * itl_ms)

    def _preempt_lower_class(
        self, req: Request, num_new: dict[str, int], preempted: list[Request], for_row: bool = False
    ) -> bool:
        """Preempt the least urgent running request of a strictly lower class than ``req``. For a
        row (not for blocks) an interactive one only if it has not streamed yet or has already
        lost its SLO: a stream paused for a recompute misses its ITL objective, so preempting an
        on-time one would trade one request's objective for another's. Bulk work always yields."""
        lower = [
            r
            for r in self.running
            if r.status is RequestStatus.RUNNING
            and r.request_class.rank < req.request_class.rank
            and (
                not for_row
                or r.request_class is RequestClass.BULK
                or r.first_token_time_s is None
                or r.missed_objective(self.config.max_model_len)
            )
        ]
        if not lower:
            return False
        victim = min(lower, key=self._victim)
        self._preempt(victim)
        preempted.append(victim)
        num_new.pop(victim.request_id, None)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft_token_ids.clear()
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_evicted_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(req)

    # --- results ---------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish stopped or failed requests."""
        updates = []
        for sr in output.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            req.draft_token_ids.clear()
            k = sr.num_draft_tokens
            accepted = min(result.num_accepted.get(sr.request_id, 0), k)
            # rejected drafts' keys and values were written but are not part of the sequence
            req.num_computed_tokens += len(sr.token_ids) - k + accepted
            error = result.errors.get(sr.request_id)
            if error is not None:
                updates.append(self.finish_request(sr.request_id, RequestStatus.FINISHED_ERROR, error))
                continue
            if k:
                req.num_draft_tokens += k
                req.num_accepted_draft_tokens += accepted
                self.num_draft_tokens += k
                self.num_accepted_draft_tokens += accepted
                if accepted < k:
                    self.kv.truncate(req)
            self.kv.cache_computed_blocks(req)
            self.kv.release_outside_windows(req)  # groups with a window only
            if not sr.sample:
                continue
            new_tokens = []
            for token in (
                *sr.token_ids[len(sr.token_ids) - k :][:accepted],
                result.sampled_token_ids[sr.request_id],
            ):
                req.append_output_token(token)
                new_tokens.append(token)
                status = self._stop_status(req, token)
                if status is not None:
                    self._finish(req, status)
                    break
            now = self.clock()
            last = req.last_token_time_s
            if last is None:
                req.first_token_time_s = now
            elif (now - last) * 1e3 > req.objective.itl_ms:
                req.num_late_gaps += 1
            req.last_token_time_s = now
            updates.append(RequestUpdate(sr.request_id, new_tokens, req.status.finish_reason))
        return updates

    def over_kv_budget(self, budget_tokens: int) -> list[Request]:
        """Running requests whose KV cache holds more than ``budget_tokens`` (kv.eviction)."""
        return [r for r in self.running if r.num_kv_tokens > budget_tokens]

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        if token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> RequestUpdate:
        """End a request from outside (abort, stop string, error) and free its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return RequestUpdate(request_id, [], status.finish_reason, error)
        if not req.is_finished:
            req.error = error
            self._finish(req, status)
        return RequestUpdate(request_id, [], req.status.finish_reason, req.error)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[RequestUpdate]:
        return [self.finish_request(rid, status) for rid in list(request_ids)]

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        del self.requests[req.request_id]
