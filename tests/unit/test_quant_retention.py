"""The retention interval and the bootstrap mean interval used by the quantisation report (no model)."""

from __future__ import annotations

import random

import pytest

from edge_rtgi.llm.quant.report import looping_share
from edge_rtgi.scoring.retention import bootstrap_mean_interval, chrf, retention_interval, score_outputs
from edge_rtgi.scoring.text import chrf_from_statistics, chrf_statistics

WORDS = (
    "the train leaves at nine from platform three and the next one comes an hour later "
    "bring a warm coat because the evenings are cold in the mountains"
).split()


def _sentences(rng: random.Random, count: int, words: int = 20) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def _noisy(rng: random.Random, texts: list[str], keep: float) -> list[str]:
    """Each word kept with probability ``keep``, otherwise replaced by a random word."""
    return [" ".join(w if rng.random() < keep else rng.choice(WORDS) for w in t.split()) for t in texts]


@pytest.fixture
def rng():
    return random.Random()  # fresh data every run


def test_summed_statistics_give_corpus_chrf(rng):
    hyps, refs = _sentences(rng, 12), _sentences(rng, 12)
    rows = chrf_statistics(hyps, [[r] for r in refs])
    assert chrf_from_statistics(rows) == pytest.approx(chrf(hyps, refs), abs=1e-9)


@pytest.mark.parametrize("with_refs", [True, False])
def test_point_value_is_the_benchmark_retention(rng, with_refs):
    refs = _sentences(rng, 30)
    full = _noisy(rng, refs, 0.7)
    opt = _noisy(rng, full, 0.8)
    scored = score_outputs("w", opt, full, references=refs if with_refs else None)
    interval = retention_interval(opt, full, refs if with_refs else None, resamples=300)
    assert interval.retention == pytest.approx(scored.retention, abs=1e-9)
    assert interval.basis == scored.basis
    assert interval.low <= interval.high <= 1.0
    assert interval.num_prompts == 30 and interval.resamples == 300


def test_identical_outputs_retain_everything_with_no_spread(rng):
    refs = _sentences(rng, 20)
    full = _noisy(rng, refs, 0.6)
    interval = retention_interval(list(full), full, refs, resamples=200)
    assert (interval.retention, interval.uncapped, interval.low, interval.high) == (1.0, 1.0, 1.0, 1.0)
    assert interval.std == pytest.approx(0.0, abs=1e-12)


def test_uncapped_ratio_shows_a_model_that_beats_the_full_one(rng):
    refs = _sentences(rng, 20)
    full = _noisy(rng, refs, 0.3)  # far from the references
    interval = retention_interval(list(refs), full, refs, resamples=200)  # "optimised" = the references
    assert interval.retention == 1.0 and interval.uncapped > 1.5


def test_interval_narrows_with_more_prompts(rng):
    refs = _sentences(rng, 400)
    full = _noisy(rng, refs, 0.7)
    opt = _noisy(rng, full, 0.7)
    few = retention_interval(opt[:16], full[:16], refs[:16], resamples=400)
    many = retention_interval(opt, full, refs, resamples=400)
    assert many.std < 0.6 * few.std  # ~1/5 expected (sqrt(16/400)); generous for a random draw


def test_block_bootstrap_counts_a_run_of_overlapping_prompts_as_one(rng):
    """Prompts cut at overlapping offsets are near-copies of their neighbours. Resampling single
    prompts then treats k copies as k independent pieces of evidence; resampling blocks of k
    gives exactly the interval of the distinct prompts (same seed, same draws)."""
    refs = _sentences(rng, 40)
    full = _noisy(rng, refs, 0.7)
    opt = _noisy(rng, full, 0.7)
    k = 5

    def copies(texts):
        return [t for t in texts for _ in range(k)]

    distinct = retention_interval(opt, full, refs, resamples=300)
    blocked = retention_interval(copies(opt), copies(full), copies(refs), resamples=300, block_prompts=k)
    naive = retention_interval(copies(opt), copies(full), copies(refs), resamples=300)
    assert (blocked.low, blocked.high, blocked.std) == pytest.approx(
        (distinct.low, distinct.high, distinct.std)
    )
    assert blocked.retention == distinct.retention and blocked.block_prompts == k
    assert naive.std < 0.7 * distinct.std  # ~1/sqrt(5): the falsely narrow interval blocks avoid


def test_a_short_last_block_is_resampled_like_the_others(rng):
    refs = _sentences(rng, 31)  # 10 blocks of 3 and one of 1
    full = _noisy(rng, refs, 0.7)
    opt = _noisy(rng, full, 0.7)
    interval = retention_interval(opt, full, refs, resamples=300, block_prompts=3)
    assert interval.low <= interval.uncapped <= interval.high or interval.high == 1.0
    assert interval.std > 0 and interval.num_prompts == 31 and interval.block_prompts == 3


def test_block_size_must_be_positive_and_leave_enough_blocks(rng):
    with pytest.raises(ValueError, match="block_prompts"):
        retention_interval([], [], [], block_prompts=0)  # checked before anything else
    refs = _sentences(rng, 20)
    full = _noisy(rng, refs, 0.7)
    with pytest.raises(ValueError, match="only 5 blocks of 4"):  # one block would give an interval of width 0
        retention_interval(full, full, refs, block_prompts=4)
    assert retention_interval(full, full, refs, block_prompts=2, resamples=50).block_prompts == 2  # 10 blocks


def test_bootstrap_mean_interval_brackets_the_mean_and_collapses_when_units_agree(rng):
    counts = [rng.randint(50, 100) for _ in range(40)]
    sums = [c * rng.uniform(0.1, 0.3) for c in counts]
    low, high = bootstrap_mean_interval(sums, counts, resamples=500)
    assert low <= sum(sums) / sum(counts) <= high
    low, high = bootstrap_mean_interval([0.25 * c for c in counts], counts, resamples=200)
    assert low == pytest.approx(0.25) and high == pytest.approx(0.25)


def test_looping_share_counts_sequences_that_repeat_their_own_ngrams(rng):
    fresh = [rng.sample(range(1000), 48) for _ in range(3)]  # no token twice: no repeated 4-gram
    cycle = rng.sample(range(1000), 5)
    loop = [cycle[i % 5] for i in range(48)]  # a 5-token cycle: 40 of 45 4-grams repeat
    almost = fresh[0][:36] + fresh[0][:12]  # 9 of 45 4-grams repeat: 20 %, under the 25 % line
    assert looping_share(fresh) == 0.0 and looping_share([loop]) == 1.0
    assert looping_share([almost]) == 0.0 and looping_share([almost], repeated_fraction=0.2) == 1.0
    assert looping_share(fresh + [loop]) == 0.25 and looping_share([]) == 0.0
