#!/usr/bin/env python
"""int4 layers with int8 activations (``int8_activations``) against the same engine without, on
SmolLM2-135M as the daemon runs it: speed and task retention, every figure from the same run.

- **Speed**: greedy decode of the workloads' own prompts (``--prompts`` per workload, 48 tokens) at
  batch 1 and in groups of ``--batch`` submitted at once, on one stepped engine whose int4 layers
  are switched between the two kernels prompt by prompt (the repacked weights are made once and
  kept), so that both see the machine's drift alike; per run and setting the decode rate per CPU
  second (tokens after each first token) and each run's ratio to the plain kernel; medians over
  ``--runs`` runs.
- **Quality**: task retention of both settings against the fp32 full model on the four graded task
  sets (``bench.task_eval``: paired bootstrap intervals), and of int8 activations against the
  plain engine (the shipped engine in the full model's place: what the switch alone costs). Beside
  them the KL(full || setting) and top-1 agreement along the full model's greedy continuations of
  ``--kl-prompts`` workload prompts, teacher-forced as the engine decodes (the prompt in one pass,
  then one row per token, so the decode kernels are the ones measured).

    flock /tmp/bench.lock .venv/bin/python scripts/bench_int8_activations.py \
        --out docs/benchmarks/int8-activations.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from edge_rtgi.bench.quality import kl_rows
from edge_rtgi.bench.suite import stepped_engine
from edge_rtgi.bench.task_eval import (
    FullOutputCache,
    run_full_model,
    run_on_engine,
    shared_context_tokens,
    task_retention,
)
from edge_rtgi.bench.tasks import TASK_SET_NAMES, load_task_set
from edge_rtgi.bench.workloads import get_workload, prepare
from edge_rtgi.catalog import resolve_model
from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.model import ContiguousKVCache, Transformer
from edge_rtgi.llm.quant.kernels import Int8ActivationSwitch
from edge_rtgi.llm.request import RequestDelta
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import LoadedModel, load_model

WORKLOADS = ("code", "translation", "dialogue", "voice")
MAX_TOKENS = 48


def decode_rate(engine: LLMEngine, prompts: list[list[int]]) -> tuple[int, float]:
    """All ``prompts`` submitted at once and decoded to the end: (tokens after each request's first
    token, CPU seconds from the step that completed the last first token to the end)."""
    deltas: dict[str, list[RequestDelta]] = {}
    for ids in prompts:
        rid = f"r{time.monotonic_ns()}"
        deltas[rid] = []
        engine.submit(ids, SamplingParams(max_tokens=MAX_TOKENS), deltas[rid].append, request_id=rid)
    while not all(deltas.values()):
        engine.step()
    cpu = time.process_time()
    while not all(d[-1].finished for d in deltas.values()):
        engine.step()
    cpu_s = time.process_time() - cpu
    return sum(sum(len(x.token_ids) for x in d[1:]) for d in deltas.values()), cpu_s


def speed(
    engine: LLMEngine, switch: Int8ActivationSwitch, prompts: list[list[int]], runs: int, batch: int
) -> dict:
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    for on in (False, True):  # warm-up
        switch.set(on)
        decode_rate(engine, groups[0])
    per_run: dict[str, list[float]] = {"plain": [], "int8": []}
    for run in range(runs):
        totals = {"plain": [0, 0.0], "int8": [0, 0.0]}
        for i, group in enumerate(groups):
            order = (False, True) if (run + i) % 2 == 0 else (True, False)
            for on in order:
                switch.set(on)
                tokens, cpu_s = decode_rate(engine, group)
                t = totals["int8" if on else "plain"]
                t[0] += tokens
                t[1] += cpu_s
        for name, (tokens, cpu_s) in totals.items():
            per_run[name].append(tokens / cpu_s)
        plain, int8 = per_run["plain"][-1], per_run["int8"][-1]
        print(f"  batch {batch} run {run + 1}: plain {plain:.1f}, int8 {int8:.1f} tok/s per CPU s")
    ratios = [b / a for a, b in zip(per_run["plain"], per_run["int8"], strict=True)]
    return {
        "runs": runs,
        "batch": batch,
        "plain_tok_per_cpu_s": statistics.median(per_run["plain"]),
        "int8_tok_per_cpu_s": statistics.median(per_run["int8"]),
        "ratio_of_medians": statistics.median(per_run["int8"]) / statistics.median(per_run["plain"]),
        "paired_ratio_median": statistics.median(ratios),
        "paired_ratio_min": min(ratios),
        "paired_ratio_max": max(ratios),
        "per_run": per_run,
    }


def decode_logits(model: Transformer, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits at the positions that predict ``continuation``: the prompt in one pass, then one row
    per token, as the engine prefills and decodes."""
    ids = [*prompt, *continuation]
    cache = ContiguousKVCache(model.config, len(ids), model.dtype, model.device)
    rows = []
    with torch.inference_mode():
        cache.begin(len(prompt))
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        cache.commit()
        rows.append(model.compute_logits(hidden[-1:]).float())
        for pos in range(len(prompt), len(ids) - 1):
            cache.begin(1)
            hidden = model(torch.tensor([ids[pos]]), torch.tensor([pos]), cache)
            cache.commit()
            rows.append(model.compute_logits(hidden).float())
    return torch.cat(rows)


def kl_part(
    full: LoadedModel, model: Transformer, switch: Int8ActivationSwitch, prompts: list[list[int]]
) -> dict:
    out: dict[str, dict] = {}
    sequences = []
    for prompt in prompts:
        res = generate(full, prompt, SamplingParams(max_tokens=MAX_TOKENS))
        sequences.append((prompt, list(res.token_ids)))
    references = [decode_logits(full.model, p, c) for p, c in sequences if c]
    for name, on in (("plain", False), ("int8", True)):
        switch.set(on)
        kls, agree = [], []
        for (prompt, cont), p in zip([s for s in sequences if s[1]], references, strict=True):
            q = decode_logits(model, prompt, cont)
            kls.append(kl_rows(p, q))
            agree.append(p.argmax(-1) == q.argmax(-1))
        kl = torch.cat(kls)
        out[name] = {
            "kl_mean": float(kl.mean()),
            "kl_p99": float(torch.quantile(kl, 0.99)),
            "top1_agreement": float(torch.cat(agree).double().mean()),
            "tokens": int(kl.numel()),
        }
        print(
            f"  KL(full || {name}): mean {out[name]['kl_mean']:.4f}, top-1 {out[name]['top1_agreement']:.3f}"
        )
    return out


def quality(
    engine: LLMEngine, switch: Int8ActivationSwitch, full: LoadedModel, names: list[str], limit: int | None
) -> dict:
    context = shared_context_tokens(engine, full)
    out = {}
    for name in names:
        task_set = load_task_set(name)
        full_outputs = run_full_model(full, task_set, limit, FullOutputCache.default(), context)
        outputs = {}
        for setting, on in (("plain", False), ("int8", True)):
            switch.set(on)
            outputs[setting] = run_on_engine(engine, task_set, limit, context)
        rows = {
            "plain_vs_full": task_retention(task_set, outputs["plain"], full_outputs),
            "int8_vs_full": task_retention(task_set, outputs["int8"], full_outputs),
            "int8_vs_plain": task_retention(task_set, outputs["int8"], outputs["plain"]),
        }
        out[name] = {k: v.as_dict() for k, v in rows.items()}
        for k, v in rows.items():
            iv = v.interval
            print(
                f"  {name:<12} {k:<14} retention {v.retention:.3f} [{iv.low:.3f}, {iv.high:.3f}] "
                f"(n {iv.n}, scores {iv.optimised_score:.3f} / {iv.full_score:.3f})",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload for the speed part")
    ap.add_argument("--batch", type=int, default=8, help="the group size besides batch 1 (0: none)")
    ap.add_argument("--kl-prompts", type=int, default=3, help="prompts per workload for KL (0: none)")
    ap.add_argument("--task-sets", default=",".join(TASK_SET_NAMES), help="comma-separated ('': none)")
    ap.add_argument("--task-items", type=int, default=None, help="items per task set (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    engine = stepped_engine(args.threads)
    if cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS:
        raise SystemExit("the fused CPU kernels have no AVX-512 VNNI or AVX2 loops here: nothing to compare")
    switch = Int8ActivationSwitch.build(engine.model)
    tok = engine.tokenizer
    assert tok is not None
    result: dict = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_start": list(os.getloadavg()),
        "int4_layers": len(switch.layers),
    }
    per_workload = {w: [list(p.prompt_token_ids) for p in prepare(get_workload(w), tok)] for w in WORKLOADS}
    speed_prompts = [ids for w in WORKLOADS for ids in per_workload[w][: args.prompts]]
    print(f"speed: {len(speed_prompts)} prompts, {MAX_TOKENS} tokens, {args.runs} runs")
    result["speed"] = [speed(engine, switch, speed_prompts, args.runs, 1)]
    if args.batch > 1:
        result["speed"].append(speed(engine, switch, speed_prompts, args.runs, args.batch))
    for s in result["speed"]:
        print(
            f"batch {s['batch']}: plain {s['plain_tok_per_cpu_s']:.1f}, "
            f"int8 {s['int8_tok_per_cpu_s']:.1f} tok/s per CPU s; "
            f"paired ratio {s['paired_ratio_median']:.2f}x "
            f"({s['paired_ratio_min']:.2f}-{s['paired_ratio_max']:.2f}, {s['runs']} runs)"
        )
    names = [n for n in args.task_sets.split(",") if n]
    if names or args.kl_prompts:
        full = load_model(resolve_model(engine.config.model, role="llm"), device="cpu", dtype="fp32")
        if args.kl_prompts:
            print("KL along the full model's greedy continuations:")
            kl_prompts = [ids for w in WORKLOADS for ids in per_workload[w][: args.kl_prompts]]
            result["kl"] = kl_part(full, engine.model, switch, kl_prompts)
        if names:
            print("task retention:")
            result["tasks"] = quality(engine, switch, full, names, args.task_items)
    result["load_average_end"] = list(os.getloadavg())
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
