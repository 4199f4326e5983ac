"""Latency and throughput metrics for benchmark runs, computed from per-request traces.

A ``RequestTrace`` records when a request was sent and when each streamed chunk of tokens
arrived (times in seconds on one monotonic clock). Everything else is derived from it:

- TTFT: first chunk time minus send time.
- Inter-token latency (ITL): for each chunk after the first, the gap since the previous
  chunk divided by the chunk's token count, counted once per token. A chunk of several
  tokens (speculative decoding, or a transport that coalesces) therefore spreads its gap
  over its tokens instead of reporting zeros.
- End-to-end latency: completion time minus send time.

A request meets the SLO when it completed without error, its TTFT is at most
``SLO.ttft_ms`` and its ``SLO.itl_percentile``-th percentile ITL is at most ``SLO.itl_ms``
(a request with a single token has no ITL and meets that part). Goodput is the number of
requests meeting the SLO divided by the run's duration. Percentiles use linear
interpolation between order statistics (numpy's default), so they are exact on known inputs.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def median(values: Iterable[float]) -> float:
    """Median of ``values``; NaN when empty."""
    values = list(values)
    return float(statistics.median(values)) if values else math.nan


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency population (milliseconds)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if len(values) == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            len(values),
            float(np.mean(values)),
            percentile(values, 50),
            percentile(values, 95),
            percentile(values, 99),
            float(max(values)),
        )


@dataclass(frozen=True)
class SLO:
    """A workload's service-level objective. Defaults are the real-time thresholds."""

    ttft_ms: float = 500.0
    itl_ms: float = 50.0
    itl_percentile: float = 95.0

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError(
                f"SLO thresholds must be positive, got ttft_ms={self.ttft_ms}, itl_ms={self.itl_ms}"
            )
        if not 0 < self.itl_percentile <= 100:
            raise ValueError(f"itl_percentile must be in (0, 100], got {self.itl_percentile}")


@dataclass
class RequestTrace:
    """What one benchmark request did, on the run's monotonic clock (seconds)."""

    request_id: str
    workload: str = ""
    prompt_key: str = ""  # which workload item the prompt came from (for quality pairing)
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    def add_chunk(self, time_s: float, num_tokens: int) -> None:
        """Record ``num_tokens`` tokens (may be 0 for a text-less final delta) arriving at ``time_s``."""
        if num_tokens > 0:
            self.chunk_times_s.append(time_s)
            self.chunk_tokens.append(num_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        """Completed without error and produced at least one token."""
        return self.error is None and self.end_s is not None and self.completion_tokens > 0

    @property
    def ttft_ms(self) -> float:
        return (self.chunk_times_s[0] - self.sent_s) * 1e3 if self.chunk_times_s else math.nan

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.sent_s) * 1e3 if self.end_s is not None else math.nan

    @property
    def itl_ms(self) -> list[float]:
        """One inter-token gap per token after the first chunk (see the module docstring)."""
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times_s)):
            n = self.chunk_tokens[i]
            gaps.extend([(self.chunk_times_s[i] - self.chunk_times_s[i - 1]) * 1e3 / n] * n)
        return gaps

    def itl_stat_ms(self, slo: SLO) -> float:
        """This request's ITL at the SLO's percentile; 0 when it has no inter-token gaps."""
        gaps = self.itl_ms
        return percentile(gaps, slo.itl_percentile) if gaps else 0.0

    def meets_ttft(self, slo: SLO) -> bool:
        return self.ok and self.ttft_ms <= slo.ttft_ms

    def meets_itl(self, slo: SLO) -> bool:
        return self.ok and self.itl_stat_ms(slo) <= slo.itl_ms

    def meets(self, slo: SLO) -> bool:
        return self.meets_ttft(slo) and self.meets_itl(slo)


@dataclass(frozen=True)
class RunMetrics:
    """Everything measured in one load run. Latencies in ms; rates per second of ``duration_s``."""

    num_requests: int
    num_ok: int
    num_failed: int
    duration_s: float
    ttft_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    output_tokens: int
    throughput_tok_s: float
    goodput_rps: float
    slo_attainment: float  # fraction of requests meeting TTFT and ITL
    ttft_attainment: float
    itl_attainment: float
    offered_rps: float | None = None
    peak_rss_mb: float | None = None
    kv_blocks_peak: int | None = None
    kv_blocks_total: int | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


def run_duration_s(traces: Sequence[RequestTrace]) -> float:
    """From the first send to the last completion (or last chunk for unfinished requests)."""
    if not traces:
        return 0.0
    start = min(t.sent_s for t in traces)
    ends = [
        t.end_s if t.end_s is not None else (t.chunk_times_s[-1] if t.chunk_times_s else t.sent_s)
        for t in traces
    ]
    return max(ends) - start


def summarise(
    traces: Sequence[RequestTrace],
    slo: SLO,
    *,
    duration_s: float | None = None,
    offered_rps: float | None = None,
    peak_rss_mb: float | None = None,
    kv_blocks_peak: int | None = None,
    kv_blocks_total: int | None = None,
) -> RunMetrics:
    """Compute ``RunMetrics`` from traces. ``duration_s`` defaults to ``run_duration_s(traces)``.

    Failed and unfinished requests count in the denominator of every attainment fraction:
    a request that timed out did not meet its SLO.
    """
    duration = run_duration_s(traces) if duration_s is None else duration_s
    ok = [t for t in traces if t.ok]
    n = len(traces)
    meeting = sum(t.meets(slo) for t in traces)
    tokens = sum(t.completion_tokens for t in traces)
    return RunMetrics(
        num_requests=n,
        num_ok=len(ok),
        num_failed=n - len(ok),
        duration_s=duration,
        ttft_ms=Distribution.of([t.ttft_ms for t in ok]),
        itl_ms=Distribution.of([g for t in ok for g in t.itl_ms]),
        e2e_ms=Distribution.of([t.e2e_ms for t in ok]),
        output_tokens=tokens,
        throughput_tok_s=tokens / duration if duration > 0 else math.nan,
        goodput_rps=meeting / duration if duration > 0 else math.nan,
        slo_attainment=meeting / n if n else math.nan,
        ttft_attainment=sum(t.meets_ttft(slo) for t in traces) / n if n else math.nan,
        itl_attainment=sum(t.meets_itl(slo) for t in traces) / n if n else math.nan,
        offered_rps=offered_rps,
        peak_rss_mb=peak_rss_mb,
        kv_blocks_peak=kv_blocks_peak,
        kv_blocks_total=kv_blocks_total,
        prompt_tokens=sum(t.prompt_tokens for t in traces),
        cached_prompt_tokens=sum(t.cached_tokens for t in traces),
    )


# --- Memory and engine-state sampling --------------------------------------------------------


def current_rss_mb() -> float:
    """Resident set size of this process now (MiB), from /proc when available."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        # ru_maxrss is the lifetime peak in KiB on Linux: the best available fallback.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakSampler:
    """Samples RSS and an optional gauge (e.g. KV blocks in use) in a background thread.

    Use as a context manager around a run; read ``peak_rss_mb`` and ``gauge_peak`` after.
    Sampling, not the kernel's lifetime high-water mark, so that each run gets its own peak.
    """

    def __init__(self, gauge: Callable[[], float | None] | None = None, interval_s: float = 0.05):
        self.gauge = gauge
        self.interval_s = interval_s
        self.peak_rss_mb = 0.0
        self.gauge_peak: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        self.peak_rss_mb = max(self.peak_rss_mb, current_rss_mb())
        if self.gauge is not None:
            value = self.gauge()
            if value is not None:
                self.gauge_peak = value if self.gauge_peak is None else max(self.gauge_peak, value)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakSampler:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="bench-peak-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


# --- Timing helpers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one quantity (seconds), with their median."""

    runs_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return median(self.runs_s)

    @property
    def num_runs(self) -> int:
        return len(self.runs_s)


def time_calls(fn: Callable[[], object], runs: int, warmup: int = 1) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``runs`` times timed (wall clock)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing(tuple(samples))
