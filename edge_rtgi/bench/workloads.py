"""The four real-time workloads: their prompts, output budgets, SLOs and default offered loads.

The data under ``bench/data/`` was written for this project:

- ``dialogue``: multi-turn chats that share one system prompt (``system_prompt.txt``); request
  ``k`` of a dialogue carries the earlier turns, so prefixes are shared across and within chats.
- ``code``: Python code prefixes completed raw (no chat template), short budgets, bursty arrivals.
- ``translation``: English sentences to Spanish with reference translations; the output
  budget scales with the source length.
- ``voice``: short spoken-style questions (lower case, no punctuation, as ASR gives them)
  under the same assistant system prompt; TTFT is the figure that matters.

A workload turns into ``PreparedRequest`` records (token ids, budget, reference) with the
model's own tokenizer, so every engine and peer receives exactly the same tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from typing import Any, Protocol

from edge_rtgi.bench.loadgen import LoadSpec
from edge_rtgi.bench.metrics import SLO
from edge_rtgi.errors import ConfigError

WORKLOAD_NAMES = ("dialogue", "code", "translation", "voice")

TRANSLATION_SYSTEM = (
    "You translate English into Spanish. Reply with the Spanish translation of the "
    "user's text only, with no notes or explanations."
)
VOICE_SUFFIX = " Answer in one short sentence."
# Spanish needs more tokens than English in an English-centric BPE vocabulary.
TRANSLATION_BUDGET_RATIO = 1.5
TRANSLATION_BUDGET_EXTRA_TOKENS = 8


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class WorkloadItem:
    """One prompt of a workload: chat ``messages`` or raw ``text`` (exactly one is set)."""

    key: str
    messages: tuple[Mapping[str, str], ...] | None = None
    text: str | None = None
    reference: str | None = None
    source_text: str | None = None  # what a user would say or type (sent as-is over WebSocket)


@dataclass(frozen=True)
class Workload:
    """A named workload: its items, output budget, SLO and default offered load."""

    name: str
    description: str
    items: tuple[WorkloadItem, ...]
    max_tokens: int
    slo: SLO
    load: LoadSpec
    budget_from_source: bool = False  # translation: budget = ratio * source tokens + extra, capped
    request_class: str = "dialogue"  # llm.request.RequestClass: whom the engine serves first

    def with_overrides(
        self,
        *,
        num_requests: int | None = None,
        rate_rps: float | None = None,
        max_tokens: int | None = None,
        max_duration_s: float | None = None,
        seed: int | None = None,
    ) -> Workload:
        """A copy with a different load size, rate, budget, time bound or seed."""
        load = self.load
        if any(v is not None for v in (num_requests, rate_rps, max_duration_s, seed)):
            load = replace(
                load,
                num_requests=load.num_requests if num_requests is None else num_requests,
                rate_rps=load.rate_rps if rate_rps is None else rate_rps,
                max_duration_s=load.max_duration_s if max_duration_s is None else max_duration_s,
                seed=load.seed if seed is None else seed,
            )
        return replace(self, load=load, max_tokens=max_tokens or self.max_tokens)


@dataclass(frozen=True)
class PreparedRequest:
    """A workload item tokenised for one model: what every engine and peer is sent."""

    key: str
    workload: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    reference: str | None = None
    source_text: str | None = None
    ignore_eos: bool = False  # generate exactly max_tokens (speed measurements)
    extra: dict[str, Any] = field(default_factory=dict)
    # what the engine's slo scheduling reads (llm.request): the workload's class and SLO
    request_class: str = "dialogue"
    slo: SLO | None = None


# --- Data -------------------------------------------------------------------------------------


def _data_text(name: str) -> str:
    return resources.files("edge_rtgi.bench").joinpath("data").joinpath(name).read_text(encoding="utf-8")


def system_prompt() -> str:
    """The assistant system prompt shared by the dialogue and voice workloads."""
    return _data_text("system_prompt.txt").strip()


def code_prefixes() -> list[str]:
    """Python prefixes from ``code_prefixes.txt`` (blocks separated by ``# ===`` lines)."""
    blocks: list[str] = []
    current: list[str] = []
    started = False
    for line in _data_text("code_prefixes.txt").splitlines():
        if line.strip() == "# ===":
            if started and current:
                blocks.append("\n".join(current).rstrip() + "\n")
            current, started = [], True
        elif started:
            current.append(line)
    if current:
        blocks.append("\n".join(current).rstrip() + "\n")
    # The model continues from the end of the last line: drop the final newline of lines that
    # stop mid-expression ("return", "print(") so it completes them in place.
    return [b.rstrip("\n") if not b.rstrip("\n").endswith(":") else b for b in blocks]


def _dialogue_items() -> tuple[WorkloadItem, ...]:
    system = system_prompt()
    items = []
    for chat in json.loads(_data_text("dialogues.json")):
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        for k, turn in enumerate(chat["turns"]):
            history.append({"role": "user", "content": turn["user"]})
            items.append(
                WorkloadItem(
                    key=f"dialogue/{chat['id']}/{k}", messages=tuple(history), source_text=turn["user"]
                )
            )
            if "assistant" in turn:
                history = [*history, {"role": "assistant", "content": turn["assistant"]}]
    return tuple(items)


def _code_items() -> tuple[WorkloadItem, ...]:
    return tuple(WorkloadItem(key=f"code/{i}", text=p, source_text=p) for i, p in enumerate(code_prefixes()))


def _translation_items() -> tuple[WorkloadItem, ...]:
    pairs = json.loads(_data_text("translation_en_es.json"))
    return tuple(
        WorkloadItem(
            key=f"translation/{i}",
            reference=p["es"],
            source_text=p["en"],
            messages=(
                {"role": "system", "content": TRANSLATION_SYSTEM},
                {"role": "user", "content": p["en"]},
            ),
        )
        for i, p in enumerate(pairs)
    )


def _voice_items() -> tuple[WorkloadItem, ...]:
    system = system_prompt() + VOICE_SUFFIX
    questions = json.loads(_data_text("voice_questions.json"))
    return tuple(
        WorkloadItem(
            key=f"voice/{i}",
            source_text=q,
            messages=({"role": "system", "content": system}, {"role": "user", "content": q}),
        )
        for i, q in enumerate(questions)
    )


@lru_cache(maxsize=1)
def _all_workloads() -> dict[str, Workload]:
    return {
        "dialogue": Workload(
            "dialogue",
            "multi-turn chat with a shared system prompt",
            _dialogue_items(),
            max_tokens=48,
            slo=SLO(ttft_ms=500.0, itl_ms=50.0),
            load=LoadSpec(pattern="poisson", rate_rps=1.0, num_requests=16, max_duration_s=45.0, seed=1),
        ),
        "code": Workload(
            "code",
            "Python code completion, short completions, bursty arrivals",
            _code_items(),
            max_tokens=16,
            # completions must show up while the user is still typing
            slo=SLO(ttft_ms=300.0, itl_ms=50.0),
            load=LoadSpec(
                pattern="burst", rate_rps=2.0, burst_size=4, num_requests=16, max_duration_s=45.0, seed=2
            ),
        ),
        "translation": Workload(
            "translation",
            "English -> Spanish sentences, budget tied to source length",
            _translation_items(),
            max_tokens=64,
            budget_from_source=True,
            request_class="translation",
            slo=SLO(ttft_ms=500.0, itl_ms=50.0),
            load=LoadSpec(pattern="poisson", rate_rps=1.0, num_requests=16, max_duration_s=45.0, seed=3),
        ),
        "voice": Workload(
            "voice",
            "short spoken questions; TTFT is critical",
            _voice_items(),
            max_tokens=32,
            request_class="voice",
            slo=SLO(ttft_ms=500.0, itl_ms=50.0),
            load=LoadSpec(pattern="poisson", rate_rps=4.0, num_requests=24, max_duration_s=45.0, seed=4),
        ),
    }


def get_workload(name: str) -> Workload:
    """One workload by name; ConfigError naming the choices otherwise."""
    try:
        return _all_workloads()[name]
    except KeyError:
        raise ConfigError(
            f"unknown workload {name!r}", hint=f"choose from {', '.join(WORKLOAD_NAMES)}"
        ) from None


def get_workloads(names: Sequence[str] | None = None) -> list[Workload]:
    """Workloads by name, in the given order (all four when ``names`` is empty)."""
    return [get_workload(n) for n in (names or WORKLOAD_NAMES)]


# --- Tokenising -------------------------------------------------------------------------------


def translation_budget_tokens(source_tokens: int, cap: int) -> int:
    """Output budget for a translation of ``source_tokens`` tokens, at most ``cap``."""
    return max(
        1, min(cap, math.ceil(TRANSLATION_BUDGET_RATIO * source_tokens) + TRANSLATION_BUDGET_EXTRA_TOKENS)
    )


def prepare_item(workload: Workload, item: WorkloadItem, tokenizer: ChatTokenizer) -> PreparedRequest:
    if item.messages is not None:
        ids = tokenizer.encode_chat([dict(m) for m in item.messages], add_generation_prompt=True)
    else:
        ids = tokenizer.encode(item.text or "", add_special_tokens=False)
    budget = workload.max_tokens
    if workload.budget_from_source and item.source_text:
        budget = translation_budget_tokens(len(tokenizer.encode(item.source_text)), workload.max_tokens)
    return PreparedRequest(
        key=item.key,
        workload=workload.name,
        prompt_token_ids=tuple(ids),
        max_tokens=budget,
        reference=item.reference,
        source_text=item.source_text,
        request_class=workload.request_class,
        slo=workload.slo,
    )


def prepare(workload: Workload, tokenizer: ChatTokenizer) -> list[PreparedRequest]:
    """Tokenise every item of ``workload`` (in item order)."""
    return [prepare_item(workload, item, tokenizer) for item in workload.items]
