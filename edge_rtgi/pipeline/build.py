"""PipelineConfig + shared Resources -> the stage objects of one session, in chain order."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.errors import ConfigError
from edge_rtgi.pipeline.config import (
    AssistantStageConfig,
    PipelineConfig,
    TranslateStageConfig,
    TtsStageConfig,
    WakeStageConfig,
)
from edge_rtgi.pipeline.stage import Stage

if TYPE_CHECKING:
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.pipeline.session import Session


async def build_stages(session: Session, pipeline: PipelineConfig, resources: Resources) -> list[Stage[Any]]:
    """Instantiate the stages; models come from ``resources`` (loaded once per daemon)."""
    from edge_rtgi.pipeline.stages.asr import AsrStage
    from edge_rtgi.pipeline.stages.text import AssistantStage, TranslateStage
    from edge_rtgi.pipeline.stages.tts import TtsStage
    from edge_rtgi.pipeline.stages.wake import WakeStage

    await resources.prepare(pipeline)
    queue = session.limits.stage_queue_frames
    stages: list[Stage[Any]] = []
    for cfg in pipeline.stages:
        if isinstance(cfg, WakeStageConfig):
            stages.append(WakeStage(session, cfg, queue))
        elif isinstance(cfg, AsrConfig):
            if session.settings.turn_mode == "semantic":  # the pipeline's own mode: prepare loaded it
                await asyncio.to_thread(resources.turn_model, cfg.turn_detection.model)
            stages.append(AsrStage(session, cfg, resources.asr(cfg), queue, resources))
        elif isinstance(cfg, AssistantStageConfig):
            backend = await asyncio.to_thread(resources.text_backend, cfg)  # loaded by prepare
            if backend is None:
                raise ConfigError("the assistant stage has no LLM backend")
            stages.append(AssistantStage(session, cfg, backend, queue))
        elif isinstance(cfg, TranslateStageConfig):
            stages.append(
                TranslateStage(session, cfg, await asyncio.to_thread(resources.text_backend, cfg), queue)
            )
        elif isinstance(cfg, TtsStageConfig):
            stages.append(TtsStage(session, cfg, resources.voice(cfg.voice), queue))
    return stages
