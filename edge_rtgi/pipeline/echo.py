"""The echo-cancelling front of a session's audio path (before the wake gate and ASR).

A client that plays the replies on an open loudspeaker sends, with each microphone chunk,
the audio it was playing at that moment (``session.update {"echo_reference": true}``; on
the native protocol, stereo frames: docs/protocol.md). ``EchoFront`` runs WebRTC's AEC3
(``edge_rtgi.audio.aec``) on each pair in a worker thread and hands on the cleaned mono
microphone, so barge-in reacts to the user and not to the device's own voice.
"""

from __future__ import annotations

import asyncio

import numpy as np

from edge_rtgi.audio.aec import EchoCanceller


class EchoFront:
    """One session's canceller; calls are serialised, so the adaptive filter sees the stream in order."""

    def __init__(self) -> None:
        self._aec: EchoCanceller | None = None
        self._lock = asyncio.Lock()

    async def process(self, mic: np.ndarray, reference: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        """The microphone with the echo of ``reference`` removed (whole 10 ms frames)."""
        async with self._lock:
            if self._aec is None or self._aec.sample_rate_hz != sample_rate_hz:
                self._aec = EchoCanceller(sample_rate_hz)
            return await asyncio.to_thread(self._aec.process, mic, reference)
