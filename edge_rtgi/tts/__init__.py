"""Streaming speech synthesis: clause segmenter, Piper voices (onnxruntime), espeak-ng.

Typical use from asyncio (the daemon)::

    engine = make_tts("piper-en_US-joe-medium")            # or "espeak:es"
    segmenter = ClauseSegmenter()
    for chunk_text in segmenter.push(delta):                # as LLM text arrives
        async for pcm in synthesize_async(engine, chunk_text):
            ...                                             # int16 at engine.sample_rate_hz
"""

from __future__ import annotations

from pathlib import Path

from edge_rtgi.tts.base import TtsEngine, synthesize_async
from edge_rtgi.tts.espeak import EspeakEngine, EspeakError, EspeakPhonemizer
from edge_rtgi.tts.piper import PiperConfig, PiperVoice
from edge_rtgi.tts.segmenter import ClauseSegmenter, split_sentences
from edge_rtgi.tts.text import EmptyTextError, check_text

DEFAULT_VOICE = "piper-en_US-joe-medium"

__all__ = [
    "DEFAULT_VOICE",
    "ClauseSegmenter",
    "EmptyTextError",
    "EspeakEngine",
    "EspeakError",
    "EspeakPhonemizer",
    "PiperConfig",
    "PiperVoice",
    "TtsEngine",
    "check_text",
    "make_tts",
    "split_sentences",
    "synthesize_async",
]


def make_tts(voice: str | Path = DEFAULT_VOICE) -> TtsEngine:
    """Build an engine from a voice name.

    - ``espeak`` or ``espeak:LANG`` (e.g. ``espeak:es``): the espeak-ng program;
    - a path to a Piper ``.onnx`` file or a folder holding one;
    - a catalogue name (e.g. ``piper-en_US-joe-medium``), pulled when missing.
    """
    name = str(voice)
    if name == "espeak" or name.startswith("espeak:"):
        return EspeakEngine(name.partition(":")[2] or "en-us")
    path = Path(name).expanduser()
    if path.exists() or path.suffix == ".onnx" or "/" in name:
        return PiperVoice(path)
    from edge_rtgi.catalog import resolve_model

    return PiperVoice(resolve_model(name, role="tts"))
