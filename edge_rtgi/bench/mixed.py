"""The mixed load: all four workloads arriving at once, as a busy daemon sees them.

Each workload keeps its own arrival pattern (code comes in bursts), SLO and request class, at
its offered rate times a scale; the runs are bounded by time, not count. Every scale is run
under each scheduling policy on its own engine (the same loaded model), the policies
alternating run by run so that load from elsewhere hits them alike. Reported per policy and
scale: SLO attainment over all requests and per class, goodput, p95 TTFT and ITL per class,
and the highest scale sustained at ``SUSTAINED_ATTAINMENT`` (every scale up to it meeting it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from edge_rtgi.bench.budgets import BudgetPolicy
from edge_rtgi.bench.loadgen import LoadResult, run_load
from edge_rtgi.bench.suite import BenchConfig, Models, make_engine, warm_prompt_prefix, warm_up
from edge_rtgi.bench.targets import EngineTarget
from edge_rtgi.bench.workloads import Workload, get_workload, prepare

log = logging.getLogger(__name__)

POLICIES = ("fcfs", "slo")
SUSTAINED_ATTAINMENT = 0.9
RATIO_RESAMPLES = 2000  # paired bootstrap of the slo / fcfs attainment ratio over rounds


@dataclass(frozen=True)
class ClassResult:
    """One workload's share of a mixed run."""

    workload: str
    request_class: str
    sent: int
    met_slo: int
    ttft_p95_ms: float | None
    itl_p95_ms: float | None
    goodput_rps: float
    duration_s: float


@dataclass(frozen=True)
class MixedRun:
    """One mixed run: a policy at a rate scale."""

    policy: str
    rate_scale: float
    round: int
    offered_rps: float
    sent: int
    met_slo: int
    goodput_rps: float
    classes: tuple[ClassResult, ...]

    @property
    def attainment(self) -> float:
        return self.met_slo / self.sent if self.sent else 0.0


def mixed_workloads(cfg: BenchConfig, rate_scale: float, seed: int) -> list[Workload]:
    """The four workloads at ``rate_scale`` times their rates, enough requests for the duration."""
    out = []
    for name in cfg.workloads:
        w = get_workload(name)
        rate = w.load.rate_rps * rate_scale
        count = max(1, math.ceil(rate * cfg.mixed_duration_s))
        out.append(
            w.with_overrides(
                num_requests=count,
                rate_rps=rate,
                max_duration_s=cfg.mixed_duration_s,
                seed=w.load.seed + seed,
            )
        )
    return out


async def run_mixed_once(
    engine: Any,
    models: Models,
    workloads: list[Workload],
    budgets: BudgetPolicy | None = None,
    warm_start: bool = True,
) -> list[LoadResult]:
    """Every workload driven at once against ``engine``; one result each. With ``warm_start``
    each workload's shared prompt prefix is computed first (``suite.warm_prompt_prefix``)."""
    requests = [prepare(w, models.optimised.tokenizer) for w in workloads]
    engine.reset_prefix_cache()
    if warm_start:
        for reqs in requests:
            warm_prompt_prefix(engine, reqs)
    target = EngineTarget(engine, budgets=budgets)
    runs = (run_load(target, r, w.load, workload=w.name) for w, r in zip(workloads, requests, strict=True))
    return list(await asyncio.gather(*runs))


def summarise_run(
    policy: str, rate_scale: float, rnd: int, workloads: list[Workload], results: list[LoadResult]
) -> MixedRun:
    classes = []
    for w, result in zip(workloads, results, strict=True):
        m = result.metrics(w.slo)
        classes.append(
            ClassResult(
                workload=w.name,
                request_class=w.request_class,
                sent=m.num_requests,
                met_slo=round(m.slo_attainment * m.num_requests),
                ttft_p95_ms=m.ttft_ms.p95,
                itl_p95_ms=m.itl_ms.p95,
                goodput_rps=m.goodput_rps,
                duration_s=m.duration_s,
            )
        )
    return MixedRun(
        policy=policy,
        rate_scale=rate_scale,
        round=rnd,
        offered_rps=sum(w.load.rate_rps for w in workloads),
        sent=sum(c.sent for c in classes),
        met_slo=sum(c.met_slo for c in classes),
        # the workloads start together: the run lasts as long as its longest workload
        goodput_rps=sum(c.met_slo for c in classes) / max(max(c.duration_s for c in classes), 1e-9),
        classes=tuple(classes),
    )


async def run_mixed_section(models: Models, cfg: BenchConfig) -> dict:
    """Each scale under each policy, ``cfg.mixed_rounds`` times, policies alternating."""
    engines = {
        p: make_engine(models.optimised, cfg.optimisations.changed(f"scheduling={p}"), cfg) for p in POLICIES
    }
    runs: list[MixedRun] = []
    try:
        for engine in engines.values():
            warm_up(engine, models.optimised.tokenizer)
        for scale in cfg.mixed_rate_scales:
            for rnd in range(cfg.mixed_rounds):
                order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
                for policy in order:
                    workloads = mixed_workloads(cfg, scale, seed=cfg.seed + rnd)
                    log.info("bench: mixed load x%.3g, %s, round %d", scale, policy, rnd + 1)
                    results = await run_mixed_once(
                        engines[policy], models, workloads, cfg.optimisations.budgets, cfg.warm_start
                    )
                    runs.append(summarise_run(policy, scale, rnd, workloads, results))
        step_models = {p: asdict(e.step_model.snapshot()) for p, e in engines.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {
        "duration_s": cfg.mixed_duration_s,
        "rounds": cfg.mixed_rounds,
        "runs": [{**asdict(r), "attainment": r.attainment} for r in runs],
        "summary": summarise_policies(runs),
        "step_model": step_models,
    }


def highest_sustained_scale(attainment_by_scale: Mapping[float, float]) -> float | None:
    """The highest measured scale up to which every measured scale meets
    ``SUSTAINED_ATTAINMENT`` (None if the lowest does not). A scale that meets it above one
    that misses is noise between runs, not a rate the policy sustains."""
    highest = None
    for scale in sorted(attainment_by_scale):
        if attainment_by_scale[scale] < SUSTAINED_ATTAINMENT:
            break
        highest = scale
    return highest


def summarise_policies(runs: list[MixedRun]) -> dict:
    """Per policy and scale: attainment over all rounds pooled, median goodput, per-class p95;
    the highest scale sustained at ``SUSTAINED_ATTAINMENT`` (``highest_sustained_scale``); slo /
    fcfs ratios per scale."""
    table: dict[str, dict[str, Any]] = {}
    for policy in POLICIES:
        rows: dict[str, dict[str, Any]] = {}
        for scale in sorted({r.rate_scale for r in runs}):
            mine = [r for r in runs if r.policy == policy and r.rate_scale == scale]
            if not mine:
                continue
            per_class = {}
            for name in [c.workload for c in mine[0].classes]:
                cs = [c for r in mine for c in r.classes if c.workload == name]
                per_class[name] = {
                    "request_class": cs[0].request_class,
                    "attainment": sum(c.met_slo for c in cs) / max(1, sum(c.sent for c in cs)),
                    "ttft_p95_ms": _median([c.ttft_p95_ms for c in cs]),
                    "itl_p95_ms": _median([c.itl_p95_ms for c in cs]),
                }
            rows[f"{scale:g}"] = {
                "rate_scale": scale,
                "offered_rps": mine[0].offered_rps,
                "attainment": sum(r.met_slo for r in mine) / max(1, sum(r.sent for r in mine)),
                "goodput_rps": statistics.median(r.goodput_rps for r in mine),
                "classes": per_class,
            }
        attainment = {row["rate_scale"]: row["attainment"] for row in rows.values()}
        table[policy] = {"scales": rows, "highest_sustained_scale": highest_sustained_scale(attainment)}
    ratios = {}
    for key, row in table.get("slo", {}).get("scales", {}).items():
        base = table["fcfs"]["scales"].get(key)
        if base:
            scale_runs = [r for r in runs if r.rate_scale == row["rate_scale"]]
            low, high = attainment_ratio_interval(scale_runs) or (None, None)
            ratios[key] = {
                "attainment": row["attainment"] / base["attainment"] if base["attainment"] else None,
                "attainment_low": low,
                "attainment_high": high,
                "goodput": row["goodput_rps"] / base["goodput_rps"] if base["goodput_rps"] else None,
            }
    return {"policies": table, "slo_over_fcfs": ratios}


def attainment_ratio_interval(
    runs: list[MixedRun], resamples: int = RATIO_RESAMPLES, seed: int = 0
) -> tuple[float, float | None] | None:
    """95 % interval of the pooled attainment ratio slo / fcfs at one scale, by a paired bootstrap
    over rounds: round i of both policies had the same arrivals, so they are drawn together. A
    single run moves by tens of points on a shared machine, and the interval says how far the
    rounds' ratio can be trusted. None with fewer than two paired rounds; the upper end is None
    (unbounded) when fcfs met nothing in more than 2.5 % of the resamples."""
    by_round: dict[int, dict[str, MixedRun]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.policy] = r
    pairs = [(p["slo"], p["fcfs"]) for p in by_round.values() if "slo" in p and "fcfs" in p]
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        slo = sum(a.met_slo for a, _ in pick) / max(1, sum(a.sent for a, _ in pick))
        fcfs = sum(b.met_slo for _, b in pick) / max(1, sum(b.sent for _, b in pick))
        ratios.append(slo / fcfs if fcfs else (math.inf if slo else 1.0))
    ratios.sort()
    low, high = ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]
    return low, (None if math.isinf(high) else high)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
