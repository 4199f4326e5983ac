#!/usr/bin/env python3
"""Quantisation benchmark: kernels per shape, decode speed, resident size, mixed vs uniform quality.

Everything is measured in one run against baselines from the same run (medians over --runs):

- kernels: each SmolLM2 matrix shape at batch 1 and 8, fp32 vs bf16 activations: F.linear
  against the int8 and int4 weight-only kernels;
- decode: greedy batch-1 decode (64-token prompt, 128 new tokens) on the project's plain path
  (``edge_rtgi.llm.generate``) for fp32, bf16, uniform int8/int4 and the mixed plans, plus
  llama.cpp on the original Q4_1 GGUF when llama-cpp-python is installed;
- memory: resident bytes of every model's weights (parameters + buffers);
- quality: mixed plans from a sensitivity table vs uniform plans of equal size, on the held-out text.

    python scripts/bench_quant.py --sensitivity sens.yaml --out bench_out/quant
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from edge_rtgi.llm.generate import generate_stream
from edge_rtgi.llm.quant.allocate import Budget, allocate
from edge_rtgi.llm.quant.kernels import make_quant_linear
from edge_rtgi.llm.quant.plan import (
    QuantPlan,
    apply_quant_plan,
    model_groups,
    plan_bits_per_weight,
    plan_nbytes,
    uniform_plan,
)
from edge_rtgi.llm.quant.profile import SensitivityTable, calibration_text
from edge_rtgi.llm.quant.report import compare_quality
from edge_rtgi.llm.quant.schemes import parse_scheme, quantize_weight
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model

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
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k) * 0.02
        for batch in (1, 8):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(batch, k).to(dtype)
                wd = w.to(dtype)
                row = {"shape": name, "n": n, "k": k, "batch": batch, "act": str(dtype).replace("torch.", ""),
                       "F.linear": 1e6 * median_time(lambda x=x, wd=wd: F.linear(x, wd), runs)}
                for scheme in ("int8", "int4-g32", "int4-g64"):
                    layer = make_quant_linear(quantize_weight(w, parse_scheme(scheme)), None, dtype, torch.device("cpu"))
                    row[scheme] = 1e6 * median_time(lambda x=x, layer=layer: layer(x), runs)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def decode_speed(model, tokenizer, prompt: list[int], runs: int) -> dict:
    """Median decode tok/s (after the first token) and median time to first token, batch 1."""
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    rates, ttfts = [], []
    for _ in range(runs + 1):  # the first run warms up
        start = time.perf_counter()
        first = None
        count = 0
        for delta in generate_stream((model, tokenizer), prompt, params):
            count += len(delta.token_ids)
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        rates.append((count - 1) / (end - first))
        ttfts.append(first - start)
    return {"decode_tok_s": statistics.median(rates[1:]), "ttft_ms": 1e3 * statistics.median(ttfts[1:]),
            "runs": runs}


def llamacpp_speed(gguf: Path, prompt: list[int], runs: int, threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, n_batch=64, verbose=False)
    rates, ttfts = [], []
    for _ in range(runs + 1):
        llm.reset()
        start = time.perf_counter()
        first, count = None, 0
        for _tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            if first is None:
                first = time.perf_counter()
            if count == NEW_TOKENS:
                break
        end = time.perf_counter()
        rates.append((count - 1) / (end - first))
        ttfts.append(first - start)
    return {"decode_tok_s": statistics.median(rates[1:]), "ttft_ms": 1e3 * statistics.median(ttfts[1:]), "runs": runs}


def resident_mb(model) -> float:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 1e6


def quantised_copy(full, plan: QuantPlan):
    model = copy.deepcopy(full)
    apply_quant_plan(model, plan, dtype=torch.bfloat16)
    return model


def plans_to_compare(groups, table: SensitivityTable | None, extra_bits: list[float]) -> dict[str, QuantPlan]:
    """Uniform plans, and mixed plans of exactly the uniform plans' sizes (same candidate family)."""
    plans = {f"uniform {s}": uniform_plan(groups, s) for s in ("int4-g64", "int4sym-g64", "int4sym-g32", "int8")}
    if table is None:
        return plans
    asym, sym = ("int8", "int4-g64", "int4-g128"), ("int8", "int4sym-g32", "int4sym-g64", "int4sym-g128")
    for base, family, label in (("uniform int4-g64", asym, "asym g64/g128+int8"),
                                ("uniform int4sym-g64", sym, "sym+int8"), ("uniform int4sym-g32", sym, "sym+int8")):
        size = plan_nbytes(plans[base].resolved(groups), groups)
        plans[f"mixed {label} @ {base.split()[1]} size"] = allocate(groups, table, Budget(size, f"{size} B"), family)
    for bits in extra_bits:
        plans[f"mixed all @ {bits} bits"] = allocate(groups, table, Budget.from_args(groups, bits, None))
    return plans


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sensitivity", help="table from `edge-rtgi quantize --profile` (enables mixed plans)")
    ap.add_argument("--out", default="bench_out/quant")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bits", type=float, nargs="*", default=[4.75, 5.5], help="extra mixed budgets (all candidates)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernels", "decode", "quality"])
    ap.add_argument("--decode-for", nargs="*", help="measure decode only for models whose label starts with one of these")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts for the chrF retention")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"threads": args.threads, "runs": args.runs}
    if "kernels" not in args.skip:
        results["kernels_us"] = bench_kernels(max(args.runs, 20))
    full = load_model(args.model, device="cpu", dtype="fp32")
    groups = model_groups(full.model)
    table = SensitivityTable.load(args.sensitivity) if args.sensitivity else None
    plans = plans_to_compare(groups, table, args.bits if table else [])
    prompt = full.tokenizer.encode(calibration_text("heldout"))[:PROMPT_TOKENS]
    rows, full_cache = {}, {}
    for label, plan in [("fp32 (full)", None), ("bf16", None)] + list(plans.items()):
        if label == "fp32 (full)":
            model = full.model
        elif label == "bf16":
            model = copy.deepcopy(full.model).to(torch.bfloat16)
        else:
            model = quantised_copy(full.model, plan)
        row = {"resident_weights_mb": round(resident_mb(model), 2)}
        if plan is not None:
            resolved = plan.resolved(groups)
            row.update(bits_per_weight=round(plan_bits_per_weight(resolved, groups), 4),
                       groups_mb=round(plan_nbytes(resolved, groups) / 1e6, 2), plan=resolved)
        if "decode" not in args.skip and (not args.decode_for or label.startswith(tuple(args.decode_for))):
            row.update(decode_speed(model, full.tokenizer, prompt, args.runs))
        if "quality" not in args.skip and model is not full.model:
            row.update(vars(compare_quality(full.model, model, full.tokenizer, calibration_text("heldout"),
                                            max_prompts=args.prompts, full_cache=full_cache)))
        rows[label] = row
        print(label, json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)
        if model is not full.model:
            del model
    if "decode" not in args.skip:
        lcpp = llamacpp_speed(full.source, prompt, args.runs, args.threads) if str(full.source).endswith(".gguf") else None
        rows["llama.cpp Q4_1"] = lcpp or {"note": "llama-cpp-python is not installed"}
        print("llama.cpp Q4_1", json.dumps(rows["llama.cpp Q4_1"]), flush=True)
    results["models"] = rows
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(f"-> {out / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
