"""Keep the daemon's memory from piling up over a long run: Python's cyclic garbage and the C
heap's freed pages.

``CycleCollector`` runs a full garbage collection every ``server.gc_interval_s`` while the daemon
is in use (``collect_cycles`` says why Python's own schedule is not enough here).

glibc's malloc keeps freed memory for reuse: the main heap can shrink only from its top, and
the per-thread arenas (the daemon has some thirty threads: whisper, torch, onnxruntime, the
worker pool) keep their pages whatever is freed in them. ``malloc_trim(0)`` returns the free
pages of every arena; ``HeapTrimmer`` calls it now and then, in a worker thread, when
``server.heap_trim_interval_s`` asks for it (docs/daemon.md, "Memory over a long run").

Elsewhere (musl, macOS) there is no ``malloc_trim`` and the trimmer does nothing.

``use_jemalloc`` is the other tool, and the default: ``edge-rtgi serve`` re-executes itself
with jemalloc preloaded where the library is installed (Debian's ``libjemalloc2``;
``scripts/setup.sh`` installs it): under glibc's malloc the daemon's resident size kept rising
through long soaks (docs/reliability.md, "RSS: what grows"). ``EDGE_RTGI_ALLOCATOR=system``
keeps glibc's malloc; under jemalloc the trimmer does nothing (jemalloc returns memory itself).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger(__name__)


ALLOCATOR_ENV = "EDGE_RTGI_ALLOCATOR"  # "auto" (default): jemalloc where installed; "system"
_REEXEC_ENV = "EDGE_RTGI_ALLOCATOR_REEXEC"  # set across the re-exec, so it happens once
# Debian/Ubuntu's libjemalloc2 on x86-64 and on arm64 (Jetson); elsewhere the loader's cache.
JEMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
)
# Unused dirty pages go back to the system after about a second, on jemalloc's own thread, so
# an idle daemon shrinks without a call from us.
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"


def jemalloc_loaded(maps_text: str | None = None) -> bool:
    """True when jemalloc is mapped into this process (``/proc/self/maps``)."""
    if maps_text is None:
        try:
            maps_text = Path("/proc/self/maps").read_text()
        except OSError:
            return False
    return "libjemalloc" in maps_text


def find_jemalloc() -> str | None:
    """The path of an installed jemalloc shared library, or None."""
    for candidate in JEMALLOC_CANDIDATES:
        if Path(candidate).is_file():
            return candidate
    # find_library only looks the name up; loading the library to probe it would map it here.
    return ctypes.util.find_library("jemalloc")


@dataclass(frozen=True)
class AllocatorChoice:
    """What ``choose_allocator`` decided: the environment to re-execute with (None: run on as
    is) and a line saying why, for the log."""

    reexec_env: dict[str, str] | None
    reason: str


def choose_allocator(environ: dict[str, str], loaded: bool, jemalloc: str | None) -> AllocatorChoice:
    """Whether the daemon should re-execute itself with jemalloc preloaded.

    ``loaded``: jemalloc is already mapped; ``jemalloc``: the installed library's path (None:
    not installed). Raises ``ValueError`` for an unknown ``EDGE_RTGI_ALLOCATOR``.
    """
    setting = environ.get(ALLOCATOR_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "jemalloc", "system"):
        raise ValueError(f"{ALLOCATOR_ENV} must be auto, jemalloc or system, got {setting!r}")
    if loaded:
        return AllocatorChoice(None, "jemalloc (preloaded)")
    if setting == "system":
        return AllocatorChoice(None, f"glibc malloc ({ALLOCATOR_ENV}=system)")
    if jemalloc is None:
        note = "not installed: apt-get install libjemalloc2"
        if setting == "jemalloc":
            raise ValueError(f"{ALLOCATOR_ENV}=jemalloc but jemalloc is {note}")
        return AllocatorChoice(None, f"glibc malloc (jemalloc {note})")
    if environ.get(_REEXEC_ENV):
        # The preload was asked for and did not take (a loader that ignores LD_PRELOAD, for one).
        return AllocatorChoice(None, f"glibc malloc (LD_PRELOAD of {jemalloc} did not load it)")
    preload = environ.get("LD_PRELOAD", "")
    env = dict(environ)
    env["LD_PRELOAD"] = f"{jemalloc}:{preload}" if preload else jemalloc
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    env[_REEXEC_ENV] = "1"
    return AllocatorChoice(env, f"jemalloc ({jemalloc})")


def reexec_with_jemalloc(argv: list[str]) -> str:
    """Re-execute this process (same pid, same descriptors) as ``python -m <argv>`` with
    jemalloc preloaded, when ``choose_allocator`` says so; otherwise return the line to log
    about the allocator in use. Linux only; elsewhere it returns at once."""
    if not sys.platform.startswith("linux"):
        return "the platform's malloc"
    choice = choose_allocator(dict(os.environ), jemalloc_loaded(), find_jemalloc())
    if choice.reexec_env is None:
        return choice.reason
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", *argv], choice.reexec_env)
    raise AssertionError("unreachable: execve returns only by raising")  # pragma: no cover


def _load_malloc_trim() -> Callable[[int], int] | None:
    if jemalloc_loaded():
        return None  # glibc's trim would only walk glibc's idle arenas
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


R = TypeVar("R")


class PeriodicUpkeep(Generic[R]):
    """Runs ``job`` every ``interval_s`` while the daemon is in use or was since the last run.

    ``in_use()`` says whether sessions or requests are running now; ``note_activity()`` marks
    that some ran and ended since (the daemon calls it when a session closes). An idle daemon is
    kept up once, not again and again for nothing. ``on_result`` receives each result (metrics).
    ``in_thread``: run the job in a worker thread (a C call that releases the interpreter), or
    on the event loop (Python work, which would hold the interpreter in any thread).
    """

    name = "upkeep"

    def __init__(
        self,
        interval_s: float,
        in_use: Callable[[], bool],
        job: Callable[[], R | None],
        on_result: Callable[[R], None] | None = None,
        in_thread: bool = False,
    ):
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0 (leave the upkeep out to turn it off)")
        self.interval_s = interval_s
        self._in_use = in_use
        self._job = job
        self._on_result = on_result
        self._in_thread = in_thread
        self._active = True  # the models' loading left plenty behind: run once after it
        self._task: asyncio.Task[None] | None = None

    @property
    def available(self) -> bool:
        """Whether the job can do anything on this system."""
        return True

    def note_activity(self) -> None:
        """Something allocated and freed memory since the last run."""
        self._active = True

    def start(self) -> None:
        """Start on the running event loop."""
        if self._task is None and self.available:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Stop (a job running in its thread finishes on its own)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def run_now(self) -> R | None:
        """One run, reported to ``on_result``."""
        self._active = False
        result = await asyncio.to_thread(self._job) if self._in_thread else self._job()
        if result is not None and self._on_result is not None:
            self._on_result(result)
        return result

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._active or self._in_use():
                try:
                    await self.run_now()
                except Exception:  # housekeeping must never end the daemon
                    log.exception("%s failed", self.name)


class HeapTrimmer(PeriodicUpkeep[TrimResult]):
    """``trim_heap`` in a worker thread every ``interval_s`` while in use (``PeriodicUpkeep``)."""

    name = "heap-trimmer"

    def __init__(
        self,
        interval_s: float,
        in_use: Callable[[], bool],
        on_trim: Callable[[TrimResult], None] | None = None,
    ):
        super().__init__(interval_s, in_use, trim_heap, on_trim, in_thread=True)

    @property
    def available(self) -> bool:
        return _MALLOC_TRIM is not None


@dataclass(frozen=True)
class CollectResult:
    """One full garbage collection: the objects it freed and how long it held the interpreter."""

    collected: int
    duration_s: float


def collect_cycles() -> CollectResult:
    """A full collection of Python's cyclic garbage (``gc.collect()``).

    Reference cycles (an exception's traceback and the frames that hold it, a cancelled task's
    callbacks, a response and its session) are freed only by the collector, and with the
    loaded models frozen out of its reach (``cpu_priority.freeze_heap``) the daemon makes too
    few long-lived objects to trigger a full collection for many minutes: the garbage, and
    the audio and tensors it holds, piled up meanwhile (docs/reliability.md, "RSS: what
    grows"). After the freeze a collection walks only what is not frozen, so it is short."""
    t0 = time.perf_counter()
    collected = gc.collect()
    return CollectResult(collected, time.perf_counter() - t0)


class CycleCollector(PeriodicUpkeep[CollectResult]):
    """``collect_cycles`` on the event loop every ``interval_s`` while in use."""

    name = "cycle-collector"

    def __init__(
        self,
        interval_s: float,
        in_use: Callable[[], bool],
        on_collect: Callable[[CollectResult], None] | None = None,
    ):
        super().__init__(interval_s, in_use, collect_cycles, on_collect, in_thread=False)


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
