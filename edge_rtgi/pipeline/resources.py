"""Models shared by every session of a daemon: one LLM engine per model, one whisper per
model, one voice per name. Loaded once (in worker threads), found through the catalogue.

Sessions keep only cheap per-session state (a VAD, a streaming transcriber, a clause
segmenter, a conversation); the heavy parts live here, so four sessions on one LLM share
one engine and are batched together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.cpu_priority import freeze_heap
from edge_rtgi.device import release_cpu_workers
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.config import (
    AssistantStageConfig,
    PipelineConfig,
    TranslateStageConfig,
    TtsStageConfig,
)

if TYPE_CHECKING:
    from edge_rtgi.asr.whisper import WhisperAsr
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.request import Usage
    from edge_rtgi.tts.base import TtsEngine

# (model, finish_reason, usage) of every finished request of every engine (the daemon's metrics)
RequestListener = Callable[[str, str, "Usage | None"], None]

log = logging.getLogger(__name__)


def _whisper_key(cfg: AsrConfig) -> AsrConfig:
    # Decoding options live on the shared WhisperAsr; the VAD is per session, so ignore it.
    return dataclasses.replace(cfg, vad=type(cfg.vad)())


class Resources:
    """Lazily loaded, shared models. Thread-safe loading; ``prepare`` loads a pipeline's set."""

    def __init__(self, engine_config: EngineConfig | None = None):
        self.engine_config = engine_config or EngineConfig()
        self._engines: dict[str, LLMEngine] = {}
        self._whispers: dict[AsrConfig, WhisperAsr] = {}
        self._voices: dict[str, TtsEngine] = {}
        self._lock = threading.Lock()
        self._warmed: set[tuple[str, object]] = set()
        self._request_listeners: list[RequestListener] = []

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

    def whisper(self, cfg: AsrConfig) -> WhisperAsr:
        """The shared ``WhisperAsr`` for this model and decoding setup."""
        key = _whisper_key(cfg)
        with self._lock:
            if key not in self._whispers:
                from edge_rtgi.asr.whisper import WhisperAsr

                log.info("loading whisper %s", cfg.model)
                self._whispers[key] = WhisperAsr(key, num_workers=2)
            return self._whispers[key]

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
        for stage in pipeline.stages:
            if isinstance(stage, AsrConfig):
                await asyncio.to_thread(self._warm, ("asr", _whisper_key(stage)), self.whisper, stage)
            elif isinstance(stage, AssistantStageConfig):
                # warming with the system prompt also puts it in the prefix cache
                prompt = [
                    {"role": "system", "content": stage.system_prompt},
                    {"role": "user", "content": "Hi"},
                ]
                await asyncio.to_thread(self._warm, ("llm", stage.model), self.llm, stage.model, prompt)
            elif isinstance(stage, TranslateStageConfig) and stage.backend == "llm":
                await asyncio.to_thread(self._warm, ("llm", stage.model), self.llm, stage.model)
            elif isinstance(stage, TtsStageConfig):
                await asyncio.to_thread(self._warm, ("tts", stage.voice), self.voice, stage.voice)
        freeze_heap()  # no full-GC pauses of the loaded models during turns (cpu_priority)

    def _warm(
        self, key: tuple[str, object], load: Callable[[Any], Any], arg: Any, prompt: Any = "Hello"
    ) -> None:
        """Load, then run one tiny input through the model: first runs of onnxruntime,
        CTranslate2 and torch pay one-off costs (allocation, kernel selection) that would
        otherwise land on the first user's first turn."""
        try:
            self._load_and_run_once(key, load, arg, prompt)
        finally:
            release_cpu_workers()  # this loader thread is done with torch (edge_rtgi.device)

    def _load_and_run_once(
        self, key: tuple[str, object], load: Callable[[Any], Any], arg: Any, prompt: Any
    ) -> None:
        model = load(arg)
        with self._lock:
            if key in self._warmed:
                return
            self._warmed.add(key)
        import numpy as np

        if key[0] == "asr":
            silence = np.zeros(16000, dtype=np.float32)
            model.transcribe(silence)  # the partials' path (greedy, no timestamps)
            # and the path of every final: beam search with timestamps
            model.transcribe(silence, timestamps=True, beam_size=model.config.final_beam_size)
        elif key[0] == "llm":
            from edge_rtgi.llm.sampling import SamplingParams

            model.generate([prompt], SamplingParams(max_tokens=2))
        else:
            for _ in model.synthesize_stream("Hello there."):
                pass

    def engines(self) -> dict[str, LLMEngine]:
        return dict(self._engines)

    def add_request_listener(self, listener: RequestListener) -> None:
        """``listener(model, finish_reason, usage)`` for every finished request of every engine,
        loaded now or later; it runs on the engine's thread (see ``LLMEngine.add_finish_listener``)."""
        with self._lock:
            self._request_listeners.append(listener)
            for model, engine in self._engines.items():
                engine.add_finish_listener(functools.partial(listener, model))

    def close(self) -> None:
        """Stop the engines' threads."""
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()
