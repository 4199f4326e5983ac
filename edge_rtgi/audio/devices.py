"""Sound-card input and output through sounddevice (PortAudio).

PortAudio calls us from its own audio thread. The microphone callback only copies the block
and hands it to the event loop with ``loop.call_soon_threadsafe``; the asyncio queue is
bounded, and when the consumer falls behind the *oldest* block is dropped (and counted),
so latency stays bounded instead of growing without limit.

``sounddevice`` is imported lazily: importing it initialises PortAudio, which is slow and
fails on machines without ``libportaudio2``; neither should happen for file-only work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np

from edge_rtgi.audio.pcm import Resampler
from edge_rtgi.errors import AudioError

log = logging.getLogger(__name__)


def _sounddevice() -> Any:
    try:
        import sounddevice
    except OSError as exc:  # libportaudio missing
        raise AudioError(
            f"PortAudio is not available ({exc})", hint="install libportaudio2 (scripts/setup.sh does)"
        ) from None
    return sounddevice


def _find_device(sd: Any, device: int | str | None, kind: str) -> dict:
    """The PortAudio device dict for ``device`` (None = default), or a clear AudioError."""
    try:
        return sd.query_devices(device, kind=kind)
    except (ValueError, sd.PortAudioError) as exc:
        what = "microphone (input)" if kind == "input" else "speaker (output)"
        names = [d["name"] for d in sd.query_devices()] if len(sd.query_devices()) else []
        raise AudioError(
            f"no {what} audio device{f' matching {device!r}' if device is not None else ''} ({exc})",
            hint=f"available devices: {names}"
            if names
            else "this machine has no sound device; use a file, or start PulseAudio",
        ) from None


class MicrophoneSource:
    """Async iterator of mono float32 chunks from a sound-card input at ``sample_rate_hz``.

    If the device does not accept ``sample_rate_hz`` directly, it is opened at its default
    rate and resampled here. ``dropped_chunks`` counts blocks discarded because the consumer
    was slower than real time for longer than ``max_queued_chunks`` blocks.
    """

    def __init__(
        self,
        sample_rate_hz: int = 16000,
        chunk_ms: int = 20,
        device: int | str | None = None,
        max_queued_chunks: int = 100,
    ):
        self.sample_rate_hz, self.chunk_ms, self.device = sample_rate_hz, chunk_ms, device
        self.max_queued_chunks = max_queued_chunks
        self.dropped_chunks = 0
        self._stop = threading.Event()

    def _open(
        self, sd: Any, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue
    ) -> tuple[Any, Resampler | None]:
        info = _find_device(sd, self.device, "input")
        rate = self.sample_rate_hz
        try:
            sd.check_input_settings(device=self.device, channels=1, dtype="float32", samplerate=rate)
        except Exception:  # noqa: BLE001 - PortAudio reports unsupported rates in several ways
            rate = int(info["default_samplerate"])
        resampler = Resampler(rate, self.sample_rate_hz) if rate != self.sample_rate_hz else None

        def put(block: np.ndarray) -> None:  # runs on the event loop thread
            if queue.full():
                queue.get_nowait()
                self.dropped_chunks += 1
            queue.put_nowait(block)

        def callback(indata, frames, time_info, status) -> None:  # PortAudio's thread
            if status.input_overflow:
                log.debug("microphone overflow")
            if not self._stop.is_set():
                loop.call_soon_threadsafe(put, indata[:, 0].copy())

        try:
            stream = sd.InputStream(
                samplerate=rate,
                blocksize=rate * self.chunk_ms // 1000,
                device=self.device,
                channels=1,
                dtype="float32",
                callback=callback,
            )
        except sd.PortAudioError as exc:
            raise AudioError(f"cannot open microphone {info['name']!r}: {exc}") from None
        return stream, resampler

    async def __aiter__(self) -> AsyncGenerator[np.ndarray, None]:
        sd = _sounddevice()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[np.ndarray] = asyncio.Queue(maxsize=self.max_queued_chunks)
        stream, resampler = self._open(sd, loop, queue)
        self._stop.clear()
        with stream:
            log.info(
                "opened input %r at %d Hz", stream.device, stream.samplerate
            )  # capture begins at the first callback
            while not self._stop.is_set():
                block = await queue.get()
                yield resampler.process(block) if resampler else block

    def stop(self) -> None:
        """End the iteration after the block in flight (thread-safe)."""
        self._stop.set()


class SpeakerSink:
    """Plays int16 or float32 mono chunks on a sound-card output, in order, without gaps.

    ``write`` queues a chunk for a background PortAudio stream and returns at once; ``drain``
    waits (asynchronously) until everything queued has been played; ``clear`` drops queued
    audio immediately, which is what barge-in needs.
    """

    def __init__(self, sample_rate_hz: int, device: int | str | None = None):
        sd = _sounddevice()
        _find_device(sd, device, "output")
        self.sample_rate_hz = sample_rate_hz
        self._lock = threading.Lock()
        self._pending: list[np.ndarray] = []
        self._idle = threading.Event()
        self._idle.set()
        try:
            self._stream = sd.OutputStream(
                samplerate=sample_rate_hz, channels=1, dtype="float32", device=device, callback=self._callback
            )
            self._stream.start()
        except sd.PortAudioError as exc:
            raise AudioError(f"cannot open speaker at {sample_rate_hz} Hz: {exc}") from None

    def _callback(self, outdata, frames, time_info, status) -> None:
        out = outdata[:, 0]
        filled = 0
        with self._lock:
            while filled < frames and self._pending:
                head = self._pending[0]
                take = min(frames - filled, len(head))
                out[filled : filled + take] = head[:take]
                filled += take
                if take == len(head):
                    self._pending.pop(0)
                else:
                    self._pending[0] = head[take:]
            if not self._pending:
                self._idle.set()
        out[filled:] = 0.0

    def write(self, chunk: np.ndarray) -> None:
        """Queue a mono chunk (int16 PCM or float32 in [-1, 1]) for playback."""
        x = chunk.astype(np.float32) / 32768.0 if chunk.dtype == np.int16 else chunk.astype(np.float32)
        with self._lock:
            self._pending.append(x)
            self._idle.clear()

    def clear(self) -> None:
        """Drop everything not yet played."""
        with self._lock:
            self._pending.clear()
            self._idle.set()

    async def drain(self) -> None:
        """Wait until all queued audio has been played."""
        await asyncio.to_thread(self._idle.wait)

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()


def has_output_device() -> bool:
    """True when PortAudio has a default output device."""
    try:
        sd = _sounddevice()
        sd.query_devices(None, kind="output")
        return True
    except Exception:  # noqa: BLE001 - any failure means "no usable speaker"
        return False
