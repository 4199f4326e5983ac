#!/usr/bin/env python
"""The translate stage's back ends on the graded translation task set, in one run: chrF of each
against the items' references.

- Apertium (``apertium -u eng-spa``), the pipeline's default;
- SmolLM2-135M-Instruct with the chat prompt (``translation_messages``);
- Gemma 3 270M (a base model) with the few-shot prompt (``translation_few_shot_prompt``), and
  with the chat prompt for comparison.

The LLMs run greedy on the engine with the stage's own budget rule and stop rule, so each
output is what the pipeline would say; the whole set is submitted at once (continuous
batching), which changes no greedy output. chrF (character 6-grams, beta 2, every reference of
an item) is ``edge_rtgi.scoring.text``'s, over the whole set, with a 95 % bootstrap interval
over items. The task set defaults to ``bench/data/tasks/translation.jsonl``.

    .venv/bin/python scripts/bench_translate_backends.py [--tasks FILE] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edge_rtgi.bench.tasks import TranslationItem, load_task_set
from edge_rtgi.pipeline.translate import (
    translation_budget_tokens,
    translation_few_shot_prompt,
    translation_messages,
)


def apertium(sentences: Sequence[str]) -> list[str]:
    """One ``apertium`` process over the set, a line per item (the stage starts one per utterance;
    a process per item costs seconds each on a loaded machine, and the lines translate alike)."""
    text = "".join(" ".join(s.split()) + "\n" for s in sentences)
    proc = subprocess.run(
        ["apertium", "-u", "eng-spa"], input=text, capture_output=True, text=True, check=True
    )
    lines = proc.stdout.splitlines()
    if len(lines) != len(sentences):
        raise RuntimeError(f"apertium returned {len(lines)} lines for {len(sentences)} sentences")
    return [" ".join(line.split()) for line in lines]


def llm(model: str, sentences: Sequence[str], prompt: str) -> list[str]:
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.llm.sampling import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(model=model))
    tok = engine.tokenizer
    assert tok is not None
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    for s in sentences:
        budget = translation_budget_tokens(len(tok.encode(s)), 2.0, 16)  # the stage's defaults
        if prompt == "few-shot":
            prompts.append(tok.encode(translation_few_shot_prompt(s, "en", "es"), add_special_tokens=True))
            params.append(SamplingParams(max_tokens=budget, stop=("\n",)))
        else:
            prompts.append(tok.encode_chat(translation_messages(s, "en", "es")))
            params.append(SamplingParams(max_tokens=budget))
    try:
        results = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    return [" ".join(r.text.split()) for r in results]


def interval(rows: list[tuple[int, ...]], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of corpus chrF over items."""
    import numpy as np

    from edge_rtgi.scoring.text import chrf_from_statistics

    stats = np.asarray(rows, dtype=np.int64)
    rng = np.random.default_rng(seed)
    scores = sorted(
        chrf_from_statistics(stats[rng.integers(0, len(stats), len(stats))]) for _ in range(resamples)
    )
    return scores[int(0.025 * resamples)], scores[int(0.975 * resamples) - 1]


def main() -> int:
    from edge_rtgi.scoring.text import chrf_from_statistics, chrf_statistics

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, help="a translation task file (default: the packaged set)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    task_set = load_task_set("translation", args.tasks)
    items = [i for i in task_set.items if isinstance(i, TranslationItem)]
    sources, refs = [i.source for i in items], [list(i.references) for i in items]
    systems = {
        "apertium": lambda: apertium(sources),
        "smollm2-135m-instruct (chat)": lambda: llm("smollm2-135m-instruct", sources, "chat"),
        "gemma-3-270m (few-shot)": lambda: llm("gemma-3-270m", sources, "few-shot"),
        "gemma-3-270m (chat)": lambda: llm("gemma-3-270m", sources, "chat"),
    }
    results: dict[str, Any] = {"tasks": str(task_set.path), "items": len(items), "systems": {}}
    load = [os.getloadavg()[0]]
    print(f"{len(items)} items from {task_set.path.name}")
    for name, run in systems.items():
        hyps = run()
        rows = chrf_statistics(hyps, refs)
        low, high = interval(rows)
        score = chrf_from_statistics(rows)
        results["systems"][name] = {"chrf": score, "interval_95": [low, high], "outputs": hyps}
        print(f"{name:32s} chrF {score:5.1f} [{low:.1f}, {high:.1f}]   e.g. {hyps[2]!r}", flush=True)
        load.append(os.getloadavg()[0])
    results["load_average"] = load
    print(f"load average (1 min): {min(load):.1f}-{max(load):.1f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
