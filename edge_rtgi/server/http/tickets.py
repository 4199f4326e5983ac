"""Single-use, short-lived WebSocket tickets for browsers.

A browser cannot put an ``Authorization`` header on a WebSocket handshake, so a page on a
token-protected daemon first calls ``POST /v1/tickets`` with the token (``fetch`` can send the
header), then opens ``/v1/native?ticket=...``. A ticket is random, works once, and expires
after ``ttl_s``, so one that leaks into a log or a history is worthless.
"""

from __future__ import annotations

import secrets
import time

TICKET_TTL_S = 30.0
MAX_OUTSTANDING = 256  # a page that asks in a loop cannot grow the table without bound


class Tickets:
    """Issue and redeem tickets (event-loop only; no locking)."""

    def __init__(self, ttl_s: float = TICKET_TTL_S):
        self.ttl_s = ttl_s
        self._expiry_s: dict[str, float] = {}

    def issue(self) -> str:
        """A new ticket, valid for one handshake within ``ttl_s``."""
        self._expire()
        while len(self._expiry_s) >= MAX_OUTSTANDING:
            self._expiry_s.pop(next(iter(self._expiry_s)))  # the oldest goes first
        ticket = secrets.token_urlsafe(24)
        self._expiry_s[ticket] = time.monotonic() + self.ttl_s
        return ticket

    def redeem(self, ticket: str) -> bool:
        """True once for a live ticket; it is gone afterwards."""
        expiry = self._expiry_s.pop(ticket, None)
        return expiry is not None and time.monotonic() < expiry

    def _expire(self) -> None:
        now = time.monotonic()
        for ticket in [t for t, expiry in self._expiry_s.items() if expiry <= now]:
            del self._expiry_s[ticket]
