#!/usr/bin/env python3
"""The mixed load under fcfs and under slo with each waiting order, in one run.

``edge-rtgi bench mixed`` compares fcfs with slo as shipped. This runs the same mixed load
(``bench.mixed``: all four workloads at once, bursts included) on three engines over one loaded
model: ``fcfs``, ``slo-edf`` (``slo_waiting_order: edf``) and ``slo-class``
(``slo_waiting_order: class``, the default), the three rotating run by run so that load
from elsewhere hits them alike. Per policy and scale: attainment over all requests and per
workload, goodput, p95 TTFT/ITL per workload, each slo variant over fcfs, the highest scale
sustained at 90 %, and the load average before and after every run.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_slo_order.py --scales 0.5,1,1.5 --out o.json

``--kernel-rows 16,32`` runs each policy once per multi-row kernel limit instead (``quant:
auto``'s widest input on the weight-only kernels and the fused decode path, more rows take the
Python layers and the dense copies), each limit on its own copy of the model, all engines
rotating; engines are then named ``policy@rows``:

    flock /tmp/bench.lock .venv/bin/python scripts/bench_slo_order.py --policies fcfs \
        --kernel-rows 16,32 --scales 0.5,1 --rounds 3 --out k.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_rtgi.bench.mixed import (  # noqa: E402
    MixedRun,
    highest_sustained_scale,
    mixed_workloads,
    run_mixed_once,
    summarise_policies,
    summarise_run,
)
from edge_rtgi.bench.report import run_conditions  # noqa: E402
from edge_rtgi.bench.suite import BenchConfig, load_models, load_optimised, warm_up  # noqa: E402
from edge_rtgi.llm.quant.kernels import set_max_kernel_rows  # noqa: E402

# policy name -> (scheduling, slo_waiting_order)
POLICIES = {"fcfs": ("fcfs", "class"), "slo-edf": ("slo", "edf"), "slo-class": ("slo", "class")}


async def main_async(args: argparse.Namespace) -> dict:
    from edge_rtgi.llm.engine import LLMEngine

    cfg = BenchConfig(
        model=args.model,
        mixed_rate_scales=tuple(float(s) for s in args.scales.split(",")),
        mixed_duration_s=args.duration,
        mixed_rounds=args.rounds,
        warm_start=not args.cold_start,
    )
    models = load_models(cfg)
    policies = args.policies.split(",")
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}: choose from {sorted(POLICIES)}")
    # (engine name, its model): one copy per kernel row limit, so each keeps its own limit
    copies = [("", models.optimised)]
    if args.kernel_rows:
        copies = []
        for rows in args.kernel_rows.split(","):
            loaded = load_optimised(models.source, cfg.optimisations)[0]
            set_max_kernel_rows(loaded.model, int(rows))
            copies.append((f"@{rows}", loaded))
    engines = {}
    for suffix, loaded in copies:
        for name in policies:
            scheduling, order = POLICIES[name]
            opt = dataclasses.replace(cfg.optimisations, scheduling=scheduling)
            engine_cfg = opt.engine_config(cfg.model, cfg.num_threads).with_(slo_waiting_order=order)
            engines[name + suffix] = LLMEngine.from_loaded(loaded, engine_cfg)
    runs: list[MixedRun] = []
    loads: list[dict] = []
    names = list(engines)
    try:
        for engine in engines.values():
            warm_up(engine, models.optimised.tokenizer)
        turn = 0
        for scale in cfg.mixed_rate_scales:
            for rnd in range(cfg.mixed_rounds):
                for policy in names[turn % len(names) :] + names[: turn % len(names)]:
                    workloads = mixed_workloads(cfg, scale, seed=cfg.seed + rnd)
                    load0 = os.getloadavg()
                    results = await run_mixed_once(
                        engines[policy], models, workloads, warm_start=cfg.warm_start
                    )
                    run = summarise_run(policy, scale, rnd, workloads, results)
                    runs.append(run)
                    loads.append(
                        {"policy": policy, "scale": scale, "round": rnd, "load": [load0, os.getloadavg()]}
                    )
                    print(f"x{scale:g} round {rnd + 1} {policy}: {run.attainment:.0%}", flush=True)
                turn += 1
        step_models = {p: dataclasses.asdict(e.step_model.snapshot()) for p, e in engines.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()
    summaries = {}
    for suffix, _ in copies:
        fcfs = "fcfs" + suffix
        for variant in (v + suffix for v in ("slo-edf", "slo-class")):
            if fcfs not in engines or variant not in engines:
                continue
            # bench.mixed summarises the pair fcfs / slo
            pair = [dataclasses.replace(r, policy="slo") if r.policy == variant else r for r in runs]
            pair = [dataclasses.replace(r, policy="fcfs") if r.policy == fcfs else r for r in pair]
            summaries[variant] = summarise_policies([r for r in pair if r.policy in ("fcfs", "slo")])
    pooled = {}
    for name in names:
        for scale in cfg.mixed_rate_scales:
            mine = [r for r in runs if r.policy == name and r.rate_scale == scale]
            pooled[f"{name} x{scale:g}"] = sum(r.met_slo for r in mine) / max(1, sum(r.sent for r in mine))
    sustained = {
        name: highest_sustained_scale({s: pooled[f"{name} x{s:g}"] for s in cfg.mixed_rate_scales})
        for name in names
    }
    return {
        "runs": [{**dataclasses.asdict(r), "attainment": r.attainment} for r in runs],
        "run_load_average": loads,
        "summary": summaries,
        "pooled_attainment": pooled,
        "highest_sustained_scale": sustained,
        "step_model": step_models,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--scales", default="0.5,1,1.5", help="rate scales of the summed offered 8 req/s")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per policy and scale")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: " + ", ".join(POLICIES))
    ap.add_argument(
        "--kernel-rows", default="", help="multi-row kernel limits to compare (16,32); default: as loaded"
    )
    ap.add_argument(
        "--cold-start", action="store_true", help="each run from an empty prefix cache (before 2026-12-06)"
    )
    args = ap.parse_args()
    started, load0 = time.monotonic(), os.getloadavg()
    result = asyncio.run(main_async(args))
    result["conditions"] = run_conditions(
        started, load0, scales=args.scales, duration_s=args.duration, rounds=args.rounds
    )
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    for variant, summary in result["summary"].items():
        print(variant, json.dumps(summary["slo_over_fcfs"]))
    for name, attainment in result["pooled_attainment"].items():
        print(f"{name}: pooled attainment {attainment:.0%}")
    for name, scale in result["highest_sustained_scale"].items():
        print(f"{name}: highest scale sustained at 90 %: {'none' if scale is None else f'x{scale:g}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
