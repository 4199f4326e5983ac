"""Load-generator targets: the engine in-process, blocking token generators, and the daemon.

- ``EngineTarget`` streams from ``LLMEngine.add_request`` (continuous batching).
- ``ThreadedTarget`` runs a blocking token generator (the plain reference path, or a peer
  such as HF transformers) in worker threads. With ``max_concurrency=1`` requests are
  served one at a time, in arrival order: the "request by request" baseline.
- ``WebSocketTarget`` drives a running daemon over its native protocol (``text.input``
  -> ``response.text.delta`` ... ``response.done``); each request gets its own connection,
  as separate users would. Its ITL is per text delta.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from edge_rtgi.bench.budgets import BudgetPolicy
from edge_rtgi.bench.loadgen import Chunk
from edge_rtgi.bench.workloads import PreparedRequest
from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.llm.request import RequestClass, RequestSLO

# (token ids, text) pieces from a blocking generator; it must stop soon after ``cancel`` is set.
TokenStreamFn = Callable[[PreparedRequest, threading.Event], Iterator[tuple[tuple[int, ...], str]]]


class EngineTarget:
    """The edge-rtgi engine, in-process. Greedy decoding so outputs are comparable."""

    def __init__(self, engine: Any, name: str = "edge-rtgi engine", budgets: BudgetPolicy | None = None):
        self.engine = engine
        self.name = name
        self.budgets = budgets or BudgetPolicy()

    async def stream(self, request: PreparedRequest) -> AsyncIterator[Chunk]:
        params = self.budgets.sampling(request, self.engine.tokenizer)
        slo = RequestSLO(request.slo.ttft_ms, request.slo.itl_ms) if request.slo else None
        stream = self.engine.add_request(
            list(request.prompt_token_ids),
            params,
            request_class=RequestClass(request.request_class),
            slo=slo,
        )
        async with stream as deltas:
            async for delta in deltas:
                usage = delta.usage
                if delta.finish_reason == "error":
                    raise RuntimeError(delta.error or "engine error")
                yield Chunk(
                    num_tokens=len(delta.token_ids),
                    text=delta.text,
                    token_ids=tuple(delta.token_ids),
                    finished=delta.finish_reason is not None,
                    finish_reason=delta.finish_reason,
                    prompt_tokens=usage.prompt_tokens if usage else None,
                    cached_tokens=usage.cached_tokens if usage else None,
                )

    def kv_blocks_in_use(self) -> int | None:
        # pool.num_used_blocks is a plain int read; no lock is needed for a sampled gauge
        return self.engine.kv.pool.num_used_blocks

    def kv_blocks_total(self) -> int | None:
        return self.engine.stats().kv_blocks_total


class ThreadedTarget:
    """A blocking token generator served by at most ``max_concurrency`` worker threads."""

    def __init__(self, name: str, stream_fn: TokenStreamFn, max_concurrency: int = 1):
        self.name = name
        self.stream_fn = stream_fn
        self.executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"bench-{name}")

    async def stream(self, request: PreparedRequest) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        done = object()

        def work() -> None:
            try:
                for ids, text in self.stream_fn(request, cancel):
                    loop.call_soon_threadsafe(queue.put_nowait, (ids, text))
                    if cancel.is_set():
                        break
                loop.call_soon_threadsafe(queue.put_nowait, done)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        future = loop.run_in_executor(self.executor, work)
        produced = 0
        try:
            while True:
                item = await queue.get()
                if item is done:
                    reason = "length" if produced >= request.max_tokens else "stop"
                    yield Chunk(0, finished=True, finish_reason=reason)
                    return
                if isinstance(item, BaseException):
                    raise item
                ids, text = item
                produced += len(ids)
                yield Chunk(num_tokens=len(ids), text=text, token_ids=tuple(ids))
        finally:
            cancel.set()
            if not future.done():
                future.add_done_callback(lambda f: f.exception())  # never leave an unretrieved error

    def kv_blocks_in_use(self) -> int | None:
        return None

    def kv_blocks_total(self) -> int | None:
        return None

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def plain_stream_fn(loaded: Any) -> TokenStreamFn:
    """The plain reference path (``llm/generate.py``), greedy, as a token stream."""
    from edge_rtgi.llm.generate import generate_stream
    from edge_rtgi.llm.sampling import SamplingParams

    def stream(request: PreparedRequest, cancel: threading.Event) -> Iterator[tuple[tuple[int, ...], str]]:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=request.ignore_eos)
        for delta in generate_stream(loaded, list(request.prompt_token_ids), params):
            if cancel.is_set():
                return
            yield tuple(delta.token_ids), delta.text

    return stream


class WebSocketTarget:
    """A running daemon over the native protocol; sends each item's ``source_text``."""

    def __init__(self, url: str, name: str = "edge-rtgi daemon (WebSocket)", session: dict | None = None):
        self.url = url
        self.name = name
        self.session = session

    async def stream(self, request: PreparedRequest) -> AsyncIterator[Chunk]:
        import websockets

        text = request.source_text
        if not text:
            raise EdgeRtgiError(f"request {request.key} has no source text to send over WebSocket")
        async with websockets.connect(self.url, max_size=None) as ws:
            if self.session:
                await ws.send(json.dumps({"type": "session.update", "session": self.session}))
            await ws.send(json.dumps({"type": "text.input", "text": text, "respond": True}))
            async for message in ws:
                if isinstance(message, bytes):
                    continue  # PCM audio frames; text timing is what is measured
                event = json.loads(message)
                kind = event.get("type")
                if kind == "response.text.delta" and event.get("delta"):
                    yield Chunk(num_tokens=1, text=event["delta"])
                elif kind == "response.done":
                    usage = event.get("usage") or {}
                    yield Chunk(
                        0,
                        finished=True,
                        finish_reason=event.get("status"),
                        prompt_tokens=usage.get("prompt_tokens"),
                        cached_tokens=usage.get("cached_tokens"),
                    )
                    return
                elif kind == "error":
                    raise EdgeRtgiError(f"daemon error {event.get('code')}: {event.get('message')}")

    def kv_blocks_in_use(self) -> int | None:
        return None

    def kv_blocks_total(self) -> int | None:
        return None
