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

Deadlock freedom: a request whose worst case (prompt + max_tokens) cannot fit in the whole
pool is rejected in ``add_request``. Otherwise preemption always ends with the oldest
highest-priority request alone in the pool, where it fits.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from edge_rtgi.errors import RequestError
from edge_rtgi.llm.kv.manager import KVCacheManager
from edge_rtgi.llm.request import Request, RequestStatus, TokenLogprob


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. ``max_model_len`` is the context window in tokens."""

    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1, max_model_len >= 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Otherwise a long prompt could never be scheduled in one piece.
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: feed ``token_ids`` at ``start_position`` onwards."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[list[int]]  # per KV group, the whole table after allocation; -1 = released block
    sample: bool  # True when this chunk reaches the end of the known tokens


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


@dataclass(frozen=True)
class RequestUpdate:
    """What changed for one request in a step (the engine turns it into a stream delta)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


def _serve_key(req: Request) -> tuple[int, float]:
    # Higher priority first, then first come first served.
    return (-req.priority, req.arrival_time_s)


def _victim_key(req: Request) -> tuple[int, float]:
    # min() picks the lowest priority, then the newest arrival.
    return (req.priority, -req.arrival_time_s)


class Scheduler:
    """Decides, each step, which requests compute how many tokens."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by _serve_key
        self.running: list[Request] = []
        self.num_preemptions = 0

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
        worst_blocks = kv.max_blocks_for(worst_tokens, cfg.max_num_batched_tokens)
        if worst_blocks > kv.num_blocks:
            raise RequestError(
                f"request needs up to {worst_tokens} tokens of KV cache ({worst_blocks} blocks of "
                f"{kv.block_size} over {kv.num_groups} KV group(s)) but the pool holds "
                f"{kv.num_blocks} blocks "
                f"({kv.num_blocks * kv.block_size} tokens)",
                hint="lower max_tokens, shorten the prompt, or give the engine more kv blocks",
            )

    def add_request(self, request: Request) -> None:
        """Queue a request (raises RequestError if it can never fit)."""
        if request.request_id in self.requests:
            raise RequestError(f"duplicate request id {request.request_id!r}")
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        keys = [_serve_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _serve_key(request)), request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (decodes before chunks), then admissions."""
        budget = self.config.max_num_batched_tokens
        num_new: dict[str, int] = {}
        preempted: list[Request] = []
        budget = self._schedule_running(budget, num_new, preempted)
        if not preempted:  # after a preemption, blocks are scarce: admit nobody this step
            self._schedule_waiting(budget, num_new)
        scheduled = []
        for req in self.running:
            n = num_new.get(req.request_id)
            if n is None:
                continue
            start = req.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids[start : start + n],
                    start_position=start,
                    block_ids=self.kv.block_ids(req.request_id),
                    sample=start + n == req.num_tokens,
                )
            )
        return SchedulerOutput(scheduled, sum(num_new.values()), [r.request_id for r in preempted])

    def _schedule_running(self, budget: int, num_new: dict[str, int], preempted: list[Request]) -> int:
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, *_serve_key(r)))
        for req in order:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted a moment ago to make room for an earlier one
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = min((r for r in self.running if r.status is RequestStatus.RUNNING), key=_victim_key)
                self._preempt(victim)
                preempted.append(victim)
                budget += num_new.pop(victim.request_id, 0)
                if victim is req:
                    break
            else:
                num_new[req.request_id] = n
                budget -= n
        return budget

    def _schedule_waiting(self, budget: int, num_new: dict[str, int]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = hits.num_tokens
            n = req.num_tokens - num_hit_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break  # strict priority order: no overtaking by smaller requests
            self.waiting.pop(0)
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.num_cached_tokens < 0:  # first admission, not a recompute after preemption
                req.num_cached_tokens = num_hit_tokens
                self.kv.record_prefix_lookup(req.num_prompt_tokens, num_hit_tokens)
            num_new[req.request_id] = n
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
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
            req.num_computed_tokens += len(sr.token_ids)
            error = result.errors.get(sr.request_id)
            if error is not None:
                updates.append(self.finish_request(sr.request_id, RequestStatus.FINISHED_ERROR, error))
                continue
            self.kv.cache_computed_blocks(req)
            self.kv.release_outside_windows(req)  # groups with a window only
            if not sr.sample:
                continue
            token = result.sampled_token_ids[sr.request_id]
            req.append_output_token(token)
            status = self._stop_status(req, token)
            if status is not None:
                self._finish(req, status)
            updates.append(RequestUpdate(sr.request_id, [token], req.status.finish_reason))
        return updates

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
