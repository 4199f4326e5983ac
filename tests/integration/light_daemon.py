"""A light daemon for the hardening and fuzzing tests: whisper tiny.en, a tiny seeded LLM and
espeak-ng, so a module starts in seconds and turns take a fraction of a second.

Three pipelines: ``tiny-voice`` (ASR -> assistant -> espeak TTS, the default),
``tiny-chat`` (ASR -> assistant, text only) and ``tiny-translate`` (ASR -> Apertium en-es).
"""

from __future__ import annotations

import logging
from pathlib import Path

from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.config import parse_pipeline
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.server.app import Daemon
from edge_rtgi.server.config import DaemonConfig, ServerConfig
from tests.tiny_models import make_tiny_hf_model

ENGINE = EngineConfig(device="cpu", dtype="fp32", quant="none", kv_cache_memory_mb=16)


def tiny_model(folder: Path) -> str:
    return str(make_tiny_hf_model("llama", folder, seed=3))


def light_pipelines(model: str) -> dict:
    voice = parse_pipeline(
        "name: tiny-voice\nstages:\n  - asr: {model: whisper-tiny.en, language: en}\n"
        f"  - assistant:\n      model: {model}\n      max_reply_tokens: 12\n"
        "  - tts: {voice: 'espeak:en'}\n",
        "tiny-voice.yaml",
    )
    chat = parse_pipeline(
        "name: tiny-chat\nstages:\n  - asr: {model: whisper-tiny.en, language: en}\n"
        f"  - assistant:\n      model: {model}\n      max_reply_tokens: 12\n",
        "tiny-chat.yaml",
    )
    translate = parse_pipeline(
        "name: tiny-translate\nstages:\n  - asr: {model: whisper-tiny.en, language: en}\n"
        "  - translate: {source_language: en, target_language: es, backend: apertium}\n",
        "tiny-translate.yaml",
    )
    return {"tiny-voice": voice, "tiny-chat": chat, "tiny-translate": translate}


def light_daemon(
    model: str, resources: Resources | None = None, default_pipeline: str = "tiny-voice", **server
) -> Daemon:
    """A daemon on port 0 over the light pipelines (``server`` overrides ``ServerConfig``)."""
    cfg = DaemonConfig(
        server=ServerConfig(port=0, **server), default_pipeline=default_pipeline, engine=ENGINE
    )
    return Daemon(cfg, light_pipelines(model), resources or Resources(ENGINE))


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    """Log records that carry a traceback or are errors: what a client must never cause."""
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in records
        if r.exc_info or r.levelno >= logging.ERROR
    ]
