"""Speculative sampling draws from the target's distribution: chi-square tests with fixed seeds.

Two levels: the acceptance rule itself on a tiny vocabulary (deterministic and sampled drafts),
and the whole engine on a tiny model, where the second generated token's frequencies over
20,000 seeded requests are tested against its exact marginal from the plain model. A broken
rule (resampling from p instead of the residual max(0, p - q)) must fail both at p < 1e-6,
which shows the tests can tell.
"""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.llm import sampling
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.sampling import SamplingParams, speculative_accept
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model

DRAWS = 20_000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs``; bins expecting < 5 are pooled."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # pooled tail still too small: fold it into the smallest kept bin
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[exp.argmin()] += counts[~big].sum()
        exp[exp.argmin()] += expected[~big].sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def broken_accept(probs, draft_token_ids, draft_probs, generator=None):
    """The classic mistake: on rejection, draw from p itself instead of the residual."""
    k = len(draft_token_ids)
    uniform = torch.rand(k, generator=generator, dtype=torch.float64).tolist() if k else []
    for i, token in enumerate(draft_token_ids):
        q = float(draft_probs[i, token]) if draft_probs is not None else 1.0
        if uniform[i] * q < float(probs[i, token]):
            continue
        return i, int(torch.multinomial(probs[i], 1, generator=generator))
    return k, int(torch.multinomial(probs[k], 1, generator=generator))


def run_rule(rule, with_draft_probs: bool) -> tuple[float, float]:
    """p-values of the first token, and of the second given the first was the draft's."""
    gen = torch.Generator().manual_seed(1234)
    vocab = 8
    probs = torch.distributions.Dirichlet(torch.full((vocab,), 0.7)).sample((3,))
    draft_q = torch.distributions.Dirichlet(torch.full((vocab,), 0.7)).sample((2,))
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(DRAWS):
        if with_draft_probs:
            drafts = [int(torch.multinomial(draft_q[i], 1, generator=gen)) for i in range(2)]
        else:
            drafts = [int(probs[0].argmax()), int(probs[1].argmax())]
        accepted, token = rule(probs, drafts, draft_q if with_draft_probs else None, gen)
        out = [*drafts[:accepted], token]
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:
            second[out[1]] += 1
    return chi_square_p(first, probs[0]), chi_square_p(second, probs[1])


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_acceptance_rule_keeps_the_target_distribution(with_draft_probs):
    torch.manual_seed(0)
    p_first, p_second = run_rule(speculative_accept, with_draft_probs)
    assert p_first > 0.01 and p_second > 0.01


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_broken_acceptance_rule_fails_the_same_test(with_draft_probs):
    torch.manual_seed(0)
    p_first, _ = run_rule(broken_accept, with_draft_probs)
    assert p_first < 1e-6


# --- the engine ---------------------------------------------------------------------------------
#
# A tiny Llama whose attention and MLP outputs are zeroed is a bigram model: the next token's
# distribution depends on the current token alone, softmax(head(norm(embed(t))) / T), and is
# known exactly. Every token the engine samples is then a draw from a known row, so a few long
# requests give tens of thousands of draws, with the real n-gram draft proposing (bigram chains
# repeat themselves, so it proposes often) and being accepted or rejected.

TEMPERATURE = 3.0  # the tied head favours repeating a token; this makes that a coin flip


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("spec-sampling"), seed=5)
    loaded = load_model(folder, device="cpu", dtype="fp64")
    model = loaded.model
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        vocab = torch.arange(model.config.vocab_size)
        logits = model.compute_logits(model.norm(model.embed_tokens(vocab))).double()
        rows = (logits / TEMPERATURE).softmax(-1)
    return loaded, rows


def transition_p(tokens: list[list[int]], rows: torch.Tensor) -> float:
    """Chi-square p-value of every (previous, next) pair against the bigram rows, pooled over
    the previous tokens seen at least 20 times."""
    vocab = rows.shape[0]
    counts = torch.zeros(vocab, vocab)
    for seq in tokens:
        for a, b in zip(seq, seq[1:], strict=False):
            counts[a, b] += 1
    stat, dof = 0.0, 0
    for prev in range(vocab):
        n = float(counts[prev].sum())
        if n < 20:
            continue
        expected = rows[prev] * n
        big = expected >= 5
        obs = torch.cat([counts[prev][big], counts[prev][~big].sum()[None]]).double()
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        if exp[-1] < 1e-9:
            obs, exp = obs[:-1], exp[:-1]
        stat += float(((obs - exp) ** 2 / exp).sum())
        dof += len(exp) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2))
    )


def engine_draws(loaded) -> tuple[list[list[int]], int]:
    engine = LLMEngine.from_loaded(
        loaded,
        EngineConfig(
            block_size=16,
            num_kv_blocks=2048,
            max_num_batched_tokens=1024,
            max_num_seqs=100,
            speculative={"draft": "ngram", "k": 4},
        ),
        start=False,
    )
    prompt = loaded.tokenizer.encode("The quick brown fox")
    params = [
        # the tiny models' context is 256 tokens: many requests of 200 tokens each
        SamplingParams(max_tokens=DRAWS // 100 + 1, temperature=TEMPERATURE, seed=i, ignore_eos=True)
        for i in range(100)
    ]
    results = engine.generate([prompt] * 100, params)
    stats = engine.stats()
    # the drafts were really verified, and both outcomes happened often
    assert stats.spec_draft_tokens > 0.1 * DRAWS
    assert 0.1 * stats.spec_draft_tokens < stats.spec_accepted_tokens < 0.9 * stats.spec_draft_tokens
    return [[prompt[-1], *r.token_ids] for r in results], sum(len(r.token_ids) for r in results)


def test_engine_speculative_sampling_matches_the_target(bigram):
    loaded, rows = bigram
    tokens, draws = engine_draws(loaded)
    assert draws >= DRAWS
    assert transition_p(tokens, rows) > 0.01


def test_engine_with_a_broken_rule_fails(bigram, monkeypatch):
    monkeypatch.setattr(sampling, "speculative_accept", broken_accept)
    loaded, rows = bigram
    tokens, _ = engine_draws(loaded)
    assert transition_p(tokens, rows) < 1e-6
