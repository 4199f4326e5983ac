"""PCM sample conversions, down-mixing and resampling (numpy only).

Conventions: float32 samples are in [-1, 1]; int16 samples are full-scale PCM; arrays are
``[num_samples]`` for mono and ``[num_samples, channels]`` for interleaved multi-channel.

Resampling is a windowed-sinc polyphase filter written with numpy, because scipy is not a
dependency of this project and the only rates that matter (8-48 kHz speech into 16 kHz,
and TTS voices out to the speaker) are served well by one good low-pass design. The
``Resampler`` keeps state across chunks so streams can be converted chunk by chunk with
the same result as converting the whole signal at once.
"""

from __future__ import annotations

import math

import numpy as np

from edge_rtgi.errors import AudioError

_INT16_SCALE = 32768.0


def pcm16_to_float32(pcm: np.ndarray | bytes) -> np.ndarray:
    """int16 PCM (array or little-endian bytes) to float32 in [-1, 1)."""
    if isinstance(pcm, (bytes, bytearray, memoryview)):
        if len(pcm) % 2:
            raise AudioError(
                f"PCM16 byte buffer has an odd length ({len(pcm)} bytes)", hint="send whole 16-bit samples"
            )
        pcm = np.frombuffer(pcm, dtype="<i2")
    return pcm.astype(np.float32) / _INT16_SCALE


def float32_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] to int16 PCM, clipping anything outside full scale."""
    scaled = np.clip(np.asarray(samples, dtype=np.float32) * _INT16_SCALE, -32768.0, 32767.0)
    return np.round(scaled).astype(np.int16)


def downmix(samples: np.ndarray) -> np.ndarray:
    """Average the channels of ``[num_samples, channels]`` audio to mono; mono passes through."""
    if samples.ndim == 1:
        return samples
    if samples.ndim != 2:
        raise AudioError(f"expected mono [N] or multi-channel [N, C] audio, got shape {samples.shape}")
    if samples.shape[1] == 1:
        return samples[:, 0]
    return samples.mean(axis=1, dtype=np.float32).astype(samples.dtype, copy=False)


class Resampler:
    """Stateful polyphase resampler from ``src_rate_hz`` to ``dst_rate_hz`` (mono float32).

    ``process(chunk)`` returns the output samples that can be computed so far; ``flush()``
    returns the rest. Concatenating all outputs gives exactly ``ceil(n_in * dst / src)``
    samples, identical to resampling the whole signal in one call.
    """

    _BLOCK_OUT = 8192  # outputs computed per vectorised gather, to bound temporary memory

    def __init__(self, src_rate_hz: int, dst_rate_hz: int, zero_crossings: int = 16, rolloff: float = 0.94):
        if src_rate_hz <= 0 or dst_rate_hz <= 0:
            raise AudioError(f"sample rates must be positive, got {src_rate_hz} -> {dst_rate_hz} Hz")
        g = math.gcd(int(src_rate_hz), int(dst_rate_hz))
        self.src_rate_hz, self.dst_rate_hz = int(src_rate_hz), int(dst_rate_hz)
        self._up, self._down = self.dst_rate_hz // g, self.src_rate_hz // g
        self._taps = self._design(zero_crossings, rolloff)  # [up, 2K]
        self._half = self._taps.shape[1] // 2
        # Input history, left-padded with K zeros so output 0 is centred on input 0.
        self._buf = np.zeros(self._half, dtype=np.float32)
        self._buf_start = -self._half  # absolute input index of _buf[0]
        self._n_in = 0
        self._n_out = 0

    def _design(self, zero_crossings: int, rolloff: float) -> np.ndarray:
        """Kaiser-windowed sinc, one row of 2K taps per output phase."""
        cutoff = rolloff * min(1.0, self._up / self._down)  # fraction of the input Nyquist
        half = int(math.ceil(zero_crossings / cutoff))  # input samples on each side
        offsets = np.arange(-half + 1, half + 1, dtype=np.float64)  # tap k reads x[base + k]
        phases = np.arange(self._up, dtype=np.float64)[:, None] / self._up  # fractional position
        t = offsets[None, :] - phases  # input-sample distance from the output instant
        window = np.kaiser(2 * half + 1, 8.6)
        # Sample the continuous window at the same distances (linear interpolation of the table).
        win = np.interp(t, np.arange(-half, half + 1), window, left=0.0, right=0.0)
        taps = cutoff * np.sinc(cutoff * t) * win
        return taps.astype(np.float32)

    @property
    def identity(self) -> bool:
        return self._up == self._down

    def _emit(self, limit_out: int) -> np.ndarray:
        """Compute outputs n in [n_out, limit_out) whose taps are all in the buffer."""
        outs = []
        up, down, half = self._up, self._down, self._half
        buf_end = self._buf_start + len(self._buf)
        # Output n sits at input position n*down/up; its last tap reads x[floor(pos) + half].
        last_ok = ((buf_end - 1 - half) * up) // down if buf_end - 1 - half >= 0 else -1
        stop = min(limit_out, last_ok + 1)
        while self._n_out < stop:
            n = np.arange(self._n_out, min(stop, self._n_out + self._BLOCK_OUT), dtype=np.int64)
            num = n * down
            base, phase = num // up, num % up
            idx = (base - self._buf_start)[:, None] + np.arange(-half + 1, half + 1)[None, :]
            outs.append(np.einsum("ij,ij->i", self._buf[idx], self._taps[phase]).astype(np.float32))
            self._n_out = int(n[-1]) + 1
        # Keep only the history the next output still needs.
        next_base = (self._n_out * down) // up
        keep_from = max(0, next_base - half + 1 - self._buf_start)
        if keep_from:
            self._buf = self._buf[keep_from:]
            self._buf_start += keep_from
        return np.concatenate(outs) if outs else np.zeros(0, dtype=np.float32)

    def _total_out(self) -> int:
        return -(-self._n_in * self._up // self._down)

    def process(self, chunk: np.ndarray) -> np.ndarray:
        """Feed mono float32 samples; return the resampled samples available so far."""
        chunk = np.asarray(chunk, dtype=np.float32)
        if self.identity:
            return chunk
        self._buf = np.concatenate([self._buf, chunk])
        self._n_in += len(chunk)
        return self._emit(self._total_out())

    def flush(self) -> np.ndarray:
        """Return the remaining output (the end of the signal is zero-padded)."""
        if self.identity:
            return np.zeros(0, dtype=np.float32)
        self._buf = np.concatenate([self._buf, np.zeros(2 * self._half, dtype=np.float32)])
        out = self._emit(self._total_out())
        return out


def resample(samples: np.ndarray, src_rate_hz: int, dst_rate_hz: int) -> np.ndarray:
    """Resample mono float32 audio from ``src_rate_hz`` to ``dst_rate_hz`` in one call."""
    if src_rate_hz == dst_rate_hz:
        return np.asarray(samples, dtype=np.float32)
    rs = Resampler(src_rate_hz, dst_rate_hz)
    head = rs.process(samples)
    return np.concatenate([head, rs.flush()])


def to_mono_16k(samples: np.ndarray, sample_rate_hz: int, target_rate_hz: int = 16000) -> np.ndarray:
    """Any float32 ``[N]`` or ``[N, C]`` audio to mono float32 at ``target_rate_hz`` (ASR input)."""
    return resample(downmix(np.asarray(samples, dtype=np.float32)), sample_rate_hz, target_rate_hz)
