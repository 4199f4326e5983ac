"""The OpenAI Realtime protocol as a thin adapter over the protocol-neutral session core.

``RealtimeAdapter`` does two translations and nothing else:

- client events -> calls on ``edge_rtgi.pipeline.session.Session`` (``push_audio``,
  ``commit_audio``, ``create_response``...), after validating them;
- the session's typed events (``edge_rtgi.frames``) -> Realtime server events.

VAD, ASR, the LLM or translator, TTS and barge-in all live in the session core. The adapter
keeps only what the wire protocol needs on top: item ids and their order, the per-response
event framing, the session object echoed back, and one ordering rule the core does not
know: a ``response.create`` sent right after ``input_audio_buffer.commit`` waits for that
turn's final transcript, so the reply answers the turn just committed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, Protocol

import numpy as np

from edge_rtgi import frames as F
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.session import TextTurn
from edge_rtgi.server.connection import ClientGone, FloodLimits
from edge_rtgi.server.metrics import Metrics
from edge_rtgi.server.openai_realtime.codecs import bytes_to_pcm, decode_base64
from edge_rtgi.server.openai_realtime.conversation import Conversation, Item, parse_message_item
from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.openai_realtime.events import (
    ClientEvent,
    IdMaker,
    error_event,
    optional,
    parse_client_event,
    require,
)
from edge_rtgi.server.openai_realtime.response import ResponseStream, usage_from_pipeline
from edge_rtgi.server.openai_realtime.session_config import (
    RealtimeSessionConfig,
    SemanticVad,
    ServerVad,
    apply_session_update,
)

log = logging.getLogger(__name__)

MIN_COMMIT_MS = 100  # the protocol's minimum for input_audio_buffer.commit
_RESPONSE_IGNORED = {
    "conversation",
    "metadata",
    "tools",
    "tool_choice",
    "prompt",
    "reasoning",
    "parallel_tool_calls",
    "audio",
    "instructions",
    "output_modalities",
    "max_output_tokens",
    # the beta spellings of the same per-response settings
    "modalities",
    "voice",
    "output_audio_format",
    "temperature",
    "max_response_output_tokens",
}


class RealtimeCore(Protocol):
    """What the adapter asks of the session core (``edge_rtgi.pipeline.session.Session``)."""

    session_id: str

    @property
    def pipeline_name(self) -> str: ...
    @property
    def turn_detection_status(self) -> dict[str, object] | None: ...

    async def push_audio(self, pcm: np.ndarray, sample_rate_hz: int | None = None) -> None: ...
    async def commit_audio(self) -> None: ...
    async def clear_audio(self) -> None: ...
    async def add_user_text(self, text: str, respond: bool = True, echo: bool = True) -> TextTurn: ...
    async def create_response(
        self, turn_id: int | None = None, source_text: str | None = None, timing: F.Transcript | None = None
    ) -> str: ...
    async def cancel_response(
        self, response_id: str | None = None, reason: str = "client_cancel"
    ) -> bool: ...
    async def update(self, changes: dict[str, Any]) -> None: ...
    def remember(
        self,
        role: Literal["user", "assistant"],
        text: str,
        *,
        turn_id: int | None = None,
        response_id: str | None = None,
    ) -> int: ...
    def revise(self, entry_id: int, text: str | None) -> bool: ...
    def find_entry(self, *, turn_id: int | None = None, response_id: str | None = None) -> int | None: ...
    def events(self) -> AsyncIterator[F.SessionEvent]: ...


class EventObserver(Protocol):
    """Counts the session's events into the daemon's metrics."""

    def __call__(self, event: F.SessionEvent) -> None: ...


def core_settings(config: RealtimeSessionConfig) -> dict[str, Any]:
    """``SessionSettings`` fields of the session core for a Realtime session config."""
    vad = config.turn_detection
    settings: dict[str, Any] = {
        "input_sample_rate_hz": config.input_format.sample_rate_hz,
        "output_sample_rate_hz": config.output_format.sample_rate_hz,
        "turn_detection": vad is not None,
        "auto_response": bool(vad and vad.create_response),
        "barge_in": bool(vad and vad.interrupt_response),
        "audio_output": "audio" in config.output_modalities,
        "partials": config.transcription is not None,
        "system_prompt": config.instructions,
        "max_reply_tokens": config.max_output_tokens,
    }
    if isinstance(vad, ServerVad):  # the silence timer alone, as OpenAI's server_vad
        settings.update(
            vad_threshold=vad.threshold,
            vad_min_silence_ms=vad.silence_duration_ms,
            vad_prefix_padding_ms=vad.prefix_padding_ms,
            turn_mode="silence",
            turn_min_silence_ms=vad.silence_duration_ms,
        )
    elif isinstance(vad, SemanticVad):  # the smart-turn model, at the eagerness's settings
        turn = vad.turn
        settings.update(
            turn_mode="semantic",
            turn_min_silence_ms=turn.min_silence_ms,
            turn_max_silence_ms=turn.max_silence_ms,
            turn_threshold=turn.threshold,
        )
    if config.pipeline is not None:
        settings["pipeline"] = config.pipeline
    return settings


def _frame_error(event: F.ErrorEvent) -> dict:
    message = f"{event.message} ({event.hint})" if event.hint else event.message
    kind = (
        "server_error"
        if event.code in ("internal_error", "stage_failed", "busy")
        else "invalid_request_error"
    )
    return {"type": kind, "code": event.code, "message": message, "param": None, "event_id": None}


class RealtimeAdapter:
    """One Realtime connection over one core ``Session``.

    ``send`` writes one server event (a dict) to the client. Feed client messages to
    ``handle_message`` and run ``pump_events`` concurrently until the session closes.
    """

    def __init__(
        self,
        session: RealtimeCore,
        send: Callable[[dict], Awaitable[None]],
        *,
        model: str,
        config: RealtimeSessionConfig | None = None,
        metrics: Metrics | None = None,
        limits: FloodLimits | None = None,
    ):
        self.session = session
        self.metrics = metrics
        self.limits = limits
        self._send = send
        self.model = model
        self.config = config or RealtimeSessionConfig()
        self.ids = IdMaker()
        self.conversation = Conversation()
        self.conversation_id = self.ids("conv")
        self.responses: dict[str, ResponseStream] = {}
        self._turn_items: dict[int, str] = {}  # core turn id -> user item id
        self._speech_item: tuple[int, str] | None = None  # server VAD: the turn being spoken
        self._awaiting_transcript: deque[str] = deque()  # committed items without a final transcript
        self._manual_commits: deque[str] = deque()  # items of client commits the core has not confirmed
        self._transcribed: dict[str, str] = {}  # item id -> transcript text sent as deltas
        self._deferred_create: ClientEvent | None = None
        self._buffered_ms = 0.0
        self._item_audio_s: dict[str, float] = {}  # user item id -> seconds of audio committed
        self._interrupt_reasons: dict[str, str] = {}

    # ================================================================== output helpers

    async def emit(self, event_type: str, **fields) -> None:
        await self._send({"type": event_type, "event_id": self.ids("event"), **fields})

    async def _emit_all(self, events: list[dict]) -> None:
        for event in events:
            await self._send(event)

    async def send_error(self, error: RealtimeProtocolError, client_event_id: str | None) -> None:
        await self._send(error_event(error, client_event_id, self.ids("event")))

    def _session_wire(self) -> dict:
        config = self.config
        if config.pipeline is None:  # show what is running
            config = dataclasses.replace(config, pipeline=self.session.pipeline_name)
        wire = config.to_wire(self.session.session_id, self.model)
        wire["edge_rtgi"]["turn_detection_status"] = self.session.turn_detection_status
        return wire

    # ================================================================== client -> core

    async def handle_message(self, message: str | bytes) -> None:
        """Validate and apply one client message; any problem becomes one ``error`` event."""
        event_id = None
        try:
            event = parse_client_event(message)
            event_id = event.event_id
            handler = getattr(self, "_on_" + event.type.replace(".", "_"))
            await handler(event)
        except RealtimeProtocolError as exc:
            log.info("realtime %s: %.200s", self.session.session_id, exc.message)
            await self.send_error(exc, event_id or exc.client_event_id)
        except EdgeRtgiError as exc:
            log.info("realtime %s: %.200s", self.session.session_id, exc.message)
            await self.send_error(RealtimeProtocolError("invalid_request", str(exc)), event_id)
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception:  # a bug of ours: logged with its traceback; the client learns no internals
            log.exception("realtime %s: failed on a client event", self.session.session_id)
            err = RealtimeProtocolError(
                "server_error", "the server failed on this event; the session goes on", None, "server_error"
            )
            await self.send_error(err, event_id)

    async def _on_session_update(self, event: ClientEvent) -> None:
        new = apply_session_update(self.config, require(event.data, "session", dict))
        try:
            await self.session.update(core_settings(new))
        except EdgeRtgiError as exc:
            param = "session.edge_rtgi.pipeline" if "pipeline" in str(exc) else "session"
            raise RealtimeProtocolError("invalid_value", str(exc), param) from None
        self.config = new
        # Sent from here, not on the core's SessionUpdated, so it precedes replies to later events.
        await self.emit("session.updated", session=self._session_wire())

    async def _on_input_audio_buffer_append(self, event: ClientEvent) -> None:
        fmt = self.config.input_format
        data = decode_base64(require(event.data, "audio", str), "audio")
        pcm = bytes_to_pcm(data, fmt, "audio")
        if (
            len(pcm)
            and self.limits is not None
            and not self.limits.admit_audio(len(pcm) / fmt.sample_rate_hz)
        ):
            if self.limits.warn_now():
                raise RealtimeProtocolError(
                    "audio_too_fast",
                    f"audio is arriving more than {self.limits.audio_speed:g}x faster than real time: "
                    f"{self.limits.dropped_audio_s:.1f} s dropped so far; stream it at its own pace",
                    "audio",
                )
            return
        if len(pcm):
            await self.session.push_audio(pcm, fmt.sample_rate_hz)
            self._buffered_ms += 1000.0 * len(pcm) / fmt.sample_rate_hz
            if self.metrics is not None:
                self.metrics.audio_in_s.inc(len(pcm) / fmt.sample_rate_hz)

    async def _on_input_audio_buffer_commit(self, event: ClientEvent) -> None:
        if self._buffered_ms < MIN_COMMIT_MS:
            raise RealtimeProtocolError(
                "input_audio_buffer_commit_empty",
                f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, but the buffer holds "
                f"{self._buffered_ms:.0f} ms",
                None,
            )
        if self._speech_item is not None:  # a server-VAD turn in progress: commit that one
            item_id = self._speech_item[1]
            self._speech_item = None
        else:
            item_id = self.ids("item")
        await self._commit_item(item_id)
        self._manual_commits.append(item_id)
        await self.session.commit_audio()

    async def _commit_item(self, item_id: str) -> None:
        """``committed`` + ``conversation.item.added`` for a user audio item (transcript to come)."""
        self._item_audio_s[item_id] = self._buffered_ms / 1000.0
        self._buffered_ms = 0.0
        item = Item(
            id=item_id,
            role="user",
            content=[{"type": "input_audio", "transcript": None}],
            status="in_progress",
        )
        previous = self.conversation.add(item)
        self._awaiting_transcript.append(item_id)
        await self.emit("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        await self.emit("conversation.item.added", previous_item_id=previous, item=item.to_wire())

    async def _on_input_audio_buffer_clear(self, event: ClientEvent) -> None:
        await self.session.clear_audio()
        self._buffered_ms = 0.0
        self._speech_item = None
        await self.emit("input_audio_buffer.cleared")

    async def _on_conversation_item_create(self, event: ClientEvent) -> None:
        item = parse_message_item(require(event.data, "item", dict), self.ids("item"))
        previous_id = optional(event.data, "previous_item_id", str)
        text = item.text().strip()
        if not text:
            raise RealtimeProtocolError("invalid_value", "the item has no text", "item.content")
        previous = self.conversation.add(item, previous_id)
        if item.role == "user":  # the core remembers it without echoing it as a transcript
            item.history_id = (await self.session.add_user_text(text, respond=False, echo=False)).entry_id
        else:  # earlier assistant turns go straight into the pipeline's history
            item.history_id = self.session.remember("assistant", text)
        await self.emit("conversation.item.added", previous_item_id=previous, item=item.to_wire())
        await self.emit("conversation.item.done", previous_item_id=previous, item=item.to_wire())

    async def _on_conversation_item_truncate(self, event: ClientEvent) -> None:
        item_id = require(event.data, "item_id", str)
        item = self.conversation.truncate(
            item_id, event.data.get("content_index"), event.data.get("audio_end_ms")
        )
        self._revise_history(item, item.text())
        await self.emit(
            "conversation.item.truncated",
            item_id=item_id,
            content_index=event.data["content_index"],
            audio_end_ms=event.data["audio_end_ms"],
        )

    async def _on_conversation_item_delete(self, event: ClientEvent) -> None:
        item_id = require(event.data, "item_id", str)
        item = self.conversation.get(item_id)
        self.conversation.delete(item_id)
        self._revise_history(item, None)
        await self.emit("conversation.item.deleted", item_id=item_id)

    async def _on_conversation_item_retrieve(self, event: ClientEvent) -> None:
        item_id = require(event.data, "item_id", str)
        await self.emit("conversation.item.retrieved", item=self.conversation.snapshot(item_id))

    def _revise_history(self, item: Item, text: str | None) -> None:
        """Keep the core's history in line with an edited (``text``) or deleted (None) item."""
        entry = item.history_id
        if entry is None and (item.turn_id is not None or item.response_id is not None):
            entry = self.session.find_entry(turn_id=item.turn_id, response_id=item.response_id)
        if entry is not None:
            self.session.revise(entry, text)

    async def _on_response_create(self, event: ClientEvent) -> None:
        params = optional(event.data, "response", dict, default={})
        unknown = sorted(set(params) - _RESPONSE_IGNORED - {"input"})
        if unknown:
            raise RealtimeProtocolError(
                "unknown_parameter", f"unknown parameter 'response.{unknown[0]}'", f"response.{unknown[0]}"
            )
        if params.get("input"):
            raise RealtimeProtocolError(
                "invalid_value",
                "response.input (out-of-band context) is not supported "
                "by edge-rtgi; add items with conversation.item.create",
                "response.input",
            )
        if self._active_response() is not None or self._deferred_create is not None:
            raise RealtimeProtocolError(
                "conversation_already_has_active_response",
                "a response is already in progress; wait for response.done or send response.cancel",
                None,
            )
        if self._awaiting_transcript:
            self._deferred_create = event  # answered when the committed turn's transcript is final
            return
        await self._create_response()

    async def _create_response(self, timing: F.Transcript | None = None) -> None:
        """Ask the core for a response to the latest user item (its text is the translate source)."""
        users = [item for item in self.conversation.items() if item.role == "user" and item.text().strip()]
        if not users:
            raise RealtimeProtocolError(
                "invalid_request",
                "there is nothing to respond to yet; append and commit "
                "audio or create a user message item first",
                None,
            )
        try:
            await self.session.create_response(
                turn_id=timing.turn_id if timing else None,
                source_text=users[-1].text().strip(),
                timing=timing,
            )
        except EdgeRtgiError as exc:
            raise RealtimeProtocolError("invalid_request", str(exc)) from None

    async def _on_response_cancel(self, event: ClientEvent) -> None:
        response_id = optional(event.data, "response_id", str)
        if self._deferred_create is not None and response_id is None:
            self._deferred_create = None
            return
        active = self._active_response()
        if active is None or (response_id is not None and response_id != active.id):
            raise RealtimeProtocolError(
                "response_cancel_not_active",
                f"no active response{' ' + repr(response_id) if response_id else ''} to cancel",
                "response_id" if response_id else None,
            )
        await self.session.cancel_response(active.id, reason="client_cancel")

    async def _on_output_audio_buffer_clear(self, event: ClientEvent) -> None:
        active = self._active_response()
        if active is not None:
            await self.session.cancel_response(active.id, reason="client_cancel")
            await self.emit("output_audio_buffer.cleared", response_id=active.id)

    def _live(self, response_id: str) -> ResponseStream | None:
        """The response's stream while it is in progress (late frames of a finished one are dropped)."""
        stream = self.responses.get(response_id)
        return stream if stream is not None and stream.status == "in_progress" else None

    def _active_response(self) -> ResponseStream | None:
        return next((r for r in self.responses.values() if r.status == "in_progress"), None)

    # ================================================================== core -> client

    async def pump_events(self, observe: EventObserver | None = None) -> None:
        """Translate the session's events until it closes; ``observe`` sees each one first (metrics)."""
        async for frame in self.session.events():
            if observe is not None:
                observe(frame)
            await self.on_frame(frame)

    async def on_frame(self, frame: F.SessionEvent) -> None:  # one branch per frame type
        """Write one core event as Realtime server events."""
        if isinstance(frame, F.SessionStarted):
            await self.emit("session.created", session=self._session_wire())
        elif isinstance(frame, F.SessionUpdated):
            return  # answered in _on_session_update
        elif isinstance(frame, F.AudioCommitted):
            await self._on_audio_committed()
        elif isinstance(frame, (F.SpeechStarted, F.SpeechStopped)) and self.config.turn_detection is None:
            return  # manual turns: the client commits, VAD events are not part of the protocol
        elif isinstance(frame, F.SpeechStarted):
            item_id = self.ids("item")
            self._speech_item = (frame.turn_id, item_id)
            self._turn_items[frame.turn_id] = item_id
            await self.emit(
                "input_audio_buffer.speech_started", audio_start_ms=frame.audio_ms, item_id=item_id
            )
        elif isinstance(frame, F.SpeechStopped):
            await self._on_speech_stopped(frame)
        elif isinstance(frame, F.Transcript):
            await self._on_transcript(frame)
        elif isinstance(frame, F.ResponseStarted):
            await self._on_response_started(frame)
        elif isinstance(frame, F.TextDelta):
            if (stream := self._live(frame.response_id)) is not None:
                await self._emit_all(stream.text_delta(frame.delta))
        elif isinstance(frame, F.TextDone):
            if (stream := self._live(frame.response_id)) is not None and not stream.text:
                await self._emit_all(stream.text_delta(frame.text))
        elif isinstance(frame, F.AudioOut):
            if (stream := self._live(frame.response_id)) is not None:
                await self._emit_all(stream.audio(frame.pcm, frame.sample_rate_hz))
        elif isinstance(frame, F.ResponseInterrupted):
            self._interrupt_reasons[frame.response_id] = frame.reason
        elif isinstance(frame, F.ResponseDone):
            await self._on_response_done(frame)
        elif isinstance(frame, F.ErrorEvent):
            await self._send({"type": "error", "event_id": self.ids("event"), "error": _frame_error(frame)})

    async def _on_speech_stopped(self, frame: F.SpeechStopped) -> None:
        item_id = self._turn_items.get(frame.turn_id) or self.ids("item")
        self._turn_items[frame.turn_id] = item_id
        await self.emit("input_audio_buffer.speech_stopped", audio_end_ms=frame.audio_ms, item_id=item_id)
        if self._speech_item is not None and self._speech_item[1] == item_id:
            self._speech_item = None
            await self._commit_item(item_id)

    def _item_for_transcript(self, frame: F.Transcript) -> str | None:
        item_id = self._turn_items.get(frame.turn_id)
        if item_id is not None and item_id in self._awaiting_transcript:
            return item_id
        if item_id is None and self._awaiting_transcript:
            item_id = self._awaiting_transcript[0]  # a manual commit: bind the turn to it
            self._turn_items[frame.turn_id] = item_id
            return item_id
        return None

    async def _on_transcript(self, frame: F.Transcript) -> None:
        item_id = self._item_for_transcript(frame)
        if item_id is None:
            if not frame.final or not frame.text.strip():
                return
            item_id = self.ids("item")  # a turn ended without a speech_stopped we saw
            await self._commit_item(item_id)
        sent = self._transcribed.get(item_id, "")
        text = frame.text.strip() if frame.final else frame.text
        delta = text[len(sent) :] if text.startswith(sent) else ""
        if self.config.transcription is not None and delta.strip():
            await self.emit(
                "conversation.item.input_audio_transcription.delta",
                item_id=item_id,
                content_index=0,
                delta=delta,
            )
            self._transcribed[item_id] = sent + delta
        if frame.final:
            await self._complete_user_item(item_id, text, frame)

    async def _on_audio_committed(self) -> None:
        """The core processed a client commit; a committed item with no speech gets an empty transcript."""
        if not self._manual_commits:
            return
        item_id = self._manual_commits.popleft()
        if item_id in self._awaiting_transcript:
            await self._complete_user_item(item_id, "", None)

    async def _complete_user_item(self, item_id: str, text: str, timing: F.Transcript | None) -> None:
        self._awaiting_transcript.remove(item_id)
        self._transcribed.pop(item_id, None)
        item = self.conversation.get(item_id)
        item.content[0]["transcript"] = text
        item.status = "completed"
        item.turn_id = timing.turn_id if timing is not None else None
        if self.config.transcription is not None:
            await self.emit(
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=text,
                usage={"type": "duration", "seconds": round(self._item_audio_s.pop(item_id, 0.0), 3)},
            )
        await self.emit("conversation.item.done", previous_item_id=None, item=item.to_wire())
        if self._deferred_create is not None and not self._awaiting_transcript:
            deferred, self._deferred_create = self._deferred_create, None
            try:
                if not text.strip():
                    raise RealtimeProtocolError(
                        "input_audio_buffer_commit_empty",
                        "the committed audio holds no speech, so there is nothing to respond to",
                        None,
                    )
                await self._create_response(timing)
            except RealtimeProtocolError as exc:  # the answer to that response.create
                await self.send_error(exc, deferred.event_id)

    async def _on_response_started(self, frame: F.ResponseStarted) -> None:
        item = Item(id=self.ids("item"), role="assistant", content=[], response_id=frame.response_id)
        stream = ResponseStream(
            response_id=frame.response_id,
            item=item,
            new_event_id=self.ids,
            modalities=self.config.output_modalities,
            output_format=self.config.output_format,
            voice=self.config.voice,
            conversation_id=self.conversation_id,
            max_output_tokens=self.config.max_output_tokens,
        )
        previous = self.conversation.add(item)
        self.responses[frame.response_id] = stream
        self._forget_old_responses()
        await self._emit_all(stream.start(previous))

    async def _on_response_done(self, frame: F.ResponseDone) -> None:
        stream = self.responses.get(frame.response_id)
        if stream is None or stream.status != "in_progress":
            return
        status, reason = {
            "completed": ("completed", None),
            "cancelled": ("cancelled", "client_cancelled"),
            "interrupted": ("cancelled", "turn_detected"),
            "failed": ("failed", None),
        }[frame.status]
        if (
            frame.status == "interrupted"
            and self._interrupt_reasons.get(frame.response_id) == "session_closed"
        ):
            reason = "client_cancelled"
        usage = usage_from_pipeline(frame.usage, frame.stats.completion_tokens or 0)
        events = stream.finish(status, reason=reason, usage=usage, text=frame.text)
        done = events[-1]["response"]
        done["edge_rtgi"] = {
            "stats": {k: v for k, v in dataclasses.asdict(frame.stats).items() if v is not None}
        }
        await self._emit_all(events)

    def _forget_old_responses(self, keep: int = 16) -> None:
        for rid in list(self.responses)[:-keep]:
            if self.responses[rid].status != "in_progress":
                del self.responses[rid]
                self._interrupt_reasons.pop(rid, None)
