"""Scores that judge quality, and how sure they are: chrF, retention ratios, bootstrap intervals.

Torch-free, and below every layer that measures quality (the benchmark harness, the quantisation
report), so each of them scores the same way. Definitions: docs/benchmarks.md.

- ``chrf``: corpus chrF (sacrebleu), with per-pair sufficient statistics for cheap resampling;
- ``score_outputs`` / ``retention_ratio``: quality retention of paired outputs against the full
  model's;
- ``retention_interval``: that retention with a paired (optionally block) bootstrap over prompts;
- ``bootstrap_mean_interval``: a per-token mean's interval, resampling whole windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


@dataclass(frozen=True)
class KLResult:
    """KL divergence of the optimised model's next-token distributions from the full model's."""

    mean: float
    p99: float
    max: float
    top1_agreement: float  # share of positions where both models' argmax agree
    num_tokens: int
    num_sequences: int


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus chrF (sacrebleu defaults: character 6-grams, beta 2), 0..100.

    Pairs whose hypothesis and reference are both empty are identical and are left out
    (chrF has no n-grams to score there); if nothing is left, the texts were identical: 100.
    """
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(
            f"chrF needs as many hypotheses ({len(hypotheses)}) as references ({len(references)})"
        )
    pairs = [(h, r) for h, r in zip(hypotheses, references, strict=True) if h.strip() or r.strip()]
    if not pairs:
        return 100.0
    if all(h == r for h, r in pairs):
        return 100.0
    return float(sacrebleu.corpus_chrf([h for h, _ in pairs], [[r for _, r in pairs]]).score)


@dataclass(frozen=True)
class QualityResult:
    """Quality of one workload's optimised outputs, relative to the full model."""

    workload: str
    num_outputs: int
    chrf_agreement: float
    chrf_ref_full: float | None
    chrf_ref_optimised: float | None
    kl: KLResult | None
    retention: float
    basis: str  # which score the retention is the ratio of


def retention_ratio(optimised_score: float, full_score: float) -> float:
    """optimised / full, capped at 1 (nothing was lost when the full model scores 0)."""
    if full_score <= 0:
        return 1.0
    return min(1.0, optimised_score / full_score)


def score_outputs(
    workload: str,
    optimised_texts: Sequence[str],
    full_texts: Sequence[str],
    references: Sequence[str | None] | None = None,
    kl: KLResult | None = None,
) -> QualityResult:
    """Quality retention of paired outputs (same prompts, same order)."""
    agreement = chrf(optimised_texts, full_texts)
    refs = [r for r in references or [] if r is not None]
    if refs and len(refs) == len(references or []):
        ref_full = chrf(full_texts, refs)
        ref_opt = chrf(optimised_texts, refs)
        if ref_full > 0:
            return QualityResult(
                workload,
                len(optimised_texts),
                agreement,
                ref_full,
                ref_opt,
                kl,
                retention_ratio(ref_opt, ref_full),
                "chrF vs references, optimised / full",
            )
        return QualityResult(
            workload,
            len(optimised_texts),
            agreement,
            ref_full,
            ref_opt,
            kl,
            agreement / 100.0,
            "chrF agreement / 100 (full model scores 0 on references)",
        )
    return QualityResult(
        workload,
        len(optimised_texts),
        agreement,
        None,
        None,
        kl,
        agreement / 100.0,
        "chrF agreement with the full model / 100",
    )


# --- How sure is a retention number? Paired bootstrap over prompts -----------------------------


def chrf_statistics(hypotheses: Sequence[str], references: Sequence[str]) -> list[list[int]]:
    """Per-pair chrF sufficient statistics (sacrebleu's n-gram match counts).

    Corpus chrF is a function of the *sum* of these rows, so a resampled corpus can be
    scored by summing rows instead of re-running the tokenizer: that is what makes a
    bootstrap over prompts cheap.
    """
    from sacrebleu.metrics import CHRF

    return CHRF()._extract_corpus_statistics(list(hypotheses), [list(references)])


def chrf_from_statistics(rows: Sequence[Sequence[int]] | npt.NDArray[np.int64]) -> float:
    """Corpus chrF (0..100) from summed ``chrf_statistics`` rows; equals ``chrf`` on the same pairs."""
    from sacrebleu.metrics import CHRF

    total = [sum(col) for col in zip(*rows, strict=True)]
    return float(CHRF()._compute_score_from_stats(total).score)


@dataclass(frozen=True)
class RetentionInterval:
    """Quality retention with a paired-bootstrap percentile interval over prompts.

    ``retention`` is exactly ``score_outputs(...).retention`` (capped at 1); ``uncapped`` is the
    same ratio without the cap, so a model that beats the full model by chance is visible.
    ``low``/``high`` bound the central ``level`` share of resampled retentions (capped like the
    point value); ``std`` is the bootstrap standard deviation of the uncapped ratio.
    """

    retention: float
    uncapped: float
    low: float
    high: float
    std: float
    level: float
    resamples: int
    num_prompts: int
    basis: str
    block_prompts: int = 1  # consecutive prompts resampled together


MIN_BOOTSTRAP_BLOCKS = 10


def retention_interval(
    optimised_texts: Sequence[str],
    full_texts: Sequence[str],
    references: Sequence[str | None] | None = None,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    block_prompts: int = 1,
) -> RetentionInterval:
    """Retention as ``score_outputs`` defines it, with a paired bootstrap over the prompts.

    Each resample draws prompts with replacement and scores the optimised and the full
    outputs of the *same* draw, so prompts that are hard for both models cancel out.
    Pairs where both texts are empty are left out, as ``chrf`` does.

    ``block_prompts`` > 1 resamples runs of that many consecutive prompts instead of single
    prompts (a block bootstrap): for prompts cut from one text at overlapping offsets, whose
    neighbours share context and true continuations, so that single-prompt resampling would give
    a falsely narrow interval. 1 is the plain bootstrap.
    """
    import numpy as np

    if block_prompts < 1:
        raise ValueError(f"block_prompts must be >= 1, got {block_prompts}")
    refs = [r for r in references or [] if r is not None]
    with_refs = bool(refs) and len(refs) == len(references or [])
    if with_refs:
        full_rows = chrf_statistics(full_texts, refs)
        if chrf_from_statistics(full_rows) <= 0:
            with_refs = False
    if with_refs:
        opt_rows = chrf_statistics(optimised_texts, refs)
        basis = "chrF vs references, optimised / full"
    else:  # the agreement basis: chrF(opt, full) / chrF(full, full) = agreement / 100
        # (blocks are formed after empty pairs are dropped, so a block may join non-neighbours)
        keep = [
            i
            for i, (o, f) in enumerate(zip(optimised_texts, full_texts, strict=True))
            if o.strip() or f.strip()
        ]
        opt_rows = chrf_statistics([optimised_texts[i] for i in keep], [full_texts[i] for i in keep])
        full_rows = chrf_statistics([full_texts[i] for i in keep], [full_texts[i] for i in keep])
        basis = "chrF agreement with the full model / 100"
    opt, full = np.asarray(opt_rows, dtype=np.int64), np.asarray(full_rows, dtype=np.int64)
    n = len(opt)
    if n == 0:
        return RetentionInterval(1.0, 1.0, 1.0, 1.0, 0.0, level, 0, 0, basis)
    point = _ratio(chrf_from_statistics(opt), chrf_from_statistics(full))
    block_of = np.arange(n) // block_prompts  # prompt -> its block (the last one may be short)
    blocks = int(block_of[-1]) + 1
    if block_prompts > 1 and blocks < MIN_BOOTSTRAP_BLOCKS:
        # a handful of blocks makes a bootstrap meaningless (one block: an interval of width 0)
        raise ValueError(
            f"{n} prompts make only {blocks} blocks of {block_prompts}; a block bootstrap needs at "
            f"least {MIN_BOOTSTRAP_BLOCKS}: give a longer text or fewer, non-overlapping prompts"
        )
    draws = np.random.default_rng(seed).integers(0, blocks, size=(resamples, blocks))
    counts = np.stack([np.bincount(d, minlength=blocks) for d in draws])[:, block_of]  # [resamples, n]
    ratios = np.array(
        [
            _ratio(chrf_from_statistics([counts[b] @ opt]), chrf_from_statistics([counts[b] @ full]))
            for b in range(resamples)
        ]
    )
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return RetentionInterval(
        min(1.0, point),
        point,
        min(1.0, float(low)),
        min(1.0, float(high)),
        float(ratios.std()),
        level,
        resamples,
        n,
        basis,
        block_prompts,
    )


def _ratio(optimised_score: float, full_score: float) -> float:
    return 1.0 if full_score <= 0 else optimised_score / full_score


def bootstrap_mean_interval(
    unit_sums: Sequence[float],
    unit_counts: Sequence[float],
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of a per-token mean, resampling whole units (windows) with replacement.

    Resampling windows rather than tokens keeps the strong correlation between neighbouring
    tokens inside each draw, so the interval is not falsely narrow. Works for differences too
    (pass per-window sums of ``kl_a - kl_b`` for a paired comparison), and for ratios of sums
    (``unit_counts`` need not be token counts).
    """
    import numpy as np

    sums, counts = np.asarray(unit_sums, dtype=np.float64), np.asarray(unit_counts, dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, len(sums), size=(resamples, len(sums)))
    means = sums[draws].sum(1) / counts[draws].sum(1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)
