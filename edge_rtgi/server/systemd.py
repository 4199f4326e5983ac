"""The systemd notify protocol: ``READY=1``, ``STOPPING=1`` and the watchdog's ``WATCHDOG=1``.

Under ``Type=notify`` systemd hands the service ``$NOTIFY_SOCKET`` (a datagram socket); with
``WatchdogSec=`` it also sets ``$WATCHDOG_USEC`` and restarts the service when no
``WATCHDOG=1`` arrives within that time. ``Watchdog`` pings from the event loop itself, every
half of that time, and only while the daemon reports itself healthy: a wedged loop (a blocking
call, a deadlock) or a dead engine thread stops the pings, and systemd restarts the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)


def sd_notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to systemd's notify socket; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify(%s) failed: %s", state.split("\n")[0], exc)
        return False


def watchdog_interval_s() -> float | None:
    """Half of ``$WATCHDOG_USEC`` (systemd's advice), or None when no watchdog is asked for
    (unset, or ``$WATCHDOG_PID`` names another process)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(int(usec), 1) / 2e6
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None


class Watchdog:
    """Pings ``WATCHDOG=1`` from the event loop while ``problems()`` returns nothing.

    ``problems`` lists what is wrong (a dead engine thread, say); while it is not empty the
    pings stop and ``STATUS=`` says why, so systemd restarts the daemon after ``WatchdogSec``.
    """

    def __init__(self, interval_s: float, problems: Callable[[], list[str]]):
        self.interval_s = interval_s
        self.problems = problems
        self.pings = 0
        self._task: asyncio.Task[None] | None = None
        self._reported: list[str] = []

    def start(self) -> None:
        """Start pinging on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="systemd-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            problems = self.problems()
            if not problems:
                if sd_notify("WATCHDOG=1"):
                    self.pings += 1
            elif problems != self._reported:
                log.error("unhealthy, stopping the watchdog pings: %s", "; ".join(problems))
                sd_notify("STATUS=unhealthy: " + "; ".join(problems))
            self._reported = problems
            await asyncio.sleep(self.interval_s)
