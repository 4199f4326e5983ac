"""The real model through the engine (catalogue -> from_config) gives the plain path's output."""

from __future__ import annotations

import pytest

from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams

pytestmark = pytest.mark.slow


def test_engine_matches_plain_generation_on_smollm2():
    engine = LLMEngine.from_config(
        EngineConfig(
            model="smollm2-135m-instruct",
            device="cpu",
            dtype="fp32",
            quant="none",  # full precision: quant auto quantises fp32 too where AVX2 int8 loops exist
            max_num_batched_tokens=32,
            num_threads=2,
        )
    )
    try:
        tok = engine.tokenizer
        chats = [
            [{"role": "user", "content": q}]
            for q in ("What is the capital of France?", "Name three colours.", "What is 2 + 2?")
        ]
        params = SamplingParams(max_tokens=12)
        results = engine.generate(chats, params)  # batched, prompts chunked over several steps
        for chat, got in zip(chats, results, strict=True):
            want = generate((engine.model, tok), tok.encode_chat(chat), params)
            assert got.token_ids == want.token_ids
            assert got.text == want.text and got.finish_reason == want.finish_reason
        assert "Paris" in results[0].text
        assert engine.stats().requests_per_step > 1.0
    finally:
        engine.shutdown()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
