"""``edge-rtgi bench``: the real-time workloads, ramp, ablations and peers, with reports.

Subcommands choose which sections run (``all`` runs every one); ``--report DIR`` writes
report.md, results.json and PNG figures there. ``report`` re-renders a saved results.json.
Other bench subcommands (such as ``bench llm``) register on the same group through
``add_bench_subcommand``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_rtgi.errors import ConfigError

if TYPE_CHECKING:
    from edge_rtgi.bench.suite import BenchConfig

SUBCOMMANDS = {
    "workloads": (
        "the four real-time workloads at their offered loads, with quality retention and RTIQ",
        ("workloads",),
    ),
    "ramp": ("Poisson stages at rising rates to find the saturation point", ("ramp",)),
    "ablations": ("one workload with each optimisation switched off in turn", ("ablations",)),
    "peers": ("batch-1 and under-load speed against HF transformers, CTranslate2, llama.cpp", ("peers",)),
    "mixed": (
        "all four workloads at once at rising rate scales, scheduling fcfs against slo",
        ("mixed",),
    ),
    "all": ("every section above, in one run", ("workloads", "ramp", "ablations", "peers")),
}
_BENCH_SUBPARSERS: argparse._SubParsersAction | None = None


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", metavar="DIR", help="write report.md, results.json and figures into DIR")
    p.add_argument("--config", metavar="YAML", help="BenchConfig fields in YAML (strict); flags override it")
    p.add_argument("--model", help="catalogue name or path (default: smollm2-135m-instruct)")
    p.add_argument(
        "--workloads", type=_split, help="comma-separated subset of dialogue,code,translation,voice"
    )
    p.add_argument(
        "--num-requests", type=int, help="requests per workload run (default: each workload's own)"
    )
    p.add_argument("--max-duration", type=float, metavar="S", help="time bound of each load run in seconds")
    p.add_argument("--rate-scale", type=float, help="multiply every workload's offered rate")
    p.add_argument("--peers", type=_split, help="comma-separated subset of hf-fp32,hf-bf16,ct2-int8,llamacpp")
    p.add_argument(
        "--ablation",
        action="append",
        metavar="FIELD=VALUE",
        help="an ablation to run (repeatable; replaces the default list)",
    )
    p.add_argument("--dtype", help="engine dtype switch (auto, fp32, bf16)")
    p.add_argument(
        "--quant",
        help="quantisation switch: auto (the engine default), none, a scheme (int8, int4-g64), "
        "a plan YAML or a checkpoint",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="switch prefix caching off")
    p.add_argument(
        "--max-num-seqs", type=int, help="batching switch: most sequences per step (1 = no batching)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, help="chunked-prefill size: tokens per step")
    p.add_argument("--scheduling", choices=("fcfs", "slo"), help="engine scheduling policy switch")
    p.add_argument("--token-budget", choices=("off", "predicted"), help="token budget switch (bench.budgets)")
    p.add_argument("--stopping", choices=("eos", "clause"), help="budgets hard (eos) or ending at a clause")
    p.add_argument(
        "--mixed-scales",
        type=lambda v: tuple(float(x) for x in _split(v)),
        metavar="S1,S2,...",
        help="mixed load: scales of the workloads' summed offered rates",
    )
    p.add_argument(
        "--mixed-duration", type=float, metavar="S", help="mixed load: seconds of arrivals per run"
    )
    p.add_argument("--mixed-rounds", type=int, help="mixed load: runs per policy and scale")
    p.add_argument("--threads", type=int, help="threads for every engine (default 2)")
    p.add_argument("--seed", type=int, help="load-generator seed offset")
    p.add_argument(
        "--cold-start",
        action="store_true",
        help="start each load run from an empty prefix cache (default: the requests' shared prompt "
        "prefix computed first, as a serving daemon has it)",
    )
    p.add_argument("--ramp-requests", type=int, help="requests per ramp stage")
    p.add_argument(
        "--ramp-rates",
        type=lambda v: tuple(float(x) for x in _split(v)),
        metavar="R1,R2,...",
        help="offered rates (req/s) of the ramp stages",
    )
    p.add_argument(
        "--quick", action="store_true", help="a reduced run: few requests, short outputs (a smoke test)"
    )
    p.add_argument(
        "--connect", metavar="URL", help="drive a running daemon over WebSocket instead (workloads only)"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    global _BENCH_SUBPARSERS
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: workloads, load, quality, RTIQ, peers",
        description="Benchmarks: the real-time workloads, a ramp to saturation, "
        "ablations and peers, with markdown/JSON/PNG reports.",
    )
    sub = parser.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    _BENCH_SUBPARSERS = sub
    for name, (help_text, sections) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_common(p)
        p.set_defaults(func=run_command, sections=sections)
    p = sub.add_parser(
        "report", help="re-render a saved results.json", description="re-render a saved results.json"
    )
    p.add_argument("results", help="a results.json written by --report")
    p.add_argument("--report", metavar="DIR", required=True, help="where to write report.md and figures")
    p.add_argument(
        "--into",
        metavar="DOC.md",
        help="also put the report under the doc's "
        "'## Results on this machine' heading (figures linked relative to the doc)",
    )
    p.set_defaults(func=report_command)
    parser.set_defaults(func=lambda args: parser.print_help() or 1)


def add_bench_subcommand(name: str, **kwargs) -> argparse.ArgumentParser:
    """For other modules' bench subcommands (e.g. ``bench llm``); call after ``register``."""
    if _BENCH_SUBPARSERS is None:
        raise RuntimeError("edge_rtgi.commands.bench.register must run first")
    return _BENCH_SUBPARSERS.add_parser(name, **kwargs)


def quick_config(cfg: BenchConfig) -> BenchConfig:
    """``--quick``: ``cfg`` with every count and bound small (a run of a few minutes)."""
    return replace(
        cfg,
        num_requests=3,
        max_duration_s=30.0,
        task_items=6,
        kl_prompts=2,
        ramp_rates_rps=(2.0, 8.0),
        ramp_requests=3,
        mixed_rate_scales=(0.25,),
        mixed_duration_s=4.0,
        mixed_rounds=1,
        ablations=("prefix_caching=false", "max_num_seqs=1"),
        decode_new_tokens=16,
        decode_runs=1,
        load_requests=3,
        load_max_tokens=8,
    )


def build_config(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from --config, --quick and the flags (flags win)."""
    from edge_rtgi.bench.suite import BenchConfig
    from edge_rtgi.config import load_config

    cfg = load_config(BenchConfig, args.config) if args.config else BenchConfig()
    if args.quick:
        cfg = quick_config(cfg)
    # The flags given on the command line (argparse values, untyped: its parser sets their types).
    changes: dict[str, Any] = {
        k: v
        for k, v in (
            ("model", args.model),
            ("workloads", args.workloads),
            ("num_requests", args.num_requests),
            ("max_duration_s", args.max_duration),
            ("rate_scale", args.rate_scale),
            ("peers", args.peers),
            ("ablations", tuple(args.ablation) if args.ablation else None),
            ("num_threads", args.threads),
            ("seed", args.seed),
            ("ramp_rates_rps", args.ramp_rates),
            ("ramp_requests", args.ramp_requests),
            ("mixed_rate_scales", args.mixed_scales),
            ("mixed_duration_s", args.mixed_duration),
            ("mixed_rounds", args.mixed_rounds),
        )
        if v is not None
    }
    opt = cfg.optimisations
    opt_changes: dict[str, Any] = {
        k: v
        for k, v in (
            ("dtype", args.dtype),
            ("quant", args.quant),
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("scheduling", args.scheduling),
            ("token_budget", args.token_budget),
            ("stopping", args.stopping),
        )
        if v is not None
    }
    if args.no_prefix_caching:
        opt_changes["prefix_caching"] = False
    if args.cold_start:
        changes["warm_start"] = False
    try:
        cfg = replace(cfg, **changes, optimisations=replace(opt, **opt_changes))
        for name in cfg.workloads:
            cfg.workload(name)
        for spec in cfg.ablations:
            cfg.optimisations.changed(spec)
    except ValueError as exc:
        raise ConfigError(f"bad benchmark setting: {exc}") from None
    from edge_rtgi.bench.peers import PEER_NAMES

    bad = [p for p in cfg.peers if p not in PEER_NAMES]
    if bad:
        raise ConfigError(f"unknown peer {bad[0]!r}", hint=f"choose from {', '.join(PEER_NAMES)}")
    return cfg


def run_command(args: argparse.Namespace) -> int:
    from edge_rtgi.bench.report import render_markdown, write_report

    cfg = build_config(args)
    config_file = args.config
    if args.connect:
        if tuple(args.sections) != ("workloads",):
            raise ConfigError(
                "--connect drives a daemon with the workloads only", hint="use `bench workloads --connect`"
            )
        from edge_rtgi.bench.runner import run_daemon_workloads

        results = asyncio.run(run_daemon_workloads(cfg, args.connect))
    else:
        from edge_rtgi.bench.runner import run_suite

        def checkpoint(partial: dict) -> None:
            if args.report:
                write_report(partial, args.report)

        results = asyncio.run(run_suite(cfg, tuple(args.sections), on_section=checkpoint))
    if config_file:
        results["config_file"] = config_file
    sys.stdout.write(render_markdown(results) + "\n")
    if args.report:
        print(f"report written to {write_report(results, args.report)}")
    return 0


def report_command(args: argparse.Namespace) -> int:
    from edge_rtgi.bench.report import write_report

    try:
        results = json.loads(Path(args.results).read_text())
    except FileNotFoundError:
        raise ConfigError(f"results file not found: {args.results}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{args.results} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(results, dict) or "machine" not in results:
        raise ConfigError(f"{args.results} is not a results.json written by `edge-rtgi bench --report`")
    print(f"report written to {write_report(results, args.report)}")
    if args.into:
        import os

        from edge_rtgi.bench.report import embed_in_doc

        prefix = os.path.relpath(Path(args.report).resolve(), Path(args.into).resolve().parent).replace(
            os.sep, "/"
        )
        config = " --config " + results["config_file"] if results.get("config_file") else ""
        embed_in_doc(results, args.into, prefix + "/", f"edge-rtgi bench all{config} --report {args.report}")
        print(f"results embedded in {args.into}")
    return 0
