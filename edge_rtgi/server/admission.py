"""Who may talk to the daemon: the Origin allow-list and the refusal every route answers with.

The checks themselves (Origin, token, draining, session limit) run in ``Daemon.admit``; this
module holds what the routes share without importing the daemon.
"""

from __future__ import annotations

import time
from collections import deque
from http import HTTPStatus
from urllib.parse import urlsplit

# headers that decide who may talk to the daemon: sent twice, which one counts is ambiguous
SINGLE_HEADERS = ("Origin", "Authorization", "Host")


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


class AuthThrottle:
    """Wrong tokens per client address in a sliding minute; past the limit, that address is
    refused (429) whatever it sends until the minute has passed, so a token cannot be guessed
    at network speed. Bounded: at most ``max_addresses`` addresses are remembered."""

    def __init__(self, failures_per_min: int, max_addresses: int = 4096):
        self.failures_per_min = failures_per_min
        self.max_addresses = max_addresses
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, address: str, now_s: float) -> deque[float] | None:
        times = self._failures.get(address)
        while times and now_s - times[0] >= 60.0:
            times.popleft()
        if times is not None and not times:
            del self._failures[address]
            return None
        return times

    def retry_after_s(self, address: str) -> float:
        """Seconds until ``address`` may try again; 0 when it may now."""
        now_s = time.monotonic()
        times = self._recent(address, now_s)
        if times is None or len(times) < self.failures_per_min:
            return 0.0
        return max(0.0, 60.0 - (now_s - times[0]))

    def failed(self, address: str) -> None:
        """Record one wrong or missing token from ``address``."""
        now_s = time.monotonic()
        if address not in self._failures and len(self._failures) >= self.max_addresses:
            self._failures.pop(next(iter(self._failures)))  # the oldest address
        self._failures.setdefault(address, deque(maxlen=self.failures_per_min)).append(now_s)
