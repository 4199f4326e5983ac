#!/usr/bin/env python
"""The translate stage's back ends on one task set, in one run: chrF of each against the references.

- Apertium (``apertium -u eng-spa``), the pipeline's default;
- SmolLM2-135M-Instruct with the chat prompt (``translation_messages``);
- Gemma 3 270M (a base model) with the few-shot prompt (``translation_few_shot_prompt``), and
  with the chat prompt for comparison.

The LLMs run greedy on the engine with the stage's own budget rule and stop rule, so each
output is what the pipeline would say. chrF (character 6-grams, beta 2) is
``edge_rtgi.scoring.chrf`` over the whole set, with a 95 % bootstrap interval over sentences.

    .venv/bin/python scripts/bench_translate_backends.py [--tasks FILE] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from edge_rtgi.pipeline.translate import (
    translation_budget_tokens,
    translation_few_shot_prompt,
    translation_messages,
)

DEFAULT_TASKS = Path(__file__).resolve().parents[1] / "edge_rtgi/bench/data/translation_en_es.json"


def load_pairs(path: Path) -> list[tuple[str, str]]:
    """(English, Spanish) pairs from a JSON list of {en, es} or a JSONL task file."""
    text = path.read_text(encoding="utf-8")
    rows = (
        [json.loads(line) for line in text.splitlines() if line.strip()]
        if path.suffix == ".jsonl"
        else json.loads(text)
    )
    pairs = []
    for row in rows:
        src = row.get("en") or row.get("source") or row.get("input")
        ref = row.get("es") or row.get("reference") or row.get("target")
        if src and ref:
            pairs.append((str(src), str(ref)))
    return pairs


def apertium(sentences: list[str]) -> list[str]:
    out = []
    for s in sentences:
        proc = subprocess.run(
            ["apertium", "-u", "eng-spa"], input=s, capture_output=True, text=True, check=True
        )
        out.append(" ".join(proc.stdout.split()))
    return out


def llm(model: str, sentences: list[str], prompt: str) -> list[str]:
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.llm.sampling import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(model=model))
    tok = engine.tokenizer
    assert tok is not None
    out = []
    try:
        for s in sentences:
            budget = translation_budget_tokens(len(tok.encode(s)), 2.0, 16)  # the stage's defaults
            if prompt == "few-shot":
                ids = tok.encode(translation_few_shot_prompt(s, "en", "es"), add_special_tokens=True)
                params = SamplingParams(max_tokens=budget, stop=("\n",))
            else:
                ids, params = (
                    tok.encode_chat(translation_messages(s, "en", "es")),
                    SamplingParams(max_tokens=budget),
                )
            (result,) = engine.generate([ids], params)
            out.append(" ".join(result.text.split()))
    finally:
        engine.shutdown()
    return out


def interval(rows: list[list[int]], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of corpus chrF over sentences."""
    import numpy as np

    from edge_rtgi.scoring.retention import chrf_from_statistics

    stats = np.asarray(rows, dtype=np.int64)
    rng = np.random.default_rng(seed)
    scores = sorted(
        chrf_from_statistics(stats[rng.integers(0, len(stats), len(stats))]) for _ in range(resamples)
    )
    return scores[int(0.025 * resamples)], scores[int(0.975 * resamples) - 1]


def main() -> int:
    from edge_rtgi.scoring.retention import chrf, chrf_statistics

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pairs = load_pairs(args.tasks)
    sources, refs = [p[0] for p in pairs], [p[1] for p in pairs]
    systems = {
        "apertium": lambda: apertium(sources),
        "smollm2-135m-instruct (chat)": lambda: llm("smollm2-135m-instruct", sources, "chat"),
        "gemma-3-270m (few-shot)": lambda: llm("gemma-3-270m", sources, "few-shot"),
        "gemma-3-270m (chat)": lambda: llm("gemma-3-270m", sources, "chat"),
    }
    results: dict[str, Any] = {"tasks": str(args.tasks), "sentences": len(pairs), "systems": {}}
    print(f"{len(pairs)} sentences from {args.tasks.name}")
    for name, run in systems.items():
        hyps = run()
        low, high = interval(chrf_statistics(hyps, refs))
        score = chrf(hyps, refs)
        results["systems"][name] = {"chrf": score, "interval_95": [low, high], "outputs": hyps}
        print(f"{name:32s} chrF {score:5.1f} [{low:.1f}, {high:.1f}]   e.g. {hyps[2]!r}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
