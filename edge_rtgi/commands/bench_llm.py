"""``edge-rtgi bench llm``: the engine against HF transformers fp32 on one model (see bench/llm.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from edge_rtgi.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    from edge_rtgi.commands.bench import add_bench_subcommand

    help_text = "engine vs HF transformers: batch-1 decode, TTFT cold/cached, 16-request throughput"
    p = add_bench_subcommand("llm", help=help_text, description=help_text)
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or path")
    p.add_argument("--dtype", default="auto", help="engine dtype: auto (bf16 where native), fp32, bf16")
    p.add_argument(
        "--quant",
        default="auto",
        help="our weights: auto (the engine default; bf16 CPU: Q4_1 blocks as int4-g32, the rest int8), "
        "none, int8, int4-g64 or a plan YAML",
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs per figure (median reported)")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens in the batch-1 decode run")
    p.add_argument("--ttft-prompt-tokens", type=int, default=512, help="prompt length of the TTFT runs")
    p.add_argument(
        "--cached-prefix-tokens",
        type=int,
        default=448,
        help="of which this many are a shared prefix, cached by an earlier request",
    )
    p.add_argument("--concurrency", type=int, default=16, help="requests in the throughput run")
    p.add_argument("--concurrent-max-tokens", type=int, default=32, help="new tokens per throughput request")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--report", metavar="DIR", help="write llm.md and llm.json into DIR")
    p.set_defaults(func=cmd_bench_llm)


def cmd_bench_llm(args: argparse.Namespace) -> int:
    from edge_rtgi.bench.llm import LLMBenchConfig, render, run_llm_bench

    if args.runs < 1 or args.decode_tokens < 2 or args.concurrency < 1 or args.concurrent_max_tokens < 1:
        raise ConfigError(
            "--runs, --concurrency and --concurrent-max-tokens must be >= 1, --decode-tokens >= 2"
        )
    if not 0 < args.cached_prefix_tokens < args.ttft_prompt_tokens:
        raise ConfigError(
            f"--cached-prefix-tokens ({args.cached_prefix_tokens}) must be between 0 and "
            f"--ttft-prompt-tokens ({args.ttft_prompt_tokens})"
        )
    cfg = replace(
        LLMBenchConfig(),
        model=args.model,
        dtype=args.dtype,
        quant=args.quant,
        runs=args.runs,
        decode_tokens=args.decode_tokens,
        ttft_prompt_tokens=args.ttft_prompt_tokens,
        cached_prefix_tokens=args.cached_prefix_tokens,
        concurrency=args.concurrency,
        concurrent_max_tokens=args.concurrent_max_tokens,
        num_threads=args.threads,
        hf=not args.no_hf,
    )
    results = run_llm_bench(cfg)
    text = render(results)
    print(text)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "llm.json").write_text(json.dumps(results, indent=1))
        (out / "llm.md").write_text("# edge-rtgi bench llm\n\n" + text + "\n")
        print(f"report written to {out / 'llm.md'}")
    return 0
