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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

from edge_rtgi.asr.agreement import normalize_word, split_words, without_repeats
from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.errors import ConfigError, ModelFileError

if TYPE_CHECKING:
    from faster_whisper import WhisperModel
    from faster_whisper.tokenizer import Tokenizer

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
        prompt: str | None = None,
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
        self.window_decoder = WindowDecoder(self._model, self.config)
        log.info("whisper %s on %s/%s", self.model_path, self.device, self.compute_type)

    def last_timing(self) -> DecodeTiming | None:
        """The calling thread's latest ``transcribe``: no queue here, it decodes at once."""
        return getattr(self._local, "timing", None)

    def detach(self) -> None:
        """Nothing to drop: this model queues nothing (each session decodes on its own thread)."""

    def language_for(self, language: str | None) -> str | None:
        """The language a decode asked for ``language`` runs in: always English on an English-only
        model; else ``language``, or the configured one when it is None (None again: detect)."""
        if not self.multilingual:
            return "en"
        return language if language is not None else self.config.language

    def transcribe(
        self,
        audio: np.ndarray,
        prefix: str | None = None,
        language: str | None = None,
        timestamps: bool = False,
        beam_size: int | None = None,
        word_timestamps: bool = False,
        prompt: str | None = None,
    ) -> Hypothesis:
        """Decode mono float32 16 kHz ``audio`` (at most 30 s). Blocking: call from a worker thread.

        ``prefix`` forces the start of the transcript (the committed words); ``language``
        overrides the configured one (None with a multilingual model: detect). ``prompt``:
        text whisper reads as what was said before (its initial prompt), which leans the decode
        towards its words and spellings.
        ``word_timestamps`` fills ``Hypothesis.words`` (an extra alignment pass; streaming
        uses it only where it must cut speech at a word boundary).

        Audio shorter than 30 s is encoded in a short window (``encoder_window_s``) when one
        applies; a doubtful short-window result is decoded again by ``transcribe_whole``.
        """
        cfg = self.config
        lang = self.language_for(language)
        beam = beam_size or cfg.beam_size
        short = self.window_decoder.window_frames(len(audio)) < _FULL_WINDOW_FRAMES
        if not (short and lang is not None and not word_timestamps):
            return self.transcribe_whole(audio, prefix, lang, timestamps, beam, word_timestamps, prompt)
        t0, started_s = time.perf_counter(), time.monotonic()
        request = _Request(
            np.asarray(audio, dtype=np.float32), prefix or None, lang, timestamps, beam, prompt or None
        )
        try:
            hyp = self.window_decoder.generate([self.window_decoder.prepare(request)])[0]
        except Exception as exc:  # noqa: BLE001 - whisper's own decode still serves this audio
            log.warning("short-window decode failed (%s); decoding in whisper's 30 s window", exc)
            hyp = None
        if hyp is None:  # doubtful: whisper's own window decides, and the attempt counts in its time
            hyp = self.transcribe_whole(audio, prefix, lang, timestamps, beam, word_timestamps, prompt)
            hyp = replace(hyp, decode_ms=(time.perf_counter() - t0) * 1000.0)
        self._local.timing = DecodeTiming(0.0, hyp.decode_ms, started_s)
        return hyp

    def transcribe_whole(
        self,
        audio: np.ndarray,
        prefix: str | None = None,
        language: str | None = None,
        timestamps: bool = False,
        beam_size: int | None = None,
        word_timestamps: bool = False,
        prompt: str | None = None,
    ) -> Hypothesis:
        """``transcribe`` through faster-whisper's own ``WhisperModel.transcribe``: 30 s windows,
        language detection, word timestamps, audio longer than one window."""
        cfg = self.config
        lang = self.language_for(language)
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
            initial_prompt=prompt or None,
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


# -- one window at a time, and the short encoder window ---------------------------------------

_FULL_WINDOW_FRAMES = 3000  # whisper's fixed 30 s window, in 10 ms feature frames
_MIN_PAD_FRAMES = 100  # a short window keeps at least 1 s of silence after the audio


def encoder_window_frames(content_frames: int, encoder_window_s: float) -> int:
    """Feature frames the encoder sees for ``content_frames`` of audio: the smallest multiple of
    ``encoder_window_s`` that leaves 1 s of padding after it, at most whisper's 30 s.

    A 30 s encode of 2 s of speech is mostly padding, and the encoder's cost grows faster than
    its length; whisper decodes a shorter padded window almost as well (docs/speech.md)."""
    step = max(1, round(encoder_window_s * 100))
    needed = content_frames + _MIN_PAD_FRAMES
    return min(_FULL_WINDOW_FRAMES, -(-needed // step) * step)


def text_loops(text: str) -> bool:
    """True when ``text`` repeats itself back to back: a phrase of 2-6 words three times running
    ("Okay. Yeah. Okay. Yeah. Okay. Yeah."), or one word four times. Too short for the
    compression ratio to notice, and seen on short windows for a murmured "Okay, yeah."."""
    words = [w.strip(".,!?;:\"'").lower() for w in text.split()]
    for n, runs in ((1, 4), *((n, 3) for n in range(2, 7))):
        for i in range(len(words) - n * runs + 1):
            phrase = words[i : i + n]
            if all(words[i + r * n : i + (r + 1) * n] == phrase for r in range(1, runs)):
                return True
    return False


def _said_again(text: str) -> bool:
    """True when ``text`` is one phrase said twice or more, back to back."""
    words = [w for w in (normalize_word(w) for w in split_words(text)) if w]
    return len(without_repeats(words)) < len(words)


class WindowRequest(Protocol):
    """What a window decode needs to know (``edge_rtgi.asr.batch.DecodeJob`` is one)."""

    @property
    def audio(self) -> np.ndarray: ...
    @property
    def prefix(self) -> str | None: ...
    @property
    def language(self) -> str | None: ...
    @property
    def timestamps(self) -> bool: ...
    @property
    def beam_size(self) -> int: ...
    @property
    def prompt(self) -> str | None: ...


R = TypeVar("R", bound=WindowRequest)


@dataclass(frozen=True)
class _Request:
    """A ``WindowRequest`` for one decode of ``WhisperAsr.transcribe``."""

    audio: np.ndarray
    prefix: str | None
    language: str | None
    timestamps: bool
    beam_size: int
    prompt: str | None


@dataclass
class PreparedWindow(Generic[R]):
    """A request's first window, encoded, with the prompt ``transcribe`` would give it."""

    job: R
    encoder_output: np.ndarray  # [1, frames, width] float32
    prompt: list[int]
    content_frames: int
    window_frames: int  # what the encoder saw: 3000 (30 s) or a short window
    tokenizer: Tokenizer
    encode_ms: float


class WindowDecoder:
    """``WhisperModel.transcribe``'s first window, split in two so that windows can share the
    decoder: ``prepare`` (features, prompt, encoder) per request, ``generate`` over many.

    Same options as ``WhisperAsr.transcribe``: temperature 0 without fallback, no previous
    text but the request's own prompt, suppress_blank and the default suppressed tokens, the
    first timestamp within 1 s. With ``encoder_window_s`` below 30 the encoder sees a short window
    (``encoder_window_frames``); a short window's result that looks wrong (no words, a
    repetition loop above ``compression_ratio_threshold``, timestamps that stop before the
    audio) comes back as None, for whisper's own 30 s decode."""

    def __init__(self, model: WhisperModel, config: AsrConfig):
        self._model = model
        self.config = config
        self._tokenizers: dict[str, Tokenizer] = {}

    def _tokenizer(self, language: str) -> Tokenizer:
        from faster_whisper.tokenizer import Tokenizer

        if language not in self._tokenizers:
            self._tokenizers[language] = Tokenizer(
                self._model.hf_tokenizer,
                self._model.model.is_multilingual,
                task=self.config.task,
                language=language,
            )
        return self._tokenizers[language]

    def window_frames(self, samples: int) -> int:
        """The encoder window for ``samples`` of 16 kHz audio."""
        frames = samples // self._model.feature_extractor.hop_length
        return encoder_window_frames(frames, self.config.encoder_window_s)

    def prepare(self, job: R) -> PreparedWindow[R]:
        from faster_whisper.transcribe import get_ctranslate2_storage, pad_or_trim

        t0 = time.perf_counter()
        wm = self._model
        fe = wm.feature_extractor
        tok = self._tokenizer(job.language or "en")
        features = fe(job.audio)
        frames = features.shape[-1] - 1
        window_frames = encoder_window_frames(frames, self.config.encoder_window_s)
        window = pad_or_trim(features[:, : min(fe.nb_max_frames, frames)], window_frames)
        # on the host even on one GPU (WhisperModel.encode leaves it there): windows are joined
        # in numpy for a batched generate, and a CUDA StorageView is no numpy array
        encoded = np.asarray(wm.model.encode(get_ctranslate2_storage(window[None]), to_cpu=True))
        # as WhisperModel.transcribe tokenises its initial_prompt
        previous = tok.encode(" " + job.prompt.strip()) if job.prompt else []
        prompt = wm.get_prompt(tok, previous, without_timestamps=not job.timestamps, prefix=job.prefix)
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        return PreparedWindow(job, encoded, prompt, frames, window_frames, tok, elapsed_ms)

    def generate(self, windows: Sequence[PreparedWindow[R]]) -> list[Hypothesis | None]:
        """Decode the windows, one ``generate`` call per beam size, window length, prompt length
        (whisper's "previous text") and timestamp mode. An entry
        is None where ``transcribe`` would go on to a second window (its timestamps end before
        the audio), or where a short window's result looks wrong: decode those with
        ``WhisperAsr.transcribe_whole``."""
        import ctranslate2
        from faster_whisper.transcribe import get_suppressed_tokens

        t0 = time.perf_counter()
        wm = self._model
        suppress = list(get_suppressed_tokens(windows[0].tokenizer, [-1]))
        # one generate per (beam, window length, start-of-transcript position, task tokens):
        # CTranslate2 needs the last two alike across a batch; a prompt ("previous text") moves
        # the first, and <|notimestamps|> is one more task token
        groups: dict[tuple[int, int, int, bool], list[int]] = {}
        for i, window in enumerate(windows):
            sot_at = window.prompt.index(window.tokenizer.sot)
            key = (window.job.beam_size, window.window_frames, sot_at, window.job.timestamps)
            groups.setdefault(key, []).append(i)
        results: dict[int, ctranslate2.models.WhisperGenerationResult] = {}
        for (beam, _, _, _), idx in groups.items():
            states = np.ascontiguousarray(np.concatenate([windows[i].encoder_output for i in idx]))
            out = wm.model.generate(
                ctranslate2.StorageView.from_array(states),
                [windows[i].prompt for i in idx],
                beam_size=beam,
                patience=1,
                length_penalty=1,
                repetition_penalty=1,
                no_repeat_ngram_size=0,
                max_length=wm.max_length,
                return_scores=True,
                return_no_speech_prob=True,
                suppress_blank=True,
                suppress_tokens=suppress,
                max_initial_timestamp_index=round(1.0 / wm.time_precision),
            )
            results.update(zip(idx, out, strict=True))
        generate_ms = (time.perf_counter() - t0) * 1000.0
        if log.isEnabledFor(logging.DEBUG):  # the per-step picture, for a slow-turn hunt
            log.debug(
                "ASR generate: %d windows (%s frames), encodes %s ms, generate %.0f ms, tokens %s",
                len(windows),
                [w.window_frames for w in windows],
                [round(w.encode_ms) for w in windows],
                generate_ms,
                [len(results[i].sequences_ids[0]) for i in range(len(windows))],
            )
        return [self._hypothesis(w, results[i], w.encode_ms + generate_ms) for i, w in enumerate(windows)]

    def _hypothesis(self, window: PreparedWindow[R], result, decode_ms: float) -> Hypothesis | None:
        """One window's result post-processed as ``WhisperModel.generate_segments`` does."""
        from faster_whisper.transcribe import get_compression_ratio

        wm, cfg, job, tok = self._model, self.config, window.job, window.tokenizer
        fe = wm.feature_extractor
        short = window.window_frames < _FULL_WINDOW_FRAMES
        tokens = result.sequences_ids[0]
        avg_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)  # as generate_with_fallback
        compression_ratio = get_compression_ratio(tok.decode(tokens).strip())
        if result.no_speech_prob > cfg.no_speech_threshold and not avg_logprob > cfg.log_prob_threshold:
            if short:  # silence to a short window; whisper's own window decides that
                return None
            return Hypothesis("", (), job.language, decode_ms)  # skipped as silence; no other window
        decoded_text = tok.decode(tokens)
        if short and (compression_ratio > cfg.compression_ratio_threshold or text_loops(decoded_text)):
            return None  # a repetition loop ("Turn it up. Turn it up. ..."): seen on short windows
        if short and job.prompt and _said_again(decoded_text):
            return None  # "I see. I see." for "I see.": a prompt on a short window, not on 30 s
        segment_size = min(fe.nb_max_frames, window.content_frames)
        pieces, seek, _ = wm._split_segments_by_timestamps(
            tokenizer=tok,
            tokens=tokens,
            time_offset=0.0,
            segment_size=segment_size,
            segment_duration=segment_size * fe.time_per_frame,
            seek=0,
        )
        if seek < window.content_frames:
            return None
        decoded = []
        for piece in pieces:
            text = tok.decode(piece["tokens"])
            if piece["start"] == piece["end"] or not text.strip():
                continue
            decoded.append(
                DecodedSegment(
                    text.strip(),
                    float(piece["start"]),
                    float(piece["end"]),
                    float(avg_logprob),
                    float(result.no_speech_prob),
                    float(compression_ratio),
                )
            )
        text = " ".join(s.text for s in decoded if s.text).strip()
        if short and not text:
            return None
        return Hypothesis(text, tuple(decoded), job.language, decode_ms)
