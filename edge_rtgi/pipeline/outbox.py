"""A session's outgoing event queue: bounded for data, with a priority lane for control.

Data events (transcripts, text deltas, audio) wait in a bounded FIFO, so a slow client
pushes back on TTS and the engine instead of growing memory. Control events
(interruptions, errors, speech start) go to an unbounded lane that is always read first,
so an interruption never waits behind the audio it cancels. ``drop(response_id)`` removes
a cancelled response's queued data at once.
"""

from __future__ import annotations

import asyncio
from collections import deque

from edge_rtgi.frames import SessionEvent


class Outbox:
    """Bounded data FIFO plus a control lane; single consumer."""

    def __init__(self, max_data_events: int = 256):
        self.max_data_events = max_data_events
        self._data: deque[SessionEvent] = deque()
        self._control: deque[SessionEvent] = deque()
        self._changed = asyncio.Condition()
        self._closed = False

    async def put(self, event: SessionEvent) -> None:
        """Queue a data event, waiting while the queue is full."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._closed or len(self._data) < self.max_data_events)
            if self._closed:
                return
            self._data.append(event)
            self._changed.notify_all()

    def put_control(self, event: SessionEvent) -> None:
        """Queue a control event without waiting (it jumps ahead of all data)."""
        self._control.append(event)
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def drop(self, response_id: str) -> int:
        """Remove every queued data event of ``response_id``; returns how many were dropped."""
        before = len(self._data)
        self._data = deque(e for e in self._data if getattr(e, "response_id", None) != response_id)
        dropped = before - len(self._data)
        if dropped:
            asyncio.ensure_future(self._notify())
        return dropped

    async def get(self) -> SessionEvent | None:
        """The next event, control first; None once closed and empty."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._control or self._data or self._closed)
            if self._control:
                event = self._control.popleft()
            elif self._data:
                event = self._data.popleft()
            else:
                return None
            self._changed.notify_all()
            return event

    def close(self) -> None:
        """Wake the consumer and any producer; queued events are still delivered."""
        self._closed = True
        asyncio.ensure_future(self._notify())

    def __len__(self) -> int:
        return len(self._data) + len(self._control)
