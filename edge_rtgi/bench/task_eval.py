"""Task retention: the graded task sets run on an optimised configuration and on the full model.

Retention of one workload = min(1, task score of the optimised configuration / task score of the
full model) over the same graded items (``bench/data/tasks``), with a paired bootstrap interval
over items (``scoring.retention``). The task score is the set's own metric: answer accuracy
(voice), recall accuracy (dialogue), edit similarity of the first generated line (code), corpus
chrF against the references (translation). Definitions: docs/benchmarks.md, docs/task-sets.md.

The full model is the same weights in fp32 with no lossy optimisation, on the plain path
(``edge_rtgi.llm.generate``). Its greedy outputs depend only on the model file, the items and the
code, so ``FullOutputCache`` keeps them on disk and each is computed once per model and task set.

Beside the ratio, and never in it: *fidelity*, the chrF of the optimised outputs against the full
model's (100 = the same text), and the set's secondary scores (exact match for code, BLEU for
translation, recall per distance for dialogue).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_rtgi.bench.budgets import BudgetPolicy
from edge_rtgi.bench.tasks import (
    DIALOGUE_DISTANCES,
    AnswerScore,
    CodeScore,
    DialogueScore,
    TaskItem,
    TaskSet,
    TranslationItem,
    TranslationScore,
    load_task_set,
    prepare_task_item,
    score_item,
)
from edge_rtgi.bench.workloads import PreparedRequest
from edge_rtgi.scoring.retention import RatioInterval, paired_chrf_ratio_interval, paired_ratio_interval
from edge_rtgi.scoring.text import bleu_score, chrf_score

if TYPE_CHECKING:
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.tokenizer import ChatTokenizer
    from edge_rtgi.llm.weights import LoadedModel

log = logging.getLogger(__name__)

# The score that enters each set's retention ratio.
TASK_METRICS = {
    "voice": "answer accuracy",
    "dialogue": "recall accuracy",
    "code": "edit similarity of the first line",
    "translation": "chrF vs references",
}

# Bump when anything that shapes the full model's outputs changes (prompt building, budgets,
# generation): cached outputs of another version are never used.
FULL_OUTPUTS_VERSION = 1


@dataclass(frozen=True)
class TaskOutputs:
    """One configuration's greedy outputs on (a selection of) a task set, in item order."""

    task_set: str
    item_ids: tuple[str, ...]
    texts: tuple[str, ...]
    completion_tokens: tuple[int, ...]


def select_items(task_set: TaskSet, limit: int | None = None) -> tuple[TaskItem, ...]:
    """The whole set, or ``limit`` items spread evenly over it (every distance of the dialogue
    set keeps its share; the files are ordered by kind)."""
    items = task_set.items
    if limit is None or limit >= len(items):
        return items
    if limit < 1:
        raise ValueError(f"a task item limit must be >= 1, got {limit}")
    return tuple(items[(i * len(items)) // limit] for i in range(limit))


def prepare_items(
    items: Sequence[TaskItem], tokenizer: ChatTokenizer, context_tokens: int | None = None
) -> list[PreparedRequest]:
    """Tokenise the items as the engine receives them (workload prompts, task budgets).

    With ``context_tokens``, items whose prompt and budget do not fit that window are left out
    (a small model's short context); both sides of a comparison pass the same window, so they
    score the same items.
    """
    requests = [prepare_task_item(item, tokenizer) for item in items]
    if context_tokens is None:
        return requests
    return [r for r in requests if len(r.prompt_token_ids) + r.max_tokens <= context_tokens]


def run_on_engine(
    engine: LLMEngine,
    task_set: TaskSet,
    limit: int | None = None,
    context_tokens: int | None = None,
    budgets: BudgetPolicy | None = None,
) -> TaskOutputs:
    """Greedy outputs of ``engine`` (as configured: quantised, windowed, speculative...) on the
    items, all submitted at once so the engine batches them as it would under load; ``budgets``
    bounds each reply as the harness's token-budget switches say."""
    from edge_rtgi.llm.sampling import SamplingParams

    if engine.tokenizer is None:
        raise ValueError("task sets need an engine with a tokenizer")
    items = select_items(task_set, limit)
    requests = prepare_items(items, engine.tokenizer, context_tokens)
    policy = budgets or BudgetPolicy()
    params = [SamplingParams(**policy.sampling(r, engine.tokenizer)) for r in requests]
    results = engine.generate([list(r.prompt_token_ids) for r in requests], params)
    failed = [
        (r.key, res.error) for r, res in zip(requests, results, strict=True) if res.finish_reason == "error"
    ]
    if failed:
        raise RuntimeError(f"the engine failed {len(failed)} task items, e.g. {failed[0][0]}: {failed[0][1]}")
    return TaskOutputs(
        task_set.name,
        tuple(r.key for r in requests),
        tuple(res.text for res in results),
        tuple(len(res.token_ids) for res in results),
    )


@dataclass(frozen=True)
class FullOutputCache:
    """The full model's task outputs on disk, keyed by model file, prompts, budgets and code version.

    A key that does not match (another file, prompt or version) is simply another entry: a stale
    entry is never used.
    """

    folder: Path

    @classmethod
    def default(cls) -> FullOutputCache:
        """``$EDGE_RTGI_BENCH_CACHE``, else ``$XDG_CACHE_HOME/edge-rtgi/bench/full-outputs``, else
        ``~/.cache/edge-rtgi/bench/full-outputs``."""
        explicit = os.environ.get("EDGE_RTGI_BENCH_CACHE")
        if explicit:
            return cls(Path(explicit).expanduser())
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
        return cls(root / "edge-rtgi" / "bench" / "full-outputs")

    def key(self, source: Path, request: PreparedRequest) -> str:
        digest = hashlib.sha256()
        for part in (
            FULL_OUTPUTS_VERSION,
            _fingerprint(source),
            request.max_tokens,
            request.prompt_token_ids,
        ):
            digest.update(repr(part).encode())
        return digest.hexdigest()

    def _path(self, source: Path, task_set: str) -> Path:
        name = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
        return self.folder / f"{task_set}-{name}.json"

    def load(self, source: Path, task_set: str) -> dict[str, dict[str, Any]]:
        path = self._path(source, task_set)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save(self, source: Path, task_set: str, entries: dict[str, dict[str, Any]]) -> None:
        path = self._path(source, task_set)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries), encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:  # a read-only cache costs time, not correctness
            log.warning("cannot write the full-model output cache %s: %s", path, exc)


def _fingerprint(source: Path) -> tuple[tuple[str, int, int], ...]:
    """Name, size and modification time of the model file, or of every file of a model folder:
    rewriting any of them changes the key."""
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    return tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def run_full_model(
    full: LoadedModel,
    task_set: TaskSet,
    limit: int | None = None,
    cache: FullOutputCache | None = None,
    context_tokens: int | None = None,
) -> TaskOutputs:
    """The full model's greedy outputs (fp32, plain path) on the items, cached per item."""
    import torch

    from edge_rtgi.llm.generate import generate
    from edge_rtgi.llm.sampling import SamplingParams

    if full.model.dtype != torch.float32:
        raise ValueError(f"the full model runs in fp32, got {full.model.dtype}")
    items = select_items(task_set, limit)
    requests = prepare_items(items, full.tokenizer, context_tokens)
    entries = cache.load(full.source, task_set.name) if cache is not None else {}
    texts, counts, fresh = [], [], 0
    for req in requests:
        key = cache.key(full.source, req) if cache is not None else ""
        hit = entries.get(key)
        if hit is None:
            res = generate(full, list(req.prompt_token_ids), SamplingParams(max_tokens=req.max_tokens))
            hit = {"text": res.text, "tokens": len(res.token_ids)}
            entries[key] = hit
            fresh += 1
        texts.append(str(hit["text"]))
        counts.append(int(hit["tokens"]))
    if cache is not None and fresh:
        cache.save(full.source, task_set.name, entries)
    return TaskOutputs(task_set.name, tuple(r.key for r in requests), tuple(texts), tuple(counts))


@dataclass(frozen=True)
class DistanceRetention:
    """Dialogue recall at one distance (exchanges between the fact and the question)."""

    distance_turns: int
    n: int
    full_score: float
    optimised_score: float
    retention: float


@dataclass(frozen=True)
class TaskRetention:
    """One workload's task retention with its interval and diagnostics.

    ``interval`` holds n, both scores, the capped and uncapped ratio and its paired-bootstrap
    bounds; ``secondary`` holds the set's other scores for both sides (exact match, BLEU);
    ``fidelity_chrf`` is chrF of the optimised outputs against the full model's (a fidelity
    diagnostic, never part of the ratio).
    """

    task_set: str
    metric: str
    interval: RatioInterval
    fidelity_chrf: float
    mean_completion_tokens_full: float
    mean_completion_tokens_optimised: float
    secondary: dict[str, float] = field(default_factory=dict)
    per_distance: tuple[DistanceRetention, ...] = ()

    @property
    def retention(self) -> float:
        return self.interval.ratio

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["retention"] = self.retention
        return out


def task_retention(
    task_set: TaskSet, optimised: TaskOutputs, full: TaskOutputs, seed: int = 0
) -> TaskRetention:
    """Score both output sets on the same items and compare them (paired bootstrap over items)."""
    if optimised.item_ids != full.item_ids:
        raise ValueError(f"{task_set.name}: the two runs scored different items")
    if not full.item_ids:
        raise ValueError(
            f"{task_set.name}: no graded item fits the context window, so there is nothing to score"
        )
    by_id = {item.id: item for item in task_set.items}
    items = [by_id[i] for i in full.item_ids]
    opt_scores = [score_item(item, text) for item, text in zip(items, optimised.texts, strict=True)]
    full_scores = [score_item(item, text) for item, text in zip(items, full.texts, strict=True)]
    secondary: dict[str, float] = {}
    per_distance: tuple[DistanceRetention, ...] = ()
    if task_set.name == "translation":
        interval = paired_chrf_ratio_interval(
            [_chrf_row(s) for s in opt_scores], [_chrf_row(s) for s in full_scores], seed=seed
        )
        refs = [list(item.references) for item in items if isinstance(item, TranslationItem)]
        secondary = {
            "bleu_full": bleu_score(full.texts, refs),
            "bleu_optimised": bleu_score(optimised.texts, refs),
        }
    else:
        interval = paired_ratio_interval(
            [_value(s) for s in opt_scores], [_value(s) for s in full_scores], seed=seed
        )
        if task_set.name == "code":
            secondary = {
                "exact_match_full": _mean([float(s.exact) for s in full_scores if isinstance(s, CodeScore)]),
                "exact_match_optimised": _mean(
                    [float(s.exact) for s in opt_scores if isinstance(s, CodeScore)]
                ),
            }
        if task_set.name == "dialogue":
            per_distance = _per_distance(opt_scores, full_scores)
    return TaskRetention(
        task_set=task_set.name,
        metric=TASK_METRICS[task_set.name],
        interval=interval,
        fidelity_chrf=chrf_score(optimised.texts, [[t] for t in full.texts]) if any(full.texts) else 100.0,
        mean_completion_tokens_full=_mean([float(c) for c in full.completion_tokens]),
        mean_completion_tokens_optimised=_mean([float(c) for c in optimised.completion_tokens]),
        secondary=secondary,
        per_distance=per_distance,
    )


def _value(score: object) -> float:
    if isinstance(score, (AnswerScore, DialogueScore)):
        return float(score.correct)
    if isinstance(score, CodeScore):
        return score.edit_similarity
    raise TypeError(f"no per-item value for {type(score).__name__}")


def _chrf_row(score: object) -> tuple[int, ...]:
    if not isinstance(score, TranslationScore):
        raise TypeError(f"expected a translation score, got {type(score).__name__}")
    return score.chrf_statistics


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _per_distance(opt: Sequence[object], full: Sequence[object]) -> tuple[DistanceRetention, ...]:
    rows = []
    for distance in DIALOGUE_DISTANCES:
        pairs = [
            (o.correct, f.correct)
            for o, f in zip(opt, full, strict=True)
            if isinstance(o, DialogueScore) and isinstance(f, DialogueScore) and f.distance_turns == distance
        ]
        if not pairs:
            continue
        full_score, opt_score = _mean([float(f) for _, f in pairs]), _mean([float(o) for o, _ in pairs])
        ratio = 1.0 if full_score <= 0 else min(1.0, opt_score / full_score)
        rows.append(DistanceRetention(distance, len(pairs), full_score, opt_score, ratio))
    return tuple(rows)


def evaluate(
    engine: LLMEngine,
    full: LoadedModel,
    names: Sequence[str],
    limit: int | None = None,
    cache: FullOutputCache | None = None,
    budgets: BudgetPolicy | None = None,
) -> dict[str, TaskRetention]:
    """Task retention of ``engine`` on each named task set (the full model's outputs cached);
    ``budgets``: the engine side's token budgets (the full model never has any)."""
    context = shared_context_tokens(engine, full)
    out = {}
    for name in names:
        task_set = load_task_set(name)
        full_outputs = run_full_model(full, task_set, limit, cache, context)
        if not full_outputs.item_ids:  # a small model's context: say so rather than invent a figure
            log.warning(
                "no %s item fits a %d-token context window: its retention is not measured", name, context
            )
            continue
        opt_outputs = run_on_engine(engine, task_set, limit, context, budgets)
        out[name] = task_retention(task_set, opt_outputs, full_outputs)
    return out


def shared_context_tokens(engine: LLMEngine, full: LoadedModel) -> int:
    """The window both sides can serve: items that do not fit it are scored by neither."""
    return min(engine.max_model_len, full.model.config.max_position_embeddings)
