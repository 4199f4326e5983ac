"""Settings for voice activity detection and streaming ASR (frozen; load with config.from_dict)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_rtgi.asr.turn import TurnDetectionConfig

# Phrases whisper is known to invent on silence, music or noise (it was trained on subtitled
# video). Only used as a last resort: an utterance whose *whole* text is one of these and
# that whisper itself was unsure about is dropped. The VAD gate and the no-speech/log-prob
# thresholds do the real work.
DEFAULT_HALLUCINATIONS = (
    "thanks for watching",
    "thank you for watching",
    "thanks for watching and see you next time",
    "please subscribe",
    "subscribe to my channel",
    "like and subscribe",
    "subtitles by the amara.org community",
    "transcribed by",
    "you",
    "bye",
)


@dataclass(frozen=True)
class VadConfig:
    """Silero VAD endpointing.

    ``threshold``: speech probability that starts speech; ``neg_threshold`` (default
    ``threshold - 0.15``) must be crossed downwards to count silence, so a wobbling
    probability does not chop words. Speech starts after ``min_speech_ms`` of consecutive
    speech frames and ends after ``min_silence_ms`` of silence. ``speech_pad_ms`` of audio
    is kept on both sides of the detected speech for the recogniser; ``end_pad_ms``, when
    set, replaces it after the speech. The speculative final is decoded as soon as the end
    pad of silence is in, so a short end pad starts it earlier (a short *leading* pad would
    clip word onsets: the VAD calls speech late, after ``min_speech_ms``).
    """

    model: str = "silero-vad"
    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_ms: int = 96
    min_silence_ms: int = 500
    speech_pad_ms: int = 200
    end_pad_ms: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 <= self.neg_threshold <= self.threshold:
            raise ValueError(f"neg_threshold must be in [0, threshold], got {self.neg_threshold}")
        for name in ("min_speech_ms", "min_silence_ms", "speech_pad_ms", "end_pad_ms"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def trailing_pad_ms(self) -> int:
        """Audio kept after the detected end of speech: ``end_pad_ms`` or ``speech_pad_ms``."""
        return self.speech_pad_ms if self.end_pad_ms is None else self.end_pad_ms

    @property
    def silence_threshold(self) -> float:
        return self.neg_threshold if self.neg_threshold is not None else max(0.01, self.threshold - 0.15)


@dataclass(frozen=True)
class AsrConfig:
    """Streaming faster-whisper settings.

    ``model`` is a catalogue name or a local CTranslate2 folder. ``device`` goes through
    ``edge_rtgi.device.resolve_device``; ``compute_type`` "auto" means int8 on CPU and
    float16 on CUDA. ``language`` None means detect (multilingual models only);
    ``task`` "translate" makes a multilingual model output English.

    Streaming: a new hypothesis is decoded once ``min_chunk_ms`` of new audio has arrived;
    words agreed by ``agreement_n`` consecutive hypotheses are committed (LocalAgreement),
    except the last ``holdback_words`` of the newest one, which may still be growing.
    Utterances longer than ``max_utterance_s`` are cut at a word boundary after the committed
    words (see ``edge_rtgi.asr.split``).
    Partials decode greedily (``beam_size``); the final decode of each utterance uses
    ``final_beam_size`` (beam 5 cut tiny.en's WER on the project sentences from about 5 % to 1-3 %).

    ``shared``: in a daemon, every session's decodes go to one engine per model that runs them
    in batched steps of at most ``batch_size`` windows, finals first (``edge_rtgi.asr.batch``);
    false (the default until the many-speaker benchmark shows it wins; docs/speech.md): each
    session decodes on its own thread. ``cpu_threads`` is whisper's thread budget (CTranslate2
    intra-op threads).

    ``encoder_window_s``: audio is padded to the smallest multiple of this that leaves 1 s of
    silence after it (at most whisper's 30 s) before the encoder, and a doubtful result is
    decoded again in the 30 s window. 30 (the default) keeps faster-whisper's own decode; the
    shipped English pipelines use 10, measured for tiny.en in docs/speech.md.
    """

    model: str = "whisper-tiny.en"
    device: str = "auto"
    compute_type: str = "auto"
    cpu_threads: int = 2
    shared: bool = False
    batch_size: int = 8
    language: str | None = "en"
    task: str = "transcribe"
    beam_size: int = 1
    final_beam_size: int = 5
    min_chunk_ms: int = 1000
    agreement_n: int = 2
    holdback_words: int = 1
    max_utterance_s: float = 20.0
    # The encoder's window for short audio (whisper.encoder_window_frames); 30 is whisper's own.
    encoder_window_s: float = 30.0
    # Real-time sessions (AsrSession) wait for factor x (last partial decode time) of new audio
    # between partials, so a slow CPU is never busy with a stale partial when speech ends.
    partial_interval_factor: float = 2.0
    # Decode the tail as soon as the pad of trailing silence is in, before the endpoint fires.
    speculative_final: bool = True
    no_speech_threshold: float = 0.6
    log_prob_threshold: float = -1.0
    compression_ratio_threshold: float = 2.4
    hallucination_blocklist: tuple[str, ...] = DEFAULT_HALLUCINATIONS
    vad: VadConfig = field(default_factory=VadConfig)
    # How a pause ends the turn: the VAD's silence timer, or the smart-turn model (edge_rtgi.asr.turn).
    turn_detection: TurnDetectionConfig = field(default_factory=TurnDetectionConfig)

    def __post_init__(self) -> None:
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        if self.agreement_n < 2:
            raise ValueError(f"agreement_n must be >= 2, got {self.agreement_n}")
        if not 2.0 <= self.max_utterance_s <= 28.0:
            raise ValueError(
                f"max_utterance_s must be in [2, 28] (whisper sees 30 s), got {self.max_utterance_s}"
            )
        if not 5.0 <= self.encoder_window_s <= 30.0:
            raise ValueError(
                f"encoder_window_s must be in [5, 30] seconds (30 = whisper's own window), "
                f"got {self.encoder_window_s}"
            )
        if self.min_chunk_ms < 50:
            raise ValueError(f"min_chunk_ms must be >= 50, got {self.min_chunk_ms}")
        for name in ("cpu_threads", "batch_size", "beam_size", "final_beam_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.partial_interval_factor < 0:
            raise ValueError(f"partial_interval_factor must be >= 0, got {self.partial_interval_factor}")
        if self.holdback_words < 0:
            raise ValueError(f"holdback_words must be >= 0, got {self.holdback_words}")
