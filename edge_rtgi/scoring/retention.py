"""Scores that judge quality, and how sure they are: chrF, retention ratios, bootstrap intervals.

Torch-free, and below every layer that measures quality (the benchmark harness, the quantisation
report), so each of them scores the same way. Definitions: docs/benchmarks.md.

- ``chrf``: corpus chrF (sacrebleu), with per-pair sufficient statistics for cheap resampling;
- ``score_outputs`` / ``retention_ratio``: quality retention of paired outputs against the full
  model's;
- ``retention_interval``: that retention with a paired (optionally block) bootstrap over prompts;
- ``bootstrap_mean_interval``: a per-token mean's interval, resampling whole windows;
- ``paired_ratio_interval`` / ``paired_chrf_ratio_interval``: task retention (optimised score /
  full score over the same graded items) with a paired bootstrap over items.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edge_rtgi.scoring.text import chrf_from_statistics, chrf_statistics


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
        full_rows = chrf_statistics(full_texts, [[r] for r in refs])
        if chrf_from_statistics(full_rows) <= 0:
            with_refs = False
    if with_refs:
        opt_rows = chrf_statistics(optimised_texts, [[r] for r in refs])
        basis = "chrF vs references, optimised / full"
    else:  # the agreement basis: chrF(opt, full) / chrF(full, full) = agreement / 100
        # (blocks are formed after empty pairs are dropped, so a block may join non-neighbours)
        keep = [
            i
            for i, (o, f) in enumerate(zip(optimised_texts, full_texts, strict=True))
            if o.strip() or f.strip()
        ]
        opt_rows = chrf_statistics([optimised_texts[i] for i in keep], [[full_texts[i]] for i in keep])
        full_rows = chrf_statistics([full_texts[i] for i in keep], [[full_texts[i]] for i in keep])
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


# --- Task retention: per-item scores resampled in pairs ---------------------------------------


@dataclass(frozen=True)
class RatioInterval:
    """Retention = optimised score / full score on the same items, capped at 1, with a paired
    bootstrap percentile interval (capped like the point value).

    ``optimised_score`` and ``full_score`` are means of per-item scores (or corpus chrF);
    ``uncapped`` is the ratio without the cap; ``low``/``high`` bound the central ``level`` share
    of the resampled ratios.
    """

    n: int
    optimised_score: float
    full_score: float
    ratio: float
    uncapped: float
    low: float
    high: float
    level: float
    resamples: int


def _resample_counts(n: int, resamples: int, seed: int) -> Any:
    import numpy as np

    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return np.stack([np.bincount(d, minlength=n) for d in draws]).astype(np.float64)  # [resamples, n]


def _check_bootstrap(n_opt: int, n_full: int, resamples: int, level: float) -> None:
    if n_opt != n_full:
        raise ValueError(f"paired scores need as many optimised ({n_opt}) as full ({n_full}) items")
    if n_opt == 0:
        raise ValueError("no items to score")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")


def _interval(
    n: int, opt_score: float, full_score: float, ratios: Any, level: float, resamples: int
) -> RatioInterval:
    import numpy as np

    point = 1.0 if full_score <= 0 else opt_score / full_score
    tail = 100 * (1 - level) / 2
    low, high = (float(v) for v in np.percentile(ratios, [tail, 100 - tail]))
    return RatioInterval(
        n=n,
        optimised_score=opt_score,
        full_score=full_score,
        ratio=min(1.0, point),
        uncapped=point,
        low=min(1.0, low),
        high=min(1.0, high),
        level=level,
        resamples=resamples,
    )


def paired_ratio_interval(
    optimised: Sequence[float],
    full: Sequence[float],
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RatioInterval:
    """Retention min(1, mean(optimised) / mean(full)) of per-item scores, paired bootstrap interval.

    Each resample draws items with replacement and scores both configurations on the *same*
    draw. A resample (or the whole set) where the full model scores 0 counts as ratio 1, as
    ``quality.retention_ratio`` does. Identical scores give exactly 1 with interval [1, 1].
    """
    import numpy as np

    _check_bootstrap(len(optimised), len(full), resamples, level)
    opt, ref = np.asarray(optimised, dtype=np.float64), np.asarray(full, dtype=np.float64)
    n = len(opt)
    counts = _resample_counts(n, resamples, seed)
    opt_sums, full_sums = counts @ opt, counts @ ref
    ratios = np.where(full_sums > 0, opt_sums / np.where(full_sums > 0, full_sums, 1.0), 1.0)
    return _interval(n, float(opt.sum() / n), float(ref.sum() / n), ratios, level, resamples)


def paired_chrf_ratio_interval(
    optimised: Sequence[Sequence[int]],
    full: Sequence[Sequence[int]],
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RatioInterval:
    """Retention of corpus chrF from per-item statistics rows (``TranslationScore.chrf_statistics``).

    Each resample sums the rows of the same drawn items for both configurations and scores the
    sums; the scores reported are corpus chrF (0..100).
    """
    import numpy as np

    _check_bootstrap(len(optimised), len(full), resamples, level)
    opt, ref = np.asarray(optimised, dtype=np.int64), np.asarray(full, dtype=np.int64)
    counts = _resample_counts(len(opt), resamples, seed).astype(np.int64)
    opt_sums, full_sums = counts @ opt, counts @ ref
    ratios = np.empty(resamples)
    for b in range(resamples):
        f = chrf_from_statistics([full_sums[b]])
        ratios[b] = 1.0 if f <= 0 else chrf_from_statistics([opt_sums[b]]) / f
    opt_score, full_score = chrf_from_statistics(optimised), chrf_from_statistics(full)
    return _interval(len(opt), opt_score, full_score, ratios, level, resamples)
