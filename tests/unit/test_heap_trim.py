"""Heap trimming (``edge_rtgi.server.memory``): glibc gives a fragmented heap back, and the
daemon's trimmer runs while in use and stops once idle."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from edge_rtgi.server.config import ServerConfig
from edge_rtgi.server.memory import HeapTrimmer, TrimResult, trim_heap

glibc_only = pytest.mark.skipif(trim_heap() is None, reason="the C library has no malloc_trim")

# A heap left fragmented as a session's buffers leave it: 100,000 malloc'd blocks of 3 kB, every
# 64th kept. Nothing is freed back by free() alone, since a kept block sits above the holes.
FRAGMENT = textwrap.dedent(
    """
    import re
    from edge_rtgi.server.memory import trim_heap

    def rss_mb():
        return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024

    blocks = [bytearray(3000) for _ in range(100_000)]
    kept = blocks[::64]
    del blocks
    before = rss_mb()
    result = trim_heap()
    print(before, rss_mb(), result.released, result.rss_drop_bytes)
    """
)


@glibc_only
def test_trim_returns_a_fragmented_heaps_free_pages():
    out = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, check=True)
    before_mb, after_mb, released, drop_bytes = out.stdout.split()
    # ~290 MB allocated, 1/64 of it still in use: most of the rest must go back
    assert released == "True"
    assert float(before_mb) - float(after_mb) > 150, out.stdout
    assert int(drop_bytes) > 150 * 2**20


@glibc_only
def test_the_trimmer_trims_while_in_use_and_once_after():
    results: list[TrimResult] = []
    in_use = [True]

    async def run() -> tuple[int, int, int]:
        trimmer = HeapTrimmer(0.02, lambda: in_use[0], results.append)
        trimmer.start()
        await asyncio.sleep(0.2)
        while_used = len(results)
        in_use[0] = False
        await asyncio.sleep(0.1)  # the last trim after use may still come
        settled = len(results)
        await asyncio.sleep(0.2)
        idle = len(results) - settled
        trimmer.note_activity()  # a session closed
        await asyncio.sleep(0.1)
        after_close = len(results) - settled - idle
        await trimmer.stop()
        return while_used, idle, after_close

    while_used, idle, after_close = asyncio.run(run())
    assert while_used >= 3
    assert idle == 0  # an idle daemon is not trimmed again and again
    assert after_close == 1
    assert all(r.duration_s >= 0 for r in results)


def test_interval_is_checked():
    with pytest.raises(ValueError, match="heap_trim_interval_s"):
        ServerConfig(heap_trim_interval_s=-1)
    with pytest.raises(ValueError, match="interval_s"):
        HeapTrimmer(0, lambda: False)


def test_sigusr2_writes_a_tracemalloc_snapshot_when_asked_for(tmp_path, monkeypatch):
    import os
    import signal
    import tracemalloc

    from edge_rtgi.server.memory import TRACEMALLOC_ENV, install_heap_snapshots

    async def run() -> list:
        loop = asyncio.get_running_loop()
        monkeypatch.delenv(TRACEMALLOC_ENV, raising=False)
        assert install_heap_snapshots(loop) is None  # off unless asked for
        monkeypatch.setenv(TRACEMALLOC_ENV, str(tmp_path / "heap"))
        assert install_heap_snapshots(loop) == tmp_path / "heap"
        try:
            kept = [bytearray(1000) for _ in range(1000)]  # noqa: F841 - traced while the snapshot is made
            os.kill(os.getpid(), signal.SIGUSR2)
            for _ in range(200):
                await asyncio.sleep(0.05)
                if found := list((tmp_path / "heap").glob("*.tracemalloc")):
                    await asyncio.sleep(0.5)
                    return found
            return []
        finally:
            loop.remove_signal_handler(signal.SIGUSR2)
            tracemalloc.stop()

    found = asyncio.run(run())
    assert len(found) == 1
    snapshot = tracemalloc.Snapshot.load(str(found[0]))
    assert any(s.traceback[0].filename == __file__ for s in snapshot.statistics("traceback"))


def test_the_cycle_collector_frees_cyclic_garbage_while_in_use_and_once_after():
    import gc
    import weakref

    from edge_rtgi.server.memory import CollectResult, CycleCollector

    class Node:
        def __init__(self) -> None:
            self.me = self  # only the cyclic collector frees it

    results: list[CollectResult] = []
    in_use = [True]

    async def run() -> tuple[bool, int, int]:
        collector = CycleCollector(0.02, lambda: in_use[0], results.append)
        gc.disable()  # no help from Python's own schedule
        try:
            collector.start()
            node = Node()
            gone = weakref.ref(node)
            del node
            for _ in range(250):  # a full collection of this test process takes a while
                await asyncio.sleep(0.02)
                if gone() is None:
                    break
            freed = gone() is None
            in_use[0] = False
            await asyncio.sleep(0.5)
            settled = len(results)
            await asyncio.sleep(0.3)
            idle = len(results) - settled
            await collector.stop()
            return freed, idle, settled
        finally:
            gc.enable()

    freed, idle, settled = asyncio.run(run())
    assert freed
    assert settled >= 1 and idle == 0  # an idle daemon is not collected again and again
    assert any(r.collected >= 1 for r in results)
    assert all(r.duration_s >= 0 for r in results)


def test_gc_interval_is_checked():
    with pytest.raises(ValueError, match="gc_interval_s"):
        ServerConfig(gc_interval_s=-1)
    assert ServerConfig(gc_interval_s=0).gc_interval_s == 0  # Python's own schedule only
