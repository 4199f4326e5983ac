"""Response stages: the assistant (multi-turn chat) and the translator.

Both turn a ``ResponseRequest`` into ``TextDelta``s as soon as text exists and one
``TextDone``. The text comes from an ``LlmBackend`` (``pipeline.backends``): the shared local
engine, a remote OpenAI-compatible server, or a router between several; the stages cannot tell
them apart. Cancelling a response cancels the task reading the stream, which aborts the engine
request (its KV blocks are freed) or closes the remote's HTTP stream.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from edge_rtgi import frames as F
from edge_rtgi.errors import RequestError
from edge_rtgi.llm.budget import default_predictor
from edge_rtgi.pipeline.backends.base import BackendRequest, BackendResult, LlmBackend, Message
from edge_rtgi.pipeline.config import AssistantStageConfig, TranslateStageConfig, speculative_setting
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


class TokenCounter(Protocol):
    """What history fitting needs of a backend (every ``LlmBackend`` is one)."""

    def count_tokens(self, prompt: Sequence[Message] | str) -> int:
        """Tokens of a chat prompt (with its template) or of plain text."""


@dataclass(frozen=True)
class ChatPrompt:
    """The chat messages that fit the budget, and their tokens as the backend counts them."""

    messages: tuple[Message, ...]
    prompt_tokens: int


class TurnTokenCounts:
    """Token counts of the turns of one conversation, each turn counted once in its life.

    Trimming a long history used to re-render the whole chat template after every dropped
    exchange, on the event loop; with these counts it drops turns by arithmetic and renders the
    template once or twice. A count is the turn's text plus the template's per-message overhead
    (measured once), an estimate the exact count of the whole prompt then checks. ``lock``: a
    cancelled fit may still be running in its worker thread when the next one starts.
    """

    def __init__(self, counter: TokenCounter):
        self.counter = counter
        self.lock = threading.Lock()
        self._texts: dict[str, int] = {}
        self._overhead_tokens: int | None = None

    def _overhead(self) -> int:
        if self._overhead_tokens is None:
            probe = "x"
            try:
                system = (Message("system", probe),)
                both = system + (Message("user", probe),)
                extra = self.counter.count_tokens(both) - self.counter.count_tokens(system)
                self._overhead_tokens = max(0, extra - self.counter.count_tokens(probe))
            except Exception:  # noqa: BLE001 - a template that refuses the probe: the exact check decides
                self._overhead_tokens = 0
        return self._overhead_tokens

    def count(self, text: str) -> int:
        """The estimated tokens of one message holding ``text``."""
        n = self._texts.get(text)
        if n is None:
            n = self._texts[text] = self.counter.count_tokens(text) + self._overhead()
        return n

    def keep_only(self, texts: Sequence[str]) -> None:
        """Forget the counts of turns no longer in the history (bounded memory)."""
        wanted = set(texts)
        self._texts = {t: n for t, n in self._texts.items() if t in wanted}


def _exchange_starts(msgs: Sequence[Message]) -> list[int]:
    """Indices where the kept history may start: the whole history, or a user turn (a trimmed
    history never starts with an assistant turn)."""
    return [i for i, m in enumerate(msgs) if i == 0 or m.role == "user"]


def fit_history(
    counter: TokenCounter,
    system: str,
    turns: Sequence[F.ChatTurn],
    budget_tokens: int,
    counts: TurnTokenCounts | None = None,
    summary_words: int = 0,
) -> ChatPrompt:
    """The system prompt always, then as many of the latest turns as fit ``budget_tokens`` (as
    ``counter``, the backend that runs the turn, counts a whole prompt).

    Dropping whole old exchanges keeps the system prompt a stable prefix, so the prefix cache
    keeps serving it. With ``summary_words``, the dropped exchanges leave a one-line note of what
    the user said in them (``summary_line``) after the system prompt, within the same budget.
    CPU-bound: call it from a worker thread, never on the event loop.
    """
    counts = counts or TurnTokenCounts(counter)
    with counts.lock:
        prompt = _fit(counter, system, turns, budget_tokens, counts)
        for _ in range(2):  # the note may push one more exchange out: note that one too
            dropped = turns[: len(turns) - (len(prompt.messages) - 1)]
            line = summary_line(dropped, summary_words) if summary_words > 0 else ""
            if not line:
                return prompt
            try:
                noted = _fit(counter, f"{system}\n{line}", turns, budget_tokens, counts)
            except RequestError:  # the note leaves no room for the latest turn: go without it
                return prompt
            if len(noted.messages) == len(prompt.messages):
                return noted
            prompt = noted
        return prompt


_FACT = re.compile(r"\d|\b[A-Z][a-z]+\b")


def summary_line(turns: Sequence[F.ChatTurn], max_words: int) -> str:
    """A one-line note of what the user said in ``turns``, at most ``max_words`` words: user
    turns holding numbers or names first (the facts a later question asks for), then the
    latest, each cut to its first 16 words, written in the order they were said."""
    said = [(i, t.text.split()) for i, t in enumerate(turns) if t.role == "user" and t.text.strip()]
    if not said:
        return ""
    ranked = sorted(said, key=lambda it: (not _FACT.search(" ".join(it[1][1:])), -it[0]))
    chosen, left = [], max_words
    for i, words in ranked:  # facts first, the latest first among equals; each to its first words
        if left < 3:
            break
        piece = words[: min(16, left)]
        chosen.append((i, " ".join(piece).rstrip(",;.")))
        left -= len(piece)
    if not chosen:
        return ""
    return "Earlier in this conversation the user said: " + "; ".join(t for _, t in sorted(chosen)) + "."


def _fit(
    counter: TokenCounter,
    system: str,
    turns: Sequence[F.ChatTurn],
    budget_tokens: int,
    counts: TurnTokenCounts,
) -> ChatPrompt:
    system_msg = (Message("system", system),)
    msgs = tuple(Message(turn.role, turn.text) for turn in turns)
    counts.keep_only([system] + [m.content for m in msgs])
    starts = _exchange_starts(msgs)
    # estimated tokens of msgs[i:] for each start, and of the system prompt
    suffix = [0] * (len(msgs) + 1)
    for i in range(len(msgs) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + counts.count(msgs[i].content)
    fixed = counts.count(system)
    fitting = [k for k, i in enumerate(starts) if fixed + suffix[i] <= budget_tokens]
    k = fitting[0] if fitting else len(starts) - 1
    best: ChatPrompt | None = None
    while 0 <= k < len(starts):
        chosen = system_msg + msgs[starts[k] :]
        n = counter.count_tokens(chosen)
        if n <= budget_tokens:
            best = ChatPrompt(chosen, n)
            k -= 1  # the estimate may be high: try one more exchange
        elif best is not None:
            break
        else:
            k += 1  # the estimate was low: drop one more exchange
    if best is None:
        raise RequestError(
            "the latest user turn alone does not fit the context window",
            hint="speak in shorter turns or raise context_tokens",
        )
    return best


def trim_history(
    counter: TokenCounter, system: str, turns: Sequence[F.ChatTurn], budget_tokens: int
) -> tuple[Message, ...]:
    """The messages of ``fit_history`` (for callers that only want the messages)."""
    return fit_history(counter, system, turns, budget_tokens).messages


def _reply_budget(mode: str, messages: Sequence[Message], cap: int) -> int | None:
    """The predicted soft budget of a reply to the last user turn (None when off)."""
    if mode != "predicted":
        return None
    user = next((m.content for m in reversed(messages) if m.role == "user"), "")
    return default_predictor().budget(user, cap)


class AssistantStage(Stage[F.ResponseRequest]):
    name = "assistant"

    def __init__(
        self, ctx: StageContext, config: AssistantStageConfig, backend: LlmBackend, inbox_frames: int
    ):
        super().__init__(ctx, inbox_frames)
        self.config = config
        self.backend = backend
        self.counts = TurnTokenCounts(backend)

    async def handle(self, req: F.ResponseRequest) -> None:
        cfg = self.config
        max_tokens = req.max_tokens or cfg.max_reply_tokens
        window = self.backend.context_tokens
        context = min(cfg.context_tokens or window, window)
        prompt = await asyncio.to_thread(  # counting a long history must not stall the loop
            fit_history,
            self.backend,
            req.system_prompt or cfg.system_prompt,
            req.messages,
            context - max_tokens,
            self.counts,
            cfg.history_summary_words,
        )
        request = BackendRequest(
            request_id=req.response_id,
            max_tokens=max_tokens,
            messages=prompt.messages,
            temperature=cfg.temperature if req.temperature is None else req.temperature,
            top_p=cfg.top_p,
            priority=cfg.priority,
            request_class=cfg.slo.klass,
            slo=cfg.slo.objective(),
            token_budget=_reply_budget(cfg.token_budget, prompt.messages, max_tokens),
            deadline_ms=cfg.reply_deadline_ms,
            speculative=speculative_setting(cfg.speculative),
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
        source_tokens = await asyncio.to_thread(self.backend.count_tokens, req.source_text)  # off the loop
        budget = translation_budget_tokens(source_tokens, cfg.budget_ratio, cfg.min_budget_tokens)
        soft: int | None = None
        if cfg.token_budget == "predicted":  # soft: the reply ends at a clause past it
            pair = f"{cfg.source_language}-{cfg.target_language}"
            soft = default_predictor().translation_budget(source_tokens, pair, budget)
        if cfg.prompt == "few-shot":  # a base model continues the pattern; the line ends it
            prompt = translation_few_shot_prompt(req.source_text, cfg.source_language, cfg.target_language)
            request = BackendRequest(
                request_id=rid,
                max_tokens=budget,
                text=prompt,
                stop=("\n",),
                add_special_tokens=True,
                request_class=cfg.slo.klass,
                slo=cfg.slo.objective(),
                token_budget=soft,
                speculative=speculative_setting(cfg.speculative),
            )
        else:
            messages = translation_messages(req.source_text, cfg.source_language, cfg.target_language)
            request = BackendRequest(
                request_id=rid,
                max_tokens=budget,
                messages=tuple(Message(m["role"], m["content"]) for m in messages),
                request_class=cfg.slo.klass,
                slo=cfg.slo.objective(),
                token_budget=soft,
                speculative=speculative_setting(cfg.speculative),
            )
        done = await stream_backend(self, self.backend, request)
        await self.ctx.forward(self, F.TextDone(rid, done.text, req.source_text, done.usage, done.llm))
