#!/usr/bin/env python
"""Batch-1 decode speed of the plain generation path against HF transformers, in one run.

SmolLM2-135M-Instruct (the catalogue's GGUF, dequantised), a 64-token prompt, 128 new
tokens, greedy with EOS ignored. Decode tok/s excludes the prefill: each engine is timed
generating 128 tokens and generating 1 token, and decode tok/s = 127 / (t_128 - t_1).
Each figure is the median of --runs runs; CPU ms per decoded token is reported beside the wall
figure. Prints a table and the ratios to HF fp32 eager.

    .venv/bin/python scripts/bench_decode.py [--runs 3] [--threads 2] [--model NAME|PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

PROMPT_TOKENS, NEW_TOKENS = 64, 128
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made, how ideas spread, and who could read them. "
) * 8


def decode_speed(run: Callable[[int], None], runs: int) -> tuple[float, float, list[float]]:
    """Median decode tok/s (wall) and median CPU ms per decoded token of ``run(new_tokens)``.

    Each run pairs a 128-token and a 1-token generation, so the prefill cancels out. CPU time
    (this process, all threads) is reported too because on a shared machine wall time mostly
    measures the other tenants.
    """
    run(4)  # warm-up: allocator, lazy init, first-call kernels
    rates, cpu_ms = [], []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        run(1)
        one_wall, one_cpu = time.perf_counter() - wall, time.process_time() - cpu
        wall, cpu = time.perf_counter(), time.process_time()
        run(NEW_TOKENS)
        full_wall, full_cpu = time.perf_counter() - wall, time.process_time() - cpu
        rates.append((NEW_TOKENS - 1) / (full_wall - one_wall))
        cpu_ms.append(1000 * (full_cpu - one_cpu) / (NEW_TOKENS - 1))
    return statistics.median(rates), statistics.median(cpu_ms), rates


def ours(model_path, dtype: str) -> Callable[[list[int]], Callable[[int], None]]:
    from edge_rtgi.llm.generate import generate
    from edge_rtgi.llm.sampling import SamplingParams
    from edge_rtgi.llm.weights import load_model

    loaded = load_model(model_path, device="cpu", dtype=dtype)

    def make(ids: list[int]) -> Callable[[int], None]:
        def run(n: int) -> None:
            result = generate(loaded, ids, SamplingParams(max_tokens=n, ignore_eos=True))
            assert len(result.token_ids) == n

        return run

    return make


def hf(model_path) -> Callable[[list[int]], Callable[[int], None]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def make(ids: list[int]) -> Callable[[int], None]:
        x = torch.tensor([ids])
        mask = torch.ones_like(x)

        def run(n: int) -> None:
            with torch.inference_mode():
                out = model.generate(
                    x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
                )
            assert out.shape[1] == len(ids) + n

        return run

    return make


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.llm.weights import load_model

    path = resolve_model(args.model, role="llm")
    tokenizer = load_model(path, device="cpu", dtype="fp32").tokenizer
    ids = tokenizer.encode(TEXT)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS

    contenders = [
        ("HF transformers fp32 eager", lambda: hf(path)),
        ("edge-rtgi plain fp32", lambda: ours(path, "fp32")),
        ("edge-rtgi plain bf16", lambda: ours(path, "bf16")),
    ]
    results = {}
    for name, build in contenders:
        rate, cpu_ms, rates = decode_speed(build()(ids), args.runs)
        results[name] = (rate, cpu_ms)
        print(
            f"{name:30s} {rate:7.1f} tok/s  {cpu_ms:7.1f} CPU ms/token  "
            f"(tok/s runs: {', '.join(f'{r:.1f}' for r in rates)})",
            flush=True,
        )
    base_rate, base_cpu = results[contenders[0][0]]
    print(
        f"\nbatch 1, {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, greedy, median of {args.runs}, "
        f"{args.threads} threads, model {path.name}"
    )
    for name, (rate, cpu_ms) in results.items():
        print(
            f"  {name:30s} {rate / base_rate:5.2f}x HF tok/s   {base_cpu / cpu_ms:5.2f}x less CPU per token"
        )


if __name__ == "__main__":
    main()
