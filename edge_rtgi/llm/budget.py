"""Token budgets: how long a reply should run, so that it can end at a clause near there.

A budget is soft: ``SamplingParams.token_budget``, past which the reply ends at the next clause
or sentence boundary (dynamic stopping, ``detokenize.BoundaryStopper``). Two sources:

- **translation**: the source length times a ratio per language pair (target tokens per source
  token, a high quantile over reference translations), plus a small allowance;
- **voice and dialogue**: ``LengthPredictor``, a linear model of log reply length over features
  of what the user said (its length, its question word, whether it asks for an explanation or
  a list), fitted by ``scripts/train_length_predictor.py`` on the model's own greedy replies.
  The budget is a quantile of the predicted length (``exp(mu + z * sigma)``), so most replies
  that would end by themselves still do.

The fitted coefficients, ratios and the predictor's measured error ship as package data
(``llm/data/length_predictor.json``, with the training conditions in its ``meta``); docs/engine.md
reports the error. No torch here: the pipeline and the HTTP API use it before a request exists.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from edge_rtgi.errors import ConfigError

FEATURES = (
    "bias",
    "log_words",
    "wh_fact",  # what, who, when, where, which, whose: usually a short fact
    "how_quantity",  # how many, how much, how old, ...
    "how_other",  # how does, how to: a process
    "why",
    "yes_no",  # is, are, can, do, ...: yes or no, often with a reason
    "open_request",  # explain, describe, tell me about, list, write, ...
    "log_clauses",  # commas and "and"s: several things asked at once
)
_WH_FACT = {"what", "who", "when", "where", "which", "whose", "whom"}
_HOW_QUANTITY = {"many", "much", "old", "long", "far", "big", "tall", "often", "high", "fast"}
_YES_NO = {
    "is",
    "are",
    "was",
    "were",
    "do",
    "does",
    "did",
    "can",
    "could",
    "will",
    "would",
    "should",
    "has",
    "have",
}
_OPEN = (
    "explain",
    "describe",
    "tell me about",
    "list",
    "write",
    "summarize",
    "summarise",
    "give me",
    "compare",
)
_WORD = re.compile(r"[a-z']+")


def text_features(text: str) -> tuple[float, ...]:
    """The predictor's features of one user turn (``FEATURES`` order)."""
    lowered = text.lower()
    words = _WORD.findall(lowered)
    first, second = (words + ["", ""])[:2]
    how = first == "how"
    return (
        1.0,
        math.log1p(len(words)),
        float(first in _WH_FACT),
        float(how and second in _HOW_QUANTITY),
        float(how and second not in _HOW_QUANTITY),
        float(first == "why"),
        float(first in _YES_NO),
        float(any(lowered.startswith(p) or f" {p} " in lowered for p in _OPEN)),
        math.log1p(lowered.count(",") + words.count("and")),
    )


def _default_path() -> Path:
    return Path(str(resources.files("edge_rtgi.llm").joinpath("data").joinpath("length_predictor.json")))


@dataclass(frozen=True)
class LengthPredictor:
    """Predicted reply lengths and the budgets made from them (see the module notes)."""

    coefficients: tuple[float, ...]
    sigma: float  # residual standard deviation of log(1 + tokens)
    quantile_z: float  # budget = exp(mu + quantile_z * sigma) - 1
    min_budget_tokens: int
    translation_ratios: dict[str, float] = field(default_factory=dict)
    translation_extra_tokens: int = 4
    default_translation_ratio: float = 2.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(
                f"a length predictor has {len(FEATURES)} coefficients, got {len(self.coefficients)}"
            )
        if self.sigma < 0 or self.min_budget_tokens < 1:
            raise ValueError("sigma must be >= 0 and min_budget_tokens >= 1")

    @classmethod
    def load(cls, path: str | Path | None = None) -> LengthPredictor:
        """The predictor in ``path`` (default: the one shipped with the package)."""
        path = Path(path) if path is not None else _default_path()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                coefficients=tuple(float(c) for c in data["coefficients"]),
                sigma=float(data["sigma"]),
                quantile_z=float(data["quantile_z"]),
                min_budget_tokens=int(data["min_budget_tokens"]),
                translation_ratios={str(k): float(v) for k, v in data.get("translation_ratios", {}).items()},
                translation_extra_tokens=int(data.get("translation_extra_tokens", 4)),
                default_translation_ratio=float(data.get("default_translation_ratio", 2.0)),
                meta=dict(data.get("meta", {})),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"cannot read the length predictor {path}: {exc}",
                hint="run scripts/train_length_predictor.py to write it again",
            ) from None

    def save(self, path: str | Path) -> None:
        data = {
            "features": list(FEATURES),
            "coefficients": list(self.coefficients),
            "sigma": self.sigma,
            "quantile_z": self.quantile_z,
            "min_budget_tokens": self.min_budget_tokens,
            "translation_ratios": self.translation_ratios,
            "translation_extra_tokens": self.translation_extra_tokens,
            "default_translation_ratio": self.default_translation_ratio,
            "meta": self.meta,
        }
        Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    def predict_tokens(self, text: str) -> float:
        """The predicted (median) reply length in tokens."""
        mu = sum(c * f for c, f in zip(self.coefficients, text_features(text), strict=True))
        return max(0.0, math.expm1(mu))

    def budget(self, text: str, cap: int) -> int:
        """A soft token budget for a reply to ``text``, at most ``cap``."""
        mu = sum(c * f for c, f in zip(self.coefficients, text_features(text), strict=True))
        tokens = math.ceil(math.expm1(mu + self.quantile_z * self.sigma))
        return max(1, min(cap, max(self.min_budget_tokens, tokens)))

    def translation_budget(self, source_tokens: int, pair: str, cap: int) -> int:
        """A soft budget for translating ``source_tokens`` tokens over ``pair`` ("en-es")."""
        ratio = self.translation_ratios.get(pair, self.default_translation_ratio)
        return max(1, min(cap, math.ceil(source_tokens * ratio) + self.translation_extra_tokens))


@lru_cache(maxsize=1)
def default_predictor() -> LengthPredictor:
    """The shipped predictor, read once per process."""
    return LengthPredictor.load()
