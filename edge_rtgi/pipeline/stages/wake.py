"""The wake-word gate: client audio reaches ASR only after the wake word was heard.

While the gate is closed, every chunk goes to a ``WakeWordDetector`` (on this stage's worker
thread; the event loop only moves frames) and nothing reaches ASR, so neither VAD nor
whisper runs, and the device's own voice cannot barge in. On a detection the session is
told at once (``WakeDetected``, on the control path) and the chunks after the detecting one
go to ASR. The gate closes again when the user's utterance ends (the ASR stage's speech
stop, which the session passes on), or when ``listen_timeout_ms`` of audio went through
without speech starting; closing resets the detector, so the words just spoken cannot wake
it a second time.

Commits and clears always pass, in order with the audio. The ASR stage sees only the audio
that passed the gate, so the positions in its events count that audio.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from edge_rtgi import frames as F
from edge_rtgi.asr.wakeword import SAMPLE_RATE_HZ, WakeDetection, WakeWordDetector
from edge_rtgi.audio.pcm import Resampler, float32_to_pcm16, pcm16_to_float32
from edge_rtgi.pipeline.config import WakeStageConfig
from edge_rtgi.pipeline.stage import Stage, StageContext

WakeInput = F.AudioIn | F.CommitAudio | F.ClearAudio


class WakeContext(StageContext, Protocol):
    """What the wake stage also asks of its session: the control path for a detection."""

    def on_wake_detected(self, event: F.WakeDetected) -> None: ...


class WakeStage(Stage[WakeInput]):
    name = "wake"

    def __init__(self, ctx: WakeContext, config: WakeStageConfig, inbox_frames: int):
        super().__init__(ctx, inbox_frames)
        self.ctx: WakeContext = ctx
        self.config = config
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="wake")
        self._detector: WakeWordDetector | None = None
        self._resampler: Resampler | None = None
        self.is_open = False  # audio goes to ASR
        self._speaking = False  # ASR heard speech since the gate opened
        self._quiet_ms = 0.0  # audio passed since the gate opened, while nobody spoke
        self._stream_ms = 0.0  # all audio seen, passed or not

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self._detector = await loop.run_in_executor(
            self._executor, WakeWordDetector, [cfg.model], cfg.refractory_ms, cfg.probability_cutoff
        )
        await super().start()

    async def close(self) -> None:
        await super().close()
        detector = self._detector
        if detector is not None:  # after the last scan: the executor runs one job at a time
            self._executor.submit(detector.close)
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ called by the session

    def speech_started(self) -> None:
        """ASR heard the user: keep the gate open until the utterance ends."""
        if self.is_open:
            self._speaking = True

    def speech_stopped(self) -> None:
        """The utterance ended: close the gate and listen for the wake word again."""
        self._close_gate()

    # ------------------------------------------------------------------ the worker

    async def _run(self) -> None:
        while True:
            frames = [await self.inbox.get()]
            while not self.inbox.empty():
                frames.append(self.inbox.get_nowait())
            try:
                await self._batch(frames)
            except Exception as exc:  # noqa: BLE001 - one failed step loses audio, not the session
                self.ctx.stage_failed(self, frames[-1], exc)

    async def _batch(self, frames: list[WakeInput]) -> None:
        loop = asyncio.get_running_loop()
        i = 0
        while i < len(frames):
            frame = frames[i]
            if not isinstance(frame, F.AudioIn):
                await self.ctx.forward(self, frame)
                i += 1
            elif self.is_open:
                await self._pass(frame)
                i += 1
            else:  # scan the run of chunks up to the next commit or clear in one worker call
                j = i
                while j < len(frames) and isinstance(frames[j], F.AudioIn):
                    j += 1
                run = [f for f in frames[i:j] if isinstance(f, F.AudioIn)]
                hit = await loop.run_in_executor(self._executor, self._scan, run, self._stream_ms)
                if hit is None:
                    self._stream_ms += sum(_duration_ms(f) for f in run)
                    i = j
                    continue
                index, detection, at_ms = hit
                self._stream_ms += sum(_duration_ms(f) for f in run[: index + 1])
                self._open_gate(detection, at_ms)
                i += index + 1

    def _open_gate(self, detection: WakeDetection, at_ms: float) -> None:
        self.is_open, self._speaking, self._quiet_ms = True, False, 0.0
        self.ctx.on_wake_detected(F.WakeDetected(detection.name, detection.phrase, int(at_ms)))

    def _close_gate(self) -> None:
        if not self.is_open:
            return
        self.is_open = False
        self._executor.submit(self._reset_scanner)  # queued behind any scan in flight

    async def _pass(self, frame: F.AudioIn) -> None:
        duration_ms = _duration_ms(frame)
        self._stream_ms += duration_ms
        await self.ctx.forward(self, frame)
        if not self._speaking:
            self._quiet_ms += duration_ms
            if self._quiet_ms >= self.config.listen_timeout_ms:
                self._close_gate()  # woken, but nobody asked anything

    def _scan(self, run: list[F.AudioIn], stream_ms: float) -> tuple[int, WakeDetection, float] | None:
        """On the worker thread: the first chunk of ``run`` that completes a detection."""
        detector = self._detector
        if detector is None:
            raise RuntimeError("the wake stage scans only after start()")
        for index, frame in enumerate(run):
            found = detector.process(self._to_16k(frame))
            stream_ms += _duration_ms(frame)
            if found:
                return index, found[0], stream_ms
        return None

    def _reset_scanner(self) -> None:
        """On the worker thread: a fresh detector state and resampler for the next stream."""
        self._resampler = None
        if self._detector is not None:
            self._detector.reset()

    def _to_16k(self, frame: F.AudioIn) -> np.ndarray:
        if frame.sample_rate_hz == SAMPLE_RATE_HZ:
            return frame.pcm
        if self._resampler is None or self._resampler.src_rate_hz != frame.sample_rate_hz:
            self._resampler = Resampler(frame.sample_rate_hz, SAMPLE_RATE_HZ)
        return float32_to_pcm16(self._resampler.process(pcm16_to_float32(frame.pcm)))


def _duration_ms(frame: F.AudioIn) -> float:
    return 1000.0 * len(frame.pcm) / frame.sample_rate_hz
