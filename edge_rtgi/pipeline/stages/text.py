"""Response stages: the assistant (multi-turn chat) and the translator.

Both turn a ``ResponseRequest`` into ``TextDelta``s as soon as text exists and one
``TextDone``. The text comes from an ``LlmBackend`` (``pipeline.backends``): the shared local
engine, a remote OpenAI-compatible server, or a router between several; the stages cannot tell
them apart. Cancelling a response cancels the task reading the stream, which aborts the engine
request (its KV blocks are freed) or closes the remote's HTTP stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import aclosing

from edge_rtgi import frames as F
from edge_rtgi.errors import RequestError
from edge_rtgi.pipeline.backends.base import BackendRequest, BackendResult, LlmBackend, Message
from edge_rtgi.pipeline.config import AssistantStageConfig, TranslateStageConfig
from edge_rtgi.pipeline.stage import Stage, StageContext
from edge_rtgi.pipeline.translate import (
    ApertiumTranslator,
    translation_budget_tokens,
    translation_few_shot_prompt,
    translation_messages,
)


def call_stats(result: BackendResult) -> F.LlmCallStats:
    """The backend's result as the frame the session keeps for the turn's stats."""
    route = result.route
    return F.LlmCallStats(
        backend=result.backend,
        model=result.model,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens,
        connect_ms=result.connect_ms,
        ttft_ms=result.ttft_ms,
        total_ms=result.total_ms,
        attempts=result.attempts,
        route_reason=route.reason if route else None,
        escalations=len(route.tried) if route else 0,
        probe_ms=route.probe_ms if route else None,
    )


async def stream_backend(
    stage: Stage[F.ResponseRequest], backend: LlmBackend, request: BackendRequest
) -> F.TextDone:
    """Run one backend request, forwarding each text delta; returns the ``TextDone`` to send."""
    text, result = "", None
    async with aclosing(backend.stream(request)) as deltas:  # closed (aborted) when cancelled
        async for delta in deltas:
            if delta.text:
                piece = delta.text.lstrip() if not text else delta.text
                if piece:
                    text += piece
                    await stage.ctx.forward(stage, F.TextDelta(request.request_id, piece))
            if delta.result is not None:
                result = delta.result
    if result is None:
        raise RequestError(f"{backend.name} ended its stream without a result")
    return F.TextDone(request.request_id, text.rstrip(), usage=dict(result.usage()), llm=call_stats(result))


def trim_history(
    count_tokens: Callable[[Sequence[Message]], int],
    system: str,
    turns: Sequence[F.ChatTurn],
    budget_tokens: int,
) -> tuple[Message, ...]:
    """Chat messages that fit ``budget_tokens`` (as ``count_tokens`` counts a whole prompt): the
    system prompt always, then as many of the latest turns as fit. Dropping whole old turns keeps
    the system prompt a stable prefix, so the prefix cache keeps serving it."""
    system_msg = (Message("system", system),)
    msgs = tuple(Message(turn.role, turn.text) for turn in turns)
    while msgs:
        if count_tokens(system_msg + msgs) <= budget_tokens:
            return system_msg + msgs
        # drop the oldest exchange; never start the history with an assistant turn
        msgs = msgs[1:]
        while msgs and msgs[0].role != "user":
            msgs = msgs[1:]
    raise RequestError(
        "the latest user turn alone does not fit the context window",
        hint="speak in shorter turns or raise context_tokens",
    )


class AssistantStage(Stage[F.ResponseRequest]):
    name = "assistant"

    def __init__(
        self, ctx: StageContext, config: AssistantStageConfig, backend: LlmBackend, inbox_frames: int
    ):
        super().__init__(ctx, inbox_frames)
        self.config = config
        self.backend = backend

    async def handle(self, req: F.ResponseRequest) -> None:
        cfg = self.config
        max_tokens = req.max_tokens or cfg.max_reply_tokens
        window = self.backend.context_tokens
        context = min(cfg.context_tokens or window, window)
        messages = trim_history(
            self.backend.count_tokens,
            req.system_prompt or cfg.system_prompt,
            req.messages,
            context - max_tokens,
        )
        request = BackendRequest(
            request_id=req.response_id,
            max_tokens=max_tokens,
            messages=messages,
            temperature=cfg.temperature if req.temperature is None else req.temperature,
            top_p=cfg.top_p,
            priority=cfg.priority,
            deadline_ms=cfg.deadline_ms,
        )
        await self.ctx.forward(self, await stream_backend(self, self.backend, request))


class TranslateStage(Stage[F.ResponseRequest]):
    name = "translate"

    def __init__(
        self,
        ctx: StageContext,
        config: TranslateStageConfig,
        backend: LlmBackend | None,
        inbox_frames: int,
    ):
        super().__init__(ctx, inbox_frames)
        self.config = config
        self.backend = backend
        self.apertium = (
            ApertiumTranslator(
                config.source_language, config.target_language, config.apertium_pair, config.timeout_s
            )
            if config.backend == "apertium"
            else None
        )

    async def handle(self, req: F.ResponseRequest) -> None:
        cfg, rid = self.config, req.response_id
        if self.apertium is not None:
            text = await self.apertium.translate(req.source_text)
            if text:
                await self.ctx.forward(self, F.TextDelta(rid, text))
            await self.ctx.forward(self, F.TextDone(rid, text, source_text=req.source_text))
            return
        if self.backend is None:
            raise RequestError("the translate stage has no LLM backend")
        budget = translation_budget_tokens(
            self.backend.count_tokens(req.source_text), cfg.budget_ratio, cfg.min_budget_tokens
        )
        if cfg.prompt == "few-shot":  # a base model continues the pattern; the line ends it
            prompt = translation_few_shot_prompt(req.source_text, cfg.source_language, cfg.target_language)
            request = BackendRequest(
                request_id=rid, max_tokens=budget, text=prompt, stop=("\n",), add_special_tokens=True
            )
        else:
            messages = translation_messages(req.source_text, cfg.source_language, cfg.target_language)
            request = BackendRequest(
                request_id=rid,
                max_tokens=budget,
                messages=tuple(Message(m["role"], m["content"]) for m in messages),
            )
        done = await stream_backend(self, self.backend, request)
        await self.ctx.forward(self, F.TextDone(rid, done.text, req.source_text, done.usage, done.llm))
