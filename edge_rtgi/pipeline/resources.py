"""Models shared by every session of a daemon: one LLM engine per model, one whisper per
model, one voice per name. Loaded once (in worker threads), found through the catalogue.

Sessions keep only cheap per-session state (a VAD, a streaming transcriber, a clause
segmenter, a conversation); the heavy parts live here, so four sessions on one LLM share
one engine and are batched together. The text stages' LLM backends (``pipeline.backends``)
are shared the same way: one per backend setting, a remote's connection pool included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.asr.turn import TurnModelLoad
from edge_rtgi.cpu_priority import freeze_heap
from edge_rtgi.device import release_cpu_workers
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.backends.base import BackendObserver, BackendResult, LlmBackend, RouteDecision
from edge_rtgi.pipeline.backends.config import LlmBackendConfig
from edge_rtgi.pipeline.config import (
    AssistantStageConfig,
    PipelineConfig,
    TranslateStageConfig,
    TtsStageConfig,
)

if TYPE_CHECKING:
    from edge_rtgi.asr.batch import SharedWhisper, StepStats
    from edge_rtgi.asr.whisper import Transcriber, WhisperAsr
    from edge_rtgi.llm.engine import LLMEngine, Prompt
    from edge_rtgi.llm.request import Usage
    from edge_rtgi.tts.base import TtsEngine

_Model = TypeVar("_Model")


def _run_whisper_once(model: Transcriber) -> None:
    import numpy as np

    silence = np.zeros(16000, dtype=np.float32)
    model.transcribe(silence)  # the partials' path (greedy, no timestamps)
    # and the path of every final: beam search with timestamps
    model.transcribe(silence, timestamps=True, beam_size=model.config.final_beam_size)


def _run_llm_once(engine: LLMEngine, prompt: Prompt) -> None:
    from edge_rtgi.llm.sampling import SamplingParams

    engine.generate([prompt], SamplingParams(max_tokens=2))


def _warm_prompt(stage: AssistantStageConfig | TranslateStageConfig) -> Prompt:
    """A first request shaped as the stage's own: its fixed part (the system prompt, the
    translation instruction or the few-shot examples) is what every turn starts with, so
    warming with it leaves that part in the engine's prefix cache for the first user."""
    if isinstance(stage, AssistantStageConfig):
        return [{"role": "system", "content": stage.system_prompt}, {"role": "user", "content": "Hi"}]
    from edge_rtgi.pipeline.translate import translation_few_shot_prompt, translation_messages

    if stage.prompt == "few-shot":
        return translation_few_shot_prompt("Hello", stage.source_language, stage.target_language)
    return translation_messages("Hello", stage.source_language, stage.target_language)


def _prompt_key(prompt: Prompt) -> object:
    if isinstance(prompt, str):
        return prompt
    return tuple(tuple(sorted(m.items())) if isinstance(m, dict) else m for m in prompt)


def _run_voice_once(voice: TtsEngine) -> None:
    for _ in voice.synthesize_stream("Hello there."):
        pass


# (model, finish_reason, usage) of every finished request of every engine (the daemon's metrics)
RequestListener = Callable[[str, str, "Usage | None"], None]

log = logging.getLogger(__name__)


def _whisper_key(cfg: AsrConfig) -> AsrConfig:
    # Decoding options live on the shared WhisperAsr; the VAD and turn detection are per
    # session, so ignore them.
    return dataclasses.replace(cfg, vad=type(cfg.vad)(), turn_detection=type(cfg.turn_detection)())


class ObserverList:
    """Fans each backend report out to the observers registered so far (the daemon's metrics
    register after some backends may exist)."""

    def __init__(self) -> None:
        self.observers: list[BackendObserver] = []

    def on_result(self, result: BackendResult) -> None:
        for observer in self.observers:
            observer.on_result(result)

    def on_failure(self, backend: str, outcome: str) -> None:
        for observer in self.observers:
            observer.on_failure(backend, outcome)

    def on_route(self, decision: RouteDecision) -> None:
        for observer in self.observers:
            observer.on_route(decision)


class Resources:
    """Lazily loaded, shared models. Thread-safe loading; ``prepare`` loads a pipeline's set."""

    def __init__(self, engine_config: EngineConfig | None = None):
        self.engine_config = engine_config or EngineConfig()
        self._engines: dict[str, LLMEngine] = {}
        self._whispers: dict[AsrConfig, WhisperAsr] = {}
        self._shared_asr: dict[AsrConfig, SharedWhisper] = {}
        self._asr_step_listeners: list[Callable[[str, StepStats], None]] = []
        self._voices: dict[str, TtsEngine] = {}
        self._turn_models: dict[str, TurnModelLoad] = {}
        self._lock = threading.Lock()
        self._warmed: set[tuple[object, ...]] = set()
        self._request_listeners: list[RequestListener] = []
        self._backends: dict[LlmBackendConfig, LlmBackend] = {}
        self.backend_observers = ObserverList()

    # ------------------------------------------------------------------ loaders (blocking)

    def llm(self, model: str) -> LLMEngine:
        """The shared ``LLMEngine`` for ``model`` (a catalogue name or path)."""
        with self._lock:
            if model not in self._engines:
                from edge_rtgi.llm.engine import LLMEngine

                log.info("loading LLM %s", model)
                engine = LLMEngine.from_config(self.engine_config.with_(model=model))
                for listener in self._request_listeners:
                    engine.add_finish_listener(functools.partial(listener, model))
                self._engines[model] = engine
            return self._engines[model]

    def llm_backend(self, spec: LlmBackendConfig) -> LlmBackend:
        """The shared backend for ``spec``: the local engine of its model, or a remote client
        (loads the local model if needed: call from a worker thread)."""
        if spec.backend == "local":
            engine = self.llm(spec.model)
        with self._lock:
            if spec not in self._backends:
                backend: LlmBackend
                if spec.backend == "local":
                    from edge_rtgi.pipeline.backends.local import LocalBackend

                    backend = LocalBackend(engine, spec.model, self.backend_observers, spec.label)
                else:
                    from edge_rtgi.pipeline.backends.remote import OpenAIBackend

                    backend = OpenAIBackend(spec, self.backend_observers)
                self._backends[spec] = backend
            return self._backends[spec]

    def text_backend(self, stage: AssistantStageConfig | TranslateStageConfig) -> LlmBackend | None:
        """The backend a text stage streams from (None for Apertium)."""
        specs = stage.backends
        if not specs:
            return None
        if stage.router is None:
            return self.llm_backend(specs[0])
        from edge_rtgi.pipeline.backends.router import RouterBackend

        return RouterBackend(stage.router, [self.llm_backend(spec) for spec in specs], self.backend_observers)

    def whisper(self, cfg: AsrConfig) -> WhisperAsr:
        """The loaded ``WhisperAsr`` for this model and decoding setup (sessions decode on it
        directly when ``cfg.shared`` is false)."""
        key = _whisper_key(cfg)
        with self._lock:
            if key not in self._whispers:
                from edge_rtgi.asr.whisper import WhisperAsr

                log.info("loading whisper %s", cfg.model)
                # one CTranslate2 worker when an engine serialises the decodes: concurrent
                # ones would only split the same cores (issue 27)
                self._whispers[key] = WhisperAsr(key, num_workers=1 if cfg.shared else 2)
            return self._whispers[key]

    def asr(self, cfg: AsrConfig) -> Transcriber:
        """What a session's ASR decodes on: the daemon's shared batching engine for this model
        (``edge_rtgi.asr.batch``), or with ``shared: false`` the model itself."""
        whisper = self.whisper(cfg)
        if not cfg.shared:
            return whisper
        key = _whisper_key(cfg)
        with self._lock:
            if key not in self._shared_asr:
                from edge_rtgi.asr.batch import SharedWhisper

                engine = SharedWhisper(whisper, cfg.batch_size)
                for listener in self._asr_step_listeners:
                    engine.add_step_listener(functools.partial(listener, cfg.model))
                self._shared_asr[key] = engine
            return self._shared_asr[key].session()

    def add_asr_step_listener(self, listener: Callable[[str, StepStats], None]) -> None:
        """``listener(model, stats)`` after every step of every shared ASR engine, now or later."""
        with self._lock:
            self._asr_step_listeners.append(listener)
            for key, engine in self._shared_asr.items():
                engine.add_step_listener(functools.partial(listener, key.model))

    def turn_model(self, name: str) -> TurnModelLoad:
        """The shared smart-turn model, or why it cannot be had (blocking: a worker thread).

        A missing or corrupt file is not fatal: sessions fall back to the silence timer. The
        failure is logged as one warning per model per daemon, and remembered, so that each
        session can say so without retrying the load.
        """
        with self._lock:
            if name not in self._turn_models:
                from edge_rtgi.asr.turn import load_turn_model

                try:
                    self._turn_models[name] = TurnModelLoad(load_turn_model(name), None)
                except EdgeRtgiError as exc:
                    reason = exc.message
                    log.warning("semantic turn detection is off, turns end on silence only: %s", reason)
                    self._turn_models[name] = TurnModelLoad(None, reason)
            return self._turn_models[name]

    def voice(self, name: str) -> TtsEngine:
        """The shared TTS voice: a catalogue Piper voice or ``espeak:<language>``."""
        with self._lock:
            if name not in self._voices:
                from edge_rtgi.tts import make_tts

                log.info("loading voice %s", name)
                self._voices[name] = make_tts(name)
            return self._voices[name]

    # ------------------------------------------------------------------ async helpers

    async def prepare(self, pipeline: PipelineConfig) -> None:
        """Load (and warm up, once) every model ``pipeline`` needs, off the event loop."""
        warmed_before = len(self._warmed)
        for stage in pipeline.stages:
            if isinstance(stage, AsrConfig):
                await asyncio.to_thread(
                    self._warm,
                    ("asr", _whisper_key(stage)),
                    functools.partial(self.asr, stage),
                    _run_whisper_once,
                )
                if stage.turn_detection.mode == "semantic":  # loading runs the model once
                    await asyncio.to_thread(self.turn_model, stage.turn_detection.model)
            elif isinstance(stage, (AssistantStageConfig, TranslateStageConfig)):
                # once per model and prompt: each stage's fixed prompt part goes into the prefix
                # cache, not only the first pipeline's
                prompt = _warm_prompt(stage)
                for spec in stage.backends:
                    if spec.backend == "local":
                        await asyncio.to_thread(
                            self._warm,
                            ("llm", spec.model, _prompt_key(prompt)),
                            functools.partial(self.llm, spec.model),
                            functools.partial(_run_llm_once, prompt=prompt),
                        )
                    else:
                        await self._check_remote(spec)
            elif isinstance(stage, TtsStageConfig):
                await asyncio.to_thread(
                    self._warm,
                    ("tts", stage.voice),
                    functools.partial(self.voice, stage.voice),
                    _run_voice_once,
                )
        if len(self._warmed) > warmed_before:
            # no full-GC pauses of the loaded models during turns (cpu_priority). Only after a
            # load: freezing on every session open kept every session alive then for good
            freeze_heap()

    async def _check_remote(self, spec: LlmBackendConfig) -> None:
        """Ask a remote whether it serves the model, once per backend: a remote that does not
        answer is a warning, never a failure (it may come up later; each turn tries again)."""
        key = ("remote", spec)
        if key in self._warmed:
            return
        self._warmed.add(key)
        problem = await self.llm_backend(spec).check()
        if problem:
            log.warning("%s; turns will fail with backend_unavailable until it answers", problem)
        else:
            log.info("%s answers at %s", spec.name, spec.base_url)

    def _warm(
        self, key: tuple[object, ...], load: Callable[[], _Model], run_once: Callable[[_Model], None]
    ) -> None:
        """Load, then run one tiny input through the model (once per ``key``): first runs of
        onnxruntime, CTranslate2 and torch pay one-off costs (allocation, kernel selection) that
        would otherwise land on the first user's first turn."""
        try:
            model = load()
            with self._lock:
                if key in self._warmed:
                    return
                self._warmed.add(key)
            run_once(model)
        finally:
            release_cpu_workers()  # this loader thread is done with torch (edge_rtgi.device)

    def engines(self) -> dict[str, LLMEngine]:
        return dict(self._engines)

    def add_request_listener(self, listener: RequestListener) -> None:
        """``listener(model, finish_reason, usage)`` for every finished request of every engine,
        loaded now or later; it runs on the engine's thread (see ``LLMEngine.add_finish_listener``)."""
        with self._lock:
            self._request_listeners.append(listener)
            for model, engine in self._engines.items():
                engine.add_finish_listener(functools.partial(listener, model))

    async def aclose_backends(self) -> None:
        """Close the remote backends' connection pools of the running event loop."""
        for backend in list(self._backends.values()):
            await backend.aclose()

    def close(self) -> None:
        """Stop the engines' threads."""
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()
        for asr in self._shared_asr.values():
            asr.close()
        self._shared_asr.clear()
