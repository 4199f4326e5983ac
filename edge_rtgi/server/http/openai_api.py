"""The OpenAI-compatible text API on the daemon's shared engines.

``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent events ending
in ``data: [DONE]``, or one JSON answer) and ``GET /v1/models``. The requests of these routes
are batched with the voice sessions' in the same engine. What happens to one request:

1. the daemon's admission rules (Origin allow-list, token, draining), as for WebSockets;
2. ``openai_requests.parse_request``: JSON, fields, model name (400 naming the reason);
3. tokenizing on a worker thread (the chat template is the model's), then the prompt's length
   and ``max_tokens`` against the context window (400 ``context_length_exceeded``);
4. ``engine.add_request``; a client that disconnects cancels the handler, and the cancelled
   stream aborts the engine request and frees its KV blocks at once.

Nothing reaches an engine before step 4. Errors use OpenAI's shape, ``{"error": {...}}``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import web

from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.llm.request import RequestClass
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.pipeline.config import AssistantStageConfig, TranslateStageConfig
from edge_rtgi.server.admission import Refusal
from edge_rtgi.server.http.openai_requests import ApiError, Kind, TextRequest, parse_request

if TYPE_CHECKING:
    from edge_rtgi.llm.engine import LLMEngine, RequestStream
    from edge_rtgi.llm.request import RequestDelta, Usage
    from edge_rtgi.server.app import Daemon

OWNER = "edge-rtgi"


def error_response(status: HTTPStatus, message: str, code: str | None = None) -> web.Response:
    """An OpenAI-style error answer outside request parsing (auth, draining, no route)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status in (HTTPStatus.UNAUTHORIZED, HTTPStatus.FORBIDDEN):
        kind = "authentication_error" if status == HTTPStatus.UNAUTHORIZED else "permission_error"
    return _json(ApiError(message, None, code, status, kind).body(), status)


def _json(body: dict[str, Any], status: HTTPStatus = HTTPStatus.OK) -> web.Response:
    return web.Response(
        status=status.value,
        body=json.dumps(body, separators=(",", ":")).encode(),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def served_models(daemon: Daemon) -> list[str]:
    """The local LLMs of the daemon's pipelines (assistant and LLM translation stages, router
    backends included; a remote backend's model is served by its own server), then any other
    engine loaded since start-up."""
    names: list[str] = []
    for pipeline in daemon.pipelines.values():
        for stage in pipeline.stages:
            if isinstance(stage, (AssistantStageConfig, TranslateStageConfig)):
                for spec in stage.backends:
                    if spec.backend == "local" and spec.model not in names:
                        names.append(spec.model)
    return names + [m for m in daemon.resources.engines() if m not in names]


def usage_body(usage: Usage | None) -> dict[str, Any]:
    """OpenAI's usage object for an engine request."""
    if usage is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class TextApi:
    """The three routes, bound to one daemon."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    async def models(self, request: web.Request) -> web.Response:
        try:
            self.daemon.admit(request)
        except Refusal as refusal:
            return self._refused(refusal, "models")
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": OWNER}
            for m in served_models(self.daemon)
        ]
        self._count("models", HTTPStatus.OK)
        return _json({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    # ------------------------------------------------------------------ one request

    def _count(self, route: str, status: HTTPStatus | str) -> None:
        label = str(status.value) if isinstance(status, HTTPStatus) else status
        self.daemon.metrics.http_requests.labels(route=route, status=label).inc()

    def _refused(self, refusal: Refusal, route: str) -> web.Response:
        self._count(route, refusal.status)
        return error_response(refusal.status, refusal.message, refusal.reason)

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        route = "chat.completions" if kind == "chat" else "completions"
        try:
            self.daemon.admit(request)
            self.daemon.admit_text_request()
        except Refusal as refusal:
            return self._refused(refusal, route)
        self.daemon.http_in_flight += 1
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                limit = self.daemon.config.server.max_message_bytes
                raise ApiError(
                    f"the request body is larger than {limit} bytes (server.max_message_bytes)",
                    None,
                    "request_too_large",
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                ) from None
            req = parse_request(kind, raw, served_models(self.daemon))
            engine = await asyncio.to_thread(self.daemon.resources.llm, req.model)
            ids, params = await self._prepare(engine, req)
            stream = engine.add_request(ids, params, request_class=RequestClass.DIALOGUE)
            if req.stream:
                response = await self._sse(request, req, stream)
            else:
                response = await self._whole(req, stream)
            self._count(route, HTTPStatus(response.status))
            return response
        except ApiError as exc:
            self._count(route, exc.status)
            return _json(exc.body(), exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            self._count(route, "disconnected")  # the client left; its engine request is aborted
            raise
        finally:
            self.daemon.http_in_flight -= 1

    async def _prepare(self, engine: LLMEngine, req: TextRequest) -> tuple[list[int], SamplingParams]:
        ids = await asyncio.to_thread(_tokenize, engine, req)
        context = int(engine.max_model_len)
        if len(ids) >= context:
            raise ApiError(
                f"the prompt is {len(ids)} tokens, and this model's context window is {context} tokens",
                "messages" if req.kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        room = context - len(ids)
        if req.max_tokens is not None and req.max_tokens > room:
            raise ApiError(
                f"max_tokens is {req.max_tokens}, but the context window of {context} tokens leaves "
                f"{room} after the {len(ids)}-token prompt",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            params = SamplingParams(
                max_tokens=req.max_tokens or room,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
                stop=req.stop,
            )
        except EdgeRtgiError as exc:
            raise ApiError(exc.message) from None
        return ids, params

    async def _whole(self, req: TextRequest, stream: RequestStream) -> web.Response:
        parts: list[str] = []
        last = None
        async with stream:
            async for delta in stream:
                parts.append(delta.text)
                last = delta
        if last is None or last.finish_reason == "error":
            raise _engine_error(last, started=bool(parts and any(parts)))
        text = "".join(parts)
        rid, created = _ids(req.kind)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(last), "logprobs": None}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        return _json(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": req.model,
                "choices": [choice],
                "usage": usage_body(last.usage),
            }
        )

    async def _sse(self, request: web.Request, req: TextRequest, stream: RequestStream) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        async with stream:
            first = await _first(stream)  # an error before any token still gets a plain 400/500
            if first.finish_reason == "error":
                raise _engine_error(first, started=False)
            await response.prepare(request)
            async for chunk in _chunks(req, first, stream):
                await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _first(stream: RequestStream) -> RequestDelta:
    async for delta in stream:
        return delta
    raise ApiError(
        "the engine ended the request without an answer",
        None,
        "engine_error",
        HTTPStatus.INTERNAL_SERVER_ERROR,
    )


async def _chunks(
    req: TextRequest, first: RequestDelta, stream: RequestStream
) -> AsyncIterator[dict[str, Any]]:
    """The SSE payloads of one streamed request, in OpenAI's chunk shapes."""
    rid, created = _ids(req.kind)
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": req.model}
    extra = {"usage": None} if req.include_usage else {}

    def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if req.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**head, "choices": [choice], **extra}

    if req.kind == "chat":
        yield chunk("", None, role=True)
    delta = first
    while True:
        if delta.finish_reason == "error":  # mid-stream: the status line is already sent
            yield {"error": _engine_error(delta, started=True).body()["error"]}
            return
        if delta.text:
            yield chunk(delta.text, None)
        if delta.finished:
            yield chunk(None, _finish(delta))
            if req.include_usage:
                yield {**head, "choices": [], "usage": usage_body(delta.usage)}
            return
        delta = await stream.__anext__()


def _tokenize(engine: LLMEngine, req: TextRequest) -> list[int]:
    """Prompt ids, as ``edge-rtgi generate`` (raw text, with the model's special tokens) and
    ``edge-rtgi chat`` (the model's chat template) make them."""
    tok = engine.tokenizer
    if tok is None:
        raise ApiError(f"model {req.model!r} has no tokenizer", "model")
    if req.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise ApiError(f"model {req.model!r} has no chat template; use /v1/completions", "model")
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        return list(tok.encode_chat(messages, add_generation_prompt=True))
    if isinstance(req.prompt, str):
        return list(tok.encode(req.prompt, add_special_tokens=True))
    vocab = engine.model.config.vocab_size
    ids = list(req.prompt or ())
    if max(ids) >= vocab:
        raise ApiError(
            f"'prompt' token ids must be below the vocabulary size {vocab}", "prompt", "invalid_value"
        )
    return ids


def _ids(kind: Kind) -> tuple[str, int]:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())


def _finish(delta: RequestDelta) -> str:
    # the engine's "abort" happens only when the client has gone or the daemon stops
    return "length" if delta.finish_reason == "length" else "stop"


def _engine_error(delta: RequestDelta | None, started: bool) -> ApiError:
    """An error delta as an answer: the engine refusing a request before its first token is
    about the request (400); a failure after tokens came is the server's (500)."""
    message = (delta.error if delta is not None else None) or "the engine failed this request"
    if delta is not None and delta.error_code == "busy":  # refused for load: try again later
        return ApiError(message, None, "busy", HTTPStatus.SERVICE_UNAVAILABLE, "server_error")
    if not started:
        return ApiError(message, None, "engine_refused")
    return ApiError(message, None, "engine_error", HTTPStatus.INTERNAL_SERVER_ERROR, "server_error")


def add_routes(router: web.UrlDispatcher, daemon: Daemon) -> None:
    """Register the routes of the text API for ``daemon``."""
    api = TextApi(daemon)
    router.add_post("/v1/chat/completions", api.chat)
    router.add_post("/v1/completions", api.completions)
    router.add_get("/v1/models", api.models)
