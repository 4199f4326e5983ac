"""A router between LLM backends: per turn, the cheapest one that will do.

``rule: confidence`` is a cascade. Each backend but the last starts the reply with per-token
entropies on (``BackendRequest.logprobs``); nothing is spoken while its first
``probe_tokens`` tokens are held back and judged. If their mean entropy is at most
``max_mean_entropy_nats`` the model is sure enough: the held tokens are released and the
rest streams as usual. Otherwise the attempt is closed (the engine aborts it and frees its KV
blocks) and the next backend starts the reply afresh; one that fails before its first token
hands the turn on the same way. The last backend is never judged.

``rule: features`` decides before generating, from the user's turn: long turns and turns with
a keyword go to the last backend, the rest to the first. ``rule: fallback`` is the cascade
without the judging: the first backend that sends a token keeps the turn (a remote that is
down hands it to the local engine behind it).

Every decision is logged with its reason and reported to the observer (``/metrics`` counts
them by router, backend and reason). The LLM core knows nothing of this: it only reports
entropies to requests that ask.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import AsyncGenerator, Sequence

from edge_rtgi.errors import RequestError
from edge_rtgi.pipeline.backends.base import (
    BackendDelta,
    BackendObserver,
    BackendRequest,
    BackendResult,
    LlmBackend,
    Message,
    RouteDecision,
)
from edge_rtgi.pipeline.backends.config import RouterConfig

log = logging.getLogger(__name__)


def _ms_since(start_s: float) -> float:
    return round((time.monotonic() - start_s) * 1000.0, 1)


class RouterBackend:
    """Satisfies ``LlmBackend``; ``backends`` cheapest first, as in ``config.backends``."""

    def __init__(
        self, config: RouterConfig, backends: Sequence[LlmBackend], observer: BackendObserver | None = None
    ):
        if len(backends) != len(config.backends):
            raise ValueError("one backend per router.backends entry")
        self.config = config
        self.backends = tuple(backends)
        self.observer = observer
        self._name = "router:" + ",".join(b.name for b in self.backends)
        words = [re.escape(k) for k in config.escalate_keywords]
        self._keywords = re.compile(r"\b(" + "|".join(words) + r")\b", re.IGNORECASE) if words else None

    @property
    def name(self) -> str:
        return self._name

    @property
    def context_tokens(self) -> int:
        return min(b.context_tokens for b in self.backends)  # the prompt must fit every one

    def count_tokens(self, prompt: Sequence[Message] | str) -> int:
        return max(b.count_tokens(prompt) for b in self.backends)

    async def check(self) -> str | None:
        problems = [p for b in self.backends if (p := await b.check())]
        return "; ".join(problems) or None

    async def aclose(self) -> None:
        return None  # the backends are shared (Resources closes them)

    # ------------------------------------------------------------------ decisions

    def _decide(self, decision: RouteDecision, request_id: str) -> RouteDecision:
        log.info("route %s -> %s (%s): %s", request_id, decision.chosen, decision.reason, decision.detail)
        if self.observer is not None:
            self.observer.on_route(decision)
        return decision

    def _by_features(self, request: BackendRequest) -> tuple[int, str, str]:
        cfg, text = self.config, request.user_text
        words = len(text.split())
        if cfg.escalate_min_words is not None and words >= cfg.escalate_min_words:
            return len(self.backends) - 1, "long_turn", f"{words} words >= {cfg.escalate_min_words}"
        found = self._keywords.search(text) if self._keywords else None
        if found:
            return len(self.backends) - 1, "keyword", f"the turn says {found.group(0)!r}"
        return 0, "plain_turn", f"{words} words, no keyword"

    async def stream(self, request: BackendRequest) -> AsyncGenerator[BackendDelta, None]:
        if self.config.rule == "features":
            index, reason, detail = self._by_features(request)
            chosen = self.backends[index]
            decision = self._decide(
                RouteDecision(self.name, "features", chosen.name, reason, detail), request.request_id
            )
            async for delta in self._relay(chosen.stream(request), decision):
                yield delta
            return
        async for delta in self._cascade(request):
            yield delta

    async def _relay(
        self, deltas: AsyncGenerator[BackendDelta, None], decision: RouteDecision
    ) -> AsyncGenerator[BackendDelta, None]:
        """Pass a chosen backend's deltas on, its result tagged with the decision."""
        try:
            async for delta in deltas:
                if delta.result is not None:
                    delta = dataclasses.replace(
                        delta, result=dataclasses.replace(delta.result, route=decision)
                    )
                yield delta
        finally:
            await deltas.aclose()

    async def _cascade(self, request: BackendRequest) -> AsyncGenerator[BackendDelta, None]:
        cfg = self.config
        judge = cfg.rule == "confidence"
        probe_tokens = cfg.probe_tokens if judge else 1
        tried: list[BackendResult] = []
        reason, detail = "last", "no cheaper backend"
        for backend in self.backends[:-1]:
            attempt_s = time.monotonic()
            deltas = backend.stream(dataclasses.replace(request, logprobs=judge))
            held: list[BackendDelta] = []
            entropies: list[float] = []
            tokens, finished = 0, False
            try:
                async for delta in deltas:
                    held.append(delta)
                    entropies.extend(delta.entropies_nats)
                    tokens += delta.num_tokens
                    finished = delta.result is not None
                    if finished or tokens >= probe_tokens:
                        break
            except RequestError as exc:
                await deltas.aclose()
                tried.append(self._dropped(backend, "failed", tokens, attempt_s))
                reason, detail = "failed", f"{backend.name} failed: {exc.message}"
                continue
            except BaseException:
                await deltas.aclose()  # cancelled: abort the probe
                raise
            mean = sum(entropies) / len(entropies) if entropies else 0.0
            if not judge or mean <= cfg.max_mean_entropy_nats:
                decision = self._decide(
                    RouteDecision(
                        self.name,
                        cfg.rule,
                        backend.name,
                        "confident" if judge else "answered",
                        f"mean entropy {mean:.2f} nats over {len(entropies)} tokens "
                        f"<= {cfg.max_mean_entropy_nats:g}"
                        if judge
                        else f"{backend.name} answered",
                        tuple(tried),
                        mean_entropy_nats=round(mean, 4) if judge else None,
                        probe_ms=_probe_ms(tried),
                    ),
                    request.request_id,
                )
                async for delta in self._relay(_chain(held, deltas, finished), decision):
                    yield delta
                return
            await deltas.aclose()  # nothing of it was spoken
            tried.append(self._dropped(backend, "low_confidence", tokens, attempt_s))
            reason = "low_confidence"
            detail = (
                f"{backend.name}: mean entropy {mean:.2f} nats over {len(entropies)} tokens "
                f"> {cfg.max_mean_entropy_nats:g}"
            )
        last = self.backends[-1]
        decision = self._decide(
            RouteDecision(
                self.name, cfg.rule, last.name, reason, detail, tuple(tried), probe_ms=_probe_ms(tried)
            ),
            request.request_id,
        )
        async for delta in self._relay(last.stream(request), decision):
            yield delta

    @staticmethod
    def _dropped(backend: LlmBackend, why: str, tokens: int, start_s: float) -> BackendResult:
        return BackendResult(
            backend=backend.name,
            model=backend.name,
            finish_reason=why,
            completion_tokens=tokens,
            total_ms=_ms_since(start_s),
        )


def _probe_ms(tried: list[BackendResult]) -> float | None:
    return round(sum(r.total_ms or 0.0 for r in tried), 1) if tried else None


async def _chain(
    held: list[BackendDelta], rest: AsyncGenerator[BackendDelta, None], finished: bool
) -> AsyncGenerator[BackendDelta, None]:
    """The held probe deltas, then the rest of the same stream (closed in any case)."""
    try:
        for delta in held:
            yield delta
        if not finished:
            async for delta in rest:
                yield delta
    finally:
        await rest.aclose()
