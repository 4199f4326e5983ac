"""What the Wyoming services share: the daemon, the pipeline they serve, and its parts.

The ``asr`` service runs sessions on an ASR-only copy of the served pipeline (no wake gate:
Home Assistant detects the wake word itself, over the ``wake`` service); the ``handle``
service on an ASR + assistant copy, text only. Both are ordinary sessions of the daemon
(``Daemon.open_session``): they share its models and engine and show in its metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wyoming.event import Event

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.errors import ConfigError
from edge_rtgi.pipeline.config import AssistantStageConfig, PipelineConfig, WakeStageConfig
from edge_rtgi.pipeline.session import Session, SessionSettings
from edge_rtgi.server.config import WyomingConfig
from edge_rtgi.server.wyoming.info import LoadedVoice, build_info, pipeline_voices, voice_language

if TYPE_CHECKING:
    from edge_rtgi.server.app import Daemon

EventWriter = Callable[[Event], Awaitable[None]]


def _part(pipeline: PipelineConfig, suffix: str, stages: tuple[Any, ...]) -> PipelineConfig:
    return dataclasses.replace(pipeline, name=f"{pipeline.name}:{suffix}", stages=stages)


@dataclass
class WyomingServices:
    """The daemon's side of every Wyoming connection."""

    daemon: Daemon
    config: WyomingConfig
    pipeline: PipelineConfig
    voices: list[LoadedVoice]
    info_event: Event

    @classmethod
    def build(cls, daemon: Daemon, config: WyomingConfig) -> WyomingServices:
        name = config.pipeline or next(iter(daemon.pipelines))
        if name not in daemon.pipelines:
            raise ConfigError(
                f"wyoming.pipeline {name!r} is not among the loaded pipelines",
                hint=f"loaded: {', '.join(daemon.pipelines)}",
            )
        pipeline = daemon.pipelines[name]
        voices = []
        for voice in pipeline_voices([pipeline, *daemon.pipelines.values()]):
            engine = daemon.resources.voice(voice)
            espeak = getattr(getattr(engine, "config", None), "espeak_voice", None)
            voices.append(LoadedVoice(voice, voice_language(voice, espeak)))
        info = build_info(pipeline, voices)
        return cls(daemon, config, pipeline, voices, info.event())

    @property
    def asr(self) -> AsrConfig | None:
        return self.pipeline.stage(AsrConfig)

    @property
    def wake(self) -> WakeStageConfig | None:
        return self.pipeline.stage(WakeStageConfig)

    @property
    def has_assistant(self) -> bool:
        return self.pipeline.stage(AssistantStageConfig) is not None

    async def open_session(self, kind: str, **settings: Any) -> Session:
        """A daemon session on the ``asr`` or ``chat`` (ASR + assistant) part of the pipeline."""
        asr = self.asr
        if asr is None:
            raise ConfigError(f"pipeline {self.pipeline.name!r} has no asr stage")
        if kind == "asr":
            part = _part(self.pipeline, "asr", (asr,))
        else:
            part = _part(self.pipeline, "chat", (asr, self.pipeline.stage(AssistantStageConfig)))
        return await self.daemon.open_session(
            SessionSettings(pipeline=part.name, audio_output=False, **settings), pipelines={part.name: part}
        )
