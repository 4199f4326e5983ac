#!/usr/bin/env python3
"""Fit the reply-length predictor behind token budgets (edge_rtgi.llm.budget) and measure it.

1. The engine, as the daemon runs it, answers the voice and dialogue task sets greedily with a
   generous cap (``--cap``), so each reply ends where the model ends it: its natural length.
2. Items alternate between a training half (even positions) and a held-out half (odd), so the
   error is measured on replies the fit never saw (and budgets judged on the task sets are not
   fitted to the very items they are judged on more than half-way).
3. A ridge regression of log(1 + tokens) on ``budget.text_features`` of the user's last turn;
   sigma is the training residual's standard deviation; budgets are exp(mu + z sigma) - 1.
4. Translation ratios per language pair: a high quantile of reference tokens per source token
   over the translation task set (tokenizer only).

Prints the held-out error (median absolute error in tokens, the share of replies that end
within their budget, mean budget against mean length) and writes the predictor JSON with the
conditions in its ``meta``.

    .venv/bin/python scripts/train_length_predictor.py [--out edge_rtgi/llm/data/length_predictor.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_rtgi.bench.tasks import load_task_set, prepare_task_item, source_text  # noqa: E402
from edge_rtgi.llm.budget import FEATURES, LengthPredictor, text_features  # noqa: E402
from edge_rtgi.llm.engine import LLMEngine  # noqa: E402
from edge_rtgi.llm.engine_config import EngineConfig  # noqa: E402
from edge_rtgi.llm.sampling import SamplingParams  # noqa: E402


def natural_lengths(engine: LLMEngine, set_name: str, cap: int) -> list[tuple[str, int, bool]]:
    """(user text, reply tokens, whether it ended by itself) for every item of a task set."""
    items = load_task_set(set_name).items
    requests = [prepare_task_item(item, engine.tokenizer) for item in items]
    results = engine.generate(
        [list(r.prompt_token_ids) for r in requests], SamplingParams(max_tokens=cap, temperature=0.0)
    )
    return [
        (source_text(item), len(res.token_ids), res.finish_reason == "stop")
        for item, res in zip(items, results, strict=True)
    ]


def fit(rows: list[tuple[str, int, bool]], ridge: float) -> tuple[np.ndarray, float]:
    x = np.array([text_features(t) for t, _, _ in rows])
    y = np.log1p(np.array([n for _, n, _ in rows], dtype=float))
    penalty = ridge * np.eye(x.shape[1])
    penalty[0, 0] = 0.0  # the intercept is not shrunk
    coef = np.linalg.solve(x.T @ x + penalty, x.T @ y)
    return coef, float(np.std(y - x @ coef))


def evaluate(predictor: LengthPredictor, rows: list[tuple[str, int, bool]], cap: int) -> dict:
    errors = [abs(predictor.predict_tokens(t) - n) for t, n, _ in rows]
    budgets = [predictor.budget(t, cap) for t, _, _ in rows]
    return {
        "n": len(rows),
        "median_abs_error_tokens": statistics.median(errors),
        "mean_abs_error_tokens": statistics.fmean(errors),
        "within_budget_share": sum(n <= b for (_, n, _), b in zip(rows, budgets, strict=True)) / len(rows),
        "mean_budget_tokens": statistics.fmean(budgets),
        "mean_length_tokens": statistics.fmean(n for _, n, _ in rows),
        "ended_by_itself_share": sum(e for _, _, e in rows) / len(rows),
    }


def translation_ratio(tokenizer, quantile: float) -> float:
    ratios = [
        len(tokenizer.encode(ref)) / max(1, len(tokenizer.encode(item.source)))
        for item in load_task_set("translation").items
        for ref in item.references
    ]
    return float(np.quantile(ratios, quantile))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--cap", type=int, default=160, help="tokens a reply may run to while measuring")
    ap.add_argument("--quantile-z", type=float, default=1.0, help="budget = exp(mu + z sigma) - 1")
    ap.add_argument("--ridge", type=float, default=1.0)
    ap.add_argument("--min-budget", type=int, default=12)
    ap.add_argument("--translation-quantile", type=float, default=0.9)
    ap.add_argument("--out", type=Path, default=ROOT / "edge_rtgi" / "llm" / "data" / "length_predictor.json")
    args = ap.parse_args()

    started = time.monotonic()
    load_start = os.getloadavg()
    engine = LLMEngine.from_config(EngineConfig(model=args.model, max_num_seqs=64, num_threads=2))
    try:
        rows = {name: natural_lengths(engine, name, args.cap) for name in ("voice", "dialogue")}
        ratio = translation_ratio(engine.tokenizer, args.translation_quantile)
    finally:
        engine.shutdown()
    train = [r for rs in rows.values() for r in rs[0::2]]
    held_out = {name: rs[1::2] for name, rs in rows.items()}
    coef, sigma = fit(train, args.ridge)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    predictor = LengthPredictor(
        coefficients=tuple(float(c) for c in coef),
        sigma=sigma,
        quantile_z=args.quantile_z,
        min_budget_tokens=args.min_budget,
        translation_ratios={"en-es": round(ratio, 3)},
        meta={},
    )
    report = {name: evaluate(predictor, rs, args.cap) for name, rs in held_out.items()}
    report["train"] = evaluate(predictor, train, args.cap)
    meta = {
        "model": args.model,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "commit": commit.stdout.strip(),
        "cap_tokens": args.cap,
        "ridge": args.ridge,
        "train_items": len(train),
        "held_out": report,
        "translation_ratio_quantile": args.translation_quantile,
        "load_average": [load_start, os.getloadavg()],
        "seconds": round(time.monotonic() - started, 1),
    }
    predictor = LengthPredictor(**{**predictor.__dict__, "meta": meta})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    predictor.save(args.out)
    print(
        json.dumps(
            {"coefficients": dict(zip(FEATURES, predictor.coefficients, strict=True)), **meta}, indent=1
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
