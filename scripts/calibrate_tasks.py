#!/usr/bin/env python3
"""Calibrate the graded task sets: run the full model on each set and print its scores.

The full model is SmolLM2-135M-Instruct in fp32 on the plain generation path
(``edge_rtgi.llm.generate``), greedy, with the prompts and budgets of ``edge_rtgi.bench.tasks``
(voice 48 new tokens, dialogue 48, code 32 as a raw completion, translation the workload's
source-length rule). A set that the model always passes or always fails measures nothing, so
the figures printed here (in docs/task-sets.md) should show some right and some wrong.

    python scripts/calibrate_tasks.py                          # all four sets
    python scripts/calibrate_tasks.py --sets voice,code --limit 20
    python scripts/calibrate_tasks.py --out bench_out/calibration   # + per-item outputs (JSONL)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from edge_rtgi.bench.task_eval import FullOutputCache, run_full_model, select_items
from edge_rtgi.bench.tasks import (
    DIALOGUE_DISTANCES,
    TASK_SET_NAMES,
    AnswerScore,
    CodeScore,
    DialogueScore,
    ItemScore,
    TaskItem,
    TaskSet,
    TranslationItem,
    TranslationScore,
    load_task_set,
    score_item,
)
from edge_rtgi.scoring.text import bleu_score, chrf_from_statistics


@dataclass(frozen=True)
class SetSummary:
    """The scores of one set: a headline figure, and the lines to print."""

    name: str
    n: int
    score: float
    lines: tuple[str, ...]


def parse_sets(text: str) -> list[str]:
    """``"voice,code"`` -> ["voice", "code"], refusing unknown names (argparse error)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in TASK_SET_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown task set(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(TASK_SET_NAMES)}"
        )
    return names


def summarise(
    task_set: TaskSet,
    scores: Sequence[ItemScore],
    outputs: Sequence[str],
    items: Sequence[TaskItem] | None = None,
) -> SetSummary:
    """Per-set figures: accuracy (voice; dialogue also per distance), exact match and edit
    similarity (code), corpus chrF and BLEU (translation)."""
    n = len(scores)
    name = task_set.name
    if name in ("voice", "dialogue"):
        correct = [s.correct for s in scores if isinstance(s, AnswerScore | DialogueScore)]
        lines = [f"{name}: n={n} accuracy={100 * sum(correct) / n:.1f} % ({sum(correct)}/{n})"]
        if name == "dialogue":
            for d in DIALOGUE_DISTANCES:
                at = [s.correct for s in scores if isinstance(s, DialogueScore) and s.distance_turns == d]
                if at:
                    lines.append(f"  distance {d:>2}: n={len(at)} accuracy={100 * sum(at) / len(at):.1f} %")
        return SetSummary(name, n, 100 * sum(correct) / n, tuple(lines))
    if name == "code":
        code = [s for s in scores if isinstance(s, CodeScore)]
        exact = sum(s.exact for s in code)
        edit = sum(s.edit_similarity for s in code) / n
        return SetSummary(
            name,
            n,
            100 * exact / n,
            (f"code: n={n} exact={100 * exact / n:.1f} % ({exact}/{n}) edit_similarity={edit:.3f}",),
        )
    stats = [s.chrf_statistics for s in scores if isinstance(s, TranslationScore)]
    chrf = chrf_from_statistics(stats)
    chosen = items if items is not None else task_set.items[:n]
    refs = [item.references for item in chosen if isinstance(item, TranslationItem)]
    bleu = bleu_score([o.strip() for o in outputs], refs)
    return SetSummary(name, n, chrf, (f"translation: n={n} chrF={chrf:.1f} BLEU={bleu:.1f}",))


def run_set(loaded, task_set: TaskSet, limit: int | None, out: Path | None) -> SetSummary:
    """The full model's greedy outputs on ``limit`` items spread over ``task_set`` (all by default),
    scored. The outputs go through the benchmark's full-model cache (``bench.task_eval``), so a
    calibration run also prepares every later benchmark run on the same model."""
    started = time.perf_counter()
    outputs = run_full_model(loaded, task_set, limit, FullOutputCache.default()).texts
    items = select_items(task_set, limit)
    scores: list[ItemScore] = [score_item(item, text) for item, text in zip(items, outputs, strict=True)]
    summary = summarise(task_set, scores, outputs, items)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with (out / f"{task_set.name}.jsonl").open("w", encoding="utf-8") as f:
            for score, text in zip(scores, outputs, strict=True):
                row = {**asdict(score), "output": text}
                row["chrf_statistics"] = list(row["chrf_statistics"]) if "chrf_statistics" in row else None
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(*summary.lines, f"  ({time.perf_counter() - started:.0f} s)", sep="\n", flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sets",
        type=parse_sets,
        default=list(TASK_SET_NAMES),
        help="comma-separated task sets (default: all four)",
    )
    parser.add_argument("--limit", type=int, default=None, help="score N items spread over each set")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="folder for per-item outputs and scores")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")

    import torch

    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.llm.weights import load_model

    torch.set_num_threads(args.threads)
    task_sets = [load_task_set(name) for name in args.sets]  # refuse a bad file before loading the model
    loaded = load_model(resolve_model(args.model, role="llm"), "cpu", "fp32")
    print(
        f"model {args.model} fp32 greedy, plain path; {platform.machine()} {platform.processor() or ''}"
        f" {torch.get_num_threads()} thread(s); torch {torch.__version__}",
        flush=True,
    )
    for task_set in task_sets:
        run_set(loaded, task_set, args.limit, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
