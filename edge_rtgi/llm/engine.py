"""The LLM engine: one step loop (schedule -> run -> update) shared by every caller.

Threading model: all scheduler, KV and model work happens in the engine's own thread; callers
only enqueue commands (add, abort) and receive deltas. ``add_request`` returns an async
iterator fed with ``loop.call_soon_threadsafe``, so the caller's event loop never blocks on
a forward pass. A consumer that stops reading (closes the iterator, is cancelled, or drops
it) aborts its request, which frees its blocks.

Failures stay local: a request with bad input gets a single error delta; a request whose
sampling fails is finished with an error while the others continue; an exception in a whole
step fails the requests of that step only, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from edge_rtgi.cpu_priority import FOREGROUND
from edge_rtgi.device import release_cpu_workers
from edge_rtgi.errors import ConfigError, EdgeRtgiError, EngineBusy, ModelNotFoundError, RequestError
from edge_rtgi.llm.detokenize import BoundaryStopper, IncrementalDetokenizer, StopStringMatcher
from edge_rtgi.llm.engine_config import EngineConfig, EngineStats, check_plan_kv_groups, layers_per_block
from edge_rtgi.llm.kv.eviction import KVEviction, observation_queries, segment_ids, select_keep
from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
from edge_rtgi.llm.kv.manager import KVCacheManager
from edge_rtgi.llm.kv.mixed import MixedPagedKVStorage
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage, PagedKVStorage
from edge_rtgi.llm.kv.window import windowed_groups
from edge_rtgi.llm.model import ModelConfig, Transformer
from edge_rtgi.llm.quant.kernels import apply_int8_activations, int8_activation_max_rows
from edge_rtgi.llm.request import (
    Request,
    RequestClass,
    RequestDelta,
    RequestSLO,
    RequestStatus,
    TokenLogprob,
    Usage,
)
from edge_rtgi.llm.retrieval import StoreMismatchError
from edge_rtgi.llm.runner import CHUNK_ROWS_MAX_KEYS, ModelRunner
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.scheduler import (
    ModelRunnerOutput,
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from edge_rtgi.llm.speculative import (
    DRAFTS,
    Draft,
    NgramDraft,
    SpeculativeConfig,
    Speculator,
    StepSize,
    parse_speculative,
)
from edge_rtgi.llm.step_model import StepShape, StepTimeModel
from edge_rtgi.llm.tokenizer import ChatTokenizer, Tokenizer, tokenizer_fingerprint

if TYPE_CHECKING:
    from edge_rtgi.llm.weights import LoadedModel

log = logging.getLogger(__name__)

# max_model_len under kv_window when none is set: a request is bounded by its max_tokens alone
UNBOUNDED_MODEL_LEN = 1 << 30

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
DeltaSink = Callable[[RequestDelta], None]
# (finish_reason, usage) of every finished request, called on the engine thread (metrics)
FinishListener = Callable[[str, Usage | None], None]


@dataclass
class _Stream:
    """Engine-side state of one request's output (lives in the engine thread)."""

    sink: DeltaSink
    arrival_s: float
    request: Request | None = None
    detok: IncrementalDetokenizer | None = None
    stops: StopStringMatcher | None = None
    stop_hit: bool = False
    token_times_ms: list[float] = field(default_factory=list)
    # dynamic stopping (SamplingParams.token_budget / deadline_ms) and why it was armed
    boundary: BoundaryStopper | None = None
    token_budget: int | None = None
    deadline_s: float | None = None
    cut_reason: RequestStatus | None = None


# Commands from callers' threads to the engine thread, applied in the order they were sent.


@dataclass(frozen=True)
class _Add:
    request: Request
    stream: _Stream


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: wakes an idle loop so that it notices shutdown."""


_Command = _Add | _Abort | _Wake


def _build_storage(
    config: EngineConfig, mcfg: ModelConfig, num_blocks: int, num_groups: int, model: Transformer
) -> PagedKVStorage:
    """The KV storage ``config.kv_dtype`` asks for: one precision for every layer, or with
    ``kv_dtype: plan`` a precision per layer (``kv.mixed``)."""
    shape = (num_blocks, config.block_size, mcfg.num_kv_heads, mcfg.head_dim, model.dtype, model.device)
    if config.kv_dtype == "plan":
        check_plan_kv_groups(mcfg.arch, num_groups)
        return MixedPagedKVStorage(config.kv_layer_dtypes(mcfg.num_layers), *shape)
    storage_cls: type[PagedKVStorage] = PagedKVStorage
    if config.kv_dtype == "int8":
        storage_cls = Int8PagedKVStorage
    elif config.kv_dtype == "int4":
        if num_groups > 1:  # its open-block bookkeeping is per step, for one slot mapping
            raise ValueError(
                f"kv_dtype int4 needs a model with one KV group; {mcfg.arch} has {num_groups} "
                "(per-layer windows): use kv_dtype auto or int8"
            )
        storage_cls = Int4KIVIPagedKVStorage
    return storage_cls(layers_per_block(mcfg), *shape)


def build_speculator(
    spec: SpeculativeConfig, model: Transformer, tokenizer: ChatTokenizer | None, model_name: str
) -> Speculator | None:
    """The speculator for ``spec``, with the drafts that need a file loaded where the setting
    asks for them: the reply store (``retrieval``) under ``auto`` wherever the catalogue has one
    for the model, and the trained draft (``eagle``) where the setting names it (``draft:
    eagle``, or ``{draft: auto, draft_model: ...}``). A file that is missing, damaged or made for
    another model is refused with one warning: under ``auto`` the other drafts run on, with a
    fixed draft the engine runs without speculation."""
    drafts: list[Draft] = []
    if spec.mode == "auto" or spec.draft in DRAFTS:
        drafts += [cls() for name, cls in DRAFTS.items() if spec.mode == "auto" or name == spec.draft]
    if spec.draft == "retrieval" or spec.mode == "auto":
        try:
            store_name = spec.draft_model if spec.mode == "fixed" else None
            # its own-text lookup is the n-gram draft's, with one index per request for both
            own = next((d for d in drafts if isinstance(d, NgramDraft)), None)
            drafts.append(load_retrieval_draft(store_name, model, tokenizer, model_name, own))
        except (ModelNotFoundError, StoreMismatchError) as exc:
            if spec.mode == "fixed":
                log.warning("speculative decoding is off: %s", exc)
                return None
            # auto looked the store up by the configured model's name; a model loaded otherwise
            # (from_loaded, a path) may have no store, or not that one: nothing to warn about
            log.info("speculative: auto runs without the retrieval draft: %s", exc)
        except EdgeRtgiError as exc:
            if spec.mode == "fixed":
                log.warning("speculative decoding is off: the reply store was refused: %s", exc)
                return None
            log.warning("speculative: auto runs without the retrieval draft: %s", exc)
    # Under plain ``auto`` the trained draft is left out: on this CPU it costs more per token than
    # its acceptance returns (docs/benchmarks.md, "The trained draft"); naming it opts in.
    if spec.draft == "eagle" or (spec.mode == "auto" and spec.draft_model is not None):
        try:
            drafts.append(load_eagle_draft(spec.draft_model, model, tokenizer, model_name))
        except EdgeRtgiError as exc:
            if spec.mode == "fixed":
                log.warning("speculative decoding is off: the eagle draft was refused: %s", exc)
                return None
            log.warning("speculative: auto runs without the eagle draft: %s", exc)
    return Speculator(spec, drafts)


def _catalogue_draft(kind: str, model_name: str) -> str:
    """The name of the catalogue's draft file of ``kind`` (``extra.kind``; entries without one
    are ``eagle``) made for ``model_name``; ModelNotFoundError when there is none."""
    from edge_rtgi.catalog import list_entries

    for entry in list_entries("draft"):
        extra = entry.extra or {}
        if extra.get("target") == model_name and extra.get("kind", "eagle") == kind:
            return entry.name
    hint = {
        "eagle": "train one with scripts/train_draft.py and set speculative.draft_model",
        "retrieval": "build one with scripts/build_reply_store.py and set speculative.draft_model",
    }[kind]
    raise ModelNotFoundError(f"the catalogue has no {kind} draft for {model_name!r}", hint=hint)


def _own_tokenizer(tokenizer: ChatTokenizer | None, draft: str) -> Tokenizer:
    if not isinstance(tokenizer, Tokenizer):
        raise ConfigError(f"the {draft} draft needs the model's own tokenizer to check it was made for it")
    return tokenizer


def load_retrieval_draft(
    store: str | None,
    model: Transformer,
    tokenizer: ChatTokenizer | None,
    model_name: str,
    own: NgramDraft | None = None,
) -> Draft:
    """The ``retrieval`` draft for ``model``: the reply store ``store`` (a catalogue name or a
    path), or the catalogue's store whose ``extra.target`` is ``model_name``; ``own``: the n-gram
    draft whose proposal from the request's own text comes first (a new one when None; pass the
    engine's, so that each request is indexed once). EdgeRtgiError with the reason."""
    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.llm.retrieval import RetrievalDraft

    name = store or _catalogue_draft("retrieval", model_name)
    checked = _own_tokenizer(tokenizer, "retrieval")
    path = resolve_model(name, role="draft")
    # the request's own tokens first (prompt lookup), the store where they have no match
    vocab = model.config.vocab_size
    return RetrievalDraft.from_file(path, tokenizer_fingerprint(checked), vocab, own or NgramDraft())


def load_eagle_draft(
    draft_model: str | None, model: Transformer, tokenizer: ChatTokenizer | None, model_name: str
) -> Draft:
    """The ``eagle`` draft for ``model``: ``draft_model`` (a catalogue name or a path), or the
    catalogue's draft whose ``extra.target`` is ``model_name``. EdgeRtgiError with the reason."""
    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.llm.eagle import EagleDraft

    name = draft_model or _catalogue_draft("eagle", model_name)
    own = _own_tokenizer(tokenizer, "eagle")
    return EagleDraft.from_file(resolve_model(name, role="draft"), model, own)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache. See docs/engine.md."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: ChatTokenizer | None = None,
        config: EngineConfig | None = None,
        *,
        start: bool = True,
    ):
        self.config = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        spec = self.config.speculation()
        self.speculator = (
            build_speculator(spec, model, tokenizer, self.config.model) if spec.enabled else None
        )
        # a property of the model's layers: engines sharing one model share it (the last one set);
        # set before the runner reads the layer loop's width
        self.int8_activation_layers = apply_int8_activations(model, self.config.int8_activations)
        mcfg = model.config
        window = self.config.kv_window
        if window is None:
            self.max_model_len = min(
                self.config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
            )
        else:  # positions stay in range however long a request runs (kv.window)
            window.check_positions(mcfg.max_position_embeddings, self.config.max_num_batched_tokens)
            self.max_model_len = self.config.max_model_len or UNBOUNDED_MODEL_LEN
        num_blocks = self.config.resolve_num_blocks(mcfg, model.dtype)
        groups = windowed_groups(mcfg.kv_groups(), window)
        self.kv = KVCacheManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching, groups
        )
        self.storage = _build_storage(self.config, mcfg, num_blocks, len(groups), model)
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill:  # a whole prompt must fit one step
            budget = max(budget, self.max_model_len)
        eviction = self.config.kv_eviction
        if eviction is not None and len(groups) > 1:  # compaction rewrites one block table
            raise ValueError(
                f"kv_eviction needs a model with one KV group; {mcfg.arch} has {len(groups)} "
                "(per-layer windows): leave kv_eviction unset"
            )
        # fitted on every step under either policy (its error is in the stats); the slo policy reads it
        self.step_model = StepTimeModel()
        self.runner = ModelRunner(model, self.storage, self.config.decode_mode, groups, eviction)
        self.scheduler = Scheduler(
            SchedulerConfig(
                budget,
                self.config.max_num_seqs,
                self.max_model_len,
                self.config.enable_chunked_prefill,
                policy=self.config.scheduling,
                min_prefill_chunk_tokens=self.config.min_prefill_chunk_tokens,
                admission_wait_factor=self.config.admission_wait_factor,
                slo_waiting_order=self.config.slo_waiting_order,
                kv_budget_tokens=self.config.kv_budget_tokens,
                kv_eviction=self.config.kv_eviction,
                # as the runner stands now (benchmarks that switch chunks_as_rows later leave it)
                fused_decode_rows=self.runner.fused_decode_rows(),
                fused_step_tokens=self.runner.fused_step_tokens(),
                fused_chunk_max_keys=CHUNK_ROWS_MAX_KEYS,
            ),
            self.kv,
            self.step_model,
        )
        self._turn_starts, self._sentence_ends = _segment_tokens(tokenizer, eviction)
        self.runner.collect_features = self.speculator is not None and self.speculator.wants_features
        tok_eos = getattr(tokenizer, "eos_token_ids", ()) if tokenizer is not None else ()
        self.eos_token_ids = frozenset((*mcfg.eos_token_ids, *tok_eos))
        self._streams: dict[str, _Stream] = {}
        self._finish_listeners: list[FinishListener] = []
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._stats = EngineStats(kv_blocks_total=num_blocks)
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if start:
            # The caller's thread loaded and prepared the model; its idle OpenMP pool would
            # slow every op of the engine thread (edge_rtgi.device.release_cpu_workers).
            release_cpu_workers()
            self.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Resolve the model through the catalogue, load it, and build an engine."""
        from edge_rtgi.catalog import resolve_model
        from edge_rtgi.llm.prepared import load_prepared

        # quant applied (llm.quant.apply_engine_quant), from a prepared copy when one matches
        prepared = load_prepared(
            resolve_model(config.model, role="llm"), config.device, config.dtype, config.quant
        )
        return cls.from_loaded(prepared.loaded, config)

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, config: EngineConfig | None = None, *, start: bool = True
    ) -> LLMEngine:
        """Build on a ``LoadedModel`` (model + tokenizer) from ``weights.load_model``."""
        return cls(loaded.model, loaded.tokenizer, config, start=start)

    # --- thread ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Abort everything and stop the thread; later requests get an error delta."""
        self._closed = True
        self._stop.set()
        self._commands.put(_Wake())
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._drain_commands()
        for rid in list(self.scheduler.requests):
            self._emit(self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED))

    def _loop(self) -> None:
        torch.set_num_threads(self.config.num_threads or torch.get_num_threads())
        holds_workers = False
        while not self._stop.is_set():
            if not self.scheduler.has_unfinished():
                if holds_workers:  # idle: let other threads' torch work run at full speed
                    holds_workers = not release_cpu_workers()
                try:  # idle: sleep until a command arrives
                    self._handle(self._commands.get(timeout=0.5))
                except queue.Empty:
                    continue
            holds_workers = True
            if self.config.yield_to_foreground_ms:
                self._stats.foreground_wait_s += FOREGROUND.wait_for_idle(
                    self.config.yield_to_foreground_ms / 1000
                )
            try:
                self.step()
            except Exception:  # a bug in one step must not hang every caller
                log.exception("engine step crashed; failing the requests in flight")
                for rid in list(self.scheduler.requests):
                    self._emit(
                        self.scheduler.finish_request(
                            rid, RequestStatus.FINISHED_ERROR, "internal engine error (see the log)"
                        )
                    )

    @property
    def closed(self) -> bool:
        """True once ``shutdown`` was called (a stopped thread is then expected, not a fault)."""
        return self._closed

    @property
    def running_in_thread(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- intake ----------------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | Mapping[str, Any] | None,
        sink: DeltaSink,
        *,
        request_id: str | None = None,
        priority: int = 0,
        request_class: RequestClass = RequestClass.DIALOGUE,
        slo: RequestSLO | None = None,
        always_queue: bool = False,
    ) -> str:
        """Queue a request whose deltas go to ``sink`` (called from the engine thread).

        ``request_class`` and ``slo`` (None: the class default) are what the ``slo`` scheduling
        policy orders and protects; ``always_queue`` exempts it from the busy refusal (a batch
        caller that waits for every result, like ``generate``). Bad input does not raise:
        ``sink`` receives one error delta. Returns the request id.
        """
        rid = request_id or f"req-{next(self._ids)}"
        arrival = time.monotonic()
        try:
            if self._closed:
                raise RequestError("the engine has been shut down")
            params = self._params(params)
            prompt_ids = self._tokenize(prompt)
            req = Request(
                rid,
                prompt_ids,
                params,
                priority=priority,
                request_class=request_class,
                slo=slo,
                may_refuse=not always_queue,
                eos_token_ids=self._stop_ids(params),
                arrival_time_s=arrival,
            )
            self.scheduler.check_fits(req)  # reads only immutable sizes; safe off-thread
            stream = self._make_stream(sink, arrival, params, prompt_ids)
        except EdgeRtgiError as exc:
            sink(RequestDelta(rid, "", (), "error", error=str(exc)))
            self._notify_finish("error", None)
            return rid
        self._commands.put(_Add(req, stream))
        return rid

    def add_finish_listener(self, listener: FinishListener) -> None:
        """``listener(finish_reason, usage)`` runs for every finished request, on the engine's
        thread (or the caller's, for input refused at submit): keep it short and thread-safe."""
        self._finish_listeners.append(listener)

    def _notify_finish(self, finish_reason: str, usage: Usage | None) -> None:
        for listener in self._finish_listeners:
            try:
                listener(finish_reason, usage)
            except Exception:  # a broken observer must not stop the engine
                log.exception("finish listener failed")

    def _params(self, params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, SamplingParams):
            params.validate()
            return params
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
        try:
            return SamplingParams(**fields)
        except TypeError as exc:
            raise RequestError(f"bad sampling parameters: {exc}") from None

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; send token ids")
            # Raw text gets the model's own special tokens (e.g. BOS), like the CLI and HF's generate.
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        messages = [m for m in prompt if isinstance(m, Mapping)]
        if messages:
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; send token ids")
            if len(messages) != len(prompt):
                raise RequestError("a chat prompt must hold only messages ({'role': ..., 'content': ...})")
            return list(self.tokenizer.encode_chat(messages))
        vocab = self.model.config.vocab_size
        ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab]
        if len(ids) != len(prompt):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= self.eos_token_ids
        return frozenset(ids)

    def _make_stream(
        self, sink: DeltaSink, arrival: float, params: SamplingParams, prompt_ids: list[int]
    ) -> _Stream:
        stream = _Stream(sink, arrival)
        if self.tokenizer is not None:
            stream.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            stream.stops = StopStringMatcher(params.stop) if params.stop else None
        elif params.stop or params.stops_at_boundaries:
            raise RequestError(
                "stop strings, token budgets and deadlines need a tokenizer; this engine has none"
            )
        if params.stops_at_boundaries:
            stream.boundary = BoundaryStopper(params.boundary_grace_tokens)
            stream.token_budget = params.token_budget
            if params.deadline_ms is not None:
                stream.deadline_s = arrival + params.deadline_ms / 1e3
        return stream

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        request_class: RequestClass = RequestClass.DIALOGUE,
        slo: RequestSLO | None = None,
    ) -> RequestStream:
        """Queue a request; iterate the result (``async for``) to receive its deltas.

        Call from a coroutine. Closing or dropping the iterator aborts the request.
        """
        stream = RequestStream(self, asyncio.get_running_loop())
        # The engine keeps only a weak reference, so a consumer that drops the iterator
        # lets it be collected, and its __del__ aborts the request.
        ref = weakref.ref(stream)

        def sink(delta: RequestDelta) -> None:
            target = ref()
            if target is not None:
                target._deliver(delta)
            elif not delta.finished:
                self.abort(delta.request_id)

        stream.request_id = self.submit(
            prompt,
            params,
            sink,
            request_id=request_id,
            priority=priority,
            request_class=request_class,
            slo=slo,
        )
        return stream

    def abort(self, request_id: str) -> None:
        """Finish a request now and free its blocks (thread-safe; no-op if already done)."""
        self._commands.put(_Abort(request_id))

    def stream(
        self, prompt: Prompt, params: SamplingParams | Mapping[str, Any] | None = None, *, priority: int = 0
    ) -> Iterator[RequestDelta]:
        """Synchronous streaming for threads without an event loop (the CLI).

        Closing the generator early aborts the request. Without a running engine thread the
        steps run in the caller's thread.
        """
        deltas: queue.SimpleQueue[RequestDelta] = queue.SimpleQueue()
        rid = self.submit(prompt, params, deltas.put, priority=priority)
        finished = False
        try:
            while not finished:
                if not self.running_in_thread:
                    while deltas.empty():
                        self.step()
                delta = deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(rid)
                if not self.running_in_thread:
                    self._drain_commands()

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Synchronous convenience: run prompts to completion (batched) and return the results.

        ``params`` is one ``SamplingParams`` for every prompt, or one per prompt.
        """
        one = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], (int, Mapping)))
        batch = [cast(Prompt, prompts)] if one else cast(list[Prompt], list(prompts))
        if params is None or isinstance(params, SamplingParams):
            per_prompt: list[SamplingParams | None] = [params] * len(batch)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(batch):
                raise RequestError(f"{len(batch)} prompts but {len(per_prompt)} sampling parameter sets")
        results = [GenerationResult() for _ in batch]
        done: queue.SimpleQueue[bool] = queue.SimpleQueue()
        for res, prompt, prompt_params in zip(results, batch, per_prompt, strict=True):

            def sink(delta: RequestDelta, res: GenerationResult = res) -> None:
                res.add(delta)
                if delta.finished:
                    done.put(True)

            self.submit(prompt, prompt_params, sink, always_queue=True)
        for _ in batch:
            if self.running_in_thread:
                done.get()
            else:
                while done.empty():
                    self.step()
                done.get()
        return results

    # --- the step --------------------------------------------------------------------------

    def _drain_commands(self) -> None:
        while True:
            try:
                self._handle(self._commands.get_nowait())
            except queue.Empty:
                return

    def _handle(self, command: _Command) -> None:
        """Apply one command, in the order commands were sent (an abort never overtakes its add)."""
        match command:
            case _Add(request=req, stream=stream):
                try:
                    self.scheduler.add_request(req)
                except EdgeRtgiError as exc:
                    busy = exc if isinstance(exc, EngineBusy) else None
                    stream.sink(
                        RequestDelta(
                            req.request_id,
                            "",
                            (),
                            "error",
                            error=str(exc),
                            error_code=busy.code if busy else None,
                            retry_after_ms=busy.retry_after_ms if busy else None,
                        )
                    )
                    self._notify_finish("error", None)
                    return
                stream.request = req
                self._streams[req.request_id] = stream
                policy = self.config.kv_eviction
                if policy is not None and policy.mode == "segment":
                    observed = observation_queries(policy, req.prompt_token_ids, self._turn_starts)
                    self.runner.observe(req.request_id, observed)
            case _Abort(request_id=rid) if rid in self.scheduler.requests:
                self._emit(self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED))
            case _Abort() | _Wake():
                pass

    def step(self) -> bool:
        """One iteration: take commands, schedule, run, deliver. False when there was no work."""
        self._drain_commands()
        if not self.scheduler.has_unfinished():
            return False
        t0 = time.perf_counter()
        if self.speculator is not None:
            self._propose_drafts(self.speculator)
        output = self.scheduler.schedule()
        if output.is_empty:
            return False
        # submit() builds every request with a SamplingParams; the scheduler sees only RequestParams
        params = {
            s.request_id: cast(SamplingParams, self.scheduler.requests[s.request_id].params)
            for s in output.scheduled
        }
        t1 = time.perf_counter()
        try:
            result = self.runner.execute(output, params)
        except Exception as exc:  # fail this step's requests, keep serving
            log.exception("engine step failed")
            result = ModelRunnerOutput(
                {}, {s.request_id: f"engine step failed: {exc}" for s in output.scheduled}
            )
        t2 = time.perf_counter()
        self.step_model.observe(step_shape(output, self.runner.last_step_python_layers), (t2 - t1) * 1e3)
        requests = {s.request_id: self.scheduler.requests.get(s.request_id) for s in output.scheduled}
        updates = self.scheduler.update_from_output(output, result)
        if self.config.kv_budget_tokens is not None:
            self._evict(self.config.kv_budget_tokens)
        if self.speculator is not None:
            if self.runner.collect_features:
                self.speculator.add_features(self.runner.features)
            self._observe_drafts(self.speculator, output, result, requests, updates, (t2 - t1) * 1e3)
        for update in updates:
            self._emit(update, result.logprobs.get(update.request_id))
        self._stats.record_step(output, schedule_s=t1 - t0, run_s=t2 - t1, update_s=time.perf_counter() - t2)
        return True

    def _evict(self, budget_tokens: int) -> None:
        """Cut every running request over its KV budget down to ``KVEviction.trim_target``:
        pick the survivors from the runner's attention scores, compact the block table, copy
        the surviving KV into place, and follow with the scores."""
        policy = self.config.kv_eviction
        assert policy is not None  # EngineConfig sets the two together
        target = policy.trim_target(budget_tokens, self.kv.block_size)
        for req in self.scheduler.over_kv_budget(budget_tokens):
            if not policy.scores_every_query() and req.num_computed_tokens < req.num_prompt_tokens:
                continue  # observation scores: the prompt is held whole until its last queries score it
            st = self.runner.eviction_scores(req.request_id)
            if st is None or len(st.scores) != req.num_kv_tokens:
                raise RuntimeError(f"request {req.request_id}: eviction scores out of step with its cache")
            segments = None
            if policy.mode == "segment":
                ids = segment_ids(req.all_token_ids, self._turn_starts, self._sentence_ends)
                segments = [ids[p] for p in st.positions.tolist()]
            keep = select_keep(st.scores.tolist(), target, policy, segments)
            moves = self.kv.compact(req, keep)
            if moves is None:
                continue  # no block for a copy-on-write: stay over budget until one frees
            if moves.src or moves.dest_blocks:
                device = self.storage.k[0].device
                self.storage.apply_compaction(
                    torch.tensor(moves.src, dtype=torch.long, device=device),
                    torch.tensor(moves.dst, dtype=torch.long, device=device),
                    moves.dest_blocks,
                    moves.num_dest_tokens,
                )
            self.runner.keep_scores(req.request_id, keep)
            self._stats.kv_evicted_tokens += len(st.scores) - len(keep)

    def _draft_room(self) -> int | None:
        """The most draft tokens the next step may verify (None: no limit but the budget's).
        Where layers round their activations to int8, a step verifies drafts only while it
        holds decodes alone (no prompt mid-prefill, none that could be admitted) and stays
        within the rows those layers' kernel takes: a wider step would run them unrounded on
        the dense copies, so drafts would change the numbers of every request in the step,
        not only in the last bits as the bf16 kernels' own differences do."""
        rows = int8_activation_max_rows(self.model)
        if rows is None:
            return None
        running = self.scheduler.running
        admits = self.scheduler.waiting and len(running) < self.config.max_num_seqs
        if admits or any(r.num_tokens - r.num_computed_tokens != 1 for r in running):
            return 0  # a prompt joins the step, and its chunk's rows are the scheduler's to choose
        return rows - len(running)

    def _propose_drafts(self, speculator: Speculator) -> None:
        room = self._draft_room()
        if room is not None and room <= 0:
            return
        decodes = []
        running_decodes = 0  # these and the ones that may not speculate: the step's sequences
        for req in self.scheduler.running:
            if req.num_tokens - req.num_computed_tokens != 1:
                continue
            running_decodes += 1
            p = cast(SamplingParams, req.params)
            own = parse_speculative(p.speculative) if p.speculative is not None else None
            if own is not None and not own.enabled:
                continue
            if speculator.eligible(req, p.greedy, p.seed is not None, p.logprobs, own):
                decodes.append((req, own))
        speculator.propose(decodes, room, running_decodes)

    def _observe_drafts(
        self,
        speculator: Speculator,
        output: SchedulerOutput,
        result: ModelRunnerOutput,
        requests: Mapping[str, Request | None],
        updates: list[RequestUpdate],
        run_ms: float,
    ) -> None:
        decode_only = all(len(s.token_ids) - s.num_draft_tokens == 1 for s in output.scheduled)
        speculator.observe(
            {rid: req for rid, req in requests.items() if req is not None},
            {s.request_id: s.num_draft_tokens for s in output.scheduled if s.num_draft_tokens},
            result.num_accepted,
            {u.request_id: u.new_token_ids for u in updates if u.new_token_ids},
            StepSize(len(output.scheduled), output.num_batched_tokens) if decode_only else None,
            run_ms,
        )

    def _emit(self, update: RequestUpdate, logprob: TokenLogprob | None = None) -> None:
        """Turn a scheduler update into a text delta (same text rules as plain generation);
        ``logprob`` is the sampled token's, for a request that asked for it."""
        stream = self._streams.get(update.request_id)
        if stream is None:
            return
        text, finish = "", update.finish_reason
        tokens = update.new_token_ids
        cut = False
        # A stop token (EOS or a stop id) ends the stream without showing its text.
        shown = tokens[:-1] if finish == "stop" else tokens
        if shown and stream.detok is not None:
            # token by token: a step that verified drafts brings several, and a stop string or
            # a boundary cut must end the stream at the token where it happened
            now_ms = (time.monotonic() - stream.arrival_s) * 1e3
            for i, tok in enumerate(shown):
                piece = stream.detok.push(tok)
                stream.token_times_ms.append(now_ms)
                if stream.stops is not None:
                    piece, stream.stop_hit = stream.stops.push(piece)
                if stream.boundary is not None and not stream.stop_hit and finish is None:
                    piece, cut = self._boundary(stream, piece)
                text += piece
                if stream.stop_hit or cut:
                    tokens = tokens[: i + 1]
                    break
            if len(tokens) > len(shown):  # the stop token itself
                stream.token_times_ms.append(now_ms)
        elif tokens:
            stream.token_times_ms.extend([(time.monotonic() - stream.arrival_s) * 1e3] * len(tokens))
        if cut and stream.cut_reason is not None:  # past the budget or deadline, at a boundary
            self.scheduler.finish_request(update.request_id, stream.cut_reason)
            finish = stream.cut_reason.value
        elif stream.stop_hit:
            if finish is None:
                self.scheduler.finish_request(update.request_id, RequestStatus.FINISHED_STOPPED)
            finish = "stop"
        elif finish in ("stop", "length") and stream.detok is not None:
            tail, stream.stop_hit = self._flush(stream)
            text += tail
            finish = "stop" if stream.stop_hit else finish
        usage = self._usage(stream) if finish else None
        if finish:
            del self._streams[update.request_id]
            self.runner.release(update.request_id)
            if self.speculator is not None and stream.request is not None:
                self.speculator.release(stream.request)
            self._notify_finish(finish, usage)
        if len(tokens) != len(update.new_token_ids):
            update = RequestUpdate(update.request_id, tokens, update.finish_reason, update.error)
        self._deliver(stream, update, text, finish, usage, logprob)

    def _boundary(self, stream: _Stream, text: str) -> tuple[str, bool]:
        """Arm the stream's boundary stopper once past its budget or deadline; cut if due."""
        boundary = stream.boundary
        assert boundary is not None
        if not boundary.armed:
            if stream.token_budget is not None and len(stream.token_times_ms) >= stream.token_budget:
                stream.cut_reason = RequestStatus.FINISHED_BUDGET
            elif stream.deadline_s is not None and time.monotonic() >= stream.deadline_s:
                stream.cut_reason = RequestStatus.FINISHED_DEADLINE
            if stream.cut_reason is not None:
                boundary.arm()
        return boundary.push(text)

    def _deliver(
        self,
        stream: _Stream,
        update: RequestUpdate,
        text: str,
        finish: str | None,
        usage: Usage | None,
        logprob: TokenLogprob | None,
    ) -> None:
        try:
            stream.sink(
                RequestDelta(
                    update.request_id,
                    text,
                    tuple(update.new_token_ids),
                    finish,
                    usage,
                    update.error,
                    (logprob,) if logprob is not None and update.new_token_ids else (),
                )
            )
        except Exception:  # a broken consumer must not stop the engine
            log.exception("delivering a delta for %s failed; aborting it", update.request_id)
            if not finish:
                self.abort(update.request_id)

    @staticmethod
    def _flush(stream: _Stream) -> tuple[str, bool]:
        """Text held back by the detokenizer and the stop matcher at the end, and whether a stop hit."""
        if stream.detok is None:
            return "", False
        tail = stream.detok.flush()
        if stream.stops is None:
            return tail, False
        text, hit = stream.stops.push(tail)
        return (text, True) if hit else (text + stream.stops.flush(), False)

    def _usage(self, stream: _Stream) -> Usage:
        req = stream.request
        draft = None
        if req is not None and self.speculator is not None:
            draft = self.speculator.draft_used(req.request_id)
        return Usage(
            prompt_tokens=req.num_prompt_tokens if req else 0,
            cached_tokens=max(req.num_cached_tokens, 0) if req else 0,
            completion_tokens=len(stream.token_times_ms),
            ttft_ms=stream.token_times_ms[0] if stream.token_times_ms else None,
            token_times_ms=tuple(stream.token_times_ms),
            num_preemptions=req.num_preemptions if req else 0,
            draft=draft,
            draft_tokens=req.num_draft_tokens if req else 0,
            accepted_draft_tokens=req.num_accepted_draft_tokens if req else 0,
        )

    # --- introspection ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of counters for /metrics and benchmarks."""
        return self._stats.snapshot(self.kv, self.scheduler, self.step_model.snapshot())

    def reset_prefix_cache(self) -> int:
        """Forget all cached free blocks (benchmarks' cold runs). Call while idle."""
        return self.kv.pool.reset_prefix_cache()


def _segment_tokens(
    tokenizer: ChatTokenizer | None, eviction: KVEviction | None
) -> tuple[frozenset[int], frozenset[int]]:
    """Token ids that start a conversation turn and, for sentence segments, those that end a
    sentence; empty unless eviction is by segment. The turn start is the first token a second
    message adds to the rendered chat (``<|im_start|>``, ``<start_of_turn>``...)."""
    if eviction is None or eviction.mode != "segment":
        return frozenset(), frozenset()
    if tokenizer is None:
        raise ValueError("kv_eviction mode segment needs a tokenizer (turns come from its chat template)")
    one = tokenizer.encode_chat([{"role": "user", "content": "x"}], add_generation_prompt=False)
    two = tokenizer.encode_chat(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], add_generation_prompt=False
    )
    common = next((i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b), len(one))
    if common >= len(two):
        raise ValueError("kv_eviction mode segment: the chat template shows no turn boundary")
    starts = frozenset([two[common]])
    if eviction.segment == "turn":
        return starts, frozenset()
    ends = set()
    for token in range(getattr(tokenizer, "vocab_size", 0)):
        text = tokenizer.decode([token], skip_special_tokens=False)
        if "\n" in text or text.rstrip(" ").endswith((".", "!", "?")):
            ends.add(token)
    return starts, frozenset(ends)


def step_shape(output: SchedulerOutput, python_layers: bool) -> StepShape:
    """What a scheduled step computes, in the step-time model's terms (``python_layers``: the
    runner ran it on the Python layer stack, ``ModelRunner.last_step_python_layers``)."""
    # a request verifying k drafts runs as k+1 decode rows (ModelRunner.execute)
    decode_rows = sum(
        len(s.token_ids) for s in output.scheduled if s.sample and len(s.token_ids) - s.num_draft_tokens == 1
    )
    return StepShape(
        decode_rows=decode_rows,
        prefill_tokens=output.num_batched_tokens - decode_rows,
        context_tokens=sum(s.start_position + len(s.token_ids) for s in output.scheduled),
        python_layers=python_layers,
    )


@dataclass
class GenerationResult:
    """A finished request from ``LLMEngine.generate``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when SamplingParams.logprobs

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason, self.usage, self.error = delta.finish_reason, delta.usage, delta.error


class RequestStream(AsyncIterator[RequestDelta]):
    """The async iterator ``add_request`` returns. Closing, cancelling or dropping it aborts."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop):
        self.request_id = ""
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._done = False

    def _deliver(self, delta: RequestDelta) -> None:
        # Called from the engine thread (or synchronously for an immediate error).
        try:
            if self._loop.is_closed():
                raise RuntimeError("event loop closed")
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except RuntimeError:
            if not delta.finished:
                self._engine.abort(delta.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            delta = await self._queue.get()
        except asyncio.CancelledError:
            self._close()
            raise
        if delta.finished:
            self._done = True
        return delta

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        """Stop reading: aborts the request if it has not finished."""
        self._close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._close()

    def __del__(self) -> None:
        if not self._done and self.request_id:
            self._engine.abort(self.request_id)
