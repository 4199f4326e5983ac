#!/usr/bin/env python3
"""Routing benchmark: a router between two backends against always-small and always-big.

For each item of a graded task set (edge_rtgi/bench/tasks.py, docs/task-sets.md), the same
request goes to the small backend alone, the big backend alone, and the router (the
confidence cascade, or the features rule), in an order that rotates from item to item so
that load on a shared machine falls on all three alike. Printed: quality (the set's metric,
and the router's and the small model's retention against always-big, with paired-bootstrap
intervals; retention is capped at 1, as everywhere, and the uncapped ratio is printed beside
it since a small model can beat the big one), the share of turns escalated, the big model's
tokens per item (probes included) as a share of always-big's, and mean and p95 latency of
each (after one untimed call to each backend), with the load average.

A backend is ``local:<catalogue model or path>`` or ``openai:<model>@<base_url>`` (any
OpenAI-compatible server: vLLM, llama.cpp, another edge-rtgi daemon):

    python scripts/bench_routing.py --small local:smollm2-135m-instruct \\
        --big local:gemma-3-270m --set code --limit 60
    python scripts/bench_routing.py --small local:smollm2-135m-instruct \\
        --big openai:Qwen/Qwen2.5-7B-Instruct@http://gpu-host:8000/v1 --set voice \\
        --threshold 1.0 --threshold 2.0
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

from edge_rtgi.bench.metrics import percentile
from edge_rtgi.bench.task_eval import TaskOutputs, select_items, task_retention
from edge_rtgi.bench.tasks import TASK_SET_NAMES, build_prompt, load_task_set, max_new_tokens
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.backends.base import BackendRequest, LlmBackend, Message
from edge_rtgi.pipeline.backends.config import LlmBackendConfig, RouterConfig
from edge_rtgi.pipeline.backends.local import LocalBackend
from edge_rtgi.pipeline.backends.router import RouterBackend
from edge_rtgi.pipeline.resources import Resources


def backend_spec(text: str) -> LlmBackendConfig:
    """``local:<model>`` or ``openai:<model>@<base_url>``."""
    kind, _, rest = text.partition(":")
    if kind == "local" and rest:
        return LlmBackendConfig("local", rest)
    if kind == "openai" and "@" in rest:
        model, _, url = rest.rpartition("@")
        return LlmBackendConfig("openai", model, base_url=url, api_key_env="ROUTING_API_KEY")
    raise argparse.ArgumentTypeError(f"{text!r}: use local:<model> or openai:<model>@<base_url>")


@dataclass
class Run:
    """One configuration's outputs and costs, in item order."""

    name: str
    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    big_tokens: list[int] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    escalated: list[bool] = field(default_factory=list)


async def call(
    backend: LlmBackend, request: BackendRequest, big_name: str
) -> tuple[str, int, int, float, bool]:
    """(text, completion tokens, big-model tokens, latency ms, escalated)."""
    start_s = time.monotonic()
    text, result = "", None
    async with aclosing(backend.stream(request)) as deltas:
        async for delta in deltas:
            text += delta.text
            result = delta.result or result
    assert result is not None
    latency_ms = (time.monotonic() - start_s) * 1000.0
    tokens = result.completion_tokens or 0
    route = result.route
    big = tokens if result.backend == big_name else 0
    if route is not None:
        big += sum(t.completion_tokens or 0 for t in route.tried if t.backend == big_name)
    escalated = route is not None and result.backend == big_name
    return text, tokens, big, latency_ms, escalated


async def main(args: argparse.Namespace) -> dict:
    resources = Resources(EngineConfig())
    small_spec, big_spec = args.small, args.big
    small, big = await asyncio.gather(
        asyncio.to_thread(resources.llm_backend, small_spec),
        asyncio.to_thread(resources.llm_backend, big_spec),
    )
    for b in (small, big):
        if problem := await b.check():
            sys.exit(f"bench_routing: {problem}")
    routers = {
        f"router(H<={t:g})": RouterBackend(
            RouterConfig(
                (small_spec, big_spec), "confidence", probe_tokens=args.probe_tokens, max_mean_entropy_nats=t
            ),
            [small, big],
        )
        for t in args.threshold
    }
    tokenizer = next((b.tokenizer for b in (small, big) if isinstance(b, LocalBackend)), None)
    task_set = load_task_set(args.set)
    items = select_items(task_set, args.limit)
    # one untimed call to each backend first (the small one with entropies, as the router
    # probes it): a first call's start-up cost would otherwise land on one config's latency
    warm = BackendRequest("warm-up", 4, text="def main():", add_special_tokens=True)
    for backend, logprobs in ((small, True), (big, False)):
        await call(backend, dataclasses.replace(warm, logprobs=logprobs), big.name)
    configs: dict[str, LlmBackend] = {"always-small": small, "always-big": big, **routers}
    runs = {name: Run(name) for name in configs}
    order = list(configs)
    for i, item in enumerate(items):
        prompt = build_prompt(item)
        if tokenizer is None and set_needs_tokenizer(args.set):
            sys.exit("bench_routing: the translation budget needs a local backend's tokenizer")
        budget = max_new_tokens(item, tokenizer) if tokenizer is not None else 48
        request = BackendRequest(
            f"{item.id}-{i}",
            budget,
            messages=tuple(Message(m["role"], m["content"]) for m in prompt.messages or ()),
            text=prompt.text,
            # a raw (code) prompt gets the tokenizer's BOS, as the daemon's raw prompts do: a base
            # model such as Gemma 3 degenerates without it; SmolLM2's tokenizer adds none
            add_special_tokens=prompt.text is not None,
        )
        rotated = order[i % len(order) :] + order[: i % len(order)]  # interleaved: no config always first
        for name in rotated:
            text, tokens, big_tokens, ms, escalated = await call(configs[name], request, big.name)
            run = runs[name]
            run.texts.append(text)
            run.tokens.append(tokens)
            run.big_tokens.append(big_tokens)
            run.latency_ms.append(ms)
            run.escalated.append(escalated)
        print(f"\r{i + 1}/{len(items)} items", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    await resources.aclose_backends()
    resources.close()

    ids = tuple(item.id for item in items)

    def outputs(run: Run) -> TaskOutputs:
        return TaskOutputs(args.set, ids, tuple(run.texts), tuple(run.tokens))

    big_run = runs["always-big"]
    big_total = sum(big_run.big_tokens) or 1
    report: dict = {
        "set": args.set,
        "items": len(items),
        "small": small.name,
        "big": big.name,
        "probe_tokens": args.probe_tokens,
        "load_average": os.getloadavg(),
        "configs": {},
    }
    for name, run in runs.items():
        retention = task_retention(task_set, outputs(run), outputs(big_run))
        report["configs"][name] = {
            "score": retention.interval.optimised_score,
            "retention_vs_big": retention.interval.ratio,
            "retention_uncapped": retention.interval.uncapped,
            "retention_low": retention.interval.low,
            "retention_high": retention.interval.high,
            "escalated_share": sum(run.escalated) / len(items),
            "big_token_share": sum(run.big_tokens) / big_total,
            "mean_latency_ms": sum(run.latency_ms) / len(items),
            "p95_latency_ms": percentile(run.latency_ms, 95),
        }
    return report


def set_needs_tokenizer(name: str) -> bool:
    return name == "translation"


def print_report(report: dict) -> None:
    print(
        f"set {report['set']}, {report['items']} items; small {report['small']}, big {report['big']}; "
        f"probe {report['probe_tokens']} tokens; load average "
        + ", ".join(f"{x:.2f}" for x in report["load_average"])
    )
    print(
        f"{'config':<18} {'score':>7} {'ret. vs big [95% CI]':>22} {'uncapped':>8} "
        f"{'escalated':>9} {'big tok':>8} {'mean ms':>8} {'p95 ms':>8}"
    )
    for name, c in report["configs"].items():
        ci = f"{c['retention_vs_big']:.3f} [{c['retention_low']:.2f}, {c['retention_high']:.2f}]"
        print(
            f"{name:<18} {c['score']:>7.3f} {ci:>22} {c['retention_uncapped']:>8.3f} "
            f"{c['escalated_share']:>9.0%} {c['big_token_share']:>8.0%} "
            f"{c['mean_latency_ms']:>8.0f} {c['p95_latency_ms']:>8.0f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--small", type=backend_spec, required=True, help="local:<model> or openai:<model>@<url>"
    )
    parser.add_argument(
        "--big", type=backend_spec, required=True, help="local:<model> or openai:<model>@<url>"
    )
    parser.add_argument("--set", choices=TASK_SET_NAMES, default="code")
    parser.add_argument("--limit", type=int, default=40, help="items, spread over the set")
    parser.add_argument("--probe-tokens", type=int, default=8)
    parser.add_argument(
        "--threshold", type=float, action="append", help="max mean entropy (nats); repeatable"
    )
    parser.add_argument("--out", type=Path, help="write the report as JSON here too")
    ns = parser.parse_args()
    ns.threshold = ns.threshold or [1.5]
    result = asyncio.run(main(ns))
    print_report(result)
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=2) + "\n")
