"""Acoustic echo cancellation: WebRTC's AEC3 (``pywebrtc-audio``) on the microphone path.

A device with an open loudspeaker hears its own reply; without help, the VAD takes that for
the user and barge-in cuts the reply. AEC3 subtracts an adaptive estimate of the echo,
computed from the *reference*: the audio that was being played while the microphone
recorded. It finds the delay between the two itself (up to several hundred ms), so the
reference only has to be the played audio, sample-aligned with the microphone samples as
well as the device can manage.

Why WebRTC's module and not speexdsp: AEC3 is what browsers run on every call, it estimates
the delay and copes with non-linear echo paths, and ``pywebrtc-audio`` ships binary wheels
(CPython 3.10-3.14, Linux x86_64 and aarch64, so Jetsons too) with the GIL released during
processing; speexdsp's Python bindings are source-only and its canceller needs the delay
to be known.

``EchoCanceller`` runs on whole 10 ms frames; it carries a remainder between calls, so any
chunk size works and the output lags the input by less than one frame. ``PlayoutReference``
keeps what a local speaker has been given (``edge-rtgi voice --mic``), to take the
reference from it in step with the microphone.
"""

from __future__ import annotations

import numpy as np

from edge_rtgi.audio.pcm import Resampler, float32_to_pcm16, pcm16_to_float32
from edge_rtgi.errors import AudioError

FRAME_MS = 10  # AEC3 works on 10 ms frames


class EchoCanceller:
    """Removes the echo of ``reference`` from ``mic`` (both mono int16 at one rate).

    Not thread-safe: use it from one thread at a time (calls may come from different threads).
    """

    def __init__(self, sample_rate_hz: int = 16000, stream_delay_ms: int = 0):
        from pywebrtc_audio import EchoCanceller as _Aec3

        if not 8000 <= sample_rate_hz <= 48000:
            raise AudioError(f"echo cancellation runs at 8-48 kHz, not {sample_rate_hz} Hz")
        self.sample_rate_hz = sample_rate_hz
        self._frame = sample_rate_hz * FRAME_MS // 1000
        # 0 lets AEC3's delay estimator find the delay; a hint only makes it converge sooner
        self._aec = _Aec3(sample_rate_hz, 1, stream_delay_ms=stream_delay_ms)
        self._mic_rest = np.zeros(0, np.int16)
        self._ref_rest = np.zeros(0, np.int16)

    def process(self, mic: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """The microphone with the echo removed: as many whole frames as are complete."""
        if len(mic) != len(reference):
            raise AudioError(
                f"the echo reference has {len(reference)} samples for {len(mic)} microphone samples",
                hint="send the reference sample-aligned with the microphone (one stereo frame each)",
            )
        near = np.concatenate([self._mic_rest, mic.astype(np.int16, copy=False)])
        far = np.concatenate([self._ref_rest, reference.astype(np.int16, copy=False)])
        usable = len(near) - len(near) % self._frame
        self._mic_rest, self._ref_rest = near[usable:], far[usable:]
        if not usable:
            return np.zeros(0, np.int16)
        return np.asarray(self._aec.process(near[:usable], far[:usable]), dtype=np.int16)

    def reset(self) -> None:
        """Forget the adapted echo path (a new device or stream)."""
        self._aec.reset()
        self._mic_rest = np.zeros(0, np.int16)
        self._ref_rest = np.zeros(0, np.int16)


def split_reference(stereo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interleaved stereo int16 (left: microphone, right: echo reference) -> the two channels."""
    if len(stereo) % 2:
        raise AudioError(
            f"a frame with an echo reference needs an even number of samples, got {len(stereo)}",
            hint="send interleaved stereo s16le: microphone on the left, played audio on the right",
        )
    frames = stereo.reshape(-1, 2)
    return np.ascontiguousarray(frames[:, 0]), np.ascontiguousarray(frames[:, 1])


def join_reference(mic: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """The inverse of ``split_reference``: interleaved stereo int16."""
    return np.stack([mic.astype(np.int16), reference.astype(np.int16)], axis=1).reshape(-1)


class PlayoutReference:
    """The audio a local speaker is playing, as the echo reference for the microphone.

    ``played`` appends what was handed to the speaker (resampled to the microphone's rate);
    ``take(n)`` returns the next ``n`` samples of it for the ``n`` microphone samples just
    recorded, silence when nothing is playing. The speaker's own buffering adds a steady
    delay, which the canceller finds. ``clear`` drops what is queued (the speaker was cut).
    """

    def __init__(self, sample_rate_hz: int = 16000, max_s: float = 120.0):
        self.sample_rate_hz = sample_rate_hz
        self._max = int(max_s * sample_rate_hz)
        self._queued: list[np.ndarray] = []
        self._size = 0
        self._resampler: Resampler | None = None

    def played(self, pcm: np.ndarray, sample_rate_hz: int) -> None:
        if sample_rate_hz != self.sample_rate_hz:
            if self._resampler is None or self._resampler.src_rate_hz != sample_rate_hz:
                self._resampler = Resampler(sample_rate_hz, self.sample_rate_hz)
            pcm = float32_to_pcm16(self._resampler.process(pcm16_to_float32(pcm)))
        if self._size + len(pcm) > self._max:  # more than the speaker can hold: it would skip too
            return
        self._queued.append(pcm.astype(np.int16))
        self._size += len(pcm)

    def take(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.int16)
        filled = 0
        while filled < n and self._queued:
            head = self._queued[0]
            k = min(n - filled, len(head))
            out[filled : filled + k] = head[:k]
            filled += k
            if k == len(head):
                self._queued.pop(0)
            else:
                self._queued[0] = head[k:]
        self._size -= filled
        return out

    def clear(self) -> None:
        self._queued.clear()
        self._size = 0
