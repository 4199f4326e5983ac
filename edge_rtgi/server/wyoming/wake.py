"""The ``wake`` service: ``detect``, then audio -> a ``detection`` per wake word heard, or
``not-detected`` at ``audio-stop``.

Detection runs the bundled microWakeWord models (``edge_rtgi.asr.wakeword``) in a worker
thread, one detector per request. ``detect`` may name the wake words to listen for; without
names it listens for the served pipeline's wake word (``okay_nabu`` when it has none). Like
wyoming-openwakeword, it keeps listening after a detection until the audio stops.
"""

from __future__ import annotations

import asyncio

import numpy as np
from wyoming.wake import Detect, Detection, NotDetected

from edge_rtgi.asr.wakeword import SAMPLE_RATE_HZ, WakeWordDetector, available_wake_words
from edge_rtgi.audio.pcm import Resampler, float32_to_pcm16, pcm16_to_float32
from edge_rtgi.server.wyoming.services import EventWriter, WyomingServices
from edge_rtgi.server.wyoming.streams import StreamFormat, WyomingRequestError


class WakeRequest:
    """One detection request, from ``detect`` to ``audio-stop``."""

    def __init__(self, services: WyomingServices, request: Detect, write: EventWriter):
        wake = services.wake
        if request.names is not None and (
            not isinstance(request.names, list) or not all(isinstance(n, str) for n in request.names)
        ):
            raise WyomingRequestError(
                "invalid_event",
                f"detect: 'names' must be a list of wake word names, got {request.names!r}",
                hint=f"available wake words: {', '.join(available_wake_words())}",
            )
        names = list(request.names or [wake.model if wake is not None else "okay_nabu"])
        unknown = [n for n in names if n not in available_wake_words()]
        if unknown:
            raise WyomingRequestError(
                "unknown_wake_word",
                f"unknown wake word {unknown[0]!r}",
                hint=f"available wake words: {', '.join(available_wake_words())}",
            )
        self.names, self.write = names, write
        self.cutoff = wake.probability_cutoff if wake is not None else None
        self.refractory_ms = wake.refractory_ms if wake is not None else 2000
        self._detector: WakeWordDetector | None = None
        self._resampler: Resampler | None = None
        self._detections = 0

    async def start(self, fmt: StreamFormat) -> None:
        self._detector = await asyncio.to_thread(
            WakeWordDetector, self.names, self.refractory_ms, self.cutoff
        )
        if fmt.rate_hz != SAMPLE_RATE_HZ:
            self._resampler = Resampler(fmt.rate_hz, SAMPLE_RATE_HZ)

    async def chunk(self, pcm: np.ndarray) -> None:
        if self._detector is None:
            return
        if self._resampler is not None:
            pcm = float32_to_pcm16(self._resampler.process(pcm16_to_float32(pcm)))
        for found in await asyncio.to_thread(self._detector.process, pcm):
            self._detections += 1
            await self.write(Detection(name=found.name, timestamp=found.audio_ms).event())

    async def stop(self) -> None:
        try:
            if not self._detections:
                await self.write(NotDetected().event())
        finally:  # also when the client left before the answer could be written
            await self.close()

    async def close(self) -> None:
        if self._detector is not None:
            self._detector.close()
            self._detector = None
