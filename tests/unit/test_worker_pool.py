"""The daemon's worker pool (the event loop's default executor) is started whole, so its
thread count does not creep up with the busiest moment (issue #18: the soak's idle level)."""

from __future__ import annotations

import asyncio
import threading

from edge_rtgi.server.app import start_worker_pool


def test_the_worker_pool_starts_every_thread_and_never_grows():
    async def main() -> None:
        before = threading.active_count()
        start_worker_pool(asyncio.get_running_loop(), 3)
        started = threading.active_count()
        assert started == before + 3  # all started at once, not on first use
        gate = threading.Event()
        # four times more blocking calls than workers: they queue; no thread is added
        calls = [asyncio.ensure_future(asyncio.to_thread(gate.wait, 10.0)) for _ in range(12)]
        await asyncio.sleep(0.2)
        assert threading.active_count() == started
        gate.set()
        assert all(await asyncio.gather(*calls))
        assert threading.active_count() == started

    asyncio.run(main())
