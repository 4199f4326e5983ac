"""The protocol-neutral session core: one conversation driven by typed calls and events.

A protocol adapter (the native WebSocket protocol, the OpenAI Realtime adapter, the
in-process CLI) does only two things:

- calls the input methods: ``push_audio``, ``commit_audio``, ``clear_audio``,
  ``add_user_text``, ``create_response``, ``cancel_response``, ``update``;
- reads ``next_event()`` (or ``async for event in session.events()``) and writes each
  typed event from ``edge_rtgi.frames`` in its own wire format.

Inside, the stages of the pipeline run as workers joined by bounded queues
([wake gate ->] ASR -> assistant|translate -> TTS -> outbox); microphone audio sent with an
echo reference is echo-cancelled first (``edge_rtgi.pipeline.echo``). The session owns the state that spans
stages: the conversation, the responses in flight with their latency marks, barge-in,
and clean shutdown (a closed session aborts its engine requests and frees their KV blocks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from edge_rtgi import frames as F
from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.asr.turn import TurnDetectionConfig, TurnDetectionUpdate, TurnStatus
from edge_rtgi.config import from_dict
from edge_rtgi.errors import BackendError, ConfigError, EdgeRtgiError, RequestError
from edge_rtgi.pipeline.config import AssistantStageConfig, PipelineConfig, TranslateStageConfig
from edge_rtgi.pipeline.echo import EchoFront
from edge_rtgi.pipeline.outbox import Outbox
from edge_rtgi.pipeline.responses import ResponseState
from edge_rtgi.pipeline.stage import Stage

if TYPE_CHECKING:
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.pipeline.stages.wake import WakeStage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionSettings:
    """What a client may set per session (``session.update``). ``None`` means the pipeline's own."""

    pipeline: str | None = None
    input_sample_rate_hz: int | None = None  # None: the pipeline's input rate
    output_sample_rate_hz: int | None = None  # None: the voice's own rate
    turn_detection: bool = True  # VAD ends turns; False: the client commits each turn
    auto_response: bool = True  # respond to each final transcript without being asked
    barge_in: bool | None = None  # None: on for assistants, off for translation
    audio_output: bool = True
    partials: bool | None = None
    system_prompt: str | None = None
    max_reply_tokens: int | None = None
    temperature: float | None = None
    vad_threshold: float | None = None
    vad_min_silence_ms: int | None = None
    vad_prefix_padding_ms: int | None = None
    # How a pause ends the turn (edge_rtgi.asr.turn); on the native wire also as one object,
    # ``turn_detection: {mode, min_silence_ms, max_silence_ms, threshold, text_check, recheck_ms,
    # talkover_prompt, preemptive_reply, question_recheck_ms}``.
    turn_mode: str | None = None
    turn_min_silence_ms: int | None = None
    turn_max_silence_ms: int | None = None
    turn_threshold: float | None = None
    turn_text_check: bool | None = None
    turn_recheck_ms: int | None = None
    turn_talkover_prompt: str | None = None
    turn_preemptive_reply: bool | None = None
    turn_question_recheck_ms: int | None = None
    # each microphone chunk comes with the audio being played (stereo on the native protocol)
    echo_reference: bool = False

    def __post_init__(self) -> None:
        for name in ("input_sample_rate_hz", "output_sample_rate_hz"):
            rate = getattr(self, name)
            if rate is not None and not 8000 <= rate <= 48000:
                raise ValueError(f"{name} must be in [8000, 48000], got {rate}")
        if self.max_reply_tokens is not None and not 1 <= self.max_reply_tokens <= 4096:
            raise ValueError(f"max_reply_tokens must be in [1, 4096], got {self.max_reply_tokens}")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if self.vad_threshold is not None and not 0.0 < self.vad_threshold < 1.0:
            raise ValueError(f"vad_threshold must be in (0, 1), got {self.vad_threshold}")
        # refused here: the VAD would only fail later, in the background, for good
        for name, low in (("vad_min_silence_ms", 50), ("vad_prefix_padding_ms", 0)):
            ms = getattr(self, name)
            if ms is not None and not low <= ms <= 10_000:
                raise ValueError(f"{name} must be in [{low}, 10000] ms, got {ms}")
        TurnDetectionUpdate(
            self.turn_mode,
            self.turn_min_silence_ms,
            self.turn_max_silence_ms,
            self.turn_threshold,
            recheck_ms=self.turn_recheck_ms,
            talkover_prompt=self.turn_talkover_prompt,
            question_recheck_ms=self.turn_question_recheck_ms,
        )

    def turn_config(self, pipeline: TurnDetectionConfig) -> TurnDetectionConfig:
        """The pipeline's turn detection with these settings on top (ValueError names the key)."""
        return pipeline.with_overrides(
            self.turn_mode,
            self.turn_min_silence_ms,
            self.turn_max_silence_ms,
            self.turn_threshold,
            self.turn_text_check,
            self.turn_recheck_ms,
            self.turn_talkover_prompt,
            self.turn_preemptive_reply,
            self.turn_question_recheck_ms,
        )

    def merged(self, changes: dict) -> SessionSettings:
        """These settings with ``changes`` applied strictly (unknown key -> ConfigError)."""
        base = {k: v for k, v in dataclasses.asdict(self).items()}
        changes = dict(changes)
        if isinstance(changes.get("turn_detection"), dict):
            # the object form: VAD turn detection stays on, with these settings
            update = from_dict(TurnDetectionUpdate, changes["turn_detection"], "session.turn_detection")
            changes["turn_detection"] = True
            for key in (
                "mode",
                "min_silence_ms",
                "max_silence_ms",
                "threshold",
                "text_check",
                "recheck_ms",
                "talkover_prompt",
                "preemptive_reply",
                "question_recheck_ms",
            ):
                if getattr(update, key) is not None:
                    changes[f"turn_{key}"] = getattr(update, key)
        checked = from_dict(SessionSettings, changes, "session")  # validates keys and types
        base.update({k: getattr(checked, k) for k in changes})
        return SessionSettings(**base)


@dataclass(frozen=True)
class TextTurn:
    """What ``add_user_text`` did: the turn, its history entry, and the response it started."""

    turn_id: int
    entry_id: int
    response_id: str | None


@dataclass(frozen=True)
class SessionLimits:
    """Bounds on per-session memory. ``history_turns``: the finished turns remembered (the oldest
    go first); the assistant sees as many of them as fit its context."""

    stage_queue_frames: int = 64
    outbox_events: int = 256
    history_turns: int = 64


_ids = itertools.count(1)


class Session:
    """One conversation over one pipeline. Create with ``await Session.open(...)``."""

    def __init__(
        self,
        pipelines: dict[str, PipelineConfig],
        resources: Resources,
        settings: SessionSettings,
        limits: SessionLimits,
        session_id: str | None = None,
    ):
        self.session_id = session_id or f"sess_{uuid.uuid4().hex[:12]}"
        self.pipelines = pipelines
        self.resources = resources
        self.limits = limits
        self.settings = settings
        self.pipeline = self._pick_pipeline(settings.pipeline)
        self.epoch_s = F.now_s()
        self.outbox = Outbox(limits.outbox_events)
        self._history: list[F.ChatTurn] = []  # finished turns, oldest first
        self._entry_ids = itertools.count(1)
        self.responses: dict[str, ResponseState] = {}
        self._cancelled: set[str] = set()
        # turn id -> the response started on that turn's likely final, held from the client
        self._guesses: dict[int, str] = {}
        self._turn_ids = itertools.count(1)
        self._stages: list[Stage[Any]] = []
        self._echo = EchoFront()
        self.closed = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(
        cls,
        pipelines: dict[str, PipelineConfig],
        resources: Resources,
        settings: SessionSettings | None = None,
        limits: SessionLimits | None = None,
        session_id: str | None = None,
    ) -> Session:
        """Build the stages (models come from the shared ``resources``) and start them."""
        session = cls(
            pipelines, resources, settings or SessionSettings(), limits or SessionLimits(), session_id
        )
        await session.start()
        return session

    async def start(self) -> None:
        """Build and start the stages and announce the session (``open`` does it for you).
        Closes what was started when it fails or is cancelled."""
        session = self
        try:
            session._check_turn(session.settings, session.pipeline)
            await session._build_stages()
        except BaseException:
            await asyncio.shield(session.close())
            raise
        session.outbox.put_control(
            F.SessionStarted(
                session_id=session.session_id,
                pipeline=session.pipeline.name,
                config=session.describe(),
                input_sample_rate_hz=session.input_sample_rate_hz,
                output_sample_rate_hz=session.output_sample_rate_hz,
            )
        )

    def _pick_pipeline(self, name: str | None) -> PipelineConfig:
        if name is None:
            name = next(iter(self.pipelines))
        if name not in self.pipelines:
            raise ConfigError(f"unknown pipeline {name!r}", hint=f"available: {', '.join(self.pipelines)}")
        return self.pipelines[name]

    async def _build_stages(self) -> None:
        from edge_rtgi.pipeline.build import build_stages  # stage modules import the models lazily

        self._stages = await build_stages(self, self.pipeline, self.resources)
        for stage in self._stages:
            await stage.start()

    async def close(self) -> None:
        """Cancel every response (aborting engine requests), stop the stages, end ``events()``."""
        if self.closed:
            return
        self.closed = True
        self._drop_guesses()
        for rid, st in list(self.responses.items()):
            if not st.finished:
                self.interrupt(rid, "session_closed")
        for stage in self._stages:
            await stage.close()
        self.outbox.close()

    # ------------------------------------------------------------------ properties

    @property
    def pipeline_name(self) -> str:
        return self.pipeline.name

    @property
    def turn_detection_status(self) -> dict[str, object] | None:
        """How pauses end turns in this session (the ASR stage's ``TurnStatus``), JSON-ready."""
        for stage in self._stages:
            status = getattr(stage, "turn_status", None)
            if isinstance(status, TurnStatus):
                return status.to_wire()
        return None

    @property
    def input_sample_rate_hz(self) -> int:
        return self.settings.input_sample_rate_hz or self.pipeline.input_sample_rate_hz

    @property
    def output_sample_rate_hz(self) -> int | None:
        if (
            not self.settings.audio_output
            or not self._stages
            or not hasattr(self._stages[-1], "voice_rate_hz")
        ):
            return None
        return self.settings.output_sample_rate_hz or self._stages[-1].voice_rate_hz

    @property
    def barge_in(self) -> bool:
        if self.settings.barge_in is not None:
            return self.settings.barge_in
        return isinstance(self.pipeline.text_stage, AssistantStageConfig)

    def describe(self) -> dict:
        """The effective settings, as sent in ``session.created`` / ``session.updated``."""
        d = {k: v for k, v in dataclasses.asdict(self.settings).items() if v is not None}
        d.update(
            pipeline=self.pipeline.name,
            input_sample_rate_hz=self.input_sample_rate_hz,
            output_sample_rate_hz=self.output_sample_rate_hz,
            barge_in=self.barge_in,
            stages=[type(s).__name__ for s in self._stages],
        )
        if (status := self.turn_detection_status) is not None:  # as the ASR stage could set it up
            d["turn_detection_status"] = status
        text = self.pipeline.text_stage
        if isinstance(text, TranslateStageConfig):
            d.update(
                source_language=text.source_language,
                target_language=text.target_language,
                translate_backend=text.backend,
            )
        return d

    def ms(self, t_s: float) -> int:
        """Milliseconds since the session started (the wire clock)."""
        return int(round((t_s - self.epoch_s) * 1000))

    # ------------------------------------------------------------------ history

    @property
    def history(self) -> tuple[F.ChatTurn, ...]:
        """The finished turns the assistant sees, oldest first."""
        return tuple(self._history)

    def remember(
        self,
        role: Literal["user", "assistant"],
        text: str,
        *,
        turn_id: int | None = None,
        response_id: str | None = None,
    ) -> int:
        """Append a finished turn to the history; returns its entry id (for ``revise``)."""
        entry_id = next(self._entry_ids)
        self._history.append(F.ChatTurn(entry_id, role, text, turn_id, response_id))
        excess = len(self._history) - self.limits.history_turns
        if excess > 0:  # unbounded, it grew memory and the cost of every turn
            del self._history[:excess]
        return entry_id

    def revise(self, entry_id: int, text: str | None) -> bool:
        """Replace a remembered turn's text, or forget the turn (``text`` None or empty).
        False when no such entry is remembered."""
        for i, turn in enumerate(self._history):
            if turn.entry_id == entry_id:
                if text:
                    self._history[i] = dataclasses.replace(turn, text=text)
                else:
                    del self._history[i]
                return True
        return False

    def find_entry(self, *, turn_id: int | None = None, response_id: str | None = None) -> int | None:
        """The entry id of the history turn recording user turn ``turn_id`` or response ``response_id``."""
        for turn in reversed(self._history):
            if (turn_id is not None and turn.turn_id == turn_id and turn.role == "user") or (
                response_id is not None and turn.response_id == response_id
            ):
                return turn.entry_id
        return None

    # ------------------------------------------------------------------ inputs

    async def push_audio(
        self, pcm: np.ndarray, sample_rate_hz: int | None = None, reference: np.ndarray | None = None
    ) -> None:
        """Mono int16 PCM from the user; waits when the first stage is behind (backpressure).

        ``reference``: the audio the client was playing while it recorded ``pcm`` (same length
        and rate); its echo is removed from ``pcm`` before anything else hears it.
        """
        if pcm.dtype != np.int16 or pcm.ndim != 1:
            raise RequestError("audio must be mono int16 PCM")
        rate = sample_rate_hz or self.input_sample_rate_hz
        if reference is not None:
            if reference.dtype != np.int16 or reference.shape != pcm.shape:
                raise RequestError(
                    "the echo reference must be int16 PCM as long as the microphone audio",
                    hint="send the played audio sample-aligned with the microphone",
                )
            pcm = await self._echo.process(pcm, reference, rate)
            if not len(pcm):
                return
        await self._input.inbox.put(F.AudioIn(pcm, rate))

    async def commit_audio(self) -> None:
        """End the user's turn now (manual turn detection)."""
        await self._input.inbox.put(F.CommitAudio())

    async def clear_audio(self) -> None:
        """Discard the audio of the turn in progress (and a reply started on its likely final)."""
        self._drop_guesses()
        await self._input.inbox.put(F.ClearAudio())

    async def add_user_text(self, text: str, respond: bool = True, echo: bool = True) -> TextTurn:
        """A typed user turn, remembered in the history; starts a response when ``respond``.

        ``echo`` sends it back as a final ``Transcript`` (the native protocol shows typed and
        spoken turns alike); the Realtime adapter has its own item for it and passes False.
        """
        text = text.strip()
        if not text:
            raise RequestError("text input is empty", hint="send some text")
        turn_id = next(self._turn_ids)
        if echo:
            await self.outbox.put(F.Transcript(turn_id=turn_id, text=text, final=True))
        entry_id = self.remember("user", text, turn_id=turn_id)
        response_id = None
        if respond and self.pipeline.text_stage is not None:
            response_id = await self.create_response(turn_id=turn_id, source_text=text)
        return TextTurn(turn_id, entry_id, response_id)

    async def create_response(
        self,
        turn_id: int | None = None,
        source_text: str | None = None,
        timing: F.Transcript | None = None,
        held: bool = False,
    ) -> str:
        """Start a response to the conversation so far (or to ``source_text`` for translation).

        ``held``: a response to ``source_text`` as the user's next turn, not yet in the history
        (``on_likely_final``); it runs, but nothing of it reaches the client until
        ``on_final_transcript`` confirms the words (or drops it unseen)."""
        text_stage = self.pipeline.text_stage
        if text_stage is None:
            raise RequestError(
                f"pipeline {self.pipeline.name!r} has no assistant or translate stage",
                hint="use a pipeline such as voice-assistant or translate-en-es",
            )
        if source_text is None:
            users = [turn.text for turn in self._history if turn.role == "user"]
            if not users:
                raise RequestError("nothing to respond to yet", hint="send audio or text first")
            source_text = users[-1]
        rid = f"resp_{next(_ids)}_{uuid.uuid4().hex[:6]}"
        kind: F.ResponseKind = "translation" if isinstance(text_stage, TranslateStageConfig) else "reply"
        st = ResponseState(rid, turn_id or 0, kind, source_text, timing=timing)
        self.responses[rid] = st
        self._forget_old_responses()
        history = tuple(self._history)
        if held:
            st.held = [(F.ResponseStarted(rid, st.turn_id, kind, source_text), False)]
            st.held_after_entry = self._last_entry_id()
            if kind == "reply":  # the history as remembering the turn would make it
                user = F.ChatTurn(-1, "user", source_text, st.turn_id, None)
                history = (history + (user,))[-self.limits.history_turns :]
        else:
            await self.outbox.put(F.ResponseStarted(rid, st.turn_id, kind, source_text))
        s = self.settings
        await self._stage_named("assistant", "translate").inbox.put(
            F.ResponseRequest(
                response_id=rid,
                turn_id=st.turn_id,
                source_text=source_text,
                messages=history,
                system_prompt=s.system_prompt,
                max_tokens=s.max_reply_tokens,
                temperature=s.temperature,
            )
        )
        return rid

    async def cancel_response(self, response_id: str | None = None, reason: str = "client_cancel") -> bool:
        """Cancel ``response_id`` (default: every active one); True if something was cancelled."""
        ids = [response_id] if response_id else [r for r, st in self.responses.items() if st.active()]
        return any([self.interrupt(rid, reason) for rid in ids])

    async def update(self, changes: dict) -> None:
        """Apply ``session.update`` settings; a pipeline change rebuilds the stages (keeps history)."""
        new = self.settings.merged(changes)
        self._check_turn(new, self._pick_pipeline(new.pipeline) if new.pipeline else self.pipeline)
        self._drop_guesses()  # started under the old settings (and the ASR stage may restart)
        if new.pipeline is not None and new.pipeline != self.pipeline.name:
            pipeline = self._pick_pipeline(new.pipeline)
            await self.cancel_response(reason="client_cancel")
            for stage in self._stages:
                await stage.close()
            self.settings, self.pipeline = new, pipeline
            await self._build_stages()
        else:
            self.settings = new
            for stage in self._stages:
                if hasattr(stage, "apply_settings"):
                    stage.apply_settings(new)
        self.outbox.put_control(F.SessionUpdated(self.describe()))

    @staticmethod
    def _check_turn(settings: SessionSettings, pipeline: PipelineConfig) -> None:
        """Refuse turn settings that do not fit the pipeline's own (a max below its min...)."""
        asr = next((s for s in pipeline.stages if isinstance(s, AsrConfig)), None)
        if asr is None:
            return
        try:
            settings.turn_config(asr.turn_detection)
        except ValueError as exc:
            raise ConfigError(
                f"session.turn_detection: {exc}", hint="min_silence_ms <= max_silence_ms, threshold in [0, 1]"
            ) from None

    # ------------------------------------------------------------------ control

    def interrupt(self, response_id: str, reason: str) -> bool:
        """Cancel one response in every stage now (pipecat-style control: no queue to wait in)."""
        st = self.responses.get(response_id)
        if st is None or response_id in self._cancelled or not st.active():
            return False
        if st.hidden:  # never the client's: nothing to tell it
            self._drop_held(response_id)
            return False
        self._cancelled.add(response_id)
        for stage in self._stages:
            stage.cancel(response_id)
        self.outbox.drop(response_id)
        now = F.now_s()
        self.outbox.put_control(F.ResponseInterrupted(response_id, reason, st.played_ms(now), t_s=now))
        if not st.done:
            st.done = True
            if st.kind == "reply" and st.text and not st.text_done:
                self.remember("assistant", st.text, response_id=response_id)
            status: F.ResponseStatus = "cancelled" if reason == "client_cancel" else "interrupted"
            self.outbox.put_control(F.ResponseDone(response_id, status, st.text, st.stats(), st.usage))
        st.playback_cut_t_s = now
        return True

    def _forget_old_responses(self, keep: int = 32) -> None:
        for rid in list(self.responses)[:-keep]:
            if self.responses[rid].finished:
                del self.responses[rid]
                self._cancelled.discard(rid)

    # ------------------------------------------------------------------ outputs

    async def next_event(self) -> F.SessionEvent | None:
        """The next event for the client, control events first; None after ``close``."""
        while True:
            event = await self.outbox.get()
            if event is None:
                return None
            rid = getattr(event, "response_id", None)
            if rid in self._cancelled and isinstance(
                event, (F.TextDelta, F.TextDone, F.AudioOut, F.AudioDone)
            ):
                continue  # raced with an interrupt; the client must not get it
            st = self.responses.get(rid) if rid else None
            if st is not None and isinstance(event, F.AudioOut):
                st.audio_sent(event, F.now_s())
            if st is not None and isinstance(event, F.ResponseDone) and event.status == "completed":
                # FIFO: all of this response's audio has been handed out by now
                event = dataclasses.replace(event, stats=st.stats(), usage=st.usage)
            return event

    async def events(self) -> AsyncIterator[F.SessionEvent]:
        """Async iterator over ``next_event()`` until the session closes."""
        while (event := await self.next_event()) is not None:
            yield event

    # ------------------------------------------------------------------ StageContext

    def is_cancelled(self, response_id: str) -> bool:
        return response_id in self._cancelled

    async def emit(self, event: F.SessionEvent) -> None:
        await self.outbox.put(event)

    async def forward(self, stage: Stage[Any], frame: F.DataFrame) -> None:
        """Route ``frame`` from ``stage`` to the next stage, or finish it at the session."""
        rid = getattr(frame, "response_id", None)
        if rid is not None and rid in self._cancelled:
            return
        st = self.responses.get(rid) if rid else None
        if st is not None:
            st.observe(frame)
        index = self._stages.index(stage)
        nxt = self._stages[index + 1] if index + 1 < len(self._stages) else None
        if isinstance(frame, (F.TextDelta, F.TextDone)):
            to_next = nxt is not None and self.settings.audio_output
            await self._to_client(st, frame, finish=isinstance(frame, F.TextDone) and not to_next)
            if to_next and nxt is not None:
                await nxt.inbox.put(frame)
        elif isinstance(frame, F.AudioOut):
            await self._to_client(st, frame, finish=False)
        elif isinstance(frame, F.AudioDone):
            await self._to_client(st, frame, finish=True)
        elif isinstance(frame, (F.AudioIn, F.CommitAudio, F.ClearAudio)) and nxt is not None:
            await nxt.inbox.put(frame)  # through the wake gate

    async def _to_client(self, st: ResponseState | None, event: F.SessionEvent, finish: bool) -> None:
        """``event`` of a response on to the client, with the session's book-keeping (the reply
        into the history; ``finish``: the response is complete), or held while the response is
        one started on a likely final (``create_response(held=True)``)."""
        if st is not None and st.held is not None:
            st.held.append((event, finish))
        else:
            await self._deliver(st, event, finish)

    async def _deliver(self, st: ResponseState | None, event: F.SessionEvent, finish: bool) -> None:
        await self.outbox.put(event)
        if isinstance(event, F.TextDone) and st is not None:
            st.usage = event.usage
            if st.kind == "reply":
                self.remember("assistant", event.text, response_id=event.response_id)
        if finish and isinstance(event, (F.TextDone, F.AudioDone)):
            await self._finish(event.response_id)

    async def _finish(self, response_id: str) -> None:
        st = self.responses.get(response_id)
        if st is None or st.done:
            return
        st.done = True
        await self.outbox.put(F.ResponseDone(response_id, "completed", st.text, st.stats(), st.usage))

    def note(self, response_id: str, mark: str, t_s: float) -> None:
        st = self.responses.get(response_id)
        if st is not None:
            st.marks.setdefault(mark, t_s)

    def stage_failed(self, stage: Stage[Any], frame: object, exc: BaseException) -> None:
        rid = getattr(frame, "response_id", None)
        held = self.responses.get(rid) if rid is not None else None
        if rid is not None and held is not None and held.hidden:
            # a response the client has not seen: dropped; the final starts its own
            log.info("a response held on a likely final failed in %s; dropped", stage.name)
            self._drop_held(rid)
            return
        if isinstance(exc, EdgeRtgiError):
            code = exc.code if isinstance(exc, BackendError) else "stage_failed"
            err = F.ErrorEvent(code, f"{stage.name}: {exc.message}", exc.hint, response_id=rid)
        else:  # a bug: the stage logged its traceback; the client gets no internals
            err = F.ErrorEvent(
                "internal_error",
                f"the {stage.name} stage failed on this response; the session goes on",
                "if it happens again, report it with the server log",
                response_id=rid,
            )
        self.outbox.put_control(err)
        if rid is not None and rid in self.responses and not self.responses[rid].done:
            st = self.responses[rid]
            st.done = True
            self._cancelled.add(rid)
            for s in self._stages:
                s.cancel(rid)
            self.outbox.put_control(F.ResponseDone(rid, "failed", st.text, st.stats(), st.usage))

    # --- called by the ASR stage (control path: not queued behind data)

    def on_speech_started(self, event: F.SpeechStarted, barge_in: bool = True) -> None:
        """User speech began: report it, and barge in on any reply that is still playing
        (unless the ASR stage defers that until it knows the speech is more than a backchannel)."""
        self.outbox.put_control(event)
        if (gate := self._wake_gate) is not None:
            gate.speech_started()
        if barge_in:
            self._barge_in(event.t_s)

    def confirm_barge_in(self, t_s: float) -> None:
        """The user is taking the turn over a reply: cut it (the deferred half of speech start)."""
        self._barge_in(t_s)

    def reply_active(self, t_s: float | None = None) -> bool:
        """A reply is being generated or (by the estimate) still playing, and barge-in is on
        (a held one, not yet the client's, does not count)."""
        return self.barge_in and any(st.active(t_s) and not st.hidden for st in self.responses.values())

    def on_speech_stopped(self, event: F.SpeechStopped) -> None:
        self.outbox.put_control(event)
        if (gate := self._wake_gate) is not None:
            gate.speech_stopped()

    def on_wake_detected(self, event: F.WakeDetected) -> None:
        """The wake word opened the gate: report it, and cut a reply that is still playing."""
        self.outbox.put_control(event)
        self._barge_in(event.t_s)

    def _barge_in(self, t_s: float) -> None:
        if self.barge_in:
            for rid, st in list(self.responses.items()):
                if st.active(t_s) and not st.hidden:
                    self.interrupt(rid, "barge_in")

    def new_turn_id(self) -> int:
        return next(self._turn_ids)

    async def on_final_transcript(self, event: F.Transcript) -> None:
        """A finished user utterance: report it, remember it, and respond if asked to (with the
        response started on its likely final when that had the same words)."""
        await self.outbox.put(event)
        words = bool(event.text.strip()) and not event.backchannel
        respond = words and self.settings.auto_response and self.pipeline.text_stage is not None
        guess = self._guesses.pop(event.turn_id, None)
        self._drop_guesses(before_turn=event.turn_id)  # turns that ended without a final
        st = self.responses.get(guess) if guess is not None else None
        confirmed = (
            respond
            and st is not None
            and st.hidden
            and st.source_text == event.text
            and st.held_after_entry == self._last_entry_id()  # nothing was said since
        )
        if guess is not None and not confirmed:
            self._drop_held(guess)
        if not words:
            return
        if isinstance(self.pipeline.text_stage, AssistantStageConfig):
            self.remember("user", event.text, turn_id=event.turn_id)
        if not respond:
            return
        if st is not None and confirmed:
            await self._release_held(st, event)
        else:
            await self.create_response(turn_id=event.turn_id, source_text=event.text, timing=event)

    async def on_likely_final(self, turn_id: int, text: str) -> None:
        """The turn will likely end with ``text`` (its pause's words are decoded; a hold, the
        cap or the silence timer waits to be sure): start its response now, held from the
        client until ``on_final_transcript`` confirms the words; dropped unseen otherwise."""
        self.drop_likely_final(turn_id)  # an earlier pause's guess
        self._drop_guesses(before_turn=turn_id)
        if text.strip() and self.settings.auto_response and self.pipeline.text_stage is not None:
            self._guesses[turn_id] = await self.create_response(turn_id, text, held=True)

    def drop_likely_final(self, turn_id: int) -> None:
        """Speech went on after a likely final: its held response is cancelled, unseen."""
        guess = self._guesses.pop(turn_id, None)
        if guess is not None:
            self._drop_held(guess)

    def _drop_guesses(self, before_turn: int | None = None) -> None:
        """Drop the held responses of every turn (or of the turns before ``before_turn``)."""
        for turn_id in [t for t in self._guesses if before_turn is None or t < before_turn]:
            self.drop_likely_final(turn_id)

    def _last_entry_id(self) -> int:
        return self._history[-1].entry_id if self._history else 0

    def _drop_held(self, response_id: str) -> None:
        st = self.responses.get(response_id)
        if st is None or not st.hidden:
            return
        for turn_id in [t for t, rid in self._guesses.items() if rid == response_id]:
            del self._guesses[turn_id]
        st.held = None
        self._cancelled.add(response_id)
        for stage in self._stages:
            stage.cancel(response_id)
        st.done, st.playback_cut_t_s = True, F.now_s()

    async def _release_held(self, st: ResponseState, timing: F.Transcript) -> None:
        """The final confirmed a held response's words: it becomes the turn's response, and
        what it produced so far goes to the client in order."""
        st.timing, st.releasing = timing, True
        # frames that arrive meanwhile join the queue, so the order holds; an interrupt while
        # the queue drains (the client's outbox full) takes the usual path and ends it
        while st.held and st.response_id not in self._cancelled:
            event, finish = st.held.pop(0)
            await self._deliver(st, event, finish)
        st.held, st.releasing = None, False

    @property
    def _input(self) -> Stage[Any]:
        """The stage client audio enters: the wake gate, or ASR."""
        return self._stages[0]

    @property
    def _wake_gate(self) -> WakeStage | None:
        first = self._stages[0] if self._stages else None
        return cast("WakeStage", first) if first is not None and first.name == "wake" else None

    def _stage_named(self, *names: str) -> Stage[Any]:
        return next(s for s in self._stages if s.name in names)
