"""The systemd watchdog over a real notify socket: a fake systemd receives the datagrams and
restarts the service, as systemd would, when no ``WATCHDOG=1`` came within ``WatchdogSec``.

The stall is a stubbed event loop stall (a blocking call on the loop), the fault the watchdog
exists for; the other fault is the daemon reporting a problem (a dead engine thread).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from edge_rtgi.server.systemd import Watchdog, sd_notify, watchdog_interval_s

WATCHDOG_USEC = 400_000  # WatchdogSec=0.4: pings every 0.2 s


class FakeSystemd:
    """Receives notify datagrams; ``restarts`` counts the watchdog timeouts it saw."""

    def __init__(self, path: str, watchdog_s: float):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.watchdog_s = watchdog_s
        self.messages: list[str] = []
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last_ping = None
        while not self._stop.is_set():
            try:
                message = self.sock.recv(4096).decode()
                self.messages.append(message)
                if message == "WATCHDOG=1":
                    last_ping = time.monotonic()
            except TimeoutError:
                pass
            if last_ping is not None and time.monotonic() - last_ping > self.watchdog_s:
                self.restarts += 1  # systemd: SIGABRT, then Restart=; a new timer starts
                last_ping = time.monotonic()

    def __enter__(self) -> FakeSystemd:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    with FakeSystemd(path, WATCHDOG_USEC / 1e6) as fake:
        yield fake


async def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval_s() is None


@pytest.mark.asyncio
async def test_a_stalled_event_loop_gets_the_daemon_restarted(systemd):
    interval_s = watchdog_interval_s()
    assert interval_s is not None
    dog = Watchdog(interval_s, problems=list)
    dog.start()
    try:
        await wait_for(lambda: dog.pings >= 3)
        restarts_before = systemd.restarts
        # the stub of a wedged daemon: a blocking call on the event loop, 5 watchdog periods
        time.sleep(5 * WATCHDOG_USEC / 1e6)
        await wait_for(lambda: systemd.restarts > restarts_before)
        pings = dog.pings
        await wait_for(lambda: dog.pings > pings + 2)  # the loop runs again: pings resume
    finally:
        await dog.stop()
    assert "WATCHDOG=1" in systemd.messages


@pytest.mark.asyncio
async def test_a_reported_problem_stops_the_pings_and_says_why(systemd):
    problems: list[str] = []
    dog = Watchdog(WATCHDOG_USEC / 2e6, problems=lambda: list(problems))
    dog.start()
    try:
        await wait_for(lambda: dog.pings >= 2)
        problems.append("the LLM engine thread of tiny has stopped; restart the daemon")
        restarts = systemd.restarts
        await wait_for(lambda: systemd.restarts > restarts)
        assert any(m.startswith("STATUS=unhealthy: the LLM engine thread") for m in systemd.messages)
    finally:
        await dog.stop()


def test_sd_notify_without_systemd_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify("READY=1") is False
