"""Per-token log-probabilities and entropies from the engine (``SamplingParams.logprobs``).

Asking for them never changes the tokens (greedy and seeded sampling, batched with requests
that do not ask), and their values are those of HF transformers' next-token distribution over
the same sequence, the oracle for the model itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from edge_rtgi.llm.engine import GenerationResult, LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model

PROMPTS = ["What is the capital of France?", "def add(a, b):", "The quick brown fox"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("logprobs"), seed=5)
    ours = load_model(folder, device="cpu", dtype="fp32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf


def run(loaded, params: list[SamplingParams]) -> list[GenerationResult]:
    """All prompts at once on one engine (batched), stepped in this thread."""
    cfg = EngineConfig(block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, quant="none")
    engine = LLMEngine.from_loaded(loaded, cfg, start=False)
    results = [GenerationResult() for _ in PROMPTS]
    for prompt, p, res in zip(PROMPTS, params, results, strict=True):
        engine.submit(prompt, p, res.add)
    while engine.step():
        pass
    return results


def test_logprobs_change_no_token_and_match_hf(models):
    ours, hf = models
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)
    plain = run(ours, [greedy, sampled, greedy])
    asked = run(
        ours,
        [
            SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True),
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7, logprobs=True),
            greedy,  # batched with the others, asks for nothing
        ],
    )
    for before, after in zip(plain, asked, strict=True):
        assert after.token_ids == before.token_ids and after.text == before.text
    assert asked[2].logprobs == [] and all(r.logprobs == [] for r in plain)

    for prompt, res in zip(PROMPTS[:2], asked[:2], strict=True):
        assert [lp.token_id for lp in res.logprobs] == res.token_ids
        prompt_ids = ours.tokenizer.encode(prompt, add_special_tokens=True)
        ids = prompt_ids + res.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        # position t predicts token t + 1: the rows that produced the generated tokens
        lp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
        want_entropy = (-(lp.exp() * lp).sum(-1)).tolist()
        want_logprob = lp.gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1).tolist()
        for got, h, lpv in zip(res.logprobs, want_entropy, want_logprob, strict=True):
            assert got.entropy_nats == pytest.approx(h, abs=2e-3)
            assert got.logprob == pytest.approx(lpv, abs=2e-3)
            assert 0.0 <= got.entropy_nats <= math.log(ours.config.vocab_size) + 1e-4
            assert got.logprob <= 0.0
