"""Who may talk to the daemon: the Origin allow-list and the refusal every route answers with.

The checks themselves (Origin, token, draining, session limit) run in ``Daemon.admit``; this
module holds what the routes share without importing the daemon.
"""

from __future__ import annotations

from http import HTTPStatus
from urllib.parse import urlsplit


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """Exact match, or match ignoring the port (``http://localhost`` allows ``http://localhost:3000``)."""
    origin = origin.rstrip("/").lower()
    parts = urlsplit(origin)
    bare = f"{parts.scheme}://{parts.hostname}" if parts.hostname else origin
    return any(origin == a.rstrip("/").lower() or bare == a.rstrip("/").lower() for a in allowed)


class Refusal(Exception):
    """A request the daemon will not serve: the HTTP status, the reason (the label it is
    counted under in /metrics) and a message that says what to do."""

    def __init__(self, status: HTTPStatus, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
