"""Speculation on top of the KV-cache options: with a sliding window plus sinks, and with int8 KV,
greedy output with drafts is the same engine's output without them (seeded tiny models in fp64);
int4 KV, which quantises a block when it fills (rejected drafts included), is refused with them.

The scripted draft (test_speculative.py) makes long acceptances and mid-draft rejections happen, so
rolled-back slots cross block boundaries and the window slides while drafts are in flight."""

from __future__ import annotations

import pytest

from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.kv.window import KVWindow
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.equivalence.test_engine import TEXTS, run_staggered
from tests.equivalence.test_speculative import engine_for, with_scripted
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request, tmp_path_factory):
    folder = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    return load_model(folder, device="cpu", dtype="fp64")


KV_OPTIONS = {
    "window": {"kv_window": KVWindow(sink_tokens=4, window_tokens=24)},
    "int8": {"kv_dtype": "int8"},
}


@pytest.mark.parametrize("option", sorted(KV_OPTIONS))
@pytest.mark.parametrize("setting", ["ngram", "scripted"])
def test_speculation_with_kv_options_equals_the_same_engine_without(loaded, option, setting):
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS[:5]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * len(prompts)
    plain = run_staggered(engine_for(loaded, **KV_OPTIONS[option]), prompts, params)
    if setting == "ngram":
        engine = engine_for(loaded, {"draft": "ngram", "k": 4}, **KV_OPTIONS[option])
    else:
        engine = engine_for(loaded, **KV_OPTIONS[option])
        with_scripted(engine, loaded, prompts, params)
    got = run_staggered(engine, prompts, params)
    for want, have in zip(plain, got, strict=True):
        assert have.token_ids == want.token_ids
    assert engine.stats().kv_blocks_used == 0


def test_int4_kv_with_speculation_is_a_config_error_naming_both_keys():
    with pytest.raises(ValueError, match="kv_dtype: int4.*speculative: off"):
        EngineConfig(kv_dtype="int4", speculative="auto")
    EngineConfig(kv_dtype="int4", speculative="off")
