"""The stage base: one worker task reading one bounded queue, cancellable per response.

A stage reads data frames from its ``inbox`` (a bounded ``asyncio.Queue``, so a slow stage
pushes back on the one before it) and hands its output to the session through a
``StageContext``. Control never waits in the inbox: ``Session.interrupt`` calls
``cancel(response_id)`` on every stage directly, which

- cancels the task handling that response's frame right now (an engine stream, a TTS
  clause), and
- makes the worker skip that response's frames still waiting in the inbox.

Blocking work (ASR passes, TTS synthesis, subprocesses) runs in worker threads or
subprocesses; a stage never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from edge_rtgi import frames as F
from edge_rtgi.errors import BackendError, EdgeRtgiError

if TYPE_CHECKING:
    from edge_rtgi.pipeline.session import SessionSettings

log = logging.getLogger(__name__)


class StageContext(Protocol):
    """What a stage may ask of its session."""

    @property
    def settings(self) -> SessionSettings:
        """The session's current settings (``session.update`` changes them)."""

    def is_cancelled(self, response_id: str) -> bool: ...

    async def emit(self, event: F.SessionEvent) -> None:
        """Send an event towards the client, in order with other data events."""

    async def forward(self, stage: Stage[Any], frame: F.DataFrame) -> None:
        """Hand a frame to the stage after ``stage`` (or to the client if it is last)."""

    def note(self, response_id: str, mark: str, t_s: float) -> None:
        """Record a latency mark for a response (``first_clause``...)."""

    def stage_failed(self, stage: Stage[Any], frame: object, exc: BaseException) -> None:
        """Report a failure on one frame; the stage keeps running."""


class AsrContext(StageContext, Protocol):
    """What the ASR stage also asks: turn ids, and the control path for speech events."""

    def new_turn_id(self) -> int: ...

    def on_speech_started(self, event: F.SpeechStarted, barge_in: bool = True) -> None: ...

    def confirm_barge_in(self, t_s: float) -> None: ...

    def reply_active(self, t_s: float | None = None) -> bool: ...

    def on_speech_stopped(self, event: F.SpeechStopped) -> None: ...

    async def on_final_transcript(self, event: F.Transcript) -> None: ...

    async def on_likely_final(self, turn_id: int, text: str) -> None: ...

    def drop_likely_final(self, turn_id: int) -> None: ...


FrameT = TypeVar("FrameT")


class Stage(Generic[FrameT]):
    """Base class: subclasses implement ``handle(frame)`` and may override ``cancel``.

    ``FrameT`` is the kind of data frame the stage's inbox holds.
    """

    name = "stage"

    def __init__(self, ctx: StageContext, inbox_frames: int = 64):
        self.ctx = ctx
        self.inbox: asyncio.Queue[FrameT] = asyncio.Queue(maxsize=inbox_frames)
        self._current: tuple[str | None, asyncio.Task[None]] | None = None
        self._cancel_requested: asyncio.Task[None] | None = None  # the task cancel() cut short
        self._closing = False
        self._worker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Prepare per-session state (models are loaded by ``Resources``), start the worker."""
        self._worker = asyncio.create_task(self._run(), name=f"stage-{self.name}")

    async def handle(self, frame: FrameT) -> None:
        """Process one data frame from the inbox.

        Not abstract on purpose: a stage that consumes its input another way (the ASR stage reads
        audio in its own ``_run`` loop) never receives frames here.
        """
        raise TypeError(f"stage {self.name!r} received a frame but implements neither handle() nor _run()")

    def cancel(self, response_id: str) -> None:
        """Stop work on ``response_id`` now. Subclasses also abort external work, then call super."""
        if self._current and self._current[0] == response_id:
            self._cancel_requested = self._current[1]
            self._current[1].cancel()

    async def close(self) -> None:
        """Stop the worker; in-flight work is cancelled."""
        self._closing = True
        if self._current:
            self._current[1].cancel()
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            frame = await self.inbox.get()
            await self._handle_one(frame)

    async def _handle_one(self, frame: FrameT) -> None:
        rid = getattr(frame, "response_id", None)
        if rid is not None and self.ctx.is_cancelled(rid):
            return  # a cancelled response's leftovers are dropped here
        task = asyncio.create_task(self.handle(frame))
        self._current = (rid, task)
        try:
            await task
        except asyncio.CancelledError:
            # Told apart by what asked for it (Task.cancelling() would need Python 3.11).
            if self._closing or self._cancel_requested is not task:
                task.cancel()
                raise  # the stage itself is closing
            # otherwise only this response was cancelled: carry on with the next frame
        except BackendError as exc:  # a remote LLM failed the turn: the operator's to see, no traceback
            log.warning("stage %s: %.200s", self.name, exc.message)
            self.ctx.stage_failed(self, frame, exc)
        except EdgeRtgiError as exc:  # a request we cannot serve (too long, say): no traceback
            log.info("stage %s refused %s: %.200s", self.name, type(frame).__name__, exc.message)
            self.ctx.stage_failed(self, frame, exc)
        except Exception as exc:  # one bad frame must not kill the stage or the session
            log.exception("stage %s failed on %s", self.name, type(frame).__name__)
            self.ctx.stage_failed(self, frame, exc)
        finally:
            self._current = None
            self._cancel_requested = None
