"""Response stages: the assistant (multi-turn chat on the shared engine) and the translator.

Both turn a ``ResponseRequest`` into ``TextDelta``s as soon as text exists and one
``TextDone``. Cancelling a response aborts its engine request at once (the engine frees
its KV blocks) and stops the stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from edge_rtgi import frames as F
from edge_rtgi.errors import ConfigError, RequestError
from edge_rtgi.llm.engine import LLMEngine, Prompt
from edge_rtgi.llm.request import Usage
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.tokenizer import ChatTokenizer
from edge_rtgi.pipeline.config import AssistantStageConfig, TranslateStageConfig
from edge_rtgi.pipeline.stage import Stage, StageContext
from edge_rtgi.pipeline.translate import (
    ApertiumTranslator,
    translation_budget_tokens,
    translation_messages,
)


def _usage_dict(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    d = {k: v for k, v in dataclasses.asdict(usage).items() if k != "token_times_ms"}
    d["total_tokens"] = usage.total_tokens
    return d


async def stream_engine(
    stage: Stage[Any],
    engine: LLMEngine,
    rid: str,
    prompt: Prompt,
    params: SamplingParams,
    priority: int = 0,
    deadline_ms: float | None = None,
) -> tuple[str, dict[str, Any] | None]:
    """Run one engine request, forwarding each text delta; returns (full text, usage)."""
    text, usage = "", None
    stream = engine.add_request(prompt, params, request_id=rid, priority=priority, deadline_ms=deadline_ms)
    try:
        async for delta in stream:
            if delta.finish_reason == "error":
                raise RequestError(f"the engine failed this request: {delta.error}")
            if delta.text:
                piece = delta.text.lstrip() if not text else delta.text
                if piece:
                    text += piece
                    await stage.ctx.forward(stage, F.TextDelta(rid, piece))
            if delta.finished:
                usage = _usage_dict(delta.usage)
    finally:
        await stream.aclose()  # no-op when finished; aborts (frees KV) when cancelled
    return text.rstrip(), usage


def trim_history(
    tokenizer: Any, system: str, turns: Sequence[F.ChatTurn], budget_tokens: int
) -> list[dict[str, str]]:
    """Chat messages that fit ``budget_tokens``: the system prompt always, then as many of the
    latest turns as fit. Dropping whole old turns keeps the system prompt a stable prefix, so
    the prefix cache keeps serving it."""
    system_msg = [{"role": "system", "content": system}]
    msgs = [{"role": turn.role, "content": turn.text} for turn in turns]
    while msgs:
        if len(tokenizer.encode_chat(system_msg + msgs)) <= budget_tokens:
            return system_msg + msgs
        # drop the oldest exchange; never start the history with an assistant turn
        msgs = msgs[1:]
        while msgs and msgs[0]["role"] != "user":
            msgs = msgs[1:]
    raise RequestError(
        "the latest user turn alone does not fit the context window",
        hint="speak in shorter turns or raise context_tokens",
    )


class AssistantStage(Stage[F.ResponseRequest]):
    name = "assistant"

    def __init__(self, ctx: StageContext, config: AssistantStageConfig, engine: LLMEngine, inbox_frames: int):
        super().__init__(ctx, inbox_frames)
        if engine.tokenizer is None:
            raise ConfigError(
                f"the assistant's model {config.model!r} has no tokenizer to build chat prompts with"
            )
        self.config = config
        self.engine = engine
        self.tokenizer: ChatTokenizer = engine.tokenizer

    def cancel(self, response_id: str) -> None:
        self.engine.abort(response_id)
        super().cancel(response_id)

    async def handle(self, req: F.ResponseRequest) -> None:
        cfg = self.config
        max_tokens = req.max_tokens or cfg.max_reply_tokens
        context = min(cfg.context_tokens or self.engine.max_model_len, self.engine.max_model_len)
        messages = trim_history(
            self.tokenizer,
            req.system_prompt or cfg.system_prompt,
            req.messages,
            context - max_tokens,
        )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=cfg.temperature if req.temperature is None else req.temperature,
            top_p=cfg.top_p,
        )
        text, usage = await stream_engine(
            self,
            self.engine,
            req.response_id,
            self.tokenizer.encode_chat(messages),
            params,
            cfg.priority,
            cfg.deadline_ms,
        )
        await self.ctx.forward(self, F.TextDone(req.response_id, text, usage=usage))


class TranslateStage(Stage[F.ResponseRequest]):
    name = "translate"

    def __init__(
        self, ctx: StageContext, config: TranslateStageConfig, engine: LLMEngine | None, inbox_frames: int
    ):
        super().__init__(ctx, inbox_frames)
        self.config = config
        self.engine = engine
        self.apertium = (
            ApertiumTranslator(
                config.source_language, config.target_language, config.apertium_pair, config.timeout_s
            )
            if config.backend == "apertium"
            else None
        )

    def cancel(self, response_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(response_id)
        super().cancel(response_id)

    async def handle(self, req: F.ResponseRequest) -> None:
        cfg, rid = self.config, req.response_id
        usage = None
        if self.apertium is not None:
            text = await self.apertium.translate(req.source_text)
            if text:
                await self.ctx.forward(self, F.TextDelta(rid, text))
        else:
            if self.engine is None or self.engine.tokenizer is None:
                raise RequestError("the llm translation backend has no engine with a tokenizer")
            tok = self.engine.tokenizer
            budget = translation_budget_tokens(
                len(tok.encode(req.source_text)), cfg.budget_ratio, cfg.min_budget_tokens
            )
            messages = translation_messages(req.source_text, cfg.source_language, cfg.target_language)
            text, usage = await stream_engine(
                self,
                self.engine,
                rid,
                tok.encode_chat(messages),
                SamplingParams(max_tokens=budget, temperature=0.0),
            )
        await self.ctx.forward(self, F.TextDone(rid, text, source_text=req.source_text, usage=usage))
