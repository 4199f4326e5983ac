"""Give the C heap's freed memory back to the operating system while the daemon runs.

glibc's malloc keeps freed memory for reuse: the main heap can shrink only from its top, and
the per-thread arenas (the daemon has some thirty threads: whisper, torch, onnxruntime, the
worker pool) keep their pages whatever is freed in them. ``malloc_trim(0)`` returns the free
pages of every arena; ``HeapTrimmer`` calls it now and then, in a worker thread, when
``server.heap_trim_interval_s`` asks for it (docs/daemon.md, "Memory over a long run").

Elsewhere (musl, macOS) there is no ``malloc_trim`` and the trimmer does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()
TRACEMALLOC_FRAMES = 8  # enough to see which caller of a shared helper holds the memory


@dataclass(frozen=True)
class TrimResult:
    """One ``malloc_trim`` call: whether glibc gave memory back, how much the process's resident
    size fell meanwhile (other threads allocate too: an estimate), and how long it took."""

    released: bool
    rss_drop_bytes: int
    duration_s: float


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim_heap() -> TrimResult | None:
    """Return the C heap's free pages to the OS; None where the C library has no malloc_trim.

    Blocks for as long as glibc walks its arenas (milliseconds): call it off the event loop.
    """
    if _MALLOC_TRIM is None:
        return None
    t0 = time.perf_counter()
    rss_before = _rss_bytes()
    released = bool(_MALLOC_TRIM(0))
    return TrimResult(released, rss_before - _rss_bytes(), time.perf_counter() - t0)


class HeapTrimmer:
    """Trims the heap every ``interval_s`` while the daemon is in use or was since the last trim.

    ``in_use()`` says whether sessions or requests are running now; ``note_activity()`` marks
    that some ran and ended since (the daemon calls it when a session closes). An idle daemon is
    trimmed once, not again and again for nothing. ``on_trim`` receives each result (metrics).
    """

    def __init__(
        self,
        interval_s: float,
        in_use: Callable[[], bool],
        on_trim: Callable[[TrimResult], None] | None = None,
    ):
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0 (leave the trimmer out to turn it off)")
        self.interval_s = interval_s
        self._in_use = in_use
        self._on_trim = on_trim
        self._active = True  # the models' loading freed plenty: trim once after it
        self._task: asyncio.Task[None] | None = None

    def note_activity(self) -> None:
        """Something allocated and freed memory since the last trim."""
        self._active = True

    def start(self) -> None:
        """Start trimming on the running event loop."""
        if self._task is None and _MALLOC_TRIM is not None:
            self._task = asyncio.create_task(self._run(), name="heap-trimmer")

    async def stop(self) -> None:
        """Stop trimming (a trim running in its thread finishes on its own)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def trim_now(self) -> TrimResult | None:
        """One trim in a worker thread, reported to ``on_trim``."""
        self._active = False
        result = await asyncio.to_thread(trim_heap)
        if result is not None and self._on_trim is not None:
            self._on_trim(result)
        return result

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._active or self._in_use():
                try:
                    await self.trim_now()
                except Exception:  # housekeeping must never end the daemon
                    log.exception("heap trim failed")


TRACEMALLOC_ENV = "EDGE_RTGI_TRACEMALLOC_DIR"


def install_heap_snapshots(loop: asyncio.AbstractEventLoop) -> Path | None:
    """With ``$EDGE_RTGI_TRACEMALLOC_DIR`` set: trace Python allocations from now on, and write a
    ``tracemalloc`` snapshot there on each SIGUSR2 (``kill -USR2 <pid>``), to find what grows
    between two moments of a long run (docs/reliability.md). Tracing slows allocation: for
    diagnosis only. Returns the folder, or None when the variable is unset."""
    folder = os.environ.get(TRACEMALLOC_ENV)
    if not folder:
        return None
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(TRACEMALLOC_FRAMES)

    def dump() -> None:
        path = out / f"heap-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.tracemalloc"
        tracemalloc.take_snapshot().dump(str(path))
        log.warning("tracemalloc snapshot written to %s", path)

    loop.add_signal_handler(signal.SIGUSR2, lambda: loop.run_in_executor(None, dump))
    log.warning("tracing Python allocations (%s): SIGUSR2 writes a snapshot to %s", TRACEMALLOC_ENV, out)
    return out
