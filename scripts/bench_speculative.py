#!/usr/bin/env python
"""Batch-1 decode speed with speculative decoding on and off, per workload, in one engine.

SmolLM2-135M-Instruct as the daemon runs it (catalogue GGUF, quant "auto"), greedy, the
workloads' own prompts (edge_rtgi.bench.workloads) plus a set chosen to defeat drafts (no text
to copy, little repetition). Each setting is one ``Speculator`` put on the same engine (None:
off); settings are interleaved prompt by prompt (every setting decodes one prompt, in a shuffled
order, before any goes on to the next), so that the machine's drift over a run hits them alike, and
each figure is the median over runs of the decode rate over a workload's prompts (tokens after the
first, over the time after the first). Beside the ratio of medians, the median and range over runs
of each run's own ratio to ``off`` (paired within the run).
The adaptive setting keeps its speculator across runs: learning is part of what it does.
Every setting runs as the engine's default does: on int8 activations where the CPU has AVX-512
VNNI and no AMX (``int8_activations: auto``, docs/engine.md), with drafts verified only within the
int8 kernel's rows; with ``--bf16`` (on such a CPU) also ``off-bf16`` and ``auto-bf16``, the same on
bf16 activations, as before int8 activations. Settings: off; ``auto`` as the engine
builds it (the n-gram draft and the ``retrieval`` draft over the catalogue's reply store); with
``--plain-cost-table`` also ``auto-ema`` (the same with the step-cost table's plain per-size EMAs,
as before it followed the machine's drift); ``auto-ngram`` (the n-gram draft alone, what ``auto``
ran before the reply store); ``auto-eagle`` (``auto`` plus the trained draft, the catalogue's or
``--draft-model``; not with ``--no-eagle``); each draft at fixed k; with ``--llamacpp K`` also
llama.cpp on the same GGUF and prompts, plain and with llama-cpp-python's prompt-lookup
speculation of K tokens (``pip install 'edge-rtgi[llamacpp]'``).

Also reported: acceptance rate and mean accepted length per draft per workload, and the measured
run time of a decode step by the number of tokens it carries (1 = plain decode, k+1 = verifying
k drafts), from the engine's own cost table.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_speculative.py [--runs 5] [--prompts 3]
        [--json docs/benchmarks/speculative.json]
    # only the step costs at 1..16 tokens, with more than 8 / 16 rows on the dense copies, paired:
    flock /tmp/bench.lock .venv/bin/python scripts/bench_speculative.py --step-costs 8,16 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from edge_rtgi.bench.peers import LlamaCppPeer
from edge_rtgi.bench.suite import stepped_engine
from edge_rtgi.bench.workloads import get_workload, prepare
from edge_rtgi.catalog import resolve_model
from edge_rtgi.llm.engine import LLMEngine, build_speculator, load_eagle_draft, load_retrieval_draft
from edge_rtgi.llm.quant.kernels import Int8ActivationSwitch, set_max_kernel_rows
from edge_rtgi.llm.request import RequestClass, RequestDelta
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.speculative import (
    Draft,
    FeatureDraft,
    NgramDraft,
    SpeculativeConfig,
    Speculator,
    StepCostTable,
)

WORKLOADS = ("code", "translation", "dialogue", "voice")
# Prompts with nothing to copy: drafts guess from text they have not seen
ADVERSARIAL = (
    "Invent ten new words and give each a one-line meaning.",
    "Write a short poem about a lighthouse, with no line repeated.",
    "List the planets of the solar system with one unusual fact about each.",
)
FIXED = (("ngram", 2), ("ngram", 4), ("ngram", 8), ("retrieval", 2), ("retrieval", 4))
EAGLE_FIXED = (("eagle", 2), ("eagle", 4), ("eagle", 6))
COST_SIZES = (1, 2, 3, 5, 9, 17)
# --step-costs: the kernel microbenchmark's row counts (scripts/bench_cpu_kernels.py --multi-row)
STEP_COST_SIZES = (1, 2, 4, 5, 8, 9, 12, 16)
MAX_TOKENS = 48


@dataclass
class Setting:
    name: str
    speculator: Speculator | None
    # the int4 layers on int8 activations where the engine's default has them; False: bf16
    int8: bool = True
    rates: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # (wall, cpu) tok/s
    accepted: dict[str, list[int]] = field(default_factory=dict)  # [drafts, accepted, verify steps]


@dataclass
class DecodeTiming:
    """Tokens decoded after each first token, and the wall and CPU seconds they took."""

    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def add(self, other: DecodeTiming) -> None:
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.cpu_s += other.cpu_s

    @property
    def rates(self) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second)."""
        return self.tokens / self.wall_s, self.tokens / self.cpu_s


def prompts_for(engine: LLMEngine, workload: str, count: int) -> list[tuple[list[int], RequestClass]]:
    tok = engine.tokenizer
    assert tok is not None
    if workload == "adversarial":
        return [
            (list(tok.encode_chat([{"role": "user", "content": p}])), RequestClass.DIALOGUE)
            for p in ADVERSARIAL[:count]
        ]
    prepared = prepare(get_workload(workload), tok)[:count]
    return [(list(p.prompt_token_ids), RequestClass(p.request_class)) for p in prepared]


def run_one(
    engine: LLMEngine, setting: Setting, workload: str, prompts, switch: Int8ActivationSwitch | None
) -> DecodeTiming:
    """Decoding ``prompts``: tokens after each first token, and the wall time and this process's
    CPU time they took (on a shared machine the CPU time is the steadier of the two)."""
    if switch is not None:
        switch.set(setting.int8)
    engine.speculator = setting.speculator
    engine.runner.collect_features = setting.speculator is not None and setting.speculator.wants_features
    before = engine.stats()
    steps_before = setting.speculator.stats.verify_steps if setting.speculator is not None else 0
    tokens, wall_s, cpu_s = 0, 0.0, 0.0
    for ids, cls in prompts:
        rid = f"{setting.name}-{workload}-{time.monotonic_ns()}"
        deltas: list[RequestDelta] = []
        engine.submit(
            ids, SamplingParams(max_tokens=MAX_TOKENS), deltas.append, request_id=rid, request_class=cls
        )
        while not deltas:  # prefill, up to the first token
            engine.step()
        wall, cpu = time.perf_counter(), time.process_time()
        while not deltas[-1].finished:
            engine.step()
        wall_s += time.perf_counter() - wall
        cpu_s += time.process_time() - cpu
        tokens += sum(len(d.token_ids) for d in deltas[1:])
    after = engine.stats()
    acc = setting.accepted.setdefault(workload, [0, 0, 0])
    acc[0] += after.spec_draft_tokens - before.spec_draft_tokens
    acc[1] += after.spec_accepted_tokens - before.spec_accepted_tokens
    if setting.speculator is not None:
        acc[2] += setting.speculator.stats.verify_steps - steps_before
    return DecodeTiming(tokens, wall_s, cpu_s)


class PeerSetting(Setting):
    """llama.cpp on the same GGUF and prompts, with or without its prompt-lookup speculation."""

    def __init__(self, name: str, peer: LlamaCppPeer):
        super().__init__(name, None)
        self.peer = peer


def run_peer(setting: PeerSetting, prompts) -> DecodeTiming:
    """``run_one`` for llama.cpp."""
    llm = setting.peer.llm
    tokens, wall_s, cpu_s = 0, 0.0, 0.0
    for ids, _ in prompts:
        produced = 0
        gen = llm.generate(list(ids), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True)
        for token in gen:
            produced += 1
            if produced == 1:
                wall, cpu = time.perf_counter(), time.process_time()
            if produced >= MAX_TOKENS or token == setting.peer.eos:
                break
        gen.close()
        wall_s += time.perf_counter() - wall
        cpu_s += time.process_time() - cpu
        tokens += produced - 1
    return DecodeTiming(tokens, wall_s, cpu_s)


def step_costs(
    engine: LLMEngine,
    sizes: tuple[int, ...],
    repeats: int,
    max_rows: tuple[int, ...] = (),
    context_tokens: int = 64,
) -> dict[tuple[int, int], tuple[float, float]]:
    """Run time of one batch-1 step carrying n tokens (the last token plus n-1 drafts) after a
    ``context_tokens`` context: median wall ms and CPU ms over ``repeats`` interleaved rounds, keyed by
    (kernel row limit, n) (limit 0: as loaded). The same step is re-run without being applied,
    so every round sees the same context; each row limit in ``max_rows`` is set in turn within
    every round (``quant.kernels.set_max_kernel_rows``)."""
    tok = engine.tokenizer
    assert tok is not None
    text = "The history of the printing press begins in the fifteenth century. "
    ids = tok.encode(text * (context_tokens // 8 + 1))[:context_tokens]
    deltas: list[RequestDelta] = []
    engine.speculator = None
    engine.runner.collect_features = False
    engine.submit(ids, SamplingParams(max_tokens=200, ignore_eos=True), deltas.append, request_id="cost")
    while not deltas:
        engine.step()
    req = engine.scheduler.requests["cost"]
    params = {"cost": SamplingParams(max_tokens=200, ignore_eos=True)}
    limits = max_rows or (0,)
    wall: dict[tuple[int, int], list[float]] = {(m, n): [] for m in limits for n in sizes}
    cpu: dict[tuple[int, int], list[float]] = {(m, n): [] for m in limits for n in sizes}
    for _ in range(repeats):
        for m in limits:
            if m:
                set_max_kernel_rows(engine.runner.model, m)
                # untimed: the first step after the change rebuilds the layer loop's plan
                req.draft_token_ids = []
                engine.runner.execute(engine.scheduler.schedule(), params)
            for n in sizes:
                req.draft_token_ids = list(ids[1:n])
                output = engine.scheduler.schedule()
                w, c = time.perf_counter(), time.process_time()
                engine.runner.execute(output, params)
                wall[m, n].append((time.perf_counter() - w) * 1e3)
                cpu[m, n].append((time.process_time() - c) * 1e3)
    req.draft_token_ids = []
    engine.abort("cost")
    engine.step()
    return {key: (statistics.median(wall[key]), statistics.median(cpu[key])) for key in wall}


def report_step_costs(
    engine: LLMEngine,
    rounds: int,
    limits: tuple[int, ...],
    json_path: str | None,
    sizes: tuple[int, ...] = STEP_COST_SIZES,
    context_tokens: int = 64,
) -> None:
    """``--step-costs``: only the step-cost table, at each kernel row limit, paired round by round."""
    sizes = tuple(sorted({1, *sizes}))
    for _ in range(2):  # warm-up: first-call kernels, each path once
        step_costs(engine, sizes, 1, limits, context_tokens)
    load_before, started = os.getloadavg(), time.time()
    costs = step_costs(engine, sizes, rounds, limits, context_tokens)
    load_after = os.getloadavg()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {rounds} rounds interleaved, "
        f"threads {torch.get_num_threads()}, load {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    print(f"batch-1 step carrying n tokens (n-1 drafts) after a {context_tokens}-token context, median ms")
    print("(ratio to n=1 at the same row limit; 'limit': auto_quant_kernel_max_rows(), more rows take")
    print("the dense copy)")
    for m in limits:
        for n in sizes:
            wall_ms, cpu_ms = costs[m, n]
            print(
                f"  limit {m:2d} n={n:2d}: wall {wall_ms:7.2f} ({wall_ms / costs[m, 1][0]:4.2f}x)  "
                f"cpu {cpu_ms:7.2f} ({cpu_ms / costs[m, 1][1]:4.2f}x)"
            )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                    "rounds": rounds,
                    "load": [load_before[0], load_after[0]],
                    "step_ms": {f"limit{m}/n{n}": {"wall": c[0], "cpu": c[1]} for (m, n), c in costs.items()},
                },
                f,
                indent=1,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default=",".join((*WORKLOADS, "adversarial")))
    ap.add_argument(
        "--fixed",
        default=",".join(f"{d}:{k}" for d, k in FIXED),
        help="the fixed (draft:k) settings beside off and the adaptive ones, comma-separated",
    )
    ap.add_argument("--json", default=None, help="write the raw figures here")
    ap.add_argument(
        "--step-costs",
        default=None,
        metavar="LIMITS",
        help="only time one step of n tokens (--step-sizes) at each of these kernel row limits (16,32)",
    )
    ap.add_argument("--rounds", type=int, default=15, help="--step-costs: interleaved rounds")
    ap.add_argument("--context-tokens", type=int, default=64, help="--step-costs: tokens before the step")
    ap.add_argument(
        "--step-sizes",
        default=",".join(map(str, STEP_COST_SIZES)),
        help="--step-costs: the tokens per step, comma-separated (1 is always included)",
    )
    ap.add_argument(
        "--draft-model",
        default=None,
        help="the eagle draft (catalogue name or path; default: the catalogue's)",
    )
    ap.add_argument(
        "--no-eagle", action="store_true", help="only the n-gram draft (the earlier runs' settings)"
    )
    ap.add_argument(
        "--plain-cost-table",
        action="store_true",
        help="also auto with plain per-size EMAs of step times (auto-ema: the cost table before it "
        "followed the machine's drift)",
    )
    ap.add_argument(
        "--llamacpp",
        type=int,
        default=0,
        metavar="K",
        help="also llama.cpp on the same GGUF, plain and with its prompt-lookup draft of K tokens",
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="also off and auto on bf16 activations (where the default rounds them to int8)",
    )
    args = ap.parse_args()
    engine = stepped_engine(args.threads)
    config = engine.config
    # the default's kernel on and off without repacking (None: the default keeps bf16 activations)
    switch = Int8ActivationSwitch.build(engine.model) if engine.int8_activation_layers else None
    if args.step_costs:
        limits = tuple(int(m) for m in args.step_costs.split(","))
        sizes = tuple(int(n) for n in args.step_sizes.split(","))
        report_step_costs(engine, args.rounds, limits, args.json, sizes, args.context_tokens)
        return
    workloads = args.workloads.split(",")

    def eagle() -> list[Draft]:
        return (
            []
            if args.no_eagle
            else [load_eagle_draft(args.draft_model, engine.model, engine.tokenizer, config.model)]
        )

    def retrieval(own: NgramDraft) -> list[Draft]:
        return [load_retrieval_draft(None, engine.model, engine.tokenizer, config.model, own)]

    def speculator(spec: SpeculativeConfig) -> Speculator:
        built = build_speculator(spec, engine.model, engine.tokenizer, config.model)
        assert built is not None, f"{spec} built no speculator (see the warning above)"
        return built

    auto = speculator(SpeculativeConfig("auto"))
    assert "retrieval" in auto.policy.drafts, "the catalogue's reply store did not load (see the log)"
    settings = [
        Setting("off", None),
        Setting("auto", auto),
        Setting("auto-ngram", Speculator(SpeculativeConfig("auto"), [NgramDraft()])),
    ]
    if switch is not None and args.bf16:
        settings.insert(1, Setting("off-bf16", None, int8=False))
        settings.append(Setting("auto-bf16", speculator(SpeculativeConfig("auto")), int8=False))
    if args.plain_cost_table:
        ema = speculator(SpeculativeConfig("auto"))
        ema.costs = ema.policy.costs = StepCostTable(follow_speed=False)
        settings.append(Setting("auto-ema", ema))
    fixed = [(d, int(k)) for d, _, k in (f.partition(":") for f in args.fixed.split(",") if f) if k.isdigit()]
    if len(fixed) != len([f for f in args.fixed.split(",") if f]):
        ap.error(f"--fixed takes draft:k settings, comma-separated (ngram:4,retrieval:2), got {args.fixed!r}")
    settings += [Setting(f"{d}:k={k}", speculator(SpeculativeConfig("fixed", d, k))) for d, k in fixed]
    if not args.no_eagle:
        ngram = NgramDraft()  # shared with the retrieval draft, as the engine builds it
        every = [ngram, *retrieval(ngram), *eagle()]
        settings.append(Setting("auto-eagle", Speculator(SpeculativeConfig("auto"), every)))
        settings += [
            Setting(f"{d}:k={k}", Speculator(SpeculativeConfig("fixed", d, k), eagle()))
            for d, k in EAGLE_FIXED
        ]
    if args.llamacpp:  # llama-cpp-python: pip install 'edge-rtgi[llamacpp]' (docs/benchmarks.md)
        gguf = resolve_model(config.model, role="llm")
        settings.append(PeerSetting("llama.cpp", LlamaCppPeer(gguf, args.threads)))
        lookup = LlamaCppPeer(gguf, args.threads, prompt_lookup_tokens=args.llamacpp)
        settings.append(PeerSetting(f"lcpp-pl:{args.llamacpp}", lookup))
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        ap.error(f"settings must have different names, got {names}")
    prompts = {w: prompts_for(engine, w, args.prompts) for w in workloads}
    for w in workloads:  # warm-up: first-call kernels, allocator
        run_one(engine, settings[0], w, prompts[w][:1], switch)
    order = random.Random(0)
    load_before = os.getloadavg()
    started = time.time()
    for _ in range(args.runs):
        for w in workloads:
            timings = {s.name: DecodeTiming() for s in settings}
            for prompt in prompts[w]:
                shuffled = list(settings)
                order.shuffle(shuffled)
                for s in shuffled:
                    one = [prompt]
                    timings[s.name].add(
                        run_peer(s, one) if isinstance(s, PeerSetting) else run_one(engine, s, w, one, switch)
                    )
            for s in settings:
                s.rates.setdefault(w, []).append(timings[s.name].rates)
    load_after = os.getloadavg()
    if switch is not None:
        switch.set(True)
    costs = {n: c for (_, n), c in step_costs(engine, COST_SIZES, max(args.runs, 5) * 2).items()}
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {args.runs} runs, "
        f"{args.prompts} prompts/workload, max_tokens {MAX_TOKENS}, greedy, threads {args.threads}, "
        f"load {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    print("decode rate per CPU second (median over runs), its ratio to off, and the wall-clock ratio;")
    print("a = acceptance rate of draft tokens, L = mean accepted tokens per verification step;")
    print("p = median [min-max] over runs of the run's own CPU-second ratio to off")
    print(f"{'setting':<11}" + "".join(f"{w:>54}" for w in workloads))
    off_cpu = {w: statistics.median(r[1] for r in settings[0].rates[w]) for w in workloads}
    off_wall = {w: statistics.median(r[0] for r in settings[0].rates[w]) for w in workloads}
    report: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "runs": args.runs,
        "prompts_per_workload": args.prompts,
        "interleaved": "per prompt",
        "load": [load_before[0], load_after[0]],
        "settings": {},
    }
    for s in settings:
        cells = []
        for w in workloads:
            cpu = statistics.median(r[1] for r in s.rates[w])
            wall = statistics.median(r[0] for r in s.rates[w])
            drafts, accepted, steps = s.accepted.get(w, [0, 0, 0])
            rate = accepted / drafts if drafts else 0.0
            length = accepted / steps if steps else 0.0
            paired = [r[1] / o[1] for r, o in zip(s.rates[w], settings[0].rates[w], strict=True)]
            cells.append(
                f"{cpu:6.1f} {cpu / off_cpu[w]:4.2f}x w{wall / off_wall[w]:4.2f}x "
                f"a{rate:4.2f} L{length:4.2f} "
                f"p{statistics.median(paired):4.2f}[{min(paired):4.2f}-{max(paired):4.2f}]"
            )
            report["settings"][f"{s.name}/{w}"] = {  # type: ignore[index]
                "tok_per_wall_s": [r[0] for r in s.rates[w]],
                "tok_per_cpu_s": [r[1] for r in s.rates[w]],
                "speedup_cpu": cpu / off_cpu[w],
                "speedup_wall": wall / off_wall[w],
                "paired_speedup_cpu_by_run": paired,
                "draft_tokens": drafts,
                "accepted_tokens": accepted,
                "verify_steps": steps,
            }
        print(f"{s.name:<11}" + "".join(f"{c:>54}" for c in cells))
    print("\nbatch-1 step carrying n tokens (n-1 drafts) after a 64-token context, median ms:")
    for n, (wall_ms, cpu_ms) in costs.items():
        print(
            f"  n={n:2d}: wall {wall_ms:7.2f} ({wall_ms / costs[1][0]:4.2f}x)  "
            f"cpu {cpu_ms:7.2f} ({cpu_ms / costs[1][1]:4.2f}x)"
        )
    report["step_ms_by_tokens"] = {n: {"wall": c[0], "cpu": c[1]} for n, c in costs.items()}
    draft_ms = {
        s.name: d.cost_ms_per_token
        for s in settings
        if s.speculator is not None
        for d in s.speculator.policy.drafts.values()
        if isinstance(d, FeatureDraft) and d.cost_ms_per_token is not None
    }
    if draft_ms:
        print(
            "trained draft's own time per drafted token (EMA, ms): "
            + ", ".join(f"{n} {ms:.2f}" for n, ms in draft_ms.items())
        )
    report["draft_ms_per_token"] = draft_ms
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
