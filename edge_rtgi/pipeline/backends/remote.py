"""A remote LLM on any server that speaks OpenAI's streaming API (vLLM, SGLang, TensorRT-LLM,
llama.cpp's server, another edge-rtgi daemon), through aiohttp's client.

One request per turn: ``POST {base_url}/chat/completions`` (``/completions`` for a raw text
prompt) with ``stream: true`` and usage requested, read as server-sent events
(``backends.sse``). What can go wrong, and what the session is told (``BackendError.code``):

- the server cannot be reached, or answers 429/5xx: ``backend_unavailable``, after up to
  ``remote.max_retries`` retries with doubling back-off;
- no first token within ``remote.first_token_timeout_s`` (one budget for every try), or a
  gap over ``remote.idle_timeout_s`` between chunks: ``backend_timeout``;
- a refusal (other 4xx), an error object, or a body that is not an event stream of JSON
  chunks: ``backend_error``.

Retries happen only before the first token: once text is on its way to TTS, a turn is never
restarted. Cancelling the reading task closes the connection at once, so the server sees the
client leave and stops generating.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import aiohttp

from edge_rtgi.errors import BackendError
from edge_rtgi.pipeline.backends.base import BackendDelta, BackendRequest, BackendResult, Message
from edge_rtgi.pipeline.backends.config import LlmBackendConfig
from edge_rtgi.pipeline.backends.sse import SseDecoder, parse_chunk

if TYPE_CHECKING:
    from edge_rtgi.pipeline.backends.base import BackendObserver

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
ERROR_BODY_TIMEOUT_S = 2.0
BYTES_PER_TOKEN = 3  # generous: BPE vocabularies average nearer 4 bytes of English per token
MESSAGE_OVERHEAD_TOKENS = 4  # role and separators of a chat template, per message


class _Retry(Exception):
    """A failure before the first token that another try may get past."""

    def __init__(self, error: BackendError):
        super().__init__(error.message)
        self.error = error


def _ms_since(start_s: float) -> float:
    return round((time.monotonic() - start_s) * 1000.0, 1)


class OpenAIBackend:
    """Streams from an OpenAI-compatible server. Shared by every session of a daemon."""

    def __init__(self, config: LlmBackendConfig, observer: BackendObserver | None = None):
        if config.backend != "openai" or not config.base_url:
            raise ValueError("OpenAIBackend needs a backend: openai config with a base_url")
        self.config = config
        self.remote = config.remote
        self.base_url = config.base_url.rstrip("/")
        self.observer = observer
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def context_tokens(self) -> int:
        return self.remote.context_tokens

    def count_tokens(self, prompt: Sequence[Message] | str) -> int:
        def estimate(text: str) -> int:
            return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)

        if isinstance(prompt, str):
            return estimate(prompt)
        return sum(estimate(m.content) + MESSAGE_OVERHEAD_TOKENS for m in prompt) + MESSAGE_OVERHEAD_TOKENS

    # ------------------------------------------------------------------ HTTP plumbing

    def _session(self) -> aiohttp.ClientSession:
        """One client session (a connection pool) per event loop that uses this backend."""
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for other in [lp for lp in self._sessions if lp.is_closed()]:
                del self._sessions[other]  # a finished loop's pool cannot be used or closed
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.remote.connect_timeout_s)
            )
            self._sessions[loop] = session
        return session

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        key = os.environ.get(self.config.api_key_env) if self.config.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _body(self, request: BackendRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.config.model,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.stop:
            body["stop"] = list(request.stop)
        if request.text is not None:
            body["prompt"] = request.text
            return f"{self.base_url}/completions", body
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        return f"{self.base_url}/chat/completions", body

    def _unreachable(self, exc: BaseException) -> BackendError:
        # aiohttp's texts can hold exception reprs: they go to the log, not to the client
        log.info("%s: %r", self.name, exc)
        return BackendError(
            f"{self.name} cannot be reached at {self.base_url}",
            hint="is the server running and the base_url right (it usually ends in /v1)?",
            code="backend_unavailable",
        )

    def _no_token(self) -> BackendError:
        return BackendError(
            f"{self.name} sent no token within {self.remote.first_token_timeout_s:g} s",
            hint="the server is overloaded or stuck; raise remote.first_token_timeout_s if it is only slow",
            code="backend_timeout",
        )

    async def _http_error(self, resp: aiohttp.ClientResponse) -> BackendError:
        try:
            raw = await asyncio.wait_for(resp.text(), ERROR_BODY_TIMEOUT_S)
        except (asyncio.TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            raw = ""
        try:
            detail = json.loads(raw)["error"]
            message = str(detail.get("message", detail) if isinstance(detail, dict) else detail)
        except (ValueError, KeyError, TypeError):
            message = raw.strip()[:200] or resp.reason or ""
        hint = None
        if resp.status in (401, 403):
            env = self.config.api_key_env
            hint = f"check the key in ${env}" if env else "set api_key_env to the server's key"
        elif resp.status in RETRY_STATUSES:
            hint = "the server is overloaded or restarting; tried again up to remote.max_retries times"
        elif resp.status == 404:
            hint = f"check base_url (it usually ends in /v1) and that the server serves {self.model!r}"
        code = "backend_unavailable" if resp.status in RETRY_STATUSES else "backend_error"
        return BackendError(f"{self.name} answered HTTP {resp.status}: {message}", hint, code)

    # ------------------------------------------------------------------ one call

    async def stream(self, request: BackendRequest) -> AsyncGenerator[BackendDelta, None]:
        start_s = time.monotonic()
        deadline_s = start_s + self.remote.first_token_timeout_s
        attempts, outcome = 0, "cancelled"
        try:
            while True:
                attempts += 1
                try:
                    async with aclosing(self._attempt(request, start_s, deadline_s, attempts)) as deltas:
                        async for delta in deltas:
                            yield delta
                    outcome = ""
                    return
                except _Retry as retry:
                    wait_s = self.remote.retry_backoff_ms / 1000.0 * 2 ** (attempts - 1)
                    if attempts > self.remote.max_retries or time.monotonic() + wait_s >= deadline_s:
                        raise retry.error from None
                    log.info("%s: try %d failed (%s); retrying in %.2f s", self.name, attempts, retry, wait_s)
                    await asyncio.sleep(wait_s)
        except BackendError as exc:
            outcome = exc.code
            raise
        finally:
            if outcome and self.observer is not None:
                self.observer.on_failure(self.name, outcome)

    async def _attempt(
        self, request: BackendRequest, start_s: float, deadline_s: float, attempts: int
    ) -> AsyncGenerator[BackendDelta, None]:
        """One try. Raises ``_Retry`` for what another try may get past, before any token."""
        url, body = self._body(request)
        try:
            resp = await asyncio.wait_for(
                self._session().post(url, json=body, headers=self._headers()),
                max(deadline_s - time.monotonic(), 0.001),
            )
        except aiohttp.ConnectionTimeoutError as exc:
            raise _Retry(self._unreachable(exc)) from None
        except asyncio.TimeoutError:
            raise _Retry(self._no_token()) from None
        except aiohttp.ClientError as exc:
            raise _Retry(self._unreachable(exc)) from None
        connect_ms = _ms_since(start_s)
        completed = False
        try:
            if resp.status != 200:
                error = await self._http_error(resp)
                if resp.status in RETRY_STATUSES:
                    raise _Retry(error)
                raise error
            content_type = resp.headers.get("Content-Type", "")
            if "text/event-stream" not in content_type:
                raise BackendError(
                    f"{self.name} answered {content_type or 'no content type'}, not text/event-stream",
                    hint="the server must support streaming (stream: true)",
                )
            chat = request.text is None
            decoder = SseDecoder()
            tokens, ttft_ms, finish, done = 0, None, None, False
            counts: dict[str, int | None] = {}
            while True:
                line = await self._read_line(resp, deadline_s if ttft_ms is None else None)
                data = decoder.feed_line(line) if line else decoder.close()
                if data is None:
                    if not line:
                        break  # the body ended
                    continue
                chunk = parse_chunk(data, chat, self.name)
                if chunk.done:
                    done = True
                    break
                for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                    if getattr(chunk, key) is not None:
                        counts[key] = getattr(chunk, key)
                finish = chunk.finish_reason or finish
                if chunk.text:
                    tokens += 1
                    ttft_ms = ttft_ms if ttft_ms is not None else _ms_since(start_s)
                    yield BackendDelta(chunk.text, 1)
            if finish is None and not done:
                raise BackendError(
                    f"{self.name} ended its event stream before the end of the answer "
                    "(no finish_reason, no [DONE])",
                    hint="the server closed the connection early",
                )
            completed = True
            result = BackendResult(
                backend=self.name,
                model=self.model,
                finish_reason=finish or "stop",
                prompt_tokens=counts.get("prompt_tokens"),
                completion_tokens=counts.get("completion_tokens") or tokens,
                cached_tokens=counts.get("cached_tokens"),
                connect_ms=connect_ms,
                ttft_ms=ttft_ms,
                total_ms=_ms_since(start_s),
                attempts=attempts,
            )
            if self.observer is not None:
                self.observer.on_result(result)
            yield BackendDelta("", 0, (), result)
        finally:
            if completed:
                resp.release()  # the whole body was read: the connection goes back to the pool
            else:
                resp.close()  # cancelled or failed: drop the connection, so the server stops

    async def _read_line(self, resp: aiohttp.ClientResponse, first_token_deadline_s: float | None) -> str:
        """The next line of the body ("" at its end), within the first-token or idle timeout."""
        before_first = first_token_deadline_s is not None
        timeout_s = (
            max(first_token_deadline_s - time.monotonic(), 0.001)
            if first_token_deadline_s is not None
            else self.remote.idle_timeout_s
        )
        try:
            raw = await asyncio.wait_for(resp.content.readline(), timeout_s)
        except asyncio.TimeoutError:
            if before_first:
                raise _Retry(self._no_token()) from None
            raise BackendError(
                f"{self.name} stalled: no data for {self.remote.idle_timeout_s:g} s mid-answer",
                hint="the server is overloaded or stuck; raise remote.idle_timeout_s if it is only slow",
                code="backend_timeout",
            ) from None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            log.info("%s: %r", self.name, exc)  # the detail, for the log only
            error = BackendError(
                f"{self.name} dropped the connection mid-stream",
                hint="the server closed the connection before the end of the answer (restarted or crashed?)",
                code="backend_unavailable",
            )
            if before_first:
                raise _Retry(error) from None
            raise error from None
        except ValueError as exc:  # a line longer than the reader's limit
            raise BackendError(f"{self.name} sent a malformed event stream: {exc}") from None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BackendError(f"{self.name} sent a malformed event stream: it is not UTF-8") from None

    # ------------------------------------------------------------------ lifecycle

    async def check(self) -> str | None:
        """Ask ``GET {base_url}/models`` once: None when the server answers and serves the model."""
        timeout = aiohttp.ClientTimeout(total=self.remote.connect_timeout_s + ERROR_BODY_TIMEOUT_S)
        try:
            async with self._session().get(
                f"{self.base_url}/models", headers=self._headers(), timeout=timeout
            ) as resp:
                if resp.status != 200:
                    return f"{self.name}: GET {self.base_url}/models answered HTTP {resp.status}"
                listing = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return f"{self.name} is not reachable at {self.base_url} ({exc or type(exc).__name__})"
        models = listing.get("data", []) if isinstance(listing, dict) else []
        ids = [m.get("id") for m in models if isinstance(m, dict)]
        if ids and self.model not in ids:
            return f"{self.name}: {self.base_url} does not list {self.model!r} (it serves {ids})"
        return None

    async def aclose(self) -> None:
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()
