"""Token budgets in the harness: the ``token_budget`` and ``stopping`` switches of ``Optimisations``.

``token_budget: predicted`` gives each request a budget (``llm.budget``): translation from its
source length and the language pair's ratio, voice and dialogue from the length predictor, none
for code (its score is the first line). ``stopping: clause`` makes that budget soft (the reply
ends at the next clause past it, ``SamplingParams.token_budget``); ``stopping: eos`` makes it a
hard cap (``max_tokens``), cutting wherever the count runs out, as a plain limit would.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from edge_rtgi.bench.workloads import PreparedRequest
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.budget import LengthPredictor

TOKEN_BUDGETS = ("off", "predicted")
STOPPING = ("eos", "clause")
TRANSLATION_PAIR = "en-es"  # the task set's and the translation workload's pair


@dataclass(frozen=True)
class BudgetPolicy:
    """How the harness bounds each reply (see the module notes)."""

    token_budget: str = "off"
    stopping: str = "eos"

    def __post_init__(self) -> None:
        if self.token_budget not in TOKEN_BUDGETS:
            raise ConfigError(
                f"token_budget must be one of {', '.join(TOKEN_BUDGETS)}, got {self.token_budget!r}"
            )
        if self.stopping not in STOPPING:
            raise ConfigError(f"stopping must be one of {', '.join(STOPPING)}, got {self.stopping!r}")

    @cached_property
    def predictor(self) -> LengthPredictor:
        return LengthPredictor.load()

    def budget(self, request: PreparedRequest, tokenizer: Any) -> int | None:
        """The request's predicted budget in tokens (None: no budget for it)."""
        if self.token_budget == "off" or not request.source_text or request.workload == "code":
            return None
        if request.workload == "translation":
            source_tokens = len(tokenizer.encode(request.source_text))
            return self.predictor.translation_budget(source_tokens, TRANSLATION_PAIR, request.max_tokens)
        return self.predictor.budget(request.source_text, request.max_tokens)

    def sampling(self, request: PreparedRequest, tokenizer: Any) -> dict[str, Any]:
        """Greedy sampling fields for ``request``: its cap, and its budget by the stopping rule."""
        params: dict[str, Any] = {
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": request.ignore_eos,
        }
        budget = self.budget(request, tokenizer)
        if budget is not None and budget < request.max_tokens:
            if self.stopping == "clause":
                params["token_budget"] = budget
            else:
                params["max_tokens"] = budget
        return params
