"""Gemma 3 against HF transformers on a tiny seeded model, and the engine's per-layer KV windows.

The tiny model has a local, a global and a local layer, a window of 8 (shorter than every
sequence here), a query scalar that differs from head_dim, and linear RoPE scaling on the
global layer, so each Gemma-specific part is on the path being compared.
"""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.equivalence.test_model_vs_hf import PROMPT, our_logits
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf_model("gemma3", tmp_path_factory.mktemp("gemma3"), seed=3)
    ours = load_model(folder, device="cpu", dtype="fp32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf


def test_config_is_gemma_with_local_and_global_layers(pair):
    ours, hf = pair
    cfg = ours.config
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert cfg.arch == "gemma3" and [cfg.window_of(i) for i in range(3)] == [8, None, 8]
    assert cfg.rope_local_theta == 10_000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.query_pre_attn_scalar == 32
    assert len(ours.tokenizer.encode(PROMPT)) > 3 * cfg.sliding_window


def test_logits_match_hf_within_1e_4(pair):
    ours, hf = pair
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = our_logits(ours, ids)
    assert (got - ref).abs().max() < 1e-4  # every position: the window masks positions past 8


def test_tied_head_logits_match_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_hf_model("gemma3", tmp_path, seed=5, tie_word_embeddings=True)
    ours = load_model(folder, device="cpu", dtype="fp32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert ours.config.tie_word_embeddings
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (our_logits(ours, ids) - ref).abs().max() < 1e-4


def test_greedy_32_tokens_match_hf(pair):
    ours, hf = pair
    ids = ours.tokenizer.encode(PROMPT)
    result = generate(ours, ids, SamplingParams(max_tokens=32, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None
        )
    assert result.token_ids == ref[0, len(ids) :].tolist()
    assert len(set(result.token_ids)) > 4  # not a degenerate repetition


def test_engine_matches_plain_path_with_chunked_prefill(pair):
    ours, _ = pair
    ids = ours.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = generate(ours, ids, params).token_ids
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, quant="none")
    engine = LLMEngine(ours.model, ours.tokenizer, config, start=False)
    (result,) = engine.generate([ids], params)
    assert result.token_ids == plain


def test_long_sequence_keeps_only_the_local_window(tmp_path):
    """4,000 tokens with Gemma 3's real window (512): local groups hold the window, the global
    group the whole context, and the greedy output equals the plain path's."""
    folder = make_tiny_hf_model(
        "gemma3", tmp_path, seed=4, sliding_window=512, max_position_embeddings=8192, rope_scaling=None
    )
    loaded = load_model(folder, device="cpu", dtype="fp32")
    ids = torch.randint(10, loaded.config.vocab_size, (4000,), generator=torch.Generator().manual_seed(0))
    prompt = ids.tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = generate(loaded, prompt, params).token_ids
    bs = 16
    config = EngineConfig(block_size=bs, num_kv_blocks=2048, max_num_batched_tokens=512, quant="none")
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, start=False)
    groups = engine.kv.groups
    assert [g.window_tokens for g in groups] == [None, 512, 512]
    results = []
    engine.submit(prompt, params, results.append, request_id="long")
    most = [0] * len(groups)
    while engine.step():
        if "long" in engine.scheduler.requests:
            held = engine.kv.num_held_blocks("long")
            most = [max(m, h) for m, h in zip(most, held, strict=True)]
            computed = engine.scheduler.requests["long"].num_computed_tokens
            assert held[0] == -(-computed // bs)  # global: every block of the context
    tokens = [t for d in results for t in d.token_ids]
    assert tokens == plain
    window_blocks = 512 // bs + 1  # the window, plus the block the next query starts
    assert most[1] <= window_blocks and most[2] <= window_blocks
    assert most[0] >= (4000 + 11) // bs  # and the global group grew with the context
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
