"""Engine settings (a frozen config dataclass) and engine counters (for /metrics, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from edge_rtgi.llm.kv.eviction import KVEviction
from edge_rtgi.llm.kv.window import KVWindow
from edge_rtgi.llm.speculative import SpeculativeConfig, parse_speculative

if TYPE_CHECKING:  # pragma: no cover
    from edge_rtgi.llm.kv.manager import KVCacheManager
    from edge_rtgi.llm.model import ModelConfig
    from edge_rtgi.llm.quant.plan import KVPlan
    from edge_rtgi.llm.scheduler import Scheduler, SchedulerOutput
    from edge_rtgi.llm.step_model import StepModelSnapshot

KV_DTYPES = ("auto", "int8", "int4", "plan")
SCHEDULING_POLICIES = ("fcfs", "slo")  # edge_rtgi.llm.scheduler.POLICIES (kept torch-free there)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Loaded strictly from YAML with ``edge_rtgi.config.from_dict``.

    ``num_kv_blocks`` sizes the KV pool directly; when unset, ``kv_cache_memory_mb`` does.
    ``max_model_len`` (tokens) defaults to the model's context window.
    ``decode_mode``: "padded" runs all decodes of a step in one SDPA call over a padded
    gather; "per_seq" runs one SDPA per sequence (see docs/engine.md for measurements).
    ``kv_dtype``: "auto" stores KV in the model's dtype, "int8" with per-slot scales, "int4"
    KIVI-style (keys per channel over a block, values per token in groups; ``kv.int4``), "plan"
    a precision per layer from the ``kv`` section of the quantisation plan at ``kv_plan``
    (``kv.mixed``; written by ``edge-rtgi quantize --profile-kv --target-kv-bits``).
    ``kv_window``: attention sinks plus a sliding window for every layer (StreamingLLM,
    ``kv.window``): each query sees the first ``sink_tokens`` and the last ``window_tokens``
    tokens, the blocks between are freed, and a request may then run past the model's context
    window (``max_model_len`` is no longer capped by it; unset, a request is bounded only by its
    ``max_tokens``). None: every layer sees the whole context (the model's own windows apply).
    ``kv_budget_tokens`` with ``kv_eviction``: importance eviction (``kv.eviction``): a request
    whose cached tokens pass the budget after a step drops its least-attended tokens (h2o,
    snapkv) or segments (segment) and compacts the rest into fewer blocks. None: off.
    ``scheduling``: "fcfs" (priority, then arrival) or "slo" (classes, deadlines and a fitted
    step-time model; ``edge_rtgi.llm.scheduler``); ``min_prefill_chunk_tokens`` is the least
    prefill a step carries under "slo" while decodes run.
    ``speculative``: "off", "auto" (per request, the adaptive policy picks a draft and its
    length from measured acceptance and step cost, or decodes plainly where nothing pays) or
    ``{draft: ngram, k: 1..16}`` (always that draft, up to k tokens); see docs/engine.md.
    Without chunked prefill the per-step budget is raised to ``max_model_len`` so that any
    prompt fits one step.
    """

    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_mb: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    decode_mode: str = "padded"
    kv_dtype: str = "auto"
    kv_plan: str | None = None
    kv_window: KVWindow | None = None
    kv_budget_tokens: int | None = None
    kv_eviction: KVEviction | None = None
    scheduling: str = "fcfs"
    min_prefill_chunk_tokens: int = 16
    # slo: a dialogue or bulk request whose estimated queue wait passes this many times its TTFT
    # SLO is refused as busy, with a retry estimate (0: never); voice and translation always queue
    admission_wait_factor: float = 4.0
    # slo: waiting requests still on time by class, then first-token deadline ("class"), or by
    # that deadline alone across classes ("edf"); late ones go behind either way (llm.scheduler)
    slo_waiting_order: str = "class"
    num_threads: int | None = None
    # "auto" (on a bf16 CPU: GGUF Q4_1 blocks as int4-g32, other weights int8; see
    # edge_rtgi.llm.quant.policy), "none",
    # or a plan YAML, quantised .safetensors or scheme name for edge_rtgi.llm.quant.apply_quant
    quant: str | None = "auto"
    # Longest a step waits while latency-critical work elsewhere in the process runs (a
    # reply's first clause being synthesised; edge_rtgi.cpu_priority). 0: never wait.
    yield_to_foreground_ms: int = 250
    speculative: str | bool | dict[str, str | int] = "off"
    # int4 layers' matmuls of 1..32 rows with the activations rounded to int8 per 32 inputs, on
    # AVX-512 VNNI or AVX2 (llm.quant.kernels.apply_int8_activations): "auto" where the CPU (not AMX)
    # and layers allow (drafts are then verified only within the kernel's rows), true (wherever
    # layers can, with a warning where none can), false (the model's own activation dtype)
    int8_activations: bool | str = "auto"

    def __post_init__(self) -> None:
        parse_speculative(self.speculative)  # ValueError naming speculative.k / .draft
        if not (isinstance(self.int8_activations, bool) or self.int8_activations == "auto"):  # not 0 / 1
            raise ValueError(f"int8_activations must be true, false or auto, got {self.int8_activations!r}")
        if self.yield_to_foreground_ms < 0:
            raise ValueError(f"yield_to_foreground_ms must be >= 0, got {self.yield_to_foreground_ms}")
        if self.block_size < 1 or (self.num_kv_blocks is not None and self.num_kv_blocks < 1):
            raise ValueError("block_size and num_kv_blocks must be >= 1")
        if self.kv_cache_memory_mb < 1:
            raise ValueError(f"kv_cache_memory_mb must be >= 1, got {self.kv_cache_memory_mb}")
        if self.decode_mode not in ("padded", "per_seq"):
            raise ValueError(f"decode_mode must be 'padded' or 'per_seq', got {self.decode_mode!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_dtype == "plan" or self.kv_plan is not None:
            self._check_kv_plan()
        if "int4" in self.kv_layer_dtypes_named() and parse_speculative(self.speculative).enabled:
            # int4 KV quantises a block when it fills, rejected drafts included: output would
            # drift from the same engine without speculation (tests/equivalence/test_speculative_kv.py)
            which, fix = ("kv_dtype: int4", "kv_dtype: int8")
            if self.kv_dtype != "int4":
                which, fix = ("a KV plan with int4 layers", "int8 layers in the plan")
            raise ValueError(
                f"speculative decoding does not work with {which} yet (a block is quantised with "
                f"rejected draft tokens in it), and speculative is {self.speculative!r} (the daemon's "
                f"engine speculates by default); set speculative: off or {fix}"
            )
        if self.kv_window is not None and not self.enable_chunked_prefill:
            raise ValueError(
                "kv_window needs enable_chunked_prefill: true (a prompt longer than the context "
                "window must be computed in steps)"
            )
        self._check_eviction()
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        if self.min_prefill_chunk_tokens < 1:
            raise ValueError(f"min_prefill_chunk_tokens must be >= 1, got {self.min_prefill_chunk_tokens}")
        if not self.admission_wait_factor >= 0:
            raise ValueError(f"admission_wait_factor must be >= 0, got {self.admission_wait_factor}")
        if self.slo_waiting_order not in ("edf", "class"):
            raise ValueError(f"slo_waiting_order must be 'edf' or 'class', got {self.slo_waiting_order!r}")

    def _check_kv_plan(self) -> None:
        if self.kv_dtype != "plan" or self.kv_plan is None:
            raise ValueError(
                "kv_dtype: plan and kv_plan go together: set kv_dtype: plan with kv_plan: PATH (a "
                "quantisation plan with a kv section), or neither"
            )
        self.load_kv_plan()  # a file or entry the plan cannot use is an error now, not at start

    def load_kv_plan(self) -> KVPlan:
        """The ``kv`` section of the plan at ``kv_plan`` (ValueError naming the key and what is
        allowed where the file, the section or an entry is not valid)."""
        from edge_rtgi.errors import ConfigError
        from edge_rtgi.llm.quant.plan import QuantPlan

        try:
            plan = QuantPlan.load(str(self.kv_plan))
        except ConfigError as exc:
            raise ValueError(f"kv_plan: {exc}") from None
        if plan.kv is None:
            raise ValueError(
                f"kv_plan: {self.kv_plan} has no kv section (a per-layer KV precision); write one "
                "with edge-rtgi quantize MODEL --profile-kv --target-kv-bits B"
            )
        return plan.kv

    def kv_layer_dtypes_named(self) -> set[str]:
        """Every KV precision this config names: ``kv_dtype``, or with a plan, its entries."""
        if self.kv_dtype != "plan" or self.kv_plan is None:
            return {self.kv_dtype}
        kv = self.load_kv_plan()
        return {kv.default, *kv.layers.values()}

    def kv_layer_dtypes(self, num_layers: int) -> list[str]:
        """The KV precision of each of ``num_layers`` layers (``kv.mixed.LAYER_KV_DTYPES``)."""
        from edge_rtgi.errors import ConfigError

        if self.kv_dtype != "plan":
            return [self.kv_dtype] * num_layers
        try:
            return list(self.load_kv_plan().layer_dtypes(num_layers, f"kv_plan {self.kv_plan}"))
        except ConfigError as exc:  # a ValueError, as from __post_init__, for from_dict's callers
            raise ValueError(str(exc)) from None

    def _check_eviction(self) -> None:
        budget, eviction = self.kv_budget_tokens, self.kv_eviction
        if budget is None and eviction is None:
            return
        if budget is None or eviction is None:
            raise ValueError(
                "kv_budget_tokens and kv_eviction go together: set both (e.g. kv_budget_tokens: 512, "
                "kv_eviction: {mode: h2o}) or neither"
            )
        eviction.check_budget(budget, self.block_size)
        # Each of these rewrites or reads a request's blocks in a way compaction would break.
        # (int4 KV combines: its compaction rebuilds the rewritten blocks' per-block key scales.)
        clashes = {
            "kv_window": self.kv_window is not None,  # windows release blocks by position
            "speculative": parse_speculative(self.speculative).enabled,  # truncates by position
        }
        for name, clash in clashes.items():
            if clash:
                hint = " (the daemon's engine speculates by default: set speculative: off)"
                raise ValueError(
                    f"kv_eviction does not combine with {name} yet; use one or the other"
                    + (hint if name == "speculative" else "")
                )

    def speculation(self) -> SpeculativeConfig:
        """The parsed ``speculative`` setting."""
        return parse_speculative(self.speculative)

    def with_(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (validated again by ``__post_init__``)."""
        return replace(self, **changes)

    def resolve_num_blocks(self, model_config: ModelConfig, dtype: torch.dtype) -> int:
        """Blocks in the pool: ``num_kv_blocks``, or what ``kv_cache_memory_mb`` holds."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        from edge_rtgi.llm.kv.mixed import mixed_bytes_per_block

        if self.kv_dtype == "plan":
            check_plan_kv_groups(model_config.arch, len(model_config.kv_groups()))
        per_block = mixed_bytes_per_block(
            self.kv_layer_dtypes(layers_per_block(model_config)),
            self.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
        )
        return max(1, self.kv_cache_memory_mb * 2**20 // per_block)


def check_plan_kv_groups(arch: str, num_groups: int) -> None:
    """Refuse ``kv_dtype: plan`` on a model with several KV groups: a plan names model layers, and
    a group's storage layers serve several of them."""
    if num_groups > 1:
        raise ValueError(
            f"kv_dtype plan needs a model with one KV group; {arch} has {num_groups} "
            "(per-layer windows): use kv_dtype auto, int8 or int4"
        )


def layers_per_block(model_config: ModelConfig) -> int:
    """Layers one KV block holds: all of them with one KV group, else a group's share."""
    groups = model_config.kv_groups()
    return model_config.num_layers if len(groups) == 1 else max(len(g.layers) for g in groups)


@dataclass
class EngineStats:
    """Counters since the engine started, plus the current pool and queue state."""

    num_steps: int = 0
    num_batched_tokens: int = 0
    num_scheduled_requests: int = 0
    max_requests_per_step: int = 0
    num_preemptions: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0
    # Where step time goes (seconds, summed): scheduling, the runner (forward + sampling),
    # and bookkeeping after it (scheduler update, detokenising, delivering deltas).
    schedule_s: float = 0.0
    run_s: float = 0.0
    update_s: float = 0.0
    foreground_wait_s: float = 0.0  # steps held back for latency-critical work (cpu_priority)
    kv_evicted_tokens: int = 0  # tokens dropped by importance eviction (kv.eviction)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_row_deferrals: int = 0  # admissions the slo policy held back for running decodes' ITL
    num_refused_busy: int = 0  # requests the slo admission refused as busy
    num_lifts_held: int = 0  # steps whose prefill cap the slo policy kept for streams' ITL
    num_prefix_waits: int = 0  # admissions put off a step to reuse a prefix another was computing
    # speculative decoding: draft tokens verified, and accepted (edge_rtgi.llm.speculative)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the step-time model (edge_rtgi.llm.step_model): fitted ms per unit, and its prediction error
    step_model_fixed_ms: float = 0.0
    step_model_per_decode_row_ms: float = 0.0
    step_model_per_prefill_token_ms: float = 0.0
    step_model_per_context_ktoken_ms: float = 0.0
    step_model_python_layers_ms: float = 0.0
    step_model_error_ms: float = 0.0
    step_model_error_pct: float = 0.0
    step_model_overshoot_ms: float = 0.0  # the margin the slo policy plans steps with
    step_model_observations: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.num_batched_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def requests_per_step(self) -> float:
        return self.num_scheduled_requests / self.num_steps if self.num_steps else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the prefix cache."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def record_step(
        self, output: SchedulerOutput, schedule_s: float = 0.0, run_s: float = 0.0, update_s: float = 0.0
    ) -> None:
        self.schedule_s += schedule_s
        self.run_s += run_s
        self.update_s += update_s
        self.num_steps += 1
        self.num_batched_tokens += output.num_batched_tokens
        self.num_scheduled_requests += len(output.scheduled)
        self.max_requests_per_step = max(self.max_requests_per_step, len(output.scheduled))

    def snapshot(
        self, kv: KVCacheManager, scheduler: Scheduler, step_model: StepModelSnapshot | None = None
    ) -> EngineStats:
        snap = replace(
            self,
            num_row_deferrals=scheduler.num_row_deferrals,
            num_prefix_waits=scheduler.num_prefix_waits,
            num_refused_busy=scheduler.num_refused_busy,
            num_lifts_held=scheduler.num_lifts_held,
            spec_draft_tokens=scheduler.num_draft_tokens,
            spec_accepted_tokens=scheduler.num_accepted_draft_tokens,
            num_preemptions=scheduler.num_preemptions,
            kv_blocks_used=kv.pool.num_used_blocks,
            kv_blocks_cached=kv.pool.num_cached_blocks,
            prefix_queried_tokens=kv.prefix_queries_tokens,
            prefix_hit_tokens=kv.prefix_hits_tokens,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
        )
        if step_model is None:
            return snap
        fixed, per_row, per_token, per_ktoken, python_layers = step_model.coefficients_ms
        return replace(
            snap,
            step_model_fixed_ms=fixed,
            step_model_per_decode_row_ms=per_row,
            step_model_per_prefill_token_ms=per_token,
            step_model_per_context_ktoken_ms=per_ktoken,
            step_model_python_layers_ms=python_layers,
            step_model_error_ms=step_model.error_ms,
            step_model_error_pct=step_model.error_pct,
            step_model_overshoot_ms=step_model.overshoot_ms,
            step_model_observations=step_model.num_observations,
        )

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for /metrics."""
        out = {k: float(v) for k, v in self.__dict__.items()}
        out.update(
            tokens_per_step=self.tokens_per_step,
            requests_per_step=self.requests_per_step,
            prefix_hit_rate=self.prefix_hit_rate,
        )
        return out
