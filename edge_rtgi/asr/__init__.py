"""Streaming speech recognition: Silero VAD + faster-whisper + LocalAgreement.

Typical use from asyncio (the daemon)::

    asr = WhisperAsr(AsrConfig(model="whisper-tiny.en"))   # load once, share
    session = AsrSession(asr)                                # one per audio stream
    session.feed(chunk_f32_16k)                              # as audio arrives
    async for event in session: ...                          # SpeechStarted, PartialTranscript, ...

See docs/speech.md for the event semantics and the latency numbers.
"""

from edge_rtgi.asr.agreement import LocalAgreement
from edge_rtgi.asr.config import AsrConfig, VadConfig
from edge_rtgi.asr.events import (
    AsrEvent,
    FinalTranscript,
    PartialTranscript,
    SpeechEnded,
    SpeechStarted,
    TranscriptSegment,
)
from edge_rtgi.asr.streaming import AsrSession, StreamingTranscriber
from edge_rtgi.asr.vad import SileroVad, VadEvent
from edge_rtgi.asr.whisper import Hypothesis, WhisperAsr, resolve_whisper_path

__all__ = [
    "AsrConfig",
    "AsrEvent",
    "AsrSession",
    "FinalTranscript",
    "Hypothesis",
    "LocalAgreement",
    "PartialTranscript",
    "SileroVad",
    "SpeechEnded",
    "SpeechStarted",
    "StreamingTranscriber",
    "TranscriptSegment",
    "VadConfig",
    "VadEvent",
    "WhisperAsr",
    "resolve_whisper_path",
]
