"""The TTS stage: text deltas -> speakable clauses -> PCM chunks, per response.

The first clause is synthesised as soon as the segmenter releases it, while the engine is
still generating the rest. Synthesis runs on a worker thread (``synthesize_async``);
cancelling a response stops it after the sentence in progress and drops the rest.

A response's first clause is synthesised as foreground work (``edge_rtgi.cpu_priority``):
the engine holds its decode steps until that audio exists, instead of taking CPU from it
(measured: docs/daemon.md).
"""

from __future__ import annotations

import contextlib

import numpy as np

from edge_rtgi import frames as F
from edge_rtgi.audio.pcm import Resampler
from edge_rtgi.cpu_priority import FOREGROUND
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.config import TtsStageConfig
from edge_rtgi.pipeline.stage import Stage, StageContext
from edge_rtgi.tts import ClauseSegmenter, TtsEngine, check_text, synthesize_async


class TtsStage(Stage[F.TextDelta | F.TextDone]):
    name = "tts"

    def __init__(self, ctx: StageContext, config: TtsStageConfig, voice: TtsEngine, inbox_frames: int):
        super().__init__(ctx, inbox_frames)
        self.config = config
        self.voice = voice
        self.voice_rate_hz: int = voice.sample_rate_hz
        self._segmenters: dict[str, ClauseSegmenter] = {}
        self._resamplers: dict[str, Resampler] = {}
        self._first_spoken: set[str] = set()  # responses whose first clause has been started

    def cancel(self, response_id: str) -> None:
        self._segmenters.pop(response_id, None)
        self._resamplers.pop(response_id, None)
        self._first_spoken.discard(response_id)
        super().cancel(response_id)

    async def handle(self, frame: F.TextDelta | F.TextDone) -> None:
        rid = frame.response_id
        seg = self._segmenters.get(rid)
        if seg is None:
            seg = self._segmenters[rid] = ClauseSegmenter(
                self.config.first_clause_min_words,
                first_break_after_words=self.config.first_break_after_words,
            )
        if isinstance(frame, F.TextDelta):
            clauses, done = seg.push(frame.delta), False
        else:
            clauses, done = seg.flush(), True
        for clause in clauses:
            await self._speak(rid, clause)
        if done:
            self._segmenters.pop(rid, None)
            self._first_spoken.discard(rid)
            tail = self._resamplers.pop(rid, None)
            if tail is not None:
                rest = tail.flush()
                if len(rest):
                    await self.ctx.forward(self, F.AudioOut(rid, _to_int16(rest), tail.dst_rate_hz))
            await self.ctx.forward(self, F.AudioDone(rid))

    async def _speak(self, rid: str, clause: str) -> None:
        try:
            check_text(clause)
        except EdgeRtgiError:
            return  # punctuation or markup only: nothing to say
        self.ctx.note(rid, "first_clause", F.now_s())
        out_rate = self.ctx.settings.output_sample_rate_hz or self.voice_rate_hz
        with contextlib.ExitStack() as critical:
            if rid not in self._first_spoken:
                self._first_spoken.add(rid)
                critical.enter_context(FOREGROUND.foreground())
            async for pcm in synthesize_async(self.voice, clause):
                critical.close()  # the first audio exists; sending it is not CPU work
                self.ctx.note(rid, "first_audio", F.now_s())
                if out_rate != self.voice_rate_hz:
                    rs = self._resamplers.setdefault(rid, Resampler(self.voice_rate_hz, out_rate))
                    pcm = _to_int16(rs.process(pcm.astype(np.float32) / 32768.0))
                    if not len(pcm):
                        continue
                await self.ctx.forward(self, F.AudioOut(rid, pcm, out_rate))


def _to_int16(samples: np.ndarray) -> np.ndarray:
    if samples.dtype == np.int16:
        return samples
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype(np.int16)
