"""The stage base: one worker task reading one bounded queue, cancellable per response.

A stage reads data frames from its ``inbox`` (a bounded ``asyncio.Queue``, so a slow stage
pushes back on the one before it) and hands its output to the session through a
``StageContext``. Control never waits in the inbox: ``Session.interrupt`` calls
``cancel(response_id)`` on every stage directly, which

- cancels the task handling that response's frame right now (an engine stream, a TTS
  clause), and
- makes the worker skip that response's frames still waiting in the inbox.

Blocking work (ASR passes, TTS synthesis, subprocesses) runs in worker threads through
``iterate_in_thread`` / ``asyncio.to_thread``; a stage never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

log = logging.getLogger(__name__)


class StageContext(Protocol):
    """What a stage may ask of its session."""

    def is_cancelled(self, response_id: str) -> bool: ...

    async def emit(self, event: Any) -> None:
        """Send an event towards the client, in order with other data events."""

    async def forward(self, stage: Stage, frame: Any) -> None:
        """Hand a frame to the stage after ``stage`` (or to the client if it is last)."""

    def note(self, response_id: str, mark: str, t_s: float) -> None:
        """Record a latency mark for a response (``first_clause``...)."""

    def stage_failed(self, stage: Stage, frame: Any, exc: BaseException) -> None:
        """Report a failure on one frame; the stage keeps running."""


class Stage:
    """Base class: subclasses implement ``handle(frame)`` and may override ``cancel``."""

    name = "stage"

    def __init__(self, ctx: StageContext, inbox_frames: int = 64):
        self.ctx = ctx
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=inbox_frames)
        self._current: tuple[str | None, asyncio.Task] | None = None
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        """Prepare per-session state (models are loaded by ``Resources``), start the worker."""
        self._worker = asyncio.create_task(self._run(), name=f"stage-{self.name}")

    async def handle(self, frame: Any) -> None:
        raise NotImplementedError

    def cancel(self, response_id: str) -> None:
        """Stop work on ``response_id`` now. Subclasses also abort external work, then call super."""
        if self._current and self._current[0] == response_id:
            self._current[1].cancel()

    async def close(self) -> None:
        """Stop the worker; in-flight work is cancelled."""
        if self._current:
            self._current[1].cancel()
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            frame = await self.inbox.get()
            await self._handle_one(frame)

    async def _handle_one(self, frame: Any) -> None:
        rid = getattr(frame, "response_id", None)
        if rid is not None and self.ctx.is_cancelled(rid):
            return  # a cancelled response's leftovers are dropped here
        task = asyncio.create_task(self.handle(frame))
        self._current = (rid, task)
        try:
            await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                task.cancel()
                raise  # the stage itself is closing
            # otherwise only this response was cancelled: carry on with the next frame
        except Exception as exc:  # one bad frame must not kill the stage or the session
            log.exception("stage %s failed on %s", self.name, type(frame).__name__)
            self.ctx.stage_failed(self, frame, exc)
        finally:
            self._current = None


_DONE = object()


async def iterate_in_thread(make_iter: Callable[[], Iterator[Any]], max_ahead: int = 8) -> AsyncIterator[Any]:
    """Run a blocking iterator in a worker thread and yield its items on the event loop.

    This is the fix for pipecat's bug with lazy generators such as faster-whisper's
    ``transcribe()``: the generator is created *and consumed* in the thread, so decoding
    never runs on the loop. Closing the async iterator (e.g. on cancellation) tells the
    thread to stop after its current item.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=max_ahead)
    stop = threading.Event()

    def put(item: Any) -> None:
        fut = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
        while not stop.is_set():
            try:
                fut.result(timeout=0.1)
                return
            except TimeoutError:
                continue
            except Exception:  # loop closed
                stop.set()
        fut.cancel()

    def work() -> None:
        try:
            for item in make_iter():
                if stop.is_set():
                    return
                put(item)
        except BaseException as exc:  # handed to the consumer
            put(("__exc__", exc))
        finally:
            put(_DONE)

    worker = loop.run_in_executor(None, work)
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, tuple) and len(item) == 2 and item[0] == "__exc__":
                raise item[1]
            yield item
    finally:
        stop.set()
        while not queue.empty():  # unblock a producer waiting for room
            queue.get_nowait()
        if worker.done():
            worker.exception()
