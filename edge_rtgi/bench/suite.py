"""The benchmark suite: configuration (every optimisation is a switch) and the parts of a run.

A run is a sequence of independent sections, each producing a JSON-friendly dict:

- ``workloads``: each workload at its offered load on the engine, with quality retention
  against the full model and the RTIQ.
- ``ramp``: Poisson stages at rising rates on one workload, to find the saturation point.
- ``ablations``: one workload with each optimisation switched off in turn.
- ``peers``: batch-1 TTFT/decode speed and throughput under load for our engine, the plain
  reference path and the peer engines, on the same token ids.

``report.py`` turns the collected dict into markdown, PNG figures and JSON.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from edge_rtgi.bench.budgets import BudgetPolicy
from edge_rtgi.bench.loadgen import LoadSpec, run_load, run_ramp
from edge_rtgi.bench.metrics import SLO, RunMetrics
from edge_rtgi.bench.peers import PEER_NAMES
from edge_rtgi.bench.quality import kl_along_continuations, model_logits_fn
from edge_rtgi.bench.rtiq import rtiq
from edge_rtgi.bench.targets import EngineTarget
from edge_rtgi.bench.task_eval import (
    FullOutputCache,
    run_full_model,
    run_on_engine,
    shared_context_tokens,
    task_retention,
)
from edge_rtgi.bench.tasks import load_task_set
from edge_rtgi.bench.workloads import WORKLOAD_NAMES, PreparedRequest, Workload, get_workload, prepare
from edge_rtgi.device import release_cpu_workers
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.kv.eviction import EVICTION_MODES, KVEviction
from edge_rtgi.llm.kv.window import KVWindow
from edge_rtgi.llm.speculative import parse_speculative

if TYPE_CHECKING:
    from edge_rtgi.llm.engine import LLMEngine

log = logging.getLogger(__name__)


T = TypeVar("T")


# Optimisations.int8_activations -> EngineConfig.int8_activations
INT8_ACTIVATION_SETTINGS: dict[str, bool | str] = {"off": False, "auto": "auto", "on": True}


@dataclass(frozen=True)
class Optimisations:
    """The switches. Each field is one optimisation, so an ablation flips exactly one field.

    ``max_num_seqs=1`` disables batching; ``max_num_batched_tokens`` is the chunked-prefill
    size (tokens per step); ``dtype``/``kv_dtype`` choose the numerics; ``quant`` is the engine's
    ``quant`` setting: "auto" (the engine default, ``edge_rtgi.llm.quant.apply_engine_quant``),
    None for full-precision weights, or an ``apply_quant`` spec (a scheme such as "int8", a plan
    YAML, or a quantised checkpoint). ``kv_window`` is the engine's attention sinks plus sliding
    window as ``SINKS:WINDOW`` tokens (``4:1024``), or "off". ``eviction`` (none, h2o, snapkv,
    segment) with ``kv_budget_tokens`` is importance eviction under a per-request KV budget
    (``llm.kv.eviction``; the policy's other settings at their defaults). Later optimisations add
    fields here.
    """

    prefix_caching: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    chunked_prefill: bool = True
    dtype: str = "auto"
    kv_dtype: str = "auto"
    kv_window: str = "off"  # "SINKS:WINDOW" tokens, e.g. "4:1024" (llm.kv.window)
    kv_budget_tokens: int = 0  # per-request KV budget under ``eviction`` (0: none)
    eviction: str | None = None  # None ("none") | h2o | snapkv | segment (llm.kv.eviction)
    quant: str | None = "auto"  # as the engine ships
    scheduling: str = "fcfs"  # or "slo" (llm.scheduler): classes, deadlines, a step-time model
    token_budget: str = "off"  # or "predicted" (bench.budgets): a budget per reply
    stopping: str = "eos"  # or "clause": a budget is soft and ends the reply at a clause
    # the engine's speculative decoding: "off", "auto" or "<draft>:<k>" (llm.speculative)
    speculative: str = "off"
    # int4 layers' decode matmuls on int8 activations: "auto" (as the engine ships), "off" or "on"
    int8_activations: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.quant, str) and self.quant.lower() in ("none", ""):
            object.__setattr__(self, "quant", None)  # "none" from a flag or YAML: full precision
        if self.scheduling not in ("fcfs", "slo"):
            raise ConfigError(f"scheduling must be fcfs or slo, got {self.scheduling!r}")
        BudgetPolicy(self.token_budget, self.stopping)  # validates both
        try:
            parse_speculative(self.speculative)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.window()  # validates kv_window
        if self.int8_activations not in INT8_ACTIVATION_SETTINGS:
            raise ConfigError(f"int8_activations must be off, auto or on, got {self.int8_activations!r}")
        if self.eviction is not None and self.eviction not in EVICTION_MODES:
            raise ConfigError(
                f"eviction must be none or one of {', '.join(EVICTION_MODES)}, got {self.eviction!r}"
            )

    def window(self) -> KVWindow | None:
        """``kv_window`` as an ``llm.kv.window.KVWindow`` (None when "off")."""
        if self.kv_window in ("off", "none", ""):
            return None
        sinks, sep, window = self.kv_window.partition(":")
        if not sep or not sinks.strip().isdigit() or not window.strip().isdigit():
            raise ConfigError(f"kv_window must be off or SINKS:WINDOW (e.g. 4:1024), got {self.kv_window!r}")
        try:
            return KVWindow(int(sinks), int(window))
        except ValueError as exc:
            raise ConfigError(f"kv_window {self.kv_window!r}: {exc}") from None

    @property
    def budgets(self) -> BudgetPolicy:
        return BudgetPolicy(self.token_budget, self.stopping)

    def engine_config(self, model: str, num_threads: int | None) -> Any:
        from edge_rtgi.llm.engine_config import EngineConfig

        return EngineConfig(
            model=model,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            kv_window=self.window(),
            kv_budget_tokens=self.kv_budget_tokens or None,
            kv_eviction=None if self.eviction is None else KVEviction(self.eviction),
            enable_prefix_caching=self.prefix_caching,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.chunked_prefill,
            scheduling=self.scheduling,
            num_threads=num_threads,
            speculative=self.speculative,
            int8_activations=INT8_ACTIVATION_SETTINGS[self.int8_activations],
        )

    @property
    def lossy(self) -> bool:
        """Whether outputs may differ from the fp32 full model (beyond float rounding)."""
        return (
            self.quant is not None
            or self.dtype not in ("fp32", "float32")
            or self.kv_dtype != "auto"
            or self.window() is not None
            or self.eviction is not None
            or self.token_budget != "off"
        )  # int8_activations only acts on quantised layers: quant already counts

    def changed(self, spec: str) -> Optimisations:
        """Apply an ablation: one ``field=value`` change, or several joined by commas
        (``scheduling=slo,token_budget=predicted``), each value parsed by its field's type."""
        if "," in spec:
            out = self
            for part in spec.split(","):
                out = out.changed(part.strip())
            return out
        key, sep, raw = spec.partition("=")
        types = {f.name: f.type for f in fields(self)}
        if not sep or key not in types:
            raise ConfigError(
                f"bad ablation {spec!r}", hint=f"write field=value with a field among {', '.join(types)}"
            )
        kind = str(types[key])
        if "bool" in kind:
            if raw.lower() not in ("true", "false", "on", "off", "1", "0"):
                raise ConfigError(f"ablation {spec!r}: {key} takes true/false")
            value: Any = raw.lower() in ("true", "on", "1")
        elif "int" in kind:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"ablation {spec!r}: {key} takes an integer") from None
        else:
            value = None if raw.lower() in ("none", "") else raw
        return replace(self, **{key: value})


DEFAULT_ABLATIONS = (
    "prefix_caching=false",
    "max_num_seqs=1",
    "max_num_batched_tokens=64",
    "max_num_batched_tokens=1024",
    "dtype=fp32",
    "quant=none",
)


@dataclass(frozen=True)
class BenchConfig:
    """What to run. Counts and bounds are small by default: this runs on 2 shared CPU cores."""

    model: str = "smollm2-135m-instruct"
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    optimisations: Optimisations = field(default_factory=Optimisations)
    num_requests: int | None = None  # per workload; None: the workload's default
    max_duration_s: float | None = None
    rate_scale: float = 1.0  # multiplies every workload's offered rate
    # Quality: every graded item of each workload's task set (None), or this many spread over it
    task_items: int | None = None
    kl_prompts: int = 12  # workload prompts whose KL from the full model is reported (a diagnostic)
    ramp_workload: str = "voice"
    ramp_rates_rps: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    ramp_requests: int = 16
    # the mixed load (bench.mixed): scales of the workloads' summed offered rates, seconds of
    # arrivals per run, runs per policy and scale
    mixed_rate_scales: tuple[float, ...] = (0.125, 0.25, 0.5)
    mixed_duration_s: float = 20.0
    mixed_rounds: int = 2
    ablation_workload: str = "dialogue"
    ablations: tuple[str, ...] = DEFAULT_ABLATIONS
    peers: tuple[str, ...] = PEER_NAMES
    # our engine with other switches, measured beside the peers too (e.g. with quantisation)
    peer_variants: tuple[str, ...] = ("quant=int8",)
    decode_prompt_tokens: int = 64
    decode_new_tokens: int = 128
    decode_runs: int = 3
    load_requests: int = 16  # throughput under load: this many requests at once
    load_max_tokens: int = 32
    num_threads: int = 2
    seed: int = 0
    # Each load run starts as a serving daemon is after start-up: the prompt prefix its requests
    # share (a system prompt, an instruction) already in the prefix cache (``start_load_run``).
    # False: from an empty cache, as every run did before 2026-12-06.
    warm_start: bool = True

    def workload(self, name: str) -> Workload:
        w = get_workload(name)
        rate = w.load.rate_rps * self.rate_scale
        return w.with_overrides(
            num_requests=self.num_requests,
            max_duration_s=self.max_duration_s,
            rate_rps=rate,
            seed=w.load.seed + self.seed,
        )


# --- Models -----------------------------------------------------------------------------------


@dataclass
class Models:
    """The optimised model (engine) and the full fp32 reference, loaded once per run."""

    optimised: Any  # LoadedModel in the engine's dtype, with ``quant`` applied
    full: Any  # LoadedModel, fp32, no lossy optimisation
    source: Path
    quant_report: dict | None = None
    # (prompt key, max_tokens) -> the full model's greedy (token ids, text), shared by all sections
    full_outputs: dict[tuple[str, int], tuple[list[int], str]] = field(default_factory=dict)


def load_optimised(source: Path, opt: Optimisations) -> tuple[Any, dict | None]:
    """A copy of the weights in ``opt.dtype`` with ``opt.quant`` applied."""
    from edge_rtgi.llm.weights import load_model

    loaded = load_model(source, device="auto", dtype=opt.dtype)
    if opt.quant is None:
        return loaded, None
    from edge_rtgi.llm.quant import apply_engine_quant, apply_quant

    if opt.quant == "auto":  # what the engine does with its default: say what it resolved to
        return loaded, {"auto": apply_engine_quant(loaded.model, "auto")}
    return loaded, apply_quant(loaded.model, opt.quant, loaded.tokenizer)


def load_models(cfg: BenchConfig) -> Models:
    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.llm.weights import load_model

    source = Path(resolve_model(cfg.model, role="llm"))
    full = load_model(source, device="auto", dtype="fp32")
    opt = cfg.optimisations
    if opt.dtype in ("fp32", "float32") and opt.quant is None:
        return Models(full, full, source)
    optimised, quant_report = load_optimised(source, opt)
    return Models(optimised, full, source, quant_report)


def model_for(models: Models, opt: Optimisations, base: Optimisations) -> Any | None:
    """The loaded model an engine with switches ``opt`` runs on, or None if neither copy fits."""
    if opt.quant == base.quant and opt.dtype == base.dtype:
        return models.optimised
    if opt.quant is None and opt.dtype in ("fp32", "float32"):
        return models.full
    return None


def stepped_engine(num_threads: int = 2) -> LLMEngine:
    """The daemon's default model and engine settings with ``num_threads`` threads, and no engine
    thread: the caller calls ``step()`` itself, so a benchmark's timings carry no hand-off."""
    import torch

    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.llm.prepared import load_prepared

    config = EngineConfig(num_threads=num_threads)
    source = resolve_model(config.model, role="llm")
    prepared = load_prepared(source, config.device, config.dtype, config.quant)
    engine = LLMEngine.from_loaded(prepared.loaded, config, start=False)
    torch.set_num_threads(num_threads)
    return engine


def warm_up(engine: Any, tokenizer: Any) -> None:
    """A few short batched requests so the first measured run does not pay one-off start-up costs."""
    from edge_rtgi.bench.workloads import system_prompt
    from edge_rtgi.llm.sampling import SamplingParams

    prompts = [tokenizer.encode(system_prompt())[: 48 + 8 * i] for i in range(3)]
    engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.reset_prefix_cache()


def shared_prompt_prefix(requests: Sequence[PreparedRequest]) -> tuple[int, ...]:
    """The longest run of prompt tokens every one of ``requests`` starts with, short of a whole
    prompt (a warm start must leave each request its own tokens to compute); empty for fewer
    than two requests."""
    prompts = [r.prompt_token_ids for r in requests]
    if len(prompts) < 2:
        return ()
    n = min(len(p) for p in prompts) - 1
    for i, token in enumerate(prompts[0][:n]):
        if any(p[i] != token for p in prompts):
            return prompts[0][:i]
    return prompts[0][:n]


def warm_prompt_prefix(engine: Any, requests: Sequence[PreparedRequest]) -> int:
    """Compute the prompt prefix all ``requests`` share once, into the prefix cache, as the
    daemon's ``Resources.prepare`` does for each pipeline's fixed prompt part at start-up.
    Returns its length in tokens (0: they share none, or the engine caches no prefixes)."""
    prefix = shared_prompt_prefix(requests) if engine.config.enable_prefix_caching else ()
    if prefix:
        from edge_rtgi.llm.sampling import SamplingParams

        engine.generate([list(prefix)], SamplingParams(max_tokens=1))
    return len(prefix)


def start_load_run(engine: Any, requests: Sequence[PreparedRequest], warm: bool) -> int:
    """Empty the prefix cache, then with ``warm`` compute the requests' shared prompt prefix
    (``warm_prompt_prefix``): a run measures a serving daemon, not the first seconds after a
    cold start, when a burst queues behind the system prompt's prefill. Returns the tokens
    computed."""
    engine.reset_prefix_cache()
    return warm_prompt_prefix(engine, requests) if warm else 0


def make_engine(loaded: Any, opt: Optimisations, cfg: BenchConfig) -> Any:
    from edge_rtgi.llm.engine import LLMEngine

    return LLMEngine.from_loaded(loaded, opt.engine_config(cfg.model, cfg.num_threads))


# --- Workloads --------------------------------------------------------------------------------


def metrics_dict(m: RunMetrics) -> dict:
    return asdict(m)


async def _full_outputs(models: Models, requests: list[PreparedRequest]) -> dict[str, tuple[list[int], str]]:
    """The full model's greedy outputs (plain path, fp32), computed once per prompt and budget."""
    from edge_rtgi.llm.generate import generate
    from edge_rtgi.llm.sampling import SamplingParams

    def run() -> None:
        for req in requests:
            if (req.key, req.max_tokens) not in models.full_outputs:
                res = generate(
                    models.full, list(req.prompt_token_ids), SamplingParams(max_tokens=req.max_tokens)
                )
                models.full_outputs[(req.key, req.max_tokens)] = (res.token_ids, res.text)

    await _torch_in_worker(run)
    return {r.key: models.full_outputs[(r.key, r.max_tokens)] for r in requests}


async def _torch_in_worker(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread that frees its OpenMP pool when done: a pool left
    spinning in an idle worker slows every op of the engine thread in the load runs that follow
    (``edge_rtgi.device``), which made the workloads measured after a quality pass look slower."""

    def run() -> T:
        try:
            return fn(*args)
        finally:
            release_cpu_workers()

    return await asyncio.to_thread(run)


async def measure_quality(
    models: Models,
    optimised: Any,
    engine: Any,
    workload: Workload,
    requests: list[PreparedRequest],
    cfg: BenchConfig,
    budgets: BudgetPolicy | None = None,
) -> dict:
    """Task retention of ``engine`` (running ``optimised``, its replies bounded by ``budgets``) on
    the workload's graded task set, against the full model (``bench.task_eval``), with KL on the
    workload's prompts beside it."""
    task_set = load_task_set(workload.name)
    context = shared_context_tokens(engine, models.full)
    full_outputs = await _torch_in_worker(
        run_full_model, models.full, task_set, cfg.task_items, FullOutputCache.default(), context
    )
    opt_outputs = await asyncio.to_thread(run_on_engine, engine, task_set, cfg.task_items, context, budgets)
    task = task_retention(task_set, opt_outputs, full_outputs, seed=cfg.seed)
    kl = None
    if optimised is not models.full:
        keys = list(dict.fromkeys(r.key for r in requests))[: cfg.kl_prompts]
        by_key = {r.key: r for r in requests}
        full = await _full_outputs(models, [by_key[k] for k in keys])
        sequences = [(list(by_key[k].prompt_token_ids), full[k][0]) for k in keys]
        kl = await _torch_in_worker(
            kl_along_continuations,
            model_logits_fn(models.full.model),
            model_logits_fn(optimised.model),
            sequences,
        )
    iv = task.interval
    return {
        "workload": workload.name,
        "basis": f"task retention: {task.metric}, optimised / full on the same {iv.n} graded items",
        "retention": iv.ratio,
        "retention_low": iv.low,
        "retention_high": iv.high,
        "num_items": iv.n,
        "task": task.as_dict(),
        "fidelity_chrf": task.fidelity_chrf,
        "kl": asdict(kl) if kl is not None else None,
        "kl_note": None if kl is not None else "same fp32 weights as the full model: KL is 0 by construction",
        "examples": [
            {"id": i, "full": f[:200], "optimised": o[:200]}
            for i, f, o in list(
                zip(full_outputs.item_ids, full_outputs.texts, opt_outputs.texts, strict=True)
            )[:3]
        ],
    }


async def run_workload(models: Models, engine: Any, workload: Workload, cfg: BenchConfig) -> dict:
    """One workload at its offered load; metrics, quality retention and RTIQ."""
    requests = prepare(workload, models.optimised.tokenizer)
    start_load_run(engine, requests, cfg.warm_start)
    budgets = cfg.optimisations.budgets
    result = await run_load(
        EngineTarget(engine, budgets=budgets), requests, workload.load, workload=workload.name
    )
    metrics = result.metrics(workload.slo)
    quality = await measure_quality(models, models.optimised, engine, workload, requests, cfg, budgets)
    index = rtiq(workload.name, quality["retention"], metrics)
    return {
        "name": workload.name,
        "description": workload.description,
        "slo": asdict(workload.slo),
        "load": asdict(workload.load),
        "metrics": metrics_dict(metrics),
        "quality": quality,
        "rtiq": asdict(index),
        "samples": {
            "ttft_ms": [t.ttft_ms for t in result.traces if t.ok],
            "itl_ms": [g for t in result.traces if t.ok for g in t.itl_ms],
            "e2e_ms": [t.e2e_ms for t in result.traces if t.ok],
        },
        "errors": sorted({t.error for t in result.traces if t.error}),
    }


async def run_ramp_section(models: Models, engine: Any, cfg: BenchConfig) -> dict:
    workload = cfg.workload(cfg.ramp_workload)
    requests = prepare(workload, models.optimised.tokenizer)
    start_load_run(engine, requests, cfg.warm_start)
    ramp = await run_ramp(
        EngineTarget(engine),
        requests,
        cfg.ramp_rates_rps,
        workload.slo,
        requests_per_stage=cfg.ramp_requests,
        stage_duration_s=workload.load.max_duration_s,
        seed=cfg.seed,
        stop_after_saturation=False,
    )  # every rate: the curve is the point
    return {
        "workload": workload.name,
        "slo": asdict(workload.slo),
        "threshold": ramp.attainment_threshold,
        "sustained_rps": ramp.sustained_rps,
        "saturation_rps": ramp.saturation_rps,
        "stages": [{"rate_rps": s.rate_rps, "metrics": metrics_dict(s.metrics)} for s in ramp.stages],
    }


async def run_ablations(models: Models, cfg: BenchConfig) -> dict:
    """The ablation workload under the base switches, then with each change applied alone."""
    workload = cfg.workload(cfg.ablation_workload)
    requests = prepare(workload, models.optimised.tokenizer)
    rows = []
    for spec in ("baseline", *cfg.ablations):
        opt = cfg.optimisations if spec == "baseline" else cfg.optimisations.changed(spec)
        loaded = model_for(models, opt, cfg.optimisations)
        if loaded is None:  # another dtype or quantisation: its own copy of the weights
            loaded, _ = load_optimised(models.source, opt)
        engine = make_engine(loaded, opt, cfg)
        try:
            start_load_run(engine, requests, cfg.warm_start)
            target = EngineTarget(engine, budgets=opt.budgets)
            result = await run_load(target, requests, workload.load, workload=workload.name)
            stats = engine.stats()
            quality = await measure_quality(models, loaded, engine, workload, requests, cfg, opt.budgets)
        finally:
            engine.shutdown()
        metrics = result.metrics(workload.slo)
        rows.append(
            {
                "label": spec,
                "optimisations": asdict(opt),
                "metrics": metrics_dict(metrics),
                "quality": quality,
                "rtiq": asdict(rtiq(workload.name, quality["retention"], metrics)),
                "prefix_hit_rate": stats.prefix_hit_rate,
                "requests_per_step": stats.requests_per_step,
                "tokens_per_step": stats.tokens_per_step,
                "preemptions": stats.num_preemptions,
            }
        )
    return {
        "workload": workload.name,
        "slo": asdict(workload.slo),
        "load": asdict(workload.load),
        "rows": rows,
    }


__all__ = [
    "SLO",
    "BenchConfig",
    "LoadSpec",
    "Models",
    "Optimisations",
    "load_models",
    "make_engine",
    "run_ablations",
    "run_ramp_section",
    "run_workload",
]
