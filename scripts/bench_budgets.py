#!/usr/bin/env python3
"""Token budgets and dynamic stopping against none, in one run, on one engine.

For every workload, each budget policy in turn (the order rotating from workload to workload):
the workload at its offered load (``bench.suite.run_workload``: TTFT, ITL, E2E, output tokens,
RTIQ) and its graded task set (task retention against the full model, with its interval, and
mean output tokens of both). Policies (``bench.budgets``):

- ``off``: replies end at EOS or the workload's cap (today's behaviour);
- ``predicted+clause``: a predicted budget per reply, soft: past it the reply ends at the next
  clause (``SamplingParams.token_budget``);
- ``predicted+eos``: the same budget as a hard cap, cutting wherever the count runs out.

    .venv/bin/python scripts/bench_budgets.py --task-items 60 --out bench-budgets.json
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

from edge_rtgi.bench.report import run_conditions  # noqa: E402
from edge_rtgi.bench.suite import (  # noqa: E402
    BenchConfig,
    Optimisations,
    load_models,
    make_engine,
    run_workload,
    warm_up,
)

POLICIES = {
    "off": ("off", "eos"),
    "predicted+clause": ("predicted", "clause"),
    "predicted+eos": ("predicted", "eos"),
}


def row(result: dict) -> dict:
    m, q = result["metrics"], result["quality"]
    return {
        "ok": m["num_ok"],
        "sent": m["num_requests"],
        "e2e_p50_ms": m["e2e_ms"]["p50"],
        "e2e_p95_ms": m["e2e_ms"]["p95"],
        "output_tokens_per_request": m["output_tokens"] / max(1, m["num_ok"]),
        "slo_attainment": m["slo_attainment"],
        "rtiq": result["rtiq"]["value"],
        "retention": q["retention"],
        "retention_low": q["retention_low"],
        "retention_high": q["retention_high"],
        "task_items": q["num_items"],
        "task_tokens_full": q["task"]["mean_completion_tokens_full"],
        "task_tokens_optimised": q["task"]["mean_completion_tokens_optimised"],
        "finish_examples": q["examples"][:2],
    }


async def main_async(args: argparse.Namespace) -> dict:
    cfg = BenchConfig(
        model=args.model, task_items=args.task_items, kl_prompts=args.kl_prompts, rate_scale=args.rate_scale
    )
    if args.scheduling:
        cfg = dataclasses.replace(
            cfg, optimisations=dataclasses.replace(cfg.optimisations, scheduling=args.scheduling)
        )
    models = load_models(cfg)
    engine = make_engine(models.optimised, cfg.optimisations, cfg)
    out: dict = {"workloads": {}}
    try:
        warm_up(engine, models.optimised.tokenizer)
        names = list(POLICIES)
        for w_index, name in enumerate(cfg.workloads):
            order = names[w_index % len(names) :] + names[: w_index % len(names)]
            out["workloads"][name] = {}
            for policy in order:
                token_budget, stopping = POLICIES[policy]
                opt: Optimisations = dataclasses.replace(
                    cfg.optimisations, token_budget=token_budget, stopping=stopping
                )
                run_cfg = dataclasses.replace(cfg, optimisations=opt)
                print(f"{name}: {policy}", flush=True)
                result = await run_workload(models, engine, run_cfg.workload(name), run_cfg)
                out["workloads"][name][policy] = row(result)
                print(json.dumps(out["workloads"][name][policy]), flush=True)
    finally:
        engine.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--task-items", type=int, default=60, help="graded items per set (spread over it)")
    ap.add_argument("--kl-prompts", type=int, default=0)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--scheduling", choices=("fcfs", "slo"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    started, load0 = time.monotonic(), os.getloadavg()
    result = asyncio.run(main_async(args))
    result["conditions"] = run_conditions(
        started,
        load0,
        task_items=args.task_items,
        rate_scale=args.rate_scale,
        scheduling=args.scheduling or "fcfs",
    )
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
