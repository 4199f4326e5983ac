"""Silero VAD (the v6 ONNX model shipped with faster-whisper), run as a stream.

The model takes 512-sample frames (32 ms at 16 kHz), each preceded by the last 64 samples of
the frame before, and carries an LSTM state ``(h, c)`` from frame to frame. ``SileroVad``
keeps that state, the partial frame and the context between calls, so audio can be pushed
in chunks of any size, and turns frame probabilities into speech start/end events with
hysteresis (``threshold`` up, ``silence_threshold`` down) and a silence timer.

All positions are absolute sample indices since the VAD was created (16 kHz).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_rtgi.asr.config import VadConfig
from edge_rtgi.errors import AudioError, ModelFileError

log = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16000
FRAME_SAMPLES = 512
_CONTEXT_SAMPLES = 64
_HISTORY_FRAMES = 1024


@dataclass(frozen=True)
class VadEvent:
    """``kind`` "start": speech began at ``sample_index``; "end": speech stopped at
    ``sample_index`` (the first silent sample), reported once the silence was long enough."""

    kind: str
    sample_index: int


def silero_model_path(name_or_path: str | Path = "silero-vad") -> Path:
    """Locate the silero ONNX file: an explicit file or folder, the catalogue entry, or the
    copy inside the installed faster-whisper package."""
    path = Path(name_or_path)
    if not path.exists() and str(name_or_path) == "silero-vad":
        try:
            from edge_rtgi.catalog import resolve_model

            path = resolve_model("silero-vad", role="vad")
        except Exception as exc:  # noqa: BLE001 - fall back to the copy faster-whisper ships
            log.debug("catalogue has no silero-vad (%s); using faster-whisper's asset", exc)
            from faster_whisper.utils import get_assets_path

            path = Path(get_assets_path())
    if path.is_dir():
        found = sorted(path.glob("silero_vad*.onnx")) or sorted(path.glob("*.onnx"))
        if not found:
            raise ModelFileError(
                f"no silero VAD .onnx file in {path}", hint="run `edge-rtgi models pull silero-vad`"
            )
        path = found[-1]
    if not path.is_file():
        raise ModelFileError(
            f"silero VAD model not found: {path}", hint="run `edge-rtgi models pull silero-vad`"
        )
    return path


def _load_session(path: Path):
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    # One thread: a frame is tiny, and ASR decoding needs the cores.
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    try:
        return onnxruntime.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ModelFileError(f"cannot load silero VAD model {path}: {exc}") from None


class SileroVad:
    """Streaming speech detector. Push 16 kHz float32 audio with ``process``; get events."""

    def __init__(self, config: VadConfig | None = None, model_path: str | Path | None = None):
        self.config = config or VadConfig()
        self._session = _load_session(silero_model_path(model_path or self.config.model))
        self.reset()

    def reset(self) -> None:
        """Forget all state; sample indices restart at 0."""
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(_CONTEXT_SAMPLES, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._frames_done = 0
        self.in_speech = False
        self._speech_run = 0  # consecutive speech frames while not in speech
        self._silence_run = 0  # consecutive silent frames while in speech
        self.last_probability = 0.0
        # Frame probabilities of the last ~32 s (whisper's window), newest last, for choosing
        # where to split long speech.
        self.recent_probabilities: deque[float] = deque(maxlen=_HISTORY_FRAMES)

    @property
    def samples_processed(self) -> int:
        return self._frames_done * FRAME_SAMPLES

    @property
    def silence_start_index(self) -> int | None:
        """While in speech and currently silent: where the silence began; else None."""
        if self.in_speech and self._silence_run:
            return (self._frames_done - self._silence_run) * FRAME_SAMPLES
        return None

    def probabilities(self, samples: np.ndarray) -> np.ndarray:
        """Speech probability of every complete frame in (pending + ``samples``)."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if not np.all(np.isfinite(samples)):
            raise AudioError("audio contains NaN or infinite samples")
        buf = np.concatenate([self._pending, samples]) if len(self._pending) else samples
        n_frames = len(buf) // FRAME_SAMPLES
        self._pending = buf[n_frames * FRAME_SAMPLES :].copy()
        if n_frames == 0:
            return np.zeros(0, dtype=np.float32)
        frames = buf[: n_frames * FRAME_SAMPLES].reshape(n_frames, FRAME_SAMPLES)
        contexts = np.concatenate([self._context[None, :], frames[:-1, -_CONTEXT_SAMPLES:]], axis=0)
        batch = np.concatenate([contexts, frames], axis=1).astype(np.float32)
        self._context = frames[-1, -_CONTEXT_SAMPLES:].copy()
        # The v6 graph runs the LSTM along the batch axis, so a batch of consecutive frames
        # with one (h, c) is the same as feeding them one by one.
        probs, self._h, self._c = self._session.run(None, {"input": batch, "h": self._h, "c": self._c})
        return np.asarray(probs, dtype=np.float32).reshape(-1)

    def process(self, samples: np.ndarray) -> list[VadEvent]:
        """Consume audio; return the speech start/end events it completes."""
        events = []
        cfg = self.config
        frame_ms = FRAME_SAMPLES * 1000 / SAMPLE_RATE_HZ
        need_speech = max(1, int(np.ceil(cfg.min_speech_ms / frame_ms)))
        need_silence = max(1, int(np.ceil(cfg.min_silence_ms / frame_ms)))
        for p in self.probabilities(samples):
            self.last_probability = float(p)
            self.recent_probabilities.append(float(p))
            if not self.in_speech:
                self._speech_run = self._speech_run + 1 if p >= cfg.threshold else 0
                if self._speech_run >= need_speech:
                    self.in_speech, self._silence_run = True, 0
                    start = (self._frames_done + 1 - self._speech_run) * FRAME_SAMPLES
                    events.append(VadEvent("start", start))
            else:
                self._silence_run = self._silence_run + 1 if p < cfg.silence_threshold else 0
                if self._silence_run >= need_silence:
                    end = (self._frames_done + 1 - self._silence_run) * FRAME_SAMPLES
                    events.append(VadEvent("end", end))
                    self.in_speech, self._speech_run, self._silence_run = False, 0, 0
            self._frames_done += 1
        return events

    def quietest_frame(self, start_index: int, end_index: int) -> tuple[int, float]:
        """The least speech-like frame starting in ``[start_index, end_index)``:
        (its first sample, probability).

        Only frames still in the history (the last ~32 s) count; with none in range the
        result is ``(start_index, 1.0)``, i.e. no known quiet place.
        """
        probs = self.recent_probabilities
        first_frame = self._frames_done - len(probs)
        lo = max(first_frame, -(-start_index // FRAME_SAMPLES))
        hi = min(self._frames_done, -(-end_index // FRAME_SAMPLES))
        if lo >= hi:
            return start_index, 1.0
        window = [probs[f - first_frame] for f in range(lo, hi)]
        best = int(np.argmin(window))
        return (lo + best) * FRAME_SAMPLES, float(window[best])

    def force_end(self) -> VadEvent | None:
        """End the current speech now (a client commit, a forced split, end of stream)."""
        if not self.in_speech:
            return None
        end = self.silence_start_index if self.silence_start_index is not None else self.samples_processed
        self.in_speech, self._speech_run, self._silence_run = False, 0, 0
        return VadEvent("end", end)
