"""The ASR stage: client PCM -> VAD -> streaming whisper -> speech events and transcripts.

All model work (VAD, whisper) runs on one worker thread per session; the event loop only
moves audio and events. Audio that arrives while a decode runs is batched into the next
step, so a slow decode never grows a backlog of tiny steps.

Barge-in needs speech *start* fast, but a step may also decode a partial (hundreds of ms).
So the worker checks the VAD after inserting each chunk and reports a rising edge to the
loop at once (``call_soon_threadsafe``), before any decoding in the same step.

Latency marks: the stage remembers when each input chunk arrived, so the positions in the
audio stream that the transcriber reports (speech end, endpoint) map back to wall-clock
times. With real-time input, "speech end" is when the user's last word reached the daemon.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from edge_rtgi import frames as F
from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.asr.events import AsrEvent, FinalTranscript, PartialTranscript, SpeechEnded
from edge_rtgi.asr.streaming import SAMPLE_RATE_HZ, StreamingTranscriber
from edge_rtgi.asr.vad import SileroVad
from edge_rtgi.asr.whisper import WhisperAsr
from edge_rtgi.audio.pcm import Resampler
from edge_rtgi.pipeline.stage import AsrContext, Stage

if TYPE_CHECKING:
    from edge_rtgi.pipeline.session import SessionSettings


class _ArrivalClock:
    """Maps a sample index of the 16 kHz stream to the time its chunk arrived."""

    def __init__(self, keep: int = 4096):
        self._ends: deque[int] = deque(maxlen=keep)
        self._times: deque[float] = deque(maxlen=keep)

    def add(self, end_index: int, t_s: float) -> None:
        self._ends.append(end_index)
        self._times.append(t_s)

    def time_of(self, index: int) -> float | None:
        if not self._ends:
            return None
        i = bisect.bisect_left(list(self._ends), index)
        return self._times[min(i, len(self._times) - 1)]


AsrInput = F.AudioIn | F.CommitAudio | F.ClearAudio


class AsrStage(Stage[AsrInput]):
    name = "asr"

    def __init__(self, ctx: AsrContext, config: AsrConfig, whisper: WhisperAsr, inbox_frames: int):
        super().__init__(ctx, inbox_frames)
        self.ctx: AsrContext = ctx
        self.config = config
        self.whisper = whisper
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="asr")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resampler: Resampler | None = None
        self._turns: dict[int, int] = {}  # transcriber utterance id -> session turn id
        self._early_turn: int | None = None  # turn announced by the rising edge, not yet mapped
        self._held: list[str] = []  # manual turn detection: finals waiting for the commit
        self._held_timing: F.Transcript | None = None
        self._speech_ended: dict[int, SpeechEnded] = {}
        self._new_transcriber()

    def _new_transcriber(self) -> None:
        s, vad_cfg = self.ctx.settings, self.config.vad
        vad_cfg = dataclasses.replace(
            vad_cfg,
            threshold=vad_cfg.threshold if s.vad_threshold is None else s.vad_threshold,
            min_silence_ms=vad_cfg.min_silence_ms if s.vad_min_silence_ms is None else s.vad_min_silence_ms,
            speech_pad_ms=vad_cfg.speech_pad_ms
            if s.vad_prefix_padding_ms is None
            else s.vad_prefix_padding_ms,
        )
        cfg = dataclasses.replace(self.config, vad=vad_cfg)
        self.transcriber = StreamingTranscriber(self.whisper, cfg, SileroVad(vad_cfg))
        self.clock = _ArrivalClock()
        self._in_speech = False

    def apply_settings(self, settings: SessionSettings) -> None:
        """New VAD settings: a fresh transcriber, queued behind the steps already running (it
        reads ``settings`` through the context, which already holds them)."""
        if self._loop is not None and not self._in_speech:
            self._loop.run_in_executor(self._executor, self._new_transcriber)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await super().start()

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ event loop side

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            frames = [await self.inbox.get()]
            while not self.inbox.empty():
                frames.append(self.inbox.get_nowait())
            try:
                await self._batch(loop, frames)
            except Exception as exc:  # noqa: BLE001 - a failed decode loses one step, not the session
                self.ctx.stage_failed(self, frames[-1], exc)

    async def _batch(self, loop: asyncio.AbstractEventLoop, frames: list[AsrInput]) -> None:
        chunks: list[tuple[np.ndarray, float]] = []
        for frame in frames:
            if isinstance(frame, F.AudioIn):
                chunks.append((self._to_16k(frame), frame.arrival_t_s))
            elif isinstance(frame, F.ClearAudio):
                chunks.clear()
                await loop.run_in_executor(self._executor, self._new_transcriber)
                self._held.clear()
            elif isinstance(frame, F.CommitAudio):
                events = await loop.run_in_executor(self._executor, self._step, chunks, True)
                chunks = []
                await self._handle_events(events, committed=True)
                await self.ctx.emit(F.AudioCommitted())
        if chunks:
            events = await loop.run_in_executor(self._executor, self._step, chunks, False)
            await self._handle_events(events, committed=False)

    def _to_16k(self, frame: F.AudioIn) -> np.ndarray:
        samples = frame.pcm.astype(np.float32) / 32768.0
        if frame.sample_rate_hz != SAMPLE_RATE_HZ:
            if self._resampler is None or self._resampler.src_rate_hz != frame.sample_rate_hz:
                self._resampler = Resampler(frame.sample_rate_hz, SAMPLE_RATE_HZ)
            samples = self._resampler.process(samples)
        return samples

    def _rising_edge(self, audio_ms: int, t_s: float) -> None:
        """On the loop: user speech started. Control path, ahead of any queued data."""
        self._early_turn = self.ctx.new_turn_id()
        self.ctx.on_speech_started(F.SpeechStarted(self._early_turn, audio_ms, t_s=t_s))

    async def _handle_events(self, events: list[AsrEvent], committed: bool) -> None:
        partials = self.ctx.settings.partials is not False
        for ev in events:
            if isinstance(ev, F.SpeechStarted):  # the transcriber's: turn_id is its utterance id
                turn = self._early_turn if self._early_turn is not None else self.ctx.new_turn_id()
                self._early_turn = None
                self._turns[ev.turn_id] = turn
            elif isinstance(ev, PartialTranscript) and partials:
                await self.ctx.emit(
                    F.Transcript(
                        self._turn(ev.utterance_id),
                        ev.text,
                        final=False,
                        t_s=ev.t_s,
                        committed_text=ev.committed_text,
                    )
                )
            elif isinstance(ev, SpeechEnded):
                self._speech_ended[ev.utterance_id] = ev
                self.ctx.on_speech_stopped(
                    F.SpeechStopped(
                        self._turn(ev.utterance_id), int(ev.speech_end_audio_s * 1000), t_s=ev.t_s
                    )
                )
            elif isinstance(ev, FinalTranscript):
                await self._final(ev)
        for ev in events:  # a VAD turn that held no words still ends with an (empty) final
            if (
                isinstance(ev, SpeechEnded)
                and self._speech_ended.pop(ev.utterance_id, None) is not None
                and self.ctx.settings.turn_detection
            ):
                turn = self._pop_turn(ev.utterance_id)
                await self.ctx.on_final_transcript(F.Transcript(turn, "", final=True, t_s=ev.t_s))
        if committed and self._held:
            await self._release_held()

    async def _final(self, ev: FinalTranscript) -> None:
        turn = self._pop_turn(ev.utterance_id)
        self._speech_ended.pop(ev.utterance_id, None)
        final = F.Transcript(
            turn,
            ev.text,
            final=True,
            language=ev.language,
            t_s=ev.t_s,
            speech_end_t_s=self.clock.time_of(int(ev.speech_end_audio_s * SAMPLE_RATE_HZ)),
            endpoint_t_s=self.clock.time_of(int(ev.endpoint_audio_s * SAMPLE_RATE_HZ)),
        )
        if self.ctx.settings.turn_detection:
            await self.ctx.on_final_transcript(final)
        else:  # manual turns: hold VAD-split pieces until the client commits
            self._held.append(ev.text)
            self._held_timing = final

    async def _release_held(self) -> None:
        if self._held_timing is None:  # _final sets both together
            raise RuntimeError("held ASR finals without their timing")
        text = " ".join(self._held)
        timing = dataclasses.replace(self._held_timing, text=text, t_s=F.now_s())
        self._held.clear()
        await self.ctx.on_final_transcript(timing)

    def _pop_turn(self, utterance_id: int) -> int:
        """The session turn of a finished utterance (a new one if it was never announced)."""
        turn = self._turns.pop(utterance_id, None)
        return turn if turn is not None else self.ctx.new_turn_id()

    def _turn(self, utterance_id: int) -> int:
        if utterance_id not in self._turns:
            self._turns[utterance_id] = self.ctx.new_turn_id()
        return self._turns[utterance_id]

    # ------------------------------------------------------------------ worker thread side

    def _step(self, chunks: list[tuple[np.ndarray, float]], commit: bool) -> list[AsrEvent]:
        tr, loop = self.transcriber, self._loop
        if loop is None:
            raise RuntimeError("the ASR stage steps only after start()")
        events: list[AsrEvent] = []
        for samples, arrival_t_s in chunks:
            tr.insert_audio(samples)
            total = int(round(tr.audio_s * SAMPLE_RATE_HZ))
            self.clock.add(total, arrival_t_s)
            if tr.vad.in_speech and not self._in_speech:
                audio_ms = int(tr.audio_s * 1000)
                loop.call_soon_threadsafe(self._rising_edge, audio_ms, F.now_s())
            self._in_speech = tr.vad.in_speech
            if tr.split_due:  # after a stall: cut long speech before the ring forgets where it began
                events.extend(tr.process_iter())
        if commit:
            tr.commit()
            self._in_speech = False
        events.extend(tr.process_iter())
        # As in AsrSession: on a slow or shared CPU, back-to-back partial decodes keep this
        # worker busy when speech ends, and the (speculative) final then waits behind a stale
        # partial. Space partials so they take at most 1/factor of real time.
        tr.partial_interval_samples = int(
            tr.config.partial_interval_factor * tr.last_partial_decode_s * SAMPLE_RATE_HZ
        )
        return events
