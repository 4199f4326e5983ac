"""Latency-critical work first, on the few CPU cores that the whole voice pipeline shares.

On an edge CPU, whisper, the LLM engine and Piper all run in one process on the same two to
eight cores, each with its own thread pool. When two of them run at once, both slow down. But
not all work is equally urgent. The synthesis of a reply's *first* clause is on the
voice-to-voice critical path; the engine's next tokens are not, once a clause is ready: it
decodes several times faster than speech is spoken. (Measurements: docs/daemon.md.)

``CpuPriority`` lets critical work say so (``with FOREGROUND.foreground(): ...``) and lets
background loops (the engine's step loop) wait, with a bound, until no critical work is
running (``FOREGROUND.wait_for_idle(max_wait_s)``). It is a counter and a condition
variable: entering and leaving never block, so the event loop may use them directly.

``freeze_heap`` keeps the other stall off the critical path: Python's full garbage
collections. Loading whisper, the LLM, its tokenizer and Piper leaves hundreds of thousands of
tracked objects, and a full collection walks them all with every Python thread stopped. After
``gc.freeze()`` a full collection walks only what was allocated since, and full collections
keep their usual pace, so cyclic garbage (with the audio and tensors it holds) is freed within
seconds, not after minutes.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class CpuPriority:
    """Counts running foreground jobs; background work waits while there are any."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._busy_since = 0.0  # when the running count last went from 0 to 1

    @property
    def foreground_running(self) -> int:
        """Foreground jobs in progress now."""
        return self._running

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """Mark the enclosed work as latency-critical. Never blocks."""
        with self._cond:
            if self._running == 0:
                self._busy_since = time.monotonic()
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if self._running == 0:
                    self._cond.notify_all()

    def wait_for_idle(self, max_wait_s: float) -> float:
        """Block until no foreground job runs; return the seconds waited.

        The bound: once foreground work has run ``max_wait_s`` without a break (counted from
        when the first of the overlapping jobs began, not per call), background work goes on
        regardless, so a long or leaked job, or back-to-back jobs from many sessions, cannot
        starve it."""
        if self._running == 0 or max_wait_s <= 0:
            return 0.0
        start = time.monotonic()
        with self._cond:
            deadline = self._busy_since + max_wait_s
            while self._running > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        return time.monotonic() - start


# One CPU per process, so one arbiter per process.
FOREGROUND = CpuPriority()


def freeze_heap() -> None:
    """Move every object alive now (loaded models, tokenizers, caches) out of the garbage
    collector's reach, so later full collections only walk what was allocated since.

    Call it once start-up loading and warm-up are done; calling it again after more models
    load freezes those too. Frozen objects are never collected, which is what loaded models
    want anyway."""
    gc.collect()
    gc.freeze()
    # The collection above counted everything alive as long-lived, and freezing does not
    # recount: the next full collection would wait for a quarter of that many new survivors
    # (minutes of use), while cyclic garbage keeps its buffers. This one walks only what is
    # not frozen, so it is cheap, and resets that count.
    gc.collect()
