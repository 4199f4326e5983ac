"""Run the benchmark sections in order and collect one JSON-friendly result with its conditions."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import logging
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from edge_rtgi.bench.suite import (
    BenchConfig,
    load_models,
    make_engine,
    run_ablations,
    run_ramp_section,
    run_workload,
    warm_up,
)
from edge_rtgi.errors import ConfigError

log = logging.getLogger(__name__)

SECTIONS = ("workloads", "ramp", "ablations", "peers", "mixed")
ENV_RECORDED = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "MKL_NUM_THREADS",
    "CT2_USE_MKL",
    "LLAMA_CPP_LIB_PATH",
    "CUDA_VISIBLE_DEVICES",
    "EDGE_RTGI_MODEL_DIR",
)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> dict:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            != ""
        )
        return {"commit": commit or None, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def machine_info() -> dict:
    """The conditions of a run: hardware, load, versions, commit."""
    mem_gib = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": mem_gib,
        "cuda_device": cuda,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "versions": {
            p: _version(p)
            for p in (
                "edge-rtgi",
                "torch",
                "transformers",
                "ctranslate2",
                "llama_cpp_python",
                "sacrebleu",
                "numpy",
            )
        },
        "git": _git_commit(),
        # settings that change how the libraries under test behave
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
    }


def check_sections(sections: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ConfigError(
            f"unknown benchmark section {unknown[0]!r}", hint=f"choose from {', '.join(SECTIONS)}"
        )
    return tuple(s for s in SECTIONS if s in sections)


async def run_suite(
    cfg: BenchConfig,
    sections: tuple[str, ...] = SECTIONS,
    on_section: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load the models once and run the requested sections; returns the full result dict.

    ``on_section`` gets the results so far after each section (the CLI rewrites its report then,
    so a run cut short by a time limit still leaves the finished sections behind).
    """
    sections = check_sections(sections)
    torch.set_num_threads(cfg.num_threads)
    results: dict[str, Any] = {"machine": machine_info(), "config": asdict(cfg), "sections": list(sections)}
    started = time.monotonic()
    models = load_models(cfg)
    results["model"] = {
        "name": cfg.model,
        "source": str(models.source),
        "engine_dtype": str(models.optimised.model.dtype),
        "quant": models.quant_report,
    }

    def done_section() -> None:
        results["elapsed_s"] = time.monotonic() - started
        results["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        if on_section is not None:
            on_section(results)

    engine = make_engine(models.optimised, cfg.optimisations, cfg)
    try:
        warm_up(engine, models.optimised.tokenizer)
        if "workloads" in sections:
            results["workloads"] = []
            for name in cfg.workloads:
                log.info("bench: workload %s", name)
                results["workloads"].append(await run_workload(models, engine, cfg.workload(name), cfg))
            done_section()
        if "ramp" in sections:
            log.info("bench: ramp on %s", cfg.ramp_workload)
            results["ramp"] = await run_ramp_section(models, engine, cfg)
            done_section()
        if "peers" in sections:
            from edge_rtgi.bench.peer_bench import run_peers_section

            results["peers"] = await run_peers_section(models, engine, cfg, models.source)
            done_section()
    finally:
        engine.shutdown()
    if "ablations" in sections:
        log.info("bench: ablations on %s", cfg.ablation_workload)
        results["ablations"] = await run_ablations(models, cfg)
        done_section()
    if "mixed" in sections:
        from edge_rtgi.bench.mixed import run_mixed_section

        results["mixed"] = await run_mixed_section(models, cfg)
    done_section()
    return results


async def run_daemon_workloads(cfg: BenchConfig, url: str) -> dict[str, Any]:
    """Drive a running daemon over WebSocket with each workload's source texts (latency only).

    The daemon builds its own prompts (its pipeline's system prompt, or its translator), so
    there is no same-prompt comparison with the full model here: no quality retention or RTIQ.
    """
    from edge_rtgi.bench.loadgen import run_load
    from edge_rtgi.bench.targets import WebSocketTarget
    from edge_rtgi.bench.workloads import PreparedRequest

    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": asdict(cfg),
        "sections": ["daemon"],
        "daemon": {"url": url, "workloads": []},
    }
    started = time.monotonic()
    target = WebSocketTarget(url)
    for name in cfg.workloads:
        workload = cfg.workload(name)
        requests = [
            PreparedRequest(
                key=i.key,
                workload=name,
                prompt_token_ids=(),
                max_tokens=workload.max_tokens,
                source_text=i.source_text,
            )
            for i in workload.items
        ]
        requests_by_key = {r.key: r.source_text for r in requests}
        result = await run_load(target, requests, workload.load, workload=name)
        m = result.metrics(workload.slo)
        ok = [t for t in result.traces if t.ok]
        refs = {i.key: i.reference for i in workload.items}
        chrf_refs = None
        ok_refs = [ref for t in ok if (ref := refs[t.prompt_key])]
        if ok and len(ok_refs) == len(ok):  # every answered item has a reference
            from edge_rtgi.scoring.retention import chrf

            chrf_refs = chrf([t.text for t in ok], ok_refs)
        results["daemon"]["workloads"].append(
            {
                "name": name,
                "slo": asdict(workload.slo),
                "load": asdict(workload.load),
                "metrics": asdict(m),
                "chrf_vs_references": chrf_refs,
                "examples": [
                    {"sent": requests_by_key[t.prompt_key], "received": t.text[:200]} for t in ok[:3]
                ],
                "errors": sorted({t.error for t in result.traces if t.error}),
            }
        )
    results["elapsed_s"] = time.monotonic() - started
    results["machine"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return results
