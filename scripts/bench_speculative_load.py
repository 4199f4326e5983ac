#!/usr/bin/env python
"""Speculation under concurrent load: ``auto`` as the engine builds it (the n-gram draft and the
catalogue's reply store), and ``auto-ngram`` (the n-gram draft alone, the earlier runs' ``auto``),
against ``off`` on one engine, every setting on the engine's default kernels (int8 activations
where ``int8_activations: auto`` turns them on: a VNNI CPU without AMX; drafts are then verified
only in decode steps within the int8 kernel's rows).

16 prompts (4 each of dialogue, voice, code, translation), 48 tokens, greedy, submitted in groups
of 1, 4 and 8 at once; per setting the median over ``--rounds`` rounds, the settings in a
rotating order, of the decode throughput (tokens over the group's wall time) and of the p50 / p95
gap between token deliveries, and the paired ratio to ``off`` of the same round in tokens per CPU
second (median and range over rounds: on a shared machine the steadier figure).

    flock /tmp/bench.lock .venv/bin/python scripts/bench_speculative_load.py [--rounds 3]
"""

import argparse
import os
import statistics
import time

from edge_rtgi.bench.suite import stepped_engine
from edge_rtgi.bench.workloads import get_workload, prepare
from edge_rtgi.llm.engine import build_speculator
from edge_rtgi.llm.request import RequestClass
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.speculative import NgramDraft, SpeculativeConfig, Speculator

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rounds", type=int, default=3)
rounds = ap.parse_args().rounds
engine = stepped_engine(2)
tok = engine.tokenizer
items = []
for w in ("dialogue", "voice", "code", "translation"):
    items += [
        (list(p.prompt_token_ids), RequestClass(p.request_class)) for p in prepare(get_workload(w), tok)[:4]
    ]


def run(spec, batch):
    """(throughput in tok/s, gap p50 ms, gap p95 ms, tokens per CPU second) over all groups."""
    engine.speculator = spec
    res = []
    cpu0, tokens = time.process_time(), 0
    for start in range(0, len(items), batch):
        group = items[start : start + batch]
        times = {}
        for i, (ids, cls) in enumerate(group):
            rid = f"r{time.monotonic_ns()}-{i}"
            times[rid] = []
            engine.submit(
                ids,
                SamplingParams(max_tokens=48),
                lambda d, log=times[rid]: log.append((time.perf_counter(), len(d.token_ids), d.finished)),
                request_id=rid,
                request_class=cls,
            )
        t0 = time.perf_counter()
        while any(not t or not t[-1][2] for t in times.values()):
            engine.step()
        wall = time.perf_counter() - t0
        toks = sum(n for t in times.values() for _, n, _ in t)
        tokens += toks
        gaps = [b[0] - a[0] for t in times.values() for a, b in zip(t, t[1:], strict=False)]
        res.append((toks / wall, gaps))
    rate = sum(r[0] for r in res) / len(res)
    gaps = [g for r in res for g in r[1]]
    gaps.sort()
    per_cpu_s = tokens / (time.process_time() - cpu0)
    return rate, gaps[len(gaps) // 2] * 1e3, gaps[int(len(gaps) * 0.95)] * 1e3, per_cpu_s


auto = build_speculator(SpeculativeConfig("auto"), engine.model, tok, engine.config.model)
ngram_only = Speculator(SpeculativeConfig("auto"), [NgramDraft()])
settings = [("off", None), ("auto", auto), ("auto-ngram", ngram_only)]
for batch in (1, 4, 8):
    run(None, batch)
    out: dict[str, list] = {name: [] for name, _ in settings}
    for r in range(rounds):
        turn = r % len(settings)
        for name, spec in settings[turn:] + settings[:turn]:
            out[name].append(run(spec, batch))
    for name, rows in out.items():
        rate = statistics.median(r[0] for r in rows)
        p50, p95 = statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)
        paired = [r[3] / o[3] for r, o in zip(rows, out["off"], strict=True)]
        print(
            f"batch {batch} {name}: tok/s {rate:.1f}  gap p50 {p50:.1f} ms  p95 {p95:.1f} ms  "
            f"per CPU s {statistics.median(paired):.3f}x off [{min(paired):.3f}-{max(paired):.3f}]  "
            f"({rounds} rounds)"
        )
print("load", os.getloadavg())
