"""Streaming speech synthesis: clause segmenter, Piper voices (onnxruntime), espeak-ng.

Typical use from asyncio (the daemon)::

    engine = make_tts("piper-en_US-joe-medium")            # or "espeak:es"
    segmenter = ClauseSegmenter()
    for chunk_text in segmenter.push(delta):                # as LLM text arrives
        async for pcm in synthesize_async(engine, chunk_text):
            ...                                             # int16 at engine.sample_rate_hz
"""

from edge_rtgi.tts.base import (
    DEFAULT_VOICE,
    EmptyTextError,
    TtsEngine,
    check_text,
    make_tts,
    synthesize_async,
)
from edge_rtgi.tts.espeak import EspeakEngine, EspeakError, EspeakPhonemizer
from edge_rtgi.tts.piper import PiperConfig, PiperVoice
from edge_rtgi.tts.segmenter import ClauseSegmenter, split_sentences

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
