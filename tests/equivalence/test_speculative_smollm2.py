"""SmolLM2 through the engine with speculation gives the plain path's greedy output, token for
token, with the n-gram draft, the catalogue's reply store (``retrieval``), the adaptive policy
over both as the engine builds it, the trained draft, and a draft that is often right (so that long
verifications of the real model happen), alone and in one batch."""

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
    alone = [engine.generate([c], params)[0] for c in chats]
    batched = engine.generate(chats, params)
    for w, a, b in zip(want, alone, batched, strict=True):
        assert a.token_ids == w.token_ids and a.text == w.text
        assert b.token_ids == w.token_ids and b.text == w.text
    after = engine.stats()
    if setting != "auto":  # the fixed drafts always propose on the copying prompt
        assert after.spec_accepted_tokens > before.spec_accepted_tokens
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
