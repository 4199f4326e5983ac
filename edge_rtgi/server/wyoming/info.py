"""``describe`` -> ``info``: the models, languages and voices this daemon really has loaded."""

from __future__ import annotations

from dataclasses import dataclass

from wyoming.info import (
    AsrModel,
    AsrProgram,
    Attribution,
    HandleModel,
    HandleProgram,
    Info,
    TtsProgram,
    TtsVoice,
    WakeModel,
    WakeProgram,
)

from edge_rtgi import __version__
from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.asr.wakeword import available_wake_words
from edge_rtgi.pipeline.config import AssistantStageConfig, PipelineConfig, TtsStageConfig

PROGRAM = "edge-rtgi"
ATTRIBUTION = Attribution(name="edge-rtgi", url="https://github.com/edge-rtgi/edge-rtgi")


@dataclass(frozen=True)
class LoadedVoice:
    """A TTS voice the daemon has loaded, with the language Home Assistant picks it by."""

    name: str
    language: str


def voice_language(name: str, espeak_voice: str | None) -> str:
    """``espeak:es`` -> ``es``; a Piper voice's espeak voice ``en-us`` -> ``en_US``."""
    code = name.partition(":")[2] if name.startswith("espeak") else (espeak_voice or "en")
    lang, _, region = (code or "en-us").partition("-")
    return f"{lang}_{region.upper()}" if region else lang


def _artifact(name: str, description: str) -> dict:
    return {
        "name": name,
        "description": description,
        "attribution": ATTRIBUTION,
        "installed": True,
        "version": __version__,
    }


def build_info(pipeline: PipelineConfig, voices: list[LoadedVoice]) -> Info:
    """The ``info`` event: ASR, TTS, wake words and the assistant, as loaded."""
    asr: AsrConfig | None = pipeline.stage(AsrConfig)
    assistant: AssistantStageConfig | None = pipeline.stage(AssistantStageConfig)
    info = Info()
    if asr is not None:
        languages = [asr.language] if asr.language else ["en"]
        info.asr = [
            AsrProgram(
                **_artifact(PROGRAM, "streaming faster-whisper with Silero VAD"),
                models=[AsrModel(**_artifact(asr.model, f"whisper {asr.model}"), languages=languages)],
                supports_transcript_streaming=True,
            )
        ]
    if voices:
        info.tts = [
            TtsProgram(
                **_artifact(PROGRAM, "Piper voices and espeak-ng, sentence by sentence"),
                voices=[TtsVoice(**_artifact(v.name, v.name), languages=[v.language]) for v in voices],
                supports_synthesize_streaming=True,
            )
        ]
    info.wake = [
        WakeProgram(
            **_artifact(PROGRAM, "microWakeWord models (pymicro-wakeword)"),
            models=[
                WakeModel(**_artifact(w.name, w.phrase), languages=list(w.languages), phrase=w.phrase)
                for w in available_wake_words().values()
            ],
        )
    ]
    if assistant is not None:
        info.handle = [
            HandleProgram(
                **_artifact(PROGRAM, "a local LLM assistant on the daemon's shared engine"),
                models=[HandleModel(**_artifact(assistant.model, assistant.model), languages=["en"])],
                supports_handled_streaming=True,
            )
        ]
    return info


def pipeline_voices(pipelines: list[PipelineConfig]) -> list[str]:
    """Every TTS voice the daemon's pipelines name, the given pipeline's first."""
    names = [s.voice for p in pipelines for s in p.stages if isinstance(s, TtsStageConfig)]
    return list(dict.fromkeys(names))
