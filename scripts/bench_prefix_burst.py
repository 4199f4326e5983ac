#!/usr/bin/env python3
"""A burst of voice turns on a cold prefix cache: waiting for a prefix in flight, or not.

N voice turns (the workload's prompts: one system prompt, a short question each) submitted at
once to an engine whose prefix cache was just emptied, as a daemon's first turns from several
sessions arrive. "wait" is the shipped scheduler (a prompt whose next block another request is
computing waits a step and reuses it: ``KVCacheManager.prefix_in_flight``); "no-wait" computes
the shared prompt once per request, side by side. The two alternate round by round on one
engine; medians over rounds of the burst's earliest, median and last first token (ms after
submission) and their ratio wait / no-wait.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_prefix_burst.py --turns 4 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import time

from edge_rtgi.bench.suite import stepped_engine
from edge_rtgi.bench.workloads import get_workload, prepare
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.request import RequestDelta
from edge_rtgi.llm.sampling import SamplingParams


def burst(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[float]:
    """First-token times (ms after submission, sorted) of ``prompts`` submitted at once."""
    engine.reset_prefix_cache()
    firsts: dict[int, float] = {}

    def sink(i: int):
        return lambda delta: (
            firsts.setdefault(i, time.perf_counter()) if isinstance(delta, RequestDelta) else None
        )

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True), sink(i), request_id=f"{tag}-{i}")
    engine.step()
    while engine.scheduler.has_unfinished():
        engine.step()
    return sorted((t - start) * 1e3 for t in firsts.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engine = stepped_engine(args.threads)
    prompts = [list(p.prompt_token_ids) for p in prepare(get_workload("voice"), engine.tokenizer)][
        : args.turns
    ]
    shipped = engine.kv.prefix_in_flight
    times: dict[str, list[list[float]]] = {"wait": [], "no-wait": []}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for arm in ("wait", "no-wait") if rnd % 2 else ("no-wait", "wait"):
            engine.kv.prefix_in_flight = shipped if arm == "wait" else (lambda *a: False)  # type: ignore[method-assign]
            got = burst(engine, prompts, f"{arm}{rnd}")
            if rnd:
                times[arm].append(got)
    sizes = [len(p) for p in prompts]
    print(f"{args.turns} voice turns of {sizes} tokens at once, cold cache, {args.rounds} rounds")
    for label, pick in (("earliest", min), ("median", statistics.median), ("last", max)):
        wait = [pick(t) for t in times["wait"]]
        plain = [pick(t) for t in times["no-wait"]]
        ratio = statistics.median(a / b for a, b in zip(wait, plain, strict=True))
        print(
            f"{label:>8} first token: wait {statistics.median(wait):6.0f} ms, "
            f"no-wait {statistics.median(plain):6.0f} ms, ratio {ratio:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
