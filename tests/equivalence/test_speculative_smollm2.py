"""SmolLM2 through the engine with speculation gives the plain path's greedy output, token for
token, with the n-gram draft, the catalogue's reply store (``retrieval``), the adaptive policy
over both as the engine builds it, the trained draft, and a draft that is often right (so that long
verifications of the real model happen), alone and in one batch, and again after a prefix-cache hit
(there: the same engine's output without speculation)."""

from __future__ import annotations

import pytest

from edge_rtgi.llm.engine import LLMEngine, build_speculator, load_eagle_draft
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.speculative import SpeculativeConfig, Speculator
from tests.equivalence.test_speculative import ScriptedDraft

pytestmark = pytest.mark.slow

QUESTIONS = (
    "Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over it.",
    "Translate to Spanish: My name is Anna and I live at 42 Baker Street.",
    "What is the capital of France?",
)


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine.from_config(
        EngineConfig(
            model="smollm2-135m-instruct",
            device="cpu",
            dtype="fp32",
            max_num_batched_tokens=64,
            num_threads=2,
        )
    )
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("setting", ["ngram:4", "retrieval:4", "auto", "scripted", "eagle"])
def test_speculative_greedy_matches_plain_on_smollm2(engine, setting):
    tok = engine.tokenizer
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=32)
    want = [generate((engine.model, tok), tok.encode_chat(c), params) for c in chats]
    # Where layers round their activations to int8 (quant auto on a CPU with AVX2 or VNNI), a step of
    # up to the kernels' rows is rounded and a wider one is not, prompt rows too: the plain path prefills each
    # prompt in one pass, so each request runs alone on a cold cache, and the batch, whose chunks are
    # the scheduler's, is held to the same engine's batch without speculation.
    engine.speculator = None
    engine.reset_prefix_cache()
    batched_plain = engine.generate(chats, params)
    # ... and each request again after a prefix hit on its own first run (its tail after the cached
    # blocks), held to the same engine's output without speculation in the same state
    warm_plain = []
    for c in chats:
        engine.reset_prefix_cache()
        engine.generate([c], params)
        warm_plain.append(engine.generate([c], params)[0])
    engine.runner.collect_features = setting == "eagle"
    if setting == "scripted":
        script = {tuple(tok.encode_chat(c)): w.token_ids for c, w in zip(chats, want, strict=True)}
        engine.speculator = Speculator(SpeculativeConfig("fixed", "scripted", 4), [ScriptedDraft(script)])
    elif setting == "eagle":  # the catalogue's trained draft for SmolLM2
        draft = load_eagle_draft(None, engine.model, tok, "smollm2-135m-instruct")
        engine.speculator = Speculator(SpeculativeConfig("fixed", "eagle", 4), [draft])
    else:
        config = (
            SpeculativeConfig("auto") if setting == "auto" else SpeculativeConfig("fixed", setting[:-2], 4)
        )
        engine.speculator = build_speculator(config, engine.model, tok, "smollm2-135m-instruct")
        assert engine.speculator is not None
        if setting != "ngram:4":  # the catalogue's reply store was found and loaded
            assert "retrieval" in engine.speculator.policy.drafts
    before = engine.stats()
    alone, warm = [], []
    for c in chats:
        engine.reset_prefix_cache()
        alone.append(engine.generate([c], params)[0])
        warm.append(engine.generate([c], params)[0])
    engine.reset_prefix_cache()
    batched = engine.generate(chats, params)
    for w, a, b, bp in zip(want, alone, batched, batched_plain, strict=True):
        assert a.token_ids == w.token_ids and a.text == w.text
        assert b.token_ids == bp.token_ids and b.text == bp.text
    assert [r.token_ids for r in warm] == [r.token_ids for r in warm_plain]
    after = engine.stats()
    if setting != "auto":  # the fixed drafts always propose on the copying prompt
        assert after.spec_accepted_tokens > before.spec_accepted_tokens
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.fixture(scope="module")
def served():
    """SmolLM2 as the daemon serves it: the catalogue GGUF, ``quant: auto``, bf16, int8 activations
    where the CPU has AVX-512 VNNI."""
    engine = LLMEngine.from_config(EngineConfig(num_threads=2))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("setting", ["ngram:4", "auto"])
def test_speculative_greedy_matches_plain_as_served(served, setting):
    """In bf16 a verification row and a plain decode row must come out the same bits, or a near tie
    between two tokens goes one way with speculation and the other without: each layer's int8
    activations turn a last-bit difference into a step. Every request runs cold (prefix cache
    emptied), so that the prompt's own path is the same in both."""
    if not served.int8_activation_layers:
        pytest.skip("without int8 activations a one-row step takes ATen's kernels, not the multi-row ones")
    tok = served.tokenizer
    chats = [[{"role": "user", "content": q}] for q in (*QUESTIONS, *MORE_QUESTIONS)]
    params = SamplingParams(max_tokens=48)

    def run() -> list[list[int]]:
        out = []
        for c in chats:
            served.reset_prefix_cache()
            out.append(served.generate([c], params)[0].token_ids)
        return out

    served.speculator = None
    want = run()
    config = SpeculativeConfig("auto") if setting == "auto" else SpeculativeConfig("fixed", "ngram", 4)
    served.speculator = build_speculator(config, served.model, tok, served.config.model)
    before = served.stats()
    try:
        assert run() == want
    finally:
        served.speculator = None
    if setting != "auto":  # the n-gram draft always proposes on the copying prompt
        assert served.stats().spec_accepted_tokens > before.spec_accepted_tokens


MORE_QUESTIONS = (
    "Tell me a short story about a cat who learns to swim.",
    "Write a Python function that returns the sum of the squares of a list.",
    "How do I make a cup of green tea? Give me the steps.",
    "What should I pack for a weekend trip to the mountains in winter?",
)
