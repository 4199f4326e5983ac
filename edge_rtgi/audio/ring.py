"""A preallocated ring buffer of float32 samples with absolute sample indexing.

Streaming ASR appends a 20-40 ms chunk many times a second and repeatedly reads "the audio
of the current utterance". ``np.append`` per chunk (whisper_streaming's buffer) copies the
whole buffer each time, which is quadratic in utterance length. Here writes copy only the
chunk, and reads address samples by their absolute index since the stream started, so a
caller can remember "the utterance starts at sample 123456" while older audio is
overwritten.
"""

from __future__ import annotations

import numpy as np

from edge_rtgi.errors import AudioError


class RingBuffer:
    """Fixed-capacity float32 ring; the newest ``capacity_samples`` samples are kept."""

    def __init__(self, capacity_samples: int):
        if capacity_samples <= 0:
            raise ValueError(f"capacity_samples must be positive, got {capacity_samples}")
        self._data = np.zeros(capacity_samples, dtype=np.float32)
        self.capacity_samples = capacity_samples
        self._total_written = 0

    @property
    def total_written(self) -> int:
        """Absolute index one past the newest sample (samples written since creation)."""
        return self._total_written

    @property
    def oldest_index(self) -> int:
        """Absolute index of the oldest sample still held."""
        return max(0, self._total_written - self.capacity_samples)

    def __len__(self) -> int:
        return self._total_written - self.oldest_index

    def write(self, samples: np.ndarray) -> None:
        """Append samples, overwriting the oldest ones when full."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        total = len(samples)
        # A chunk larger than the ring: only its tail can be kept, but every sample counts.
        samples = samples[-self.capacity_samples :]
        n = len(samples)
        start = (self._total_written + total - n) % self.capacity_samples
        first = min(n, self.capacity_samples - start)
        self._data[start : start + first] = samples[:first]
        if n > first:
            self._data[: n - first] = samples[first:]
        self._total_written += total

    def read(self, start_index: int, end_index: int | None = None) -> np.ndarray:
        """Copy of samples with absolute indices in ``[start_index, end_index)``."""
        end_index = self._total_written if end_index is None else end_index
        if start_index < self.oldest_index or end_index > self._total_written or start_index > end_index:
            raise AudioError(
                f"ring buffer holds samples [{self.oldest_index}, {self._total_written}), "
                f"cannot read [{start_index}, {end_index})",
                hint="raise the buffer capacity or read sooner",
            )
        n = end_index - start_index
        out = np.empty(n, dtype=np.float32)
        start = start_index % self.capacity_samples
        first = min(n, self.capacity_samples - start)
        out[:first] = self._data[start : start + first]
        if n > first:
            out[first:] = self._data[: n - first]
        return out

    def latest(self, num_samples: int) -> np.ndarray:
        """Copy of the newest ``num_samples`` samples (fewer if less is held)."""
        num_samples = min(num_samples, len(self))
        return self.read(self._total_written - num_samples)
