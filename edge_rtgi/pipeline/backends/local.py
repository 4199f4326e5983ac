"""The daemon's own engine as a backend: one shared ``LLMEngine`` per model (``Resources``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING

from edge_rtgi.errors import ConfigError, EngineBusy, RequestError
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.pipeline.backends.base import BackendDelta, BackendRequest, BackendResult, Message

if TYPE_CHECKING:
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.tokenizer import ChatTokenizer
    from edge_rtgi.pipeline.backends.base import BackendObserver


def _chat(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


class TokenizerCounter:
    """Exact token counts with a model's own tokenizer and chat template (``LocalBackend``'s
    ``count_tokens``; a ``TokenCounter`` for history fitting)."""

    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer

    def count_tokens(self, prompt: Sequence[Message] | str) -> int:
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt))
        return len(self.tokenizer.encode_chat(_chat(prompt)))


class LocalBackend:
    """Streams from a local engine; exact token counts, per-token entropies on request.

    A raw ``text`` prompt is tokenised without special tokens, as the task sets' code items
    are (``bench.tasks.prepare_task_item``).
    """

    def __init__(
        self, engine: LLMEngine, model: str, observer: BackendObserver | None = None, label: str | None = None
    ):
        if engine.tokenizer is None:
            raise ConfigError(f"the model {model!r} has no tokenizer to build prompts with")
        self.engine = engine
        self.model = model
        self.tokenizer: ChatTokenizer = engine.tokenizer
        self._counter = TokenizerCounter(self.tokenizer)
        self.observer = observer
        self._name = label or f"local:{model}"

    @property
    def name(self) -> str:
        return self._name

    @property
    def context_tokens(self) -> int:
        return int(self.engine.max_model_len)

    def count_tokens(self, prompt: Sequence[Message] | str) -> int:
        return self._counter.count_tokens(prompt)

    def _prompt_ids(self, request: BackendRequest) -> list[int]:
        if request.text is not None:
            return list(self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens))
        return list(self.tokenizer.encode_chat(_chat(request.messages)))

    async def stream(self, request: BackendRequest) -> AsyncGenerator[BackendDelta, None]:
        start_s = time.monotonic()
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            logprobs=request.logprobs,
            stop=request.stop,
            token_budget=request.token_budget,
            deadline_ms=request.deadline_ms,
            speculative=request.speculative,
        )
        try:  # a long chat prompt takes milliseconds to render: not on the event loop
            prompt_ids = await asyncio.to_thread(self._prompt_ids, request)
        except asyncio.CancelledError:
            if self.observer is not None:
                self.observer.on_failure(self.name, "cancelled")
            raise
        stream = self.engine.add_request(
            prompt_ids,
            params,
            request_id=request.request_id,
            priority=request.priority,
            request_class=request.request_class,
            slo=request.slo,
        )
        finished = False
        try:
            async for delta in stream:
                if delta.finish_reason == "error":
                    if delta.error_code == "busy":
                        raise EngineBusy(delta.error or "busy", delta.retry_after_ms or 1000.0)
                    raise RequestError(f"the engine failed this request: {delta.error}")
                result = None
                if delta.finished:
                    finished = True
                    usage = delta.usage
                    result = BackendResult(
                        backend=self.name,
                        model=self.model,
                        finish_reason=delta.finish_reason or "stop",
                        prompt_tokens=usage.prompt_tokens if usage else None,
                        completion_tokens=usage.completion_tokens if usage else None,
                        cached_tokens=usage.cached_tokens if usage else None,
                        ttft_ms=usage.ttft_ms if usage else None,
                        total_ms=round((time.monotonic() - start_s) * 1000.0, 1),
                    )
                    if self.observer is not None:
                        self.observer.on_result(result)
                yield BackendDelta(
                    delta.text,
                    len(delta.token_ids),
                    tuple(lp.entropy_nats for lp in delta.logprobs),
                    result,
                )
        finally:
            await stream.aclose()  # no-op when finished; aborts (frees KV) when cancelled or closed
            if not finished and self.observer is not None:
                self.observer.on_failure(self.name, "cancelled")

    async def check(self) -> str | None:
        return None

    async def aclose(self) -> None:
        return None
