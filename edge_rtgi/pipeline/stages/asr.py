"""The ASR stage: client PCM -> VAD -> streaming whisper -> speech events and transcripts.

All model work (VAD, whisper) runs on one worker thread per session; the event loop only
moves audio and events. Audio that arrives while a decode runs is batched into the next
step, so a slow decode never grows a backlog of tiny steps.

Barge-in needs speech *start* fast, but a step may also decode a partial (hundreds of ms).
So the worker checks the VAD after inserting each chunk and reports a rising edge to the
loop at once (``call_soon_threadsafe``), before any decoding in the same step.

Turn detection (``edge_rtgi.asr.turn``): in semantic mode the VAD's silence timer is the cap
and the transcriber asks the smart-turn model, on this same worker thread, whether a pause ends
the turn. The model comes from the shared resources; when it cannot be loaded the stage runs
on the silence timer alone and says so in ``turn_status`` (sent in ``session.created``).

Barge-in in semantic mode: speech that starts over a reply does not cut it at once. It cuts it
once it has lasted ``barge_in_min_speech_ms`` (unless the words heard so far are a backchannel's:
then at ``barge_in_max_speech_ms``), at a pause whose decoded words are not a backchannel's,
or when its final turns out to be more than a backchannel
("mm-hm", "yes"); a backchannel's final is shown to the client but is not a turn. Such speech
is decoded with the talkover prompt (``TurnDetectionConfig.talkover_prompt``).

Latency marks: the stage remembers when each input chunk arrived, so the positions in the
audio stream that the transcriber reports (speech end, endpoint) map back to wall-clock
times. With real-time input, "speech end" is when the user's last word reached the daemon.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edge_rtgi import frames as F
from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.asr.events import (
    AsrEvent,
    FinalTranscript,
    PartialTranscript,
    SpeechEnded,
    TurnLikelyEnded,
    TurnResumed,
)
from edge_rtgi.asr.streaming import SAMPLE_RATE_HZ, StreamingTranscriber
from edge_rtgi.asr.turn import (
    SemanticEndpointer,
    TalkoverMeter,
    TurnDetectionConfig,
    TurnModelLoad,
    TurnStatus,
    is_backchannel,
    talkover_cuts,
)
from edge_rtgi.asr.vad import SileroVad
from edge_rtgi.asr.whisper import Transcriber
from edge_rtgi.audio.pcm import Resampler
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.stage import AsrContext, Stage

if TYPE_CHECKING:
    from edge_rtgi.pipeline.session import SessionSettings

log = logging.getLogger(__name__)


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


class TurnModelSource(Protocol):
    """Where the stage gets the shared smart-turn model (``Resources``); blocking."""

    def turn_model(self, name: str) -> TurnModelLoad: ...


class AsrStage(Stage[AsrInput]):
    name = "asr"

    def __init__(
        self,
        ctx: AsrContext,
        config: AsrConfig,
        whisper: Transcriber,
        inbox_frames: int,
        turn_models: TurnModelSource | None = None,
    ):
        super().__init__(ctx, inbox_frames)
        self._turn_models = turn_models
        self.turn_status: TurnStatus | None = None
        self._endpointer: SemanticEndpointer | None = None
        self._turn_cfg = config.turn_detection
        self.transcriber: StreamingTranscriber | None = None
        # semantic barge-in: the turn that started over a reply and has not cut it yet, and
        # (worker side) where its speech began
        self._talkover_turn: int | None = None
        self._talkover: TalkoverMeter | None = None
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
        turn = self._effective_turn()
        status, endpointer = self._turn_setup(turn, vad_cfg.min_silence_ms)
        vad_cfg = dataclasses.replace(vad_cfg, min_silence_ms=status.silence_ms)
        cfg = dataclasses.replace(self.config, vad=vad_cfg)
        old = self.transcriber
        self.transcriber = StreamingTranscriber(
            self.whisper, cfg, SileroVad(vad_cfg), endpointer, likely_ends=turn.preemptive_reply
        )
        if old is not None:
            old.close()
        self._turn_cfg, self._endpointer, self.turn_status = turn, endpointer, status
        self.clock = _ArrivalClock()
        self._in_speech = False
        self._talkover = None

    def _effective_turn(self) -> TurnDetectionConfig:
        try:
            return self.ctx.settings.turn_config(self.config.turn_detection)
        except ValueError:  # the session refuses such settings before they get here
            return self.config.turn_detection

    def _turn_setup(
        self, turn: TurnDetectionConfig, vad_min_silence_ms: int
    ) -> tuple[TurnStatus, SemanticEndpointer | None]:
        """What ends a pause: the model with its silence cap, or the silence timer alone (also
        when the model cannot be had: then ``fallback`` says why)."""
        if turn.mode != "semantic":
            return TurnStatus("silence", turn.mode, turn.silence_ms(vad_min_silence_ms)), None
        load = (
            self._turn_models.turn_model(turn.model)
            if self._turn_models is not None
            else TurnModelLoad(None, "no model source in this process")
        )
        if load.model is None:
            fallback = TurnStatus("silence", "semantic", vad_min_silence_ms, fallback=load.error)
            return fallback, None
        endpointer = SemanticEndpointer.from_config(load.model, turn)
        status = TurnStatus(
            "semantic",
            "semantic",
            turn.semantic_max_ms,
            check_ms=turn.semantic_min_ms,
            threshold=turn.threshold,
            model=turn.model,
            text_check=turn.text_check,
            fragment_hold_ms=turn.fragment_hold_ms if turn.text_check else None,
            continuation_hold_ms=turn.continuation_hold_ms if turn.text_check else None,
            recheck_ms=turn.recheck_ms,
        )
        return status, endpointer

    def apply_settings(self, settings: SessionSettings) -> None:
        """New VAD or turn settings: a fresh transcriber, queued behind the steps already running
        (it reads ``settings`` through the context, which already holds them; loading the turn
        model, if that is new, happens there too, off the event loop)."""
        if self._loop is not None and not self._in_speech:
            self._loop.run_in_executor(self._executor, self._new_transcriber)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await super().start()

    async def close(self) -> None:
        await super().close()
        self.whisper.detach()  # a decode still queued in the shared engine frees its slot now
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.transcriber is not None:
            self.transcriber.close()

    # ------------------------------------------------------------------ event loop side

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            frames = [await self.inbox.get()]
            while not self.inbox.empty():
                frames.append(self.inbox.get_nowait())
            try:
                await self._batch(loop, frames)
            except EdgeRtgiError as exc:  # a step we cannot serve: said to the client, no traceback
                log.info("stage %s refused a step: %.200s", self.name, exc.message)
                self.ctx.stage_failed(self, frames[-1], exc)
            except Exception as exc:  # a failed decode loses one step, not the session
                # a bug of ours: the operator gets the traceback (stage_failed tells the client
                # without internals), as every other stage does
                log.exception("stage %s failed on a step of %d frames", self.name, len(frames))
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

    def _rising_edge(
        self, audio_ms: int, t_s: float, transcriber: StreamingTranscriber, utterance_id: int | None
    ) -> None:
        """On the loop: user speech started. Control path, ahead of any queued data.

        Over a reply, in semantic mode, the barge-in waits: a backchannel must not cut it, and
        the speech is decoded with the talkover prompt, so that whisper writes a backchannel as one."""
        self._early_turn = self.ctx.new_turn_id()
        defer = self._endpointer is not None and self.ctx.reply_active(t_s)
        self._talkover_turn = self._early_turn if defer else None
        prompt = self._turn_cfg.talkover_prompt
        english = not transcriber.asr.multilingual or transcriber.config.language == "en"
        if defer and prompt and english and utterance_id is not None:
            transcriber.prompt_utterance(utterance_id, prompt)
        self.ctx.on_speech_started(F.SpeechStarted(self._early_turn, audio_ms, t_s=t_s), barge_in=not defer)

    def _talkover_long(self, t_s: float) -> None:
        """On the loop: speech over a reply has gone on past a backchannel's length."""
        if self._talkover_turn is not None:
            self._talkover_turn = None
            self.ctx.confirm_barge_in(t_s)

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
            elif isinstance(ev, TurnLikelyEnded):
                # not over a reply (_talkover_turn): such speech may be a backchannel
                preempt = self._turn_cfg.preemptive_reply and self.ctx.settings.turn_detection
                if preempt and self._talkover_turn is None:
                    await self.ctx.on_likely_final(self._turn(ev.utterance_id), ev.text)
            elif isinstance(ev, TurnResumed):
                self.ctx.drop_likely_final(self._turn(ev.utterance_id))
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
        ended = self._speech_ended.pop(ev.utterance_id, None)
        backchannel = False
        if self._talkover_turn is not None and self._talkover_turn == turn:
            self._talkover_turn = None
            backchannel = is_backchannel(ev.text)
            if not backchannel:  # the user is taking the turn after all
                self.ctx.confirm_barge_in(F.now_s())
        endpoint_t_s = (
            ev.decided_t_s
            if ev.decided_t_s is not None
            else self.clock.time_of(int(ev.endpoint_audio_s * SAMPLE_RATE_HZ))
        )
        final = F.Transcript(
            turn,
            ev.text,
            final=True,
            language=ev.language,
            t_s=ev.t_s,
            speech_end_t_s=self.clock.time_of(int(ev.speech_end_audio_s * SAMPLE_RATE_HZ)),
            endpoint_t_s=endpoint_t_s,
            turn_decision_ms=ev.turn_decision_ms,
            asr_queue_ms=ev.final_queue_ms,
            asr_decode_ms=round(ev.final_decode_ms, 1),
            end_reason=ended.reason if ended is not None else None,
            backchannel=backchannel,
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
        if tr is None:
            raise RuntimeError("the ASR stage has no transcriber")
        if loop is None:
            raise RuntimeError("the ASR stage steps only after start()")
        events: list[AsrEvent] = []
        for samples, arrival_t_s in chunks:
            tr.insert_audio(samples)
            total = int(round(tr.audio_s * SAMPLE_RATE_HZ))
            self.clock.add(total, arrival_t_s)
            if tr.vad.in_speech and not self._in_speech:
                audio_ms = int(tr.audio_s * 1000)
                loop.call_soon_threadsafe(self._rising_edge, audio_ms, F.now_s(), tr, tr.active_utterance_id)
                self._talkover = TalkoverMeter(total)
            elif not tr.vad.in_speech:
                self._talkover = None
            elif self._talkover is not None and self._endpointer is not None:
                turn_cfg = self._turn_cfg
                heard = self._talkover.heard_samples(total, tr.vad.silence_start_index)
                if talkover_cuts(
                    heard * 1000 // SAMPLE_RATE_HZ,
                    tr.heard_text,
                    tr.decode_pending,
                    turn_cfg.barge_in_min_speech_ms,
                    turn_cfg.barge_in_max_speech_ms,
                    tr.pause_words,
                ):
                    # once per utterance; the loop ignores it unless the speech is over a reply
                    self._talkover = None
                    loop.call_soon_threadsafe(self._talkover_long, F.now_s())
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
