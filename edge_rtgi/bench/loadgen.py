"""Seeded, bounded load generation against any streaming target.

Open loop (``poisson``, ``burst``): the arrival schedule is fixed in advance from the seed,
and latency is measured from each request's *scheduled* arrival time, so a target that falls
behind is charged for the queueing it causes (no coordinated omission). Closed loop
(``closed``): ``concurrency`` clients each send a request, wait for it to finish, think for
``think_time_s`` and send the next. A ramp runs open-loop Poisson stages at rising rates to
find the saturation point.

Every run is bounded: at most ``num_requests`` requests, no arrival after ``max_duration_s``,
and any request still streaming at ``max_duration_s + drain_timeout_s`` is cancelled and
counted as failed. Which prompt each request carries is drawn from the same seed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from edge_rtgi.bench.metrics import SLO, PeakSampler, RequestTrace, RunMetrics, summarise

PATTERNS = ("poisson", "burst", "closed")


@dataclass(frozen=True)
class LoadSpec:
    """How requests arrive. Rates are requests per second; times are seconds."""

    pattern: str = "poisson"
    rate_rps: float = 1.0
    num_requests: int = 16
    max_duration_s: float = 60.0
    drain_timeout_s: float = 60.0
    burst_size: int = 4
    concurrency: int = 4
    think_time_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown load pattern {self.pattern!r}; choose from {', '.join(PATTERNS)}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.pattern != "closed" and not self.rate_rps > 0:
            raise ValueError(f"rate_rps must be > 0 for {self.pattern} arrivals, got {self.rate_rps}")
        if self.max_duration_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("max_duration_s must be > 0 and drain_timeout_s >= 0")
        if self.burst_size < 1 or self.concurrency < 1 or self.think_time_s < 0:
            raise ValueError("burst_size and concurrency must be >= 1 and think_time_s >= 0")


def arrival_times_s(spec: LoadSpec) -> list[float]:
    """Open-loop send times (seconds from the start), deterministic in ``spec.seed``.

    The first request goes at t=0. ``poisson``: exponential gaps with mean ``1/rate_rps``.
    ``burst``: bursts of ``burst_size`` simultaneous requests whose start times form a Poisson
    process of rate ``rate_rps / burst_size`` (same mean request rate). Arrivals at or after
    ``max_duration_s`` are dropped.
    """
    if spec.pattern == "closed":
        raise ValueError("closed-loop load has no arrival schedule")
    rng = random.Random(spec.seed)
    times: list[float] = []
    t = 0.0
    if spec.pattern == "poisson":
        while len(times) < spec.num_requests and t < spec.max_duration_s:
            times.append(t)
            t += rng.expovariate(spec.rate_rps)
    else:
        burst_rate = spec.rate_rps / spec.burst_size
        while len(times) < spec.num_requests and t < spec.max_duration_s:
            times.extend([t] * min(spec.burst_size, spec.num_requests - len(times)))
            t += rng.expovariate(burst_rate)
    return times


def request_order(num_items: int, num_requests: int, seed: int) -> list[int]:
    """Which item each request carries: seeded shuffles of all items, repeated as needed."""
    rng = random.Random(seed * 7919 + 17)
    order: list[int] = []
    while len(order) < num_requests:
        epoch = list(range(num_items))
        rng.shuffle(epoch)
        order.extend(epoch)
    return order[:num_requests]


# --- Targets ------------------------------------------------------------------------------------


@dataclass
class Chunk:
    """Tokens streamed back for one request; the last chunk of a request has ``finished``."""

    num_tokens: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class Target(Protocol):
    """Anything the load generator can drive: the engine in-process, a peer, or the daemon."""

    name: str

    def stream(self, request: Any) -> AsyncIterator[Chunk]:
        """Send ``request`` (a ``PreparedRequest``) and stream its chunks."""
        ...

    def kv_blocks_in_use(self) -> int | None:
        """KV blocks in use right now, or None where the target has no such gauge."""
        ...

    def kv_blocks_total(self) -> int | None: ...


@dataclass
class LoadResult:
    """Traces of one run plus what was offered and what was sampled alongside it."""

    target: str
    workload: str
    spec: LoadSpec
    traces: list[RequestTrace]
    wall_s: float
    peak_rss_mb: float
    kv_blocks_peak: int | None
    kv_blocks_total: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def offered_rps(self) -> float | None:
        return None if self.spec.pattern == "closed" else self.spec.rate_rps

    def metrics(self, slo: SLO) -> RunMetrics:
        return summarise(
            self.traces,
            slo,
            offered_rps=self.offered_rps,
            peak_rss_mb=self.peak_rss_mb,
            kv_blocks_peak=self.kv_blocks_peak,
            kv_blocks_total=self.kv_blocks_total,
        )


async def _drive_one(target: Target, request: Any, trace: RequestTrace, clock: Callable[[], float]) -> None:
    try:
        async for chunk in target.stream(request):
            now = clock()
            trace.add_chunk(now, chunk.num_tokens)
            trace.text += chunk.text
            trace.token_ids.extend(chunk.token_ids)
            if chunk.prompt_tokens is not None:
                trace.prompt_tokens = chunk.prompt_tokens
            if chunk.cached_tokens is not None:
                trace.cached_tokens = chunk.cached_tokens
            if chunk.finished:
                trace.finish_reason = chunk.finish_reason
        trace.end_s = clock()
        if trace.finish_reason == "error":
            trace.error = "the target reported an error"
    except asyncio.CancelledError:
        trace.error = "cancelled: the run's time bound was reached"
        raise
    except Exception as exc:  # noqa: BLE001 - one failing request is recorded, the run goes on
        trace.error = f"{type(exc).__name__}: {exc}"


def _new_trace(i: int, request: Any, sent_s: float) -> RequestTrace:
    return RequestTrace(
        request_id=f"{request.workload}-{i}",
        workload=request.workload,
        prompt_key=request.key,
        sent_s=sent_s,
        prompt_tokens=len(request.prompt_token_ids),
    )


async def _await_bounded(tasks: list[asyncio.Task], deadline: float, clock: Callable[[], float]) -> None:
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - clock()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _open_loop(
    target: Target, requests: Sequence[Any], spec: LoadSpec, clock: Callable[[], float]
) -> list[RequestTrace]:
    order = request_order(len(requests), spec.num_requests, spec.seed)
    traces, tasks = [], []
    for i, at in enumerate(arrival_times_s(spec)):
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        request = requests[order[i]]
        trace = _new_trace(i, request, sent_s=at)  # scheduled time: queueing delay counts
        traces.append(trace)
        tasks.append(asyncio.create_task(_drive_one(target, request, trace, clock)))
    await _await_bounded(tasks, spec.max_duration_s + spec.drain_timeout_s, clock)
    return traces


async def _closed_loop(
    target: Target, requests: Sequence[Any], spec: LoadSpec, clock: Callable[[], float]
) -> list[RequestTrace]:
    order = request_order(len(requests), spec.num_requests, spec.seed)
    traces: list[RequestTrace] = []
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while next_index < spec.num_requests and clock() < spec.max_duration_s:
            i, next_index = next_index, next_index + 1
            request = requests[order[i]]
            trace = _new_trace(i, request, sent_s=clock())
            traces.append(trace)
            await _drive_one(target, request, trace, clock)
            if spec.think_time_s:
                await asyncio.sleep(spec.think_time_s)

    tasks = [asyncio.create_task(client()) for _ in range(spec.concurrency)]
    await _await_bounded(tasks, spec.max_duration_s + spec.drain_timeout_s, clock)
    traces.sort(key=lambda t: int(t.request_id.rsplit("-", 1)[1]))
    return traces


async def run_load(
    target: Target, requests: Sequence[Any], spec: LoadSpec, *, workload: str = ""
) -> LoadResult:
    """Drive ``target`` with ``requests`` (``PreparedRequest`` records) as ``spec`` says."""
    if not requests:
        raise ValueError("run_load needs at least one request")
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    def gauge() -> float | None:
        return target.kv_blocks_in_use()

    with PeakSampler(gauge=gauge) as sampler:
        if spec.pattern == "closed":
            traces = await _closed_loop(target, requests, spec, clock)
        else:
            traces = await _open_loop(target, requests, spec, clock)
    peak = sampler.gauge_peak
    return LoadResult(
        target=target.name,
        workload=workload or requests[0].workload,
        spec=spec,
        traces=traces,
        wall_s=clock(),
        peak_rss_mb=sampler.peak_rss_mb,
        kv_blocks_peak=int(peak) if peak is not None else None,
        kv_blocks_total=target.kv_blocks_total(),
    )


@dataclass(frozen=True)
class RampStage:
    rate_rps: float
    metrics: RunMetrics


@dataclass(frozen=True)
class RampResult:
    """Poisson stages at rising rates; ``saturation_rps`` is the first rate the target cannot sustain."""

    stages: tuple[RampStage, ...]
    sustained_rps: float | None  # highest rate meeting the attainment threshold
    saturation_rps: float | None  # first rate that did not (None: never saturated in the ramp)
    attainment_threshold: float


async def run_ramp(
    target: Target,
    requests: Sequence[Any],
    rates_rps: Sequence[float],
    slo: SLO,
    *,
    requests_per_stage: int,
    stage_duration_s: float,
    seed: int = 0,
    attainment_threshold: float = 0.9,
    stop_after_saturation: bool = True,
) -> RampResult:
    """Run Poisson stages at each rate; a stage saturates when SLO attainment < threshold."""
    stages, sustained, saturated = [], None, None
    for rate in sorted(rates_rps):
        spec = LoadSpec(
            pattern="poisson",
            rate_rps=rate,
            num_requests=requests_per_stage,
            max_duration_s=stage_duration_s,
            drain_timeout_s=stage_duration_s,
            seed=seed,
        )
        result = await run_load(target, requests, spec)
        metrics = result.metrics(slo)
        stages.append(RampStage(rate, metrics))
        if metrics.slo_attainment >= attainment_threshold:
            sustained = rate
        elif saturated is None:
            saturated = rate
            if stop_after_saturation:
                break
    return RampResult(tuple(stages), sustained, saturated, attainment_threshold)
