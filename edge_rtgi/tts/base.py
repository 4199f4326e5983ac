"""The TTS engine protocol and its asyncio wrapper."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from typing import Protocol, runtime_checkable

import numpy as np

from edge_rtgi.tts.text import check_text


@runtime_checkable
class TtsEngine(Protocol):
    """A speech synthesiser.

    ``synthesize_stream`` is a blocking generator of mono int16 PCM chunks at
    ``sample_rate_hz``; the first chunk comes before the whole text is synthesised (engines
    work sentence by sentence). Run it off the event loop: see ``synthesize_async``.
    """

    sample_rate_hz: int

    def synthesize_stream(self, text: str) -> Iterator[np.ndarray]: ...


async def synthesize_async(
    engine: TtsEngine, text: str, executor: Executor | None = None, max_queued_chunks: int = 8
) -> AsyncIterator[np.ndarray]:
    """Iterate an engine's chunks from asyncio; synthesis runs on a worker thread.

    Leaving the ``async for`` early (barge-in) stops the worker after the sentence in
    progress. At most ``max_queued_chunks`` chunks are made ahead of the consumer.
    """
    check_text(text)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    room = threading.Semaphore(max_queued_chunks)
    done = object()

    def work() -> None:
        try:
            for chunk in engine.synthesize_stream(text):
                while not room.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
            loop.call_soon_threadsafe(queue.put_nowait, done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, exc)

    future = loop.run_in_executor(executor, work)
    try:
        while True:
            item = await queue.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            room.release()
            yield item
    finally:
        stop.set()
        await asyncio.shield(future)
