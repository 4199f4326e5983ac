#!/usr/bin/env python3
"""Quantisation benchmark: kernels per shape, decode speed, resident size, mixed vs uniform quality.

Everything is measured in one run against baselines from the same run (medians over --runs):

- kernels: each SmolLM2 matrix shape at batch 1 and 8, fp32 vs bf16 activations: F.linear
  against the int8 and int4 weight-only kernels;
- decode: greedy batch-1 decode (64-token prompt, 128 new tokens) on the project's plain path
  (``edge_rtgi.llm.generate``) for fp32, bf16, uniform int8/int4, the mixed plans, the chosen
  operating point and the engine's ``quant: auto`` plan (``--decode-for "engine auto (Q4_1 as
  int4-g32, int8 head)"``), and llama.cpp on the original Q4_1 GGUF (``edge_rtgi.bench.peers``), the
  engines interleaved run by run so that load from other jobs hits them alike;
- memory: resident bytes of every model's weights (parameters + buffers);
- quality: uniform plans, mixed plans of exactly the uniform plans' sizes, and a budget sweep of
  mixed plans (4.5, 5.25 and 6.0 bits by default), judged by task retention: each model served by
  the engine on the four graded task sets (``bench.task_eval``: optimised / full task score on the
  same items, paired bootstrap interval), with KL, perplexity, top-1 agreement and continuation chrF
  (fidelity) on the evaluation text beside it (``compare_quality``), plus two ablations that split
  int8's loss between the tied head and the layers. The operating point is the smallest mixed plan
  whose task retention meets --target-retention on every workload (``choose_operating_point``: by
  every interval, then every point estimate, then not significantly below, then by the
  token-accuracy interval). With --same-computation the fp32 weights are first served by the engine
  and scored against the plain path: the yardstick's own check, which must read 1 with [1, 1]. The
  Spearman correlation of mean task retention with KL across the
  quantised models is reported as a check on the yardstick.

    python scripts/bench_quant.py --sensitivity sens.yaml --out bench_out/quant
    python scripts/bench_quant.py --sensitivity sens.yaml --skip kernels decode   # quality only
    python scripts/bench_quant.py --sensitivity sens.yaml --skip kernels quality  # decode only

Quality goes to ``quality.json``, decode to ``decode.json`` and kernels to ``kernels.json`` in
--out, each written as soon as its part is done, so the parts can run at different times.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from edge_rtgi.bench.peers import LlamaCppPeer, PeerUnavailable
from edge_rtgi.bench.task_eval import FullOutputCache, evaluate
from edge_rtgi.bench.tasks import TASK_SET_NAMES
from edge_rtgi.bench.workloads import PreparedRequest
from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate_stream
from edge_rtgi.llm.quant import source_aligned_plan
from edge_rtgi.llm.quant.allocate import Budget, allocate
from edge_rtgi.llm.quant.kernels import keep_dense_copies, make_quant_linear
from edge_rtgi.llm.quant.plan import (
    QuantPlan,
    apply_quant_plan,
    model_groups,
    plan_bits_per_weight,
    plan_nbytes,
    uniform_plan,
)
from edge_rtgi.llm.quant.policy import auto_quant_kernel_max_rows
from edge_rtgi.llm.quant.profile import SensitivityTable, calibration_text, collect_importance
from edge_rtgi.llm.quant.report import compare_quality
from edge_rtgi.llm.quant.schemes import parse_scheme, quantize_weight
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from edge_rtgi.scoring.retention import bootstrap_mean_interval

PROMPT_TOKENS, NEW_TOKENS = 64, 128


def median_time(fn, runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_kernels(runs: int) -> list[dict]:
    """Microseconds per call for each shape / batch / activation dtype / kernel."""
    shapes = {
        "qkv": (960, 576),
        "o": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    }
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.02
        for batch in (1, 8):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(batch, k).to(dtype)
                wd = w.to(dtype)
                row = {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "batch": batch,
                    "act": str(dtype).replace("torch.", ""),
                    "F.linear": 1e6 * median_time(lambda x=x, wd=wd: F.linear(x, wd), runs),
                }
                for scheme in ("int8", "int4-g32", "int4-g64"):
                    layer = make_quant_linear(
                        quantize_weight(w, parse_scheme(scheme)), None, dtype, torch.device("cpu")
                    )
                    row[scheme] = 1e6 * median_time(lambda x=x, layer=layer: layer(x), runs)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def load_average() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


class OurDecoder:
    """One of our models on the plain path: one timed greedy run = first-token time, decode tok/s."""

    def __init__(self, model, tokenizer, fused_kernels: bool = True):
        self.model, self.tokenizer, self.fused_kernels = model, tokenizer, fused_kernels

    def once(self, prompt: list[int]) -> tuple[float, float]:
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        start, first, count = time.perf_counter(), None, 0
        with contextlib.nullcontext() if self.fused_kernels else cpu_ops.disabled():
            for delta in generate_stream((self.model, self.tokenizer), prompt, params):
                count += len(delta.token_ids)
                if first is None:
                    first = time.perf_counter()
        return first - start, (count - 1) / (time.perf_counter() - first)


class LlamaCppDecoder:
    """llama.cpp on the catalogue GGUF through the peer benchmark's loader (AMX probe included)."""

    def __init__(self, gguf: Path, threads: int):
        self.peer = LlamaCppPeer(gguf, threads, context_tokens=512)
        self.name = self.peer.name

    def once(self, prompt: list[int]) -> tuple[float, float]:
        request = PreparedRequest("decode", "decode", tuple(prompt), NEW_TOKENS, ignore_eos=True)
        self.peer.reset()
        start, first, count = time.perf_counter(), None, 0
        for ids, _text in self.peer.stream(request, threading.Event()):
            count += len(ids)
            if first is None:
                first = time.perf_counter()
        return first - start, (count - 1) / (time.perf_counter() - first)


def decode_interleaved(decoders: dict, prompt: list[int], runs: int) -> dict[str, dict]:
    """Round-robin: one warm-up run each, then ``runs`` rounds in which every engine runs once."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in decoders}
    loads = []
    for round_index in range(runs + 1):
        for name, decoder in decoders.items():
            ttft_s, rate = decoder.once(prompt)
            if round_index:  # round 0 warms every engine up
                samples[name].append((ttft_s, rate))
        loads.append(load_average())
        print(f"decode round {round_index}/{runs} load {loads[-1]}", flush=True)
    rows = {}
    for name, runs_ in samples.items():
        rates = [r for _, r in runs_]
        rows[name] = {
            "decode_tok_s": round(statistics.median(rates), 2),
            "decode_tok_s_runs": [round(r, 2) for r in rates],
            "ttft_ms": round(1e3 * statistics.median(t for t, _ in runs_), 1),
            "runs": len(runs_),
        }
    return {"models": rows, "load_average_per_round": loads}


def resident_mb(model) -> float:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 1e6


# Labels ending in this are quantised with min..max grids whatever --grids says: the ablation
# that shows what fitting the grids to the calibration activations is worth.
MINMAX_SUFFIX = " [min-max grids]"


def quantised_copy(full, plan: QuantPlan, label: str, importance: dict | None):
    """``plan`` applied to a copy of ``full``; the engine's auto plan as the engine applies it (min..max
    grids, which reproduce the file's Q4_1 blocks, and dense bf16 copies for many-row inputs such as
    prefill chunks), every other plan with ``importance``."""
    model = copy.deepcopy(full)
    apply_quant_plan(
        model,
        plan,
        dtype=torch.bfloat16,
        importance=None if label.endswith(MINMAX_SUFFIX) or label == ENGINE_AUTO else importance,
    )
    if label == ENGINE_AUTO:
        keep_dense_copies(model, auto_quant_kernel_max_rows())
    return model


def task_pass(model, full, args) -> dict:
    """Task retention of ``model`` served by the engine, on every graded task set (bench/task_eval)."""
    engine = LLMEngine(model, full.tokenizer, EngineConfig(quant="none", num_threads=args.quality_threads))
    try:
        results = evaluate(engine, full, args.task_sets, args.task_items, FullOutputCache.default())
    finally:
        engine.shutdown()
    tasks = {name: r.as_dict() for name, r in results.items()}
    retentions = [r.retention for r in results.values()]
    return {
        "tasks": tasks,
        "task_retention_min": min(retentions),
        "task_retention_mean": sum(retentions) / len(retentions),
        "task_retention_low_min": min(r.interval.low for r in results.values()),
        "task_retention_high_min": min(r.interval.high for r in results.values()),
    }


# Every candidate except the asymmetric g32 scheme, which re-encodes this Q4_1 file almost
# exactly (DESIGN.md's trap) and so would hide where bits are really lost.
UNALIGNED = ("int8", "int4-g64", "int4-g128", "int4sym-g32", "int4sym-g64", "int4sym-g128")
# The engine's default on a bf16 CPU: the file's Q4_1 blocks as int4-g32, everything else int8.
ENGINE_AUTO = "engine auto (Q4_1 as int4-g32, int8 head)"


# The yardstick's own check: the full model's fp32 weights served by the engine (batched, paged) and
# scored against the plain path. Same weights and dtype, so task retention must read 1; no KL row
# (0 by construction), never an operating-point candidate and not in the Spearman.
SAME_COMPUTATION = "fp32 engine (same computation as the full model)"


# Where int8's loss comes from: the tied head alone at int8, and everything but the head (the rest
# stays bf16, the run dtype). Not operating-point candidates.
HEAD_ABLATIONS = {
    "int8 head only (rest bf16)": QuantPlan({"lm_head": "int8"}, "none"),
    "int8 except the head (head bf16)": QuantPlan({"lm_head": "none"}, "int8"),
}


def plans_to_compare(
    groups, table: SensitivityTable | None, sweep_bits: list[float], blind_bits: list[float] = ()
) -> dict[str, QuantPlan]:
    """Uniform plans, mixed plans of exactly the uniform plans' sizes, and a mixed budget sweep.

    Ordered so that an interrupted run has the operating-point sweep and its equal-size
    comparison first.
    """
    uniform = {
        f"uniform {s}": uniform_plan(groups, s) for s in ("int4sym-g32", "int4-g64", "int4sym-g64", "int8")
    }
    if table is None:
        return uniform
    asym, sym = ("int8", "int4-g64", "int4-g128"), ("int8", "int4sym-g32", "int4sym-g64", "int4sym-g128")

    def equal_size(base: str, family: tuple[str, ...]) -> QuantPlan:
        size = plan_nbytes(uniform[base].resolved(groups), groups)
        return allocate(groups, table, Budget(size, f"{size} B"), family)

    plans = {
        "uniform int4sym-g32": uniform["uniform int4sym-g32"],
        "mixed sym+int8 @ int4sym-g32 size": equal_size("uniform int4sym-g32", sym),
    }
    for bits in sweep_bits:
        plans[f"mixed unaligned @ {bits} bits"] = allocate(
            groups, table, Budget.from_args(groups, bits, None), UNALIGNED
        )
    for bits in blind_bits:
        plans[f"blind unaligned @ {bits} bits"] = allocate(
            groups, sensitivity_blind(table), Budget.from_args(groups, bits, None), UNALIGNED
        )
    plans["uniform int8"] = uniform["uniform int8"]
    for base, family, label in (
        ("uniform int4-g64", asym, "asym g64/g128+int8"),
        ("uniform int4sym-g64", sym, "sym+int8"),
    ):
        plans[base] = uniform[base]
        plans[f"mixed {label} @ {base.split()[1]} size"] = equal_size(base, family)
    return plans


def sensitivity_blind(table: SensitivityTable) -> SensitivityTable:
    """The same table with every weight equally sensitive: a group's KL for a scheme becomes its
    weight count x that scheme's mean KL per weight. The allocator then sees the same gain per
    byte everywhere and upgrades groups in model order: the ablation "same budget, same
    candidates, no per-group sensitivity"."""
    numel = {name: out_f * in_f for name, (out_f, in_f) in table.shapes.items()}
    schemes = {s for row in table.kl.values() for s in row}
    per_weight = {
        s: sum(row[s] for row in table.kl.values() if s in row)
        / sum(numel[g] for g, row in table.kl.items() if s in row)
        for s in schemes
    }
    kl = {g: {s: numel[g] * per_weight[s] for s in row} for g, row in table.kl.items()}
    return SensitivityTable(kl, dict(table.shapes), {"derived": "sensitivity-blind"})


def choose_operating_point(rows: dict[str, dict], target: float) -> dict:
    """Smallest mixed plans (by bytes of the quantised groups) whose task retention meets ``target``
    on every workload three ways: every workload's 95 % interval at or above it, every point
    estimate at or above it, and every interval reaching it (not significantly below); and, as a
    second view, by the teacher-forced next-token accuracy ratio. Blind ablation plans are not
    candidates."""
    mixed = sorted(
        (r["groups_mb"], label) for label, r in rows.items() if label.startswith("mixed") and "tasks" in r
    )

    def first(key: str, source: str = "task") -> str | None:
        for _, label in mixed:
            row = rows[label]
            value = (
                row.get(key, -1)
                if source == "row"
                else min(t["interval"][key] for t in row["tasks"].values())
            )
            if value >= target:
                return label
        return None

    point = {
        "target_retention": target,
        "by_interval": first("low"),
        "by_point_estimate": first("ratio"),
        "not_significantly_below": first("high"),
        # the teacher-forced view (not the benchmark's definition), reported beside it
        "token_accuracy_by_interval": first("token_accuracy_ratio_low", "row"),
        "token_accuracy_by_point_estimate": first("token_accuracy_retention", "row"),
    }
    point["chosen"], point["chosen_by"] = chosen_operating_point(point)
    return point


# The criteria in the order the operating point is chosen by: task retention on every workload,
# strictest first; the teacher-forced token accuracy only when no mixed plan meets it.
OPERATING_POINT_CRITERIA = (
    "by_interval",
    "by_point_estimate",
    "not_significantly_below",
    "token_accuracy_by_interval",
)


def chosen_operating_point(point: dict) -> tuple[str | None, str | None]:
    """(plan label, criterion) of the first criterion in OPERATING_POINT_CRITERIA that a plan meets."""
    return next(((point[c], c) for c in OPERATING_POINT_CRITERIA if point.get(c)), (None, None))


def task_comparison(rows: dict[str, dict], mixed: str, uniform: str) -> dict:
    """Per-workload task retention of a mixed plan and the uniform plan of the same size."""
    per = {
        name: {
            "mixed": rows[mixed]["tasks"][name]["interval"]["ratio"],
            "uniform": rows[uniform]["tasks"][name]["interval"]["ratio"],
        }
        for name in rows[mixed]["tasks"]
        if name in rows[uniform].get("tasks", {})
    }
    wins = sum(1 for v in per.values() if v["mixed"] > v["uniform"])
    ties = sum(1 for v in per.values() if v["mixed"] == v["uniform"])
    return {
        "mixed": mixed,
        "uniform": uniform,
        "per_workload": per,
        "mixed_better": wins,
        "ties": ties,
        "mean_mixed": rows[mixed]["task_retention_mean"],
        "mean_uniform": rows[uniform]["task_retention_mean"],
    }


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):  # ties share their mean rank
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (Pearson on ranks, ties averaged)."""
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else math.nan


def spearman_task_vs_kl(rows: dict[str, dict]) -> dict:
    """Across the quantised models with task results: mean task retention against mean KL."""
    labels = [label for label, r in rows.items() if "tasks" in r and label not in ("bf16", SAME_COMPUTATION)]
    if len(labels) < 3:
        return {"models": len(labels), "rho": None}
    rho = spearman([rows[k]["task_retention_mean"] for k in labels], [rows[k]["mean_kl"] for k in labels])
    return {"models": len(labels), "rho": round(rho, 3), "labels": labels}


def paired_kl(rows: dict[str, dict], a: str, b: str) -> dict:
    """Mean KL(a) - KL(b) over the same windows, with a bootstrap interval (negative: a is better)."""
    diff = [x - y for x, y in zip(rows[a]["window_kl_sums"], rows[b]["window_kl_sums"], strict=True)]
    low, high = bootstrap_mean_interval(diff, rows[a]["window_tokens"])
    return {
        "a": a,
        "b": b,
        "kl_diff": round(sum(diff) / sum(rows[a]["window_tokens"]), 5),
        "low": round(low, 5),
        "high": round(high, 5),
    }


def same_computation_row(full, args, start: float) -> dict:
    """SAME_COMPUTATION's row: the fp32 weights themselves (no copy) on the engine, task pass only."""
    row = {"resident_weights_mb": round(resident_mb(full.model), 2), "kl_note": "same weights: 0"}
    row.update(task_pass(full.model, full, args))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def quality_pass(full, groups, plans: dict[str, QuantPlan], args, out: Path) -> dict:
    """Quality (and resident size) of bf16 and every plan against the fp32 model; written as it goes."""
    rows, full_cache, loads = {}, {}, []
    if args.only and (out / "quality.json").is_file():  # add to an earlier run's results
        earlier = json.loads((out / "quality.json").read_text())
        rows, loads = earlier["models"], earlier["load_average_per_model"]
    todo = [("bf16", None)] + list(plans.items())
    if args.same_computation:
        todo.insert(0, (SAME_COMPUTATION, None))
    if args.only:
        todo = [(label, plan) for label, plan in todo if label.startswith(tuple(args.only))]
    for label, plan in todo:
        start = time.perf_counter()
        if label == SAME_COMPUTATION:
            rows[label] = same_computation_row(full, args, start)
            loads.append(load_average())
            print(label, json.dumps({k: v for k, v in rows[label].items() if k != "tasks"}), flush=True)
            continue
        model = (
            copy.deepcopy(full.model).to(torch.bfloat16)
            if plan is None
            else quantised_copy(full.model, plan, label, args.importance)
        )
        row = {"resident_weights_mb": round(resident_mb(model), 2)}
        if plan is not None:
            resolved = plan.resolved(groups)
            row.update(
                bits_per_weight=round(plan_bits_per_weight(resolved, groups), 4),
                groups_mb=round(plan_nbytes(resolved, groups) / 1e6, 2),
                plan=resolved,
            )
        measured = compare_quality(
            full.model,
            model,
            full.tokenizer,
            calibration_text("eval"),
            max_prompts=args.prompts,
            new_tokens=args.new_tokens,
            full_cache=full_cache,
        )
        row.update(vars(measured), token_accuracy_retention=measured.token_accuracy_retention)
        if args.task_sets and label not in HEAD_ABLATIONS and not label.endswith(MINMAX_SUFFIX):
            row.update(task_pass(model, full, args))
        row["seconds"] = round(time.perf_counter() - start, 1)
        loads.append(load_average())
        rows[label] = row
        del model
        print(
            label,
            json.dumps(
                {
                    k: v
                    for k, v in row.items()
                    if k not in ("plan", "window_kl_sums", "window_tokens", "tasks")
                }
            ),
            flush=True,
        )
        result = {"threads": args.quality_threads, "load_average_per_model": loads, "models": rows}
        (out / "quality.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    result["operating_point"] = choose_operating_point(rows, args.target_retention)
    pairs = [
        (m, u)
        for m, u in (
            ("mixed sym+int8 @ int4sym-g32 size", "uniform int4sym-g32"),
            ("mixed asym g64/g128+int8 @ int4-g64 size", "uniform int4-g64"),
            ("mixed sym+int8 @ int4sym-g64 size", "uniform int4sym-g64"),
            *((label.replace("blind", "mixed"), label) for label in rows if label.startswith("blind")),
        )
        if m in rows and u in rows
    ]
    result["paired_kl"] = [paired_kl(rows, m, u) for m, u in pairs]
    result["task_vs_uniform"] = [task_comparison(rows, m, u) for m, u in pairs if "tasks" in rows[m]]
    result["spearman_task_retention_vs_kl"] = spearman_task_vs_kl(rows)
    (out / "quality.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(
        "operating point", json.dumps(result["operating_point"]), json.dumps(result["paired_kl"]), flush=True
    )
    return result


def decode_pass(full, groups, plans: dict[str, QuantPlan], labels: list[str], args, out: Path) -> dict:
    """Interleaved batch-1 decode of our fp32 path, the chosen models and llama.cpp Q4_1."""
    torch.set_num_threads(args.threads)
    prompt = full.tokenizer.encode(calibration_text("eval"))[:PROMPT_TOKENS]
    decoders: dict = {"fp32 (full)": OurDecoder(full.model, full.tokenizer)}
    sizes = {"fp32 (full)": round(resident_mb(full.model), 2)}
    for label in labels:
        model = (
            copy.deepcopy(full.model).to(torch.bfloat16)
            if label == "bf16"
            else quantised_copy(full.model, plans[label], label, args.importance)
        )
        decoders[label], sizes[label] = OurDecoder(model, full.tokenizer), round(resident_mb(model), 2)
        if label in args.unfused and cpu_ops.available():
            # The same model on the plain PyTorch ops: what the fused CPU kernels are worth.
            unfused = f"{label} [no fused kernels]"
            decoders[unfused], sizes[unfused] = (
                OurDecoder(model, full.tokenizer, fused_kernels=False),
                sizes[label],
            )
    llama_note = None
    if str(full.source).endswith(".gguf"):
        try:
            lcpp = LlamaCppDecoder(Path(full.source), args.threads)
            decoders["llama.cpp Q4_1"] = lcpp
            llama_note = lcpp.name
        except PeerUnavailable as exc:
            llama_note = str(exc)
    result = decode_interleaved(decoders, prompt, args.runs)
    base, lcpp_row = result["models"]["fp32 (full)"], result["models"].get("llama.cpp Q4_1")
    for label, row in result["models"].items():
        row["resident_weights_mb"] = sizes.get(label)
        row["vs_fp32"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
        if lcpp_row:
            row["vs_llamacpp"] = round(row["decode_tok_s"] / lcpp_row["decode_tok_s"], 3)
        print(
            f"{label:<45} {row['decode_tok_s']:8.2f} tok/s  x{row['vs_fp32']:.2f} fp32"
            + (f"  x{row['vs_llamacpp']:.2f} llama.cpp" if lcpp_row else ""),
            flush=True,
        )
    result.update(
        threads=args.threads, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW_TOKENS, llama_cpp=llama_note
    )
    (out / "decode.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def render_markdown(out: Path) -> str:
    """The results table of docs/quantization.md from quality.json and decode.json in ``out``."""
    quality = (
        json.loads((out / "quality.json").read_text()) if (out / "quality.json").is_file() else {"models": {}}
    )
    decode = (
        json.loads((out / "decode.json").read_text()) if (out / "decode.json").is_file() else {"models": {}}
    )
    q, d = quality["models"], decode["models"]
    full_ppl = next((r["perplexity_full"] for r in q.values() if "perplexity_full" in r), math.nan)
    chosen, chosen_by = chosen_operating_point(quality.get("operating_point") or {})
    task_names = [n for n in TASK_SET_NAMES if any(n in (r.get("tasks") or {}) for r in q.values())]
    header = ["model", "bits/weight (incl. scales)", "resident weights MB"]
    header += [f"task retention {n} [95 % CI]" for n in task_names]
    header += ["mean KL [95 % CI]", f"PPL (full {full_ppl:.2f})", "top-1 agreement"]
    header += ["continuation chrF retention (fidelity)", "token-accuracy ratio [95 % CI]"]
    header += ["decode tok/s", "vs fp32", "vs llama.cpp"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    labels = ["fp32 (full)"] + sorted(
        q, key=lambda k: (-q[k].get("bits_per_weight", 32 if k == SAME_COMPUTATION else 16), k)
    )
    labels += [k for k in d if k not in labels]
    for label in labels:
        r, t = q.get(label, {}), d.get(label, {})
        name = f"**{label}** (operating point, {chosen_by.replace('_', ' ')})" if label == chosen else label
        if label == "fp32 (full)":
            bits = "32"
        elif label == "bf16":
            bits = "16"
        elif label == SAME_COMPUTATION:
            bits = "32"
        elif "bits_per_weight" in r:
            bits = f"{r['bits_per_weight']:.2f}"
        else:
            bits = "5.0 (Q4_1)" if "llama" in label else "-"
        mb = r.get("resident_weights_mb") or t.get("resident_weights_mb") or "-"
        cells = [name, bits, f"{mb}"]
        tasks = r.get("tasks") or {}
        for n in task_names:
            iv = (tasks.get(n) or {}).get("interval")
            cells.append(
                f"{100 * iv['ratio']:.1f} % [{100 * iv['low']:.1f}, {100 * iv['high']:.1f}]"
                if iv
                else ("100 %" if label == "fp32 (full)" else "-")
            )
        if r and label == SAME_COMPUTATION:
            cells += ["0 (same weights)"] + ["-"] * 4
        elif r:
            cells += [
                f"{r['mean_kl']:.4f} [{r['kl_low']:.4f}, {r['kl_high']:.4f}]",
                f"{r['perplexity_quant']:.2f}",
                f"{100 * r['next_token_agreement']:.1f} %",
                f"{100 * r['quality_retention']:.1f} % [{100 * r['retention_low']:.1f}, "
                f"{100 * r['retention_high']:.1f}]",
                f"{100 * r['token_accuracy_retention']:.1f} % [{100 * r['token_accuracy_ratio_low']:.1f}, "
                f"{100 * r['token_accuracy_ratio_high']:.1f}]"
                if "token_accuracy_ratio_low" in r
                else "-",
            ]
        elif label == "fp32 (full)":
            cells += ["0", f"{full_ppl:.2f}", "100 %", "100 %", "100 %"]
        else:
            cells += ["-"] * 5
        cells += (
            [
                f"{t['decode_tok_s']:.1f}",
                f"{t['vs_fp32']:.2f}x",
                f"{t['vs_llamacpp']:.2f}x" if "vs_llamacpp" in t else "-",
            ]
            if t
            else ["-"] * 3
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sensitivity", help="table from `edge-rtgi quantize --profile` (enables mixed plans)")
    ap.add_argument("--out", default="bench_out/quant")
    ap.add_argument("--runs", type=int, default=3, help="timed decode rounds (after one warm-up round)")
    ap.add_argument(
        "--threads", type=int, default=2, help="threads for kernels and decode (ours and llama.cpp)"
    )
    ap.add_argument(
        "--quality-threads",
        type=int,
        default=1,
        help="threads for the quality pass (1: OpenMP spin-waits on busy shared cores)",
    )
    ap.add_argument(
        "--bits",
        type=float,
        nargs="*",
        default=[4.5, 5.25, 6.0],
        help="budget sweep of mixed plans (all candidates but the aligned int4-g32)",
    )
    ap.add_argument(
        "--grids",
        choices=("fitted", "min-max"),
        default="fitted",
        help="how every plan is quantised (fitted: importance-weighted grids, as edge-rtgi quantize "
        "does by default); with fitted, min-max copies of uniform int4-g64 and int8 are added",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernels", "decode", "quality"])
    ap.add_argument(
        "--decode-for",
        nargs="*",
        default=["bf16", "uniform int8", "uniform int4-g64", "chosen"],
        help="models to time besides fp32 and llama.cpp: labels, or 'chosen' (the operating point "
        "from this run's or an earlier run's quality.json)",
    )
    ap.add_argument(
        "--unfused",
        nargs="*",
        default=[],
        help="labels of --decode-for to run a second time without the fused CPU kernels",
    )
    ap.add_argument(
        "--prompts",
        type=int,
        default=64,
        help="evaluation prompts of the continuation chrF, a fidelity diagnostic beside task retention "
        "(448: one every 16 tokens of the evaluation text, overlapping; the interval then resamples runs "
        "of 14 prompts)",
    )
    ap.add_argument(
        "--task-sets",
        type=lambda v: tuple(x for x in v.split(",") if x),
        default=TASK_SET_NAMES,
        help="graded task sets whose retention judges each plan (comma-separated; '' for none)",
    )
    ap.add_argument(
        "--task-items", type=int, default=None, help="items per task set, spread over it (default: all)"
    )
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per evaluation prompt")
    ap.add_argument("--target-retention", type=float, default=0.97)
    ap.add_argument(
        "--same-computation",
        action="store_true",
        help="first, the yardstick's check: the fp32 weights served by the engine against the plain "
        "path on the task sets (must read 1 with interval [1, 1])",
    )
    ap.add_argument(
        "--blind-bits",
        type=float,
        nargs="*",
        default=[],
        help="also sensitivity-blind plans at these budgets (the allocator without the profile)",
    )
    ap.add_argument(
        "--only", nargs="*", help="quality pass only for models whose label starts with one of these"
    )
    ap.add_argument("--render", action="store_true", help="only print the markdown table of --out's results")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        print(render_markdown(out))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if "kernels" not in args.skip:
        torch.set_num_threads(args.threads)
        rows = bench_kernels(max(args.runs, 20))
        (out / "kernels.json").write_text(json.dumps({"threads": args.threads, "kernels_us": rows}, indent=1))
    full = load_model(args.model, device="cpu", dtype="fp32")
    groups = model_groups(full.model)
    table = SensitivityTable.load(args.sensitivity) if args.sensitivity else None
    plans = plans_to_compare(groups, table, args.bits if table else [], args.blind_bits if table else [])
    args.importance = None
    if args.grids == "fitted":
        args.importance = collect_importance(full.model, full.tokenizer)
        for base in ("uniform int4-g64", "uniform int8"):
            plans[base + MINMAX_SUFFIX] = (
                plans[base] if base in plans else uniform_plan(groups, base.split()[1])
            )
        if table is not None and table.info.get("quantiser", "min-max") != "importance-fitted":
            print(
                f"warning: {args.sensitivity} was profiled with min-max grids; mixed plans will be allocated "
                "on the wrong sensitivities (profile again, or pass --grids min-max)",
                file=sys.stderr,
            )
    plans[ENGINE_AUTO] = source_aligned_plan(full.model, "int8")
    plans.update(HEAD_ABLATIONS)
    if "quality" not in args.skip:
        torch.set_num_threads(args.quality_threads)
        quality_pass(full, groups, plans, args, out)
    if "decode" not in args.skip:
        labels = []
        for label in args.decode_for:
            if label == "chosen":
                quality = (
                    json.loads((out / "quality.json").read_text()) if (out / "quality.json").is_file() else {}
                )
                label, _ = chosen_operating_point(quality.get("operating_point") or {})
                if label is None:
                    print("no operating point in quality.json; 'chosen' skipped", file=sys.stderr)
                    continue
            if label != "bf16" and label not in plans:
                ap.error(f"--decode-for {label!r}: not a model of this run ({', '.join(plans)})")
            labels.append(label)
        decode_pass(full, groups, plans, list(dict.fromkeys(labels)), args, out)
    print(f"-> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
