"""RTIQ, the Real-Time Inference Quality Index (defined in docs/benchmarks.md).

RTIQ = quality retention x the fraction of requests that meet both the TTFT and the
inter-token-latency SLO at the offered load. Both factors lie in [0, 1], so RTIQ does too;
it is always reported beside its parts so that one number never hides a trade-off.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_rtgi.bench.metrics import RunMetrics


@dataclass(frozen=True)
class RTIQ:
    """The index for one workload at one offered load, with its parts."""

    workload: str
    value: float
    quality_retention: float
    slo_attainment: float
    ttft_attainment: float
    itl_attainment: float
    offered_rps: float | None


def rtiq(workload: str, quality_retention: float, metrics: RunMetrics) -> RTIQ:
    """Combine quality retention (0..1) with the run's SLO attainment."""
    if not 0.0 <= quality_retention <= 1.0:
        raise ValueError(f"quality retention must be in [0, 1], got {quality_retention}")
    return RTIQ(
        workload=workload,
        value=quality_retention * metrics.slo_attainment,
        quality_retention=quality_retention,
        slo_attainment=metrics.slo_attainment,
        ttft_attainment=metrics.ttft_attainment,
        itl_attainment=metrics.itl_attainment,
        offered_rps=metrics.offered_rps,
    )
