"""faster-whisper, loaded from a local CTranslate2 folder and called from worker threads.

``WhisperModel.transcribe`` returns a *lazy generator*: the decoding happens while it is
iterated. Iterating it on the event loop blocks every session (pipecat's bug), so
``WhisperAsr.transcribe`` consumes it completely and must itself be called from a worker
thread; ``transcribe_async`` does that. One ``WhisperAsr`` can serve several streams: a
CTranslate2 model accepts concurrent calls (up to ``num_workers`` in parallel).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.errors import ConfigError, ModelFileError

log = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16000
_REQUIRED_FILES = ("model.bin", "config.json")


@dataclass(frozen=True)
class DecodedSegment:
    text: str
    start_s: float  # relative to the start of the decoded audio
    end_s: float
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float


@dataclass(frozen=True)
class TimedWord:
    """A whitespace-delimited word of a hypothesis with its time span in the decoded audio."""

    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Hypothesis:
    """One decode of an audio window. ``text`` includes the forced ``prefix`` if one was given.

    ``words`` (only when word timestamps were asked for) are ``text.split()`` with times,
    forced prefix words included.
    """

    text: str
    segments: tuple[DecodedSegment, ...]
    language: str | None
    decode_ms: float
    words: tuple[TimedWord, ...] = ()


@dataclass(frozen=True)
class DecodeTiming:
    """Where one decode's time went: waiting for a shared engine's step, then decoding."""

    queue_wait_ms: float
    decode_ms: float
    started_s: float  # time.monotonic() when the decode itself began (after any queue wait)


class Transcriber(Protocol):
    """What streaming ASR needs of a model: ``WhisperAsr`` (decodes on the calling thread) or
    ``edge_rtgi.asr.batch.SharedWhisper`` (one engine thread batching every session's decodes)."""

    config: AsrConfig
    multilingual: bool

    def transcribe(
        self,
        audio: np.ndarray,
        prefix: str | None = None,
        language: str | None = None,
        timestamps: bool = False,
        beam_size: int | None = None,
        word_timestamps: bool = False,
    ) -> Hypothesis: ...

    def last_timing(self) -> DecodeTiming | None:
        """Queue wait and decode time of the calling thread's latest ``transcribe``."""
        ...

    def detach(self) -> None:
        """The session using this handle is closing: drop its queued decodes, refuse new ones."""
        ...


def _timed_words(segment) -> list[TimedWord]:
    """faster-whisper's word pieces regrouped into the segment's whitespace words.

    Its words follow the tokenizer ("half", "-past") while transcripts are compared by
    whitespace words ("half-past"), so each whitespace word takes the span of the pieces
    its characters came from.
    """
    pieces = list(segment.words or ())
    owner: list[int] = []  # piece index of every character of the joined text
    for i, piece in enumerate(pieces):
        owner.extend([i] * len(piece.word))
    joined = "".join(p.word for p in pieces)
    return [
        TimedWord(m.group(), float(pieces[owner[m.start()]].start), float(pieces[owner[m.end() - 1]].end))
        for m in re.finditer(r"\S+", joined)
    ]


def resolve_whisper_path(name_or_path: str | Path) -> Path:
    """A CTranslate2 whisper folder: an explicit path, or a catalogue name (pulled if missing)."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        if "/" in str(name_or_path) or str(name_or_path).startswith("."):
            raise ModelFileError(
                f"whisper model folder not found: {path}",
                hint="give a CTranslate2 whisper folder or a catalogue name such as whisper-tiny.en",
            )
        from edge_rtgi.catalog import resolve_model

        path = resolve_model(str(name_or_path), role="asr")
    if path.is_file():
        path = path.parent
    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise ModelFileError(
            f"whisper model folder {path} lacks {', '.join(missing)}",
            hint="it must be a CTranslate2 conversion (model.bin, config.json, tokenizer.json); "
            "re-pull it with `edge-rtgi models pull`",
        )
    return path


def _device_and_compute(config: AsrConfig) -> tuple[str, str]:
    from edge_rtgi.device import resolve_device

    device = resolve_device(config.device).type
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"faster-whisper runs on cpu or cuda, not {device!r}")
    if config.compute_type != "auto":
        return device, config.compute_type
    return device, "float16" if device == "cuda" else "int8"


class WhisperAsr:
    """A loaded faster-whisper model plus the decoding options of ``AsrConfig``."""

    def __init__(self, config: AsrConfig | None = None, num_workers: int = 1):
        self.config = config or AsrConfig()
        self.model_path = resolve_whisper_path(self.config.model)
        self.device, self.compute_type = _device_and_compute(self.config)
        from faster_whisper import WhisperModel

        try:
            self._model = WhisperModel(
                str(self.model_path),
                device=self.device,
                compute_type=self.compute_type,
                cpu_threads=self.config.cpu_threads,
                num_workers=num_workers,
                local_files_only=True,
            )
        except (RuntimeError, ValueError, OSError) as exc:
            raise ModelFileError(
                f"cannot load whisper model from {self.model_path}: {exc}",
                hint="the files may be truncated; re-pull with `edge-rtgi models pull --force`",
            ) from None
        self.multilingual = self._model.model.is_multilingual
        if self.config.task == "translate" and not self.multilingual:
            raise ConfigError(
                f"task 'translate' needs a multilingual whisper model; {self.config.model} is English-only",
                hint="use model whisper-base",
            )
        self._local = threading.local()
        log.info("whisper %s on %s/%s", self.model_path, self.device, self.compute_type)

    def last_timing(self) -> DecodeTiming | None:
        """The calling thread's latest ``transcribe``: no queue here, it decodes at once."""
        return getattr(self._local, "timing", None)

    def detach(self) -> None:
        """Nothing to drop: this model queues nothing (each session decodes on its own thread)."""

    def transcribe(
        self,
        audio: np.ndarray,
        prefix: str | None = None,
        language: str | None = None,
        timestamps: bool = False,
        beam_size: int | None = None,
        word_timestamps: bool = False,
    ) -> Hypothesis:
        """Decode mono float32 16 kHz ``audio`` (at most 30 s). Blocking: call from a worker thread.

        ``prefix`` forces the start of the transcript (the committed words); ``language``
        overrides the configured one (None with a multilingual model: detect).
        ``word_timestamps`` fills ``Hypothesis.words`` (an extra alignment pass; streaming
        uses it only where it must cut speech at a word boundary).
        """
        cfg = self.config
        lang = language if language is not None else cfg.language
        if not self.multilingual:
            lang = "en"
        t0, started_s = time.perf_counter(), time.monotonic()
        segments, info = self._model.transcribe(
            audio,
            language=lang,
            task=cfg.task,
            beam_size=beam_size or cfg.beam_size,
            temperature=0.0,  # no fallback re-decodes: they stall a stream for seconds
            compression_ratio_threshold=cfg.compression_ratio_threshold,
            log_prob_threshold=cfg.log_prob_threshold,
            no_speech_threshold=cfg.no_speech_threshold,
            condition_on_previous_text=False,
            prefix=prefix or None,
            without_timestamps=not (timestamps or word_timestamps),
            word_timestamps=word_timestamps,  # an alignment pass: off for partials, which are many
            vad_filter=False,  # our own streaming VAD already gated this audio
        )
        segments = list(segments)
        decoded = tuple(
            DecodedSegment(
                s.text.strip(),
                float(s.start),
                float(s.end),
                float(s.avg_logprob),
                float(s.no_speech_prob),
                float(s.compression_ratio),
            )
            for s in segments
        )
        text = " ".join(s.text for s in decoded if s.text).strip()
        words = tuple(w for s in segments for w in _timed_words(s)) if word_timestamps else ()
        decode_ms = (time.perf_counter() - t0) * 1000.0
        self._local.timing = DecodeTiming(0.0, decode_ms, started_s)
        return Hypothesis(text, decoded, info.language, decode_ms, words)

    async def transcribe_async(self, audio: np.ndarray, **kwargs) -> Hypothesis:
        """``transcribe`` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.transcribe, audio, **kwargs)
