"""The TTS engine protocol, its asyncio wrapper, and the voice-name factory."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from edge_rtgi.errors import EdgeRtgiError

DEFAULT_VOICE = "piper-en_US-joe-medium"


class EmptyTextError(EdgeRtgiError):
    """There is nothing to say."""


def check_text(text: str) -> str:
    """The text itself, or ``EmptyTextError`` if it has nothing speakable."""
    if not text or not any(ch.isalnum() for ch in text):
        raise EmptyTextError(
            "nothing to speak: the text is empty or has no words",
            hint='give some text, e.g. edge-rtgi speak "Hello there"',
        )
    return text


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


def make_tts(voice: str | Path = DEFAULT_VOICE) -> TtsEngine:
    """Build an engine from a voice name.

    - ``espeak`` or ``espeak:LANG`` (e.g. ``espeak:es``): the espeak-ng program;
    - a path to a Piper ``.onnx`` file or a folder holding one;
    - a catalogue name (e.g. ``piper-en_US-joe-medium``), pulled when missing.
    """
    name = str(voice)
    if name == "espeak" or name.startswith("espeak:"):
        from edge_rtgi.tts.espeak import EspeakEngine

        return EspeakEngine(name.partition(":")[2] or "en-us")
    from edge_rtgi.tts.piper import PiperVoice

    path = Path(name).expanduser()
    if path.exists() or path.suffix == ".onnx" or "/" in name:
        return PiperVoice(path)
    from edge_rtgi.catalog import resolve_model

    return PiperVoice(resolve_model(name, role="tts"))
