"""Audio streams from Wyoming clients: the formats accepted, and one stream's bookkeeping.

Home Assistant sends 16 kHz, 16-bit, mono; any rate from 8 to 48 kHz is accepted (the
pipeline resamples), 16-bit samples only, mono or stereo (stereo is averaged to mono).
Anything else is refused with an ``unsupported_audio`` error naming what was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_rtgi.errors import EdgeRtgiError


class WyomingRequestError(EdgeRtgiError):
    """A well-framed event the server cannot act on; answered with an ``error`` event."""

    def __init__(self, code: str, message: str, hint: str | None = None):
        super().__init__(message, hint)
        self.code = code


@dataclass(frozen=True)
class StreamFormat:
    """The format an ``audio-start`` announced."""

    rate_hz: int
    width_bytes: int
    channels: int

    @classmethod
    def checked(cls, data: dict) -> StreamFormat:
        values = [data.get(key) for key in ("rate", "width", "channels")]
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if len(ints) != len(values):  # JSON floats, strings, booleans, null, missing
            raise WyomingRequestError(
                "invalid_event", "audio events need integer 'rate', 'width' and 'channels'"
            )
        fmt = cls(*ints)
        problems = []
        if not 8000 <= fmt.rate_hz <= 48000:
            problems.append(f"rate {fmt.rate_hz} Hz (8000-48000 are accepted)")
        if fmt.width_bytes != 2:
            problems.append(f"width {fmt.width_bytes} bytes (16-bit samples only: width 2)")
        if fmt.channels not in (1, 2):
            problems.append(f"{fmt.channels} channels (mono or stereo)")
        if problems:
            raise WyomingRequestError(
                "unsupported_audio",
                "unsupported audio format: " + ", ".join(problems),
                hint="send 16 kHz, 16-bit (width 2), mono PCM, as Home Assistant does",
            )
        return fmt

    def to_mono(self, payload: bytes) -> np.ndarray:
        """A chunk's payload -> mono int16 samples."""
        frame_bytes = self.width_bytes * self.channels
        if len(payload) % frame_bytes:
            raise WyomingRequestError(
                "invalid_audio",
                f"an audio chunk of {len(payload)} bytes is not a whole number of {frame_bytes}-byte frames",
            )
        pcm = np.frombuffer(payload, dtype="<i2").astype(np.int16)
        if self.channels == 2:
            pcm = pcm.reshape(-1, 2).mean(axis=1).astype(np.int16)
        return pcm


class AudioStream:
    """One ``audio-start`` ... ``audio-stop`` stream: its format and how much audio came."""

    def __init__(self, fmt: StreamFormat, max_audio_s: float):
        self.format = fmt
        self.max_audio_s = max_audio_s
        self.samples = 0

    def chunk(self, data: dict, payload: bytes | None) -> np.ndarray:
        """A chunk's mono samples; errors for a changed format or too much audio."""
        if StreamFormat.checked(data) != self.format:
            raise WyomingRequestError(
                "unsupported_audio", "an audio chunk's format differs from its audio-start"
            )
        pcm = self.format.to_mono(payload or b"")
        self.samples += len(pcm)
        if self.samples > self.max_audio_s * self.format.rate_hz:
            raise WyomingRequestError(
                "audio_too_long",
                f"more than {self.max_audio_s:.0f} s of audio in one request",
                hint="end each request with audio-stop (wyoming.max_audio_s sets the limit)",
            )
        return pcm

    @property
    def audio_ms(self) -> int:
        return int(1000 * self.samples / self.format.rate_hz)
