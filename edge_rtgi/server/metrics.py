"""The daemon's Prometheus metrics, on ``prometheus-client`` with one registry per daemon.

Tests start several daemons in one process, so nothing goes to the library's global registry.
Latencies are histograms in milliseconds (the names carry the unit, as the turn stats do), with
buckets placed around what these stages take on a CPU (docs/daemon.md has the figures): a few
ms between tokens, tens to hundreds of ms to a first token, about a second voice to voice.
Engine counters and gauges are read from each engine when ``/metrics`` is scraped, so they are
always current; token latencies are observed when an engine request finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from edge_rtgi import frames as F

if TYPE_CHECKING:
    from edge_rtgi.asr.batch import StepStats
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.request import Usage
    from edge_rtgi.pipeline.backends.base import BackendResult, RouteDecision
    from edge_rtgi.server.memory import CollectResult, TrimResult

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the text format generate_latest writes, as the library names it

# Buckets in ms, each spanning the idle figure to several times it under load.
TTFT_BUCKETS_MS = (10, 25, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 2000, 5000)
ITL_BUCKETS_MS = (2, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 200, 500)
VOICE_TO_VOICE_BUCKETS_MS = (250, 500, 750, 1000, 1250, 1500, 2000, 2500, 3000, 4000, 6000, 10000)
ASR_FINAL_BUCKETS_MS = (50, 100, 150, 200, 300, 400, 500, 750, 1000, 1500, 2000, 3000, 5000)
TTS_FIRST_AUDIO_BUCKETS_MS = (25, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 2000)
ENDPOINTING_BUCKETS_MS = (50, 100, 150, 200, 250, 300, 400, 500, 750, 1000, 1500, 2000)
TURN_DECISION_BUCKETS_MS = (5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500)
REPLY_HEAD_START_BUCKETS_MS = (10, 25, 50, 100, 150, 200, 300, 400, 600, 800, 1000, 1500)
ASR_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
ASR_QUEUE_BUCKETS_MS = (1, 5, 10, 25, 50, 100, 200, 300, 500, 750, 1000, 2000, 5000)


class Metrics:
    """Every series the daemon exports; ``render()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.up = Gauge("edge_rtgi_up", "1 while the daemon serves", registry=r)
        self.sessions_active = Gauge("edge_rtgi_sessions_active", "WebSocket sessions open now", registry=r)
        self.sessions = Counter("edge_rtgi_sessions", "Sessions opened since start", registry=r)
        self.rejected = Counter(
            "edge_rtgi_connections_rejected", "Connections refused, by reason", ["reason"], registry=r
        )
        self.errors = Counter(
            "edge_rtgi_errors", "error events sent to clients, by code", ["code"], registry=r
        )
        self.responses = Counter(
            "edge_rtgi_responses", "Responses finished, by status", ["status"], registry=r
        )
        self.audio_in_s = Counter("edge_rtgi_audio_in_seconds", "Seconds of user audio received", registry=r)
        self.audio_out_s = Counter(
            "edge_rtgi_audio_out_seconds", "Seconds of synthesised audio sent", registry=r
        )
        self.http_requests = Counter(
            "edge_rtgi_http_requests",
            "OpenAI-compatible HTTP API requests, by route and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.voice_to_voice_ms = Histogram(
            "edge_rtgi_voice_to_voice_ms",
            "End of user speech to first reply audio sent, per turn (ms)",
            buckets=VOICE_TO_VOICE_BUCKETS_MS,
            registry=r,
        )
        self.endpointing_ms = Histogram(
            "edge_rtgi_endpointing_ms",
            "End of user speech to end of turn declared, per turn (ms)",
            buckets=ENDPOINTING_BUCKETS_MS,
            registry=r,
        )
        self.turn_decision_ms = Histogram(
            "edge_rtgi_turn_decision_ms",
            "Semantic turn detection: the model's verdict on a pause, per turn (ms)",
            buckets=TURN_DECISION_BUCKETS_MS,
            registry=r,
        )
        self.reply_head_start_ms = Histogram(
            "edge_rtgi_reply_head_start_ms",
            "A reply started on the turn's likely final: how long before the final, per turn (ms)",
            buckets=REPLY_HEAD_START_BUCKETS_MS,
            registry=r,
        )
        self.asr_final_ms = Histogram(
            "edge_rtgi_asr_final_ms",
            "End of turn to final transcript, per turn (ms)",
            buckets=ASR_FINAL_BUCKETS_MS,
            registry=r,
        )
        self.asr_batch_size = Histogram(
            "edge_rtgi_asr_batch_size",
            "Decodes per step of the shared ASR engine, per step",
            ["model"],
            buckets=ASR_BATCH_BUCKETS,
            registry=r,
        )
        self.asr_queue_wait_ms = Histogram(
            "edge_rtgi_asr_queue_wait_ms",
            "Shared ASR engine: a decode asked for -> its step began, per decode (ms)",
            ["model", "kind"],
            buckets=ASR_QUEUE_BUCKETS_MS,
            registry=r,
        )
        self.asr_turn_queue_ms = Histogram(
            "edge_rtgi_asr_final_queue_ms",
            "Of the ASR final's time after the endpoint, the wait for a shared-engine step, per turn (ms)",
            buckets=ASR_QUEUE_BUCKETS_MS,
            registry=r,
        )
        self.tts_first_audio_ms = Histogram(
            "edge_rtgi_tts_first_audio_ms",
            "First speakable chunk of a reply to its first audio, per turn (ms)",
            buckets=TTS_FIRST_AUDIO_BUCKETS_MS,
            registry=r,
        )
        self.llm_ttft_ms = Histogram(
            "edge_rtgi_llm_ttft_ms",
            "LLM request arrival to its first token, every engine request (ms)",
            ["model"],
            buckets=TTFT_BUCKETS_MS,
            registry=r,
        )
        self.llm_itl_ms = Histogram(
            "edge_rtgi_llm_itl_ms",
            "Time between consecutive tokens of an LLM request (ms)",
            ["model"],
            buckets=ITL_BUCKETS_MS,
            registry=r,
        )
        self.llm_requests = Counter(
            "edge_rtgi_llm_requests",
            "LLM engine requests finished, by model and finish reason",
            ["model", "finish_reason"],
            registry=r,
        )
        # The text stages' LLM backends (local engine, remote server, router), per turn.
        self.backend_requests = Counter(
            "edge_rtgi_backend_requests",
            "Text-stage LLM backend calls, by backend and outcome (a finish reason, cancelled, or an "
            "error code: backend_unavailable, backend_timeout, backend_error)",
            ["backend", "outcome"],
            registry=r,
        )
        self.backend_tokens = Counter(
            "edge_rtgi_backend_tokens",
            "Tokens of finished backend calls, by backend and kind (prompt, completion)",
            ["backend", "kind"],
            registry=r,
        )
        self.backend_ttft_ms = Histogram(
            "edge_rtgi_backend_ttft_ms",
            "Backend call sent to its first token, as the text stage saw it (ms)",
            ["backend"],
            buckets=TTFT_BUCKETS_MS,
            registry=r,
        )
        self.route_decisions = Counter(
            "edge_rtgi_route_decisions",
            "Router decisions, by router, chosen backend and reason",
            ["router", "backend", "reason"],
            registry=r,
        )
        self.heap_trims = Counter(
            "edge_rtgi_heap_trims", "Returns of the C heap's free pages to the OS (malloc_trim)", registry=r
        )
        self.heap_trim_rss_drop = Counter(
            "edge_rtgi_heap_trim_rss_drop_bytes",
            "Fall of the resident size across heap trims (other threads allocate meanwhile: an estimate)",
            registry=r,
        )
        self.heap_trim_ms = Histogram(
            "edge_rtgi_heap_trim_ms",
            "Time malloc_trim took, in a worker thread (ms)",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )
        self.gc_runs = Counter(
            "edge_rtgi_gc_runs", "Full collections of Python's cyclic garbage by the daemon", registry=r
        )
        self.gc_collected = Counter(
            "edge_rtgi_gc_collected_objects", "Objects those collections freed", registry=r
        )
        self.gc_ms = Histogram(
            "edge_rtgi_gc_ms",
            "Time a full collection held the interpreter (ms)",
            buckets=(0.5, 1, 2, 5, 10, 20, 50, 100, 200),
            registry=r,
        )
        self.up.set(1)

    def observe_gc(self, result: CollectResult) -> None:
        """One full garbage collection (``edge_rtgi.server.memory.CycleCollector``)."""
        self.gc_runs.inc()
        self.gc_collected.inc(result.collected)
        self.gc_ms.observe(result.duration_s * 1000)

    def observe_heap_trim(self, result: TrimResult) -> None:
        """One heap trim (``edge_rtgi.server.memory``)."""
        self.heap_trims.inc()
        self.heap_trim_rss_drop.inc(max(0, result.rss_drop_bytes))
        self.heap_trim_ms.observe(result.duration_s * 1000)

    def render(self) -> bytes:
        """The Prometheus text exposition (``CONTENT_TYPE``) of every series."""
        return generate_latest(self.registry)

    def add_engines(self, engines: Callable[[], dict[str, LLMEngine]]) -> None:
        """Export the engines' counters and gauges, read from ``engines()`` at each scrape."""
        self.registry.register(EngineCollector(engines))

    def observe_event(self, event: object) -> None:
        """The per-event series, the same for every protocol."""
        if isinstance(event, F.AudioOut):
            self.audio_out_s.inc(event.duration_s)
        elif isinstance(event, F.ResponseDone):
            self.responses.labels(status=event.status).inc()
            stats = event.stats
            for value, histogram in (
                (stats.voice_to_voice_ms, self.voice_to_voice_ms),
                (stats.endpointing_ms, self.endpointing_ms),
                (stats.turn_decision_ms, self.turn_decision_ms),
                (stats.reply_head_start_ms, self.reply_head_start_ms),
                (stats.asr_final_ms, self.asr_final_ms),
                (stats.asr_queue_ms, self.asr_turn_queue_ms),
                (stats.tts_first_chunk_ms, self.tts_first_audio_ms),
            ):
                if value is not None:
                    histogram.observe(value)
        elif isinstance(event, F.ErrorEvent):
            self.errors.labels(code=event.code).inc()

    def observe_asr_step(self, model: str, stats: StepStats) -> None:
        """A shared ASR engine step finished (called on its thread; the client is thread-safe)."""
        self.asr_batch_size.labels(model=model).observe(stats.batch_size)
        for wait_ms, final in zip(stats.queue_wait_ms, stats.job_finals, strict=True):
            self.asr_queue_wait_ms.labels(model=model, kind="final" if final else "partial").observe(wait_ms)

    def observe_request(self, model: str, finish_reason: str, usage: Usage | None) -> None:
        """An engine request finished (called on the engine's thread; the client is thread-safe)."""
        self.llm_requests.labels(model=model, finish_reason=finish_reason).inc()
        if usage is None or not usage.token_times_ms:
            return
        times = usage.token_times_ms
        self.llm_ttft_ms.labels(model=model).observe(times[0])
        itl = self.llm_itl_ms.labels(model=model)
        for before, after in zip(times[:-1], times[1:], strict=True):
            itl.observe(after - before)

    # BackendObserver (pipeline.backends.base), called on the event loop

    def on_result(self, result: BackendResult) -> None:
        """A backend call finished."""
        self.backend_requests.labels(backend=result.backend, outcome=result.finish_reason).inc()
        for kind, count in (("prompt", result.prompt_tokens), ("completion", result.completion_tokens)):
            if count:
                self.backend_tokens.labels(backend=result.backend, kind=kind).inc(count)
        if result.ttft_ms is not None:
            self.backend_ttft_ms.labels(backend=result.backend).observe(result.ttft_ms)

    def on_failure(self, backend: str, outcome: str) -> None:
        """A backend call ended without a result (cancelled, or an error code)."""
        self.backend_requests.labels(backend=backend, outcome=outcome).inc()

    def on_route(self, decision: RouteDecision) -> None:
        """A router sent a turn to a backend."""
        self.route_decisions.labels(
            router=decision.router, backend=decision.chosen, reason=decision.reason
        ).inc()


class EngineCollector(Collector):
    """The engines' own counters as Prometheus families, one label set per model."""

    def __init__(self, engines: Callable[[], dict[str, LLMEngine]]):
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "steps": CounterMetricFamily("edge_rtgi_engine_steps", "LLM engine steps run", labels=["model"]),
            "scheduled": CounterMetricFamily(
                "edge_rtgi_engine_scheduled_requests",
                "Sum over engine steps of the requests each step ran (divide by steps: batch size)",
                labels=["model"],
            ),
            "prefix_queried": CounterMetricFamily(
                "edge_rtgi_engine_prefix_queried_tokens",
                "Prompt tokens looked up in the prefix cache",
                labels=["model"],
            ),
            "prefix_hit": CounterMetricFamily(
                "edge_rtgi_engine_prefix_hit_tokens",
                "Prompt tokens served from the prefix cache",
                labels=["model"],
            ),
            "preemptions": CounterMetricFamily(
                "edge_rtgi_engine_preemptions", "Requests preempted (recomputed later)", labels=["model"]
            ),
            "per_step": GaugeMetricFamily(
                "edge_rtgi_engine_requests_per_step",
                "Mean LLM requests scheduled per engine step",
                labels=["model"],
            ),
            "max_per_step": GaugeMetricFamily(
                "edge_rtgi_engine_max_requests_per_step",
                "Most LLM requests in one engine step",
                labels=["model"],
            ),
            "running": GaugeMetricFamily(
                "edge_rtgi_engine_running_requests", "LLM requests running now", labels=["model"]
            ),
            "waiting": GaugeMetricFamily(
                "edge_rtgi_engine_waiting_requests", "LLM requests queued for admission now", labels=["model"]
            ),
            "kv_used": GaugeMetricFamily(
                "edge_rtgi_engine_kv_blocks_used", "KV cache blocks in use", labels=["model"]
            ),
            "kv_cached": GaugeMetricFamily(
                "edge_rtgi_engine_kv_blocks_cached",
                "Free KV blocks that still hold a cached prefix",
                labels=["model"],
            ),
            "kv_total": GaugeMetricFamily(
                "edge_rtgi_engine_kv_blocks_total", "KV cache blocks in the pool", labels=["model"]
            ),
            "row_deferrals": CounterMetricFamily(
                "edge_rtgi_engine_row_deferrals",
                "Admissions held back so that running decodes keep their ITL SLO (scheduling: slo)",
                labels=["model"],
            ),
            "prefix_waits": CounterMetricFamily(
                "edge_rtgi_engine_prefix_waits",
                "Admissions put off a step to reuse a prompt prefix another request was computing",
                labels=["model"],
            ),
            "refused_busy": CounterMetricFamily(
                "edge_rtgi_engine_refused_busy",
                "Requests refused as busy by the slo admission (their queue wait would pass their SLO)",
                labels=["model"],
            ),
            "spec_draft": CounterMetricFamily(
                "edge_rtgi_engine_spec_draft_tokens",
                "Draft tokens proposed and verified by speculative decoding",
                labels=["model"],
            ),
            "spec_accepted": CounterMetricFamily(
                "edge_rtgi_engine_spec_accepted_tokens",
                "Draft tokens accepted by speculative decoding (tokens gained over plain decoding)",
                labels=["model"],
            ),
            "step_model": GaugeMetricFamily(
                "edge_rtgi_engine_step_model_ms",
                "Fitted step-time model: ms per unit of each term (term label)",
                labels=["model", "term"],
            ),
            "step_model_error": GaugeMetricFamily(
                "edge_rtgi_engine_step_model_error_ms",
                "Mean absolute error of the step-time model's predictions, measured before each step",
                labels=["model"],
            ),
            "step_model_overshoot": GaugeMetricFamily(
                "edge_rtgi_engine_step_model_overshoot_ms",
                "97th percentile of how far steps ran past their prediction (the slo policy's margin)",
                labels=["model"],
            ),
            "lifts_held": CounterMetricFamily(
                "edge_rtgi_engine_prefill_lifts_held",
                "Steps whose prefill cap the slo policy kept for streams with no late gap to spare",
                labels=["model"],
            ),
        }
        for name, engine in self._engines().items():
            s = engine.stats()
            for key, value in (
                ("steps", s.num_steps),
                ("scheduled", s.num_scheduled_requests),
                ("prefix_queried", s.prefix_queried_tokens),
                ("prefix_hit", s.prefix_hit_tokens),
                ("preemptions", s.num_preemptions),
                ("per_step", s.requests_per_step),
                ("max_per_step", s.max_requests_per_step),
                ("running", s.num_running),
                ("waiting", s.num_waiting),
                ("kv_used", s.kv_blocks_used),
                ("kv_cached", s.kv_blocks_cached),
                ("kv_total", s.kv_blocks_total),
                ("row_deferrals", s.num_row_deferrals),
                ("prefix_waits", s.num_prefix_waits),
                ("refused_busy", s.num_refused_busy),
                ("spec_draft", s.spec_draft_tokens),
                ("spec_accepted", s.spec_accepted_tokens),
                ("step_model_error", s.step_model_error_ms),
                ("step_model_overshoot", s.step_model_overshoot_ms),
                ("lifts_held", s.num_lifts_held),
            ):
                fams[key].add_metric([name], float(value))
            for term, ms in (
                ("fixed", s.step_model_fixed_ms),
                ("per_decode_row", s.step_model_per_decode_row_ms),
                ("per_prefill_token", s.step_model_per_prefill_token_ms),
                ("per_context_ktoken", s.step_model_per_context_ktoken_ms),
                ("python_layers", s.step_model_python_layers_ms),
            ):
                fams["step_model"].add_metric([name, term], ms)
        yield from fams.values()
