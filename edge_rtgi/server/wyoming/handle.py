"""The ``handle`` service: a ``transcript`` (the user's words) -> the assistant's answer.

The answer streams as ``handled-start``, ``handled-chunk``..., ``handled-stop`` while the
engine generates it, then comes whole as ``handled`` (the event Home Assistant waits for).
A failed response is ``not-handled`` with the reason. Each connection holds one
conversation (a daemon session on the chat part of the served pipeline, text only), so
several transcripts on one connection are one multi-turn dialogue.
"""

from __future__ import annotations

from wyoming.handle import Handled, HandledChunk, HandledStart, HandledStop, NotHandled

from edge_rtgi import frames as F
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.session import Session
from edge_rtgi.server.wyoming.services import EventWriter, WyomingServices
from edge_rtgi.server.wyoming.streams import WyomingRequestError


class Conversation:
    """The assistant side of one connection."""

    def __init__(self, services: WyomingServices, write: EventWriter):
        if not services.has_assistant:
            raise WyomingRequestError("no_service", "this daemon's Wyoming pipeline has no assistant")
        self.services, self.write = services, write
        self.session: Session | None = None

    async def handle(self, text: str) -> None:
        """Answer ``text``; returns once ``handled`` or ``not-handled`` was sent."""
        if self.session is None:
            self.session = await self.services.open_session("chat", auto_response=False)
        try:
            turn = await self.session.add_user_text(text, echo=False)
        except EdgeRtgiError as exc:
            raise WyomingRequestError("invalid_text", exc.message, exc.hint) from None
        rid, started, error = turn.response_id, False, None
        while (event := await self.session.next_event()) is not None:
            if getattr(event, "response_id", None) != rid:
                continue
            if isinstance(event, F.TextDelta) and event.delta:
                if not started:
                    started = True
                    await self.write(HandledStart().event())
                await self.write(HandledChunk(text=event.delta).event())
            elif isinstance(event, F.ErrorEvent):
                error = event.message  # the failed response's done event follows
            elif isinstance(event, F.ResponseDone):
                if started:
                    await self.write(HandledStop().event())
                if event.status == "completed":
                    await self.write(Handled(text=event.text).event())
                else:
                    await self.write(NotHandled(text=error or f"the response was {event.status}").event())
                return

    async def close(self) -> None:
        if self.session is not None:
            await self.services.daemon.close_session(self.session)
            self.session = None
