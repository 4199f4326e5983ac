"""Speculative decoding is lossless: greedy output is the plain path's, token for token, for every
draft, alone and in mixed batches, with prefix hits and after preemption (seeded tiny models in
float64, as in test_engine.py).

Besides the real drafts (n-gram, the adaptive policy) a test draft proposes the plain path's own
continuation with every third token wrong, so that long acceptances, rejections in the middle of
a draft and the KV rollback after them all happen on every architecture; the random tiny models
rarely repeat themselves enough for the n-gram draft to be accepted often.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.request import Request
from edge_rtgi.llm.retrieval import save_reply_store
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.speculative import NgramDraft, SpeculativeConfig, Speculator
from edge_rtgi.llm.tokenizer import tokenizer_fingerprint
from edge_rtgi.llm.weights import load_model
from tests.equivalence.test_engine import TEXTS, run_staggered
from tests.tiny_models import make_tiny_hf_model


class ScriptedDraft:
    """Proposes the known continuation of each prompt (the plain path's output), with every
    ``wrong_every``-th proposed token replaced by a wrong one."""

    name = "scripted"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
        self.continuations = continuations
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, request: Request, k: int) -> list[int]:
        full = self.continuations[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        out = list(full[done : done + k])
        for i in range(len(out)):
            self.calls += 1
            if self.calls % self.wrong_every == 0:
                out[i] = (out[i] + 1) % 300
        return out

    def release(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def loaded(request, tmp_path_factory):
    folder = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    return load_model(folder, device="cpu", dtype="fp64")


def engine_for(loaded, speculative="off", **overrides) -> LLMEngine:
    cfg = EngineConfig(
        **{
            "block_size": 4,
            "num_kv_blocks": 256,
            "max_num_batched_tokens": 16,
            "speculative": speculative,
            "int8_activations": False,  # lossy; the tests that want it ask for it
            **overrides,
        }
    )
    return LLMEngine.from_loaded(loaded, cfg, start=False)


def with_scripted(engine: LLMEngine, loaded, prompts, params, k: int = 4) -> ScriptedDraft:
    script = {
        tuple(p): generate(loaded, p, SamplingParams(max_tokens=pp.max_tokens, ignore_eos=True)).token_ids
        for p, pp in zip(prompts, params, strict=True)
    }
    draft = ScriptedDraft(script)
    engine.speculator = Speculator(SpeculativeConfig("fixed", "scripted", k), [draft])
    return draft


SETTINGS = ["ngram", "auto", "scripted", "retrieval"]


def retrieval_engine(loaded, prompts, params, k: int = 4, **overrides) -> LLMEngine:
    """The ``retrieval`` draft, loaded from a store file as the engine loads the catalogue's, over
    the model's own greedy replies to ``prompts``, each also twice with every 5th token changed (so
    that there the store's majority is wrong and drafts are rejected), and its replies to
    unrelated texts."""
    replies = []
    for p, pp in zip(prompts, params, strict=True):
        reply = generate(loaded, p, SamplingParams(max_tokens=pp.max_tokens, ignore_eos=True)).token_ids
        changed = [(t + 7) % 300 if i % 5 == 4 else t for i, t in enumerate(reply)]
        replies += [reply, changed, changed]
    tok = loaded.tokenizer
    replies += [generate(loaded, tok.encode(t[::-1]), SamplingParams(max_tokens=20)).token_ids for t in TEXTS]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "replies.safetensors"
        save_reply_store(path, replies, {"target": "tiny", "tokenizer_sha256": tokenizer_fingerprint(tok)})
        return engine_for(loaded, {"draft": "retrieval", "k": k, "draft_model": str(path)}, **overrides)


def speculating_engine(loaded, setting, prompts, params, **overrides) -> LLMEngine:
    if setting == "ngram":
        return engine_for(loaded, {"draft": "ngram", "k": 4}, **overrides)
    if setting == "retrieval":
        return retrieval_engine(loaded, prompts, params, **overrides)
    if setting == "auto":
        return engine_for(loaded, "auto", **overrides)
    engine = engine_for(loaded, **overrides)
    with_scripted(engine, loaded, prompts, params)
    return engine


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_batch_one_equals_plain(loaded, setting):
    tok = loaded.tokenizer
    prompts = [tok.encode(TEXTS[1] + " " + TEXTS[1]), tok.encode(TEXTS[4])]
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 2
    drafted = accepted = 0
    for prompt, p in zip(prompts, params, strict=True):
        engine = speculating_engine(loaded, setting, [prompt], [p])
        got = engine.generate([prompt], p)[0]
        want = generate(loaded, prompt, p)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        assert engine.kv.num_free_blocks == 256
        stats = engine.stats()
        drafted, accepted = drafted + stats.spec_draft_tokens, accepted + stats.spec_accepted_tokens
        if setting == "scripted":
            assert stats.spec_accepted_tokens > 10  # long acceptances happened
            assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # and rejections
            assert stats.num_steps < 30  # fewer steps than tokens
            assert got.usage.accepted_draft_tokens == stats.spec_accepted_tokens
    if setting == "retrieval":
        assert drafted > accepted > 0  # drafts accepted and rejected


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_in_mixed_batches_equals_plain(loaded, setting):
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(TEXTS))]
    engine = speculating_engine(loaded, setting, prompts, params)
    results = run_staggered(engine, prompts, params)
    for prompt, p, got in zip(prompts, params, results, strict=True):
        want = generate(loaded, prompt, p)
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
    stats = engine.stats()
    assert stats.requests_per_step > 1.5
    assert stats.kv_blocks_used == 0
    if setting in ("scripted", "retrieval"):
        assert stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("setting", SETTINGS)
def test_prefix_hits_and_preemption_with_speculation(loaded, setting):
    check_prefix_hits_and_preemption(
        loaded, lambda prompts, params, **kw: speculating_engine(loaded, setting, prompts, params, **kw)
    )


def check_prefix_hits_and_preemption(loaded, build) -> None:
    """Staggered requests sharing a system prompt in a pool small enough to preempt: prefix hits
    happen, and each output is the plain path's. ``build(prompts, params, **engine overrides)``
    makes the speculating engine."""
    tok = loaded.tokenizer
    system = tok.encode(TEXTS[5] + " " + TEXTS[1])
    prompts = [system + tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    engine = build(prompts, params, num_kv_blocks=30, max_num_batched_tokens=32)
    results = run_staggered(engine, prompts, params, join_every_steps=1)
    stats = engine.stats()
    assert stats.prefix_hit_tokens > 0
    # the tiny Mistral's sliding window releases blocks behind it, so its pool never runs out
    windowed = any(g.window_tokens is not None for g in loaded.model.config.kv_groups())
    assert stats.num_preemptions > 0 or windowed
    for prompt, p, got in zip(prompts, params, results, strict=True):
        assert got.token_ids == generate(loaded, prompt, p).token_ids
    assert engine.kv.num_free_blocks == 30


def test_stop_string_and_eos_inside_accepted_drafts(loaded):
    tok = loaded.tokenizer
    prompt = tok.encode(TEXTS[1])
    plain = generate(loaded, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    stop = plain.text[9:12]
    p = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    want = generate(loaded, prompt, p)
    engine = engine_for(loaded)
    draft = with_scripted(engine, loaded, [prompt], [p], k=8)
    draft.wrong_every = 1000  # accept everything: the stop lands inside a verified draft
    got = engine.generate([prompt], p)[0]
    assert want.finish_reason == "stop"
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    # a stop token (a token of the plain output used as EOS) met inside a draft ends it there
    eos = plain.token_ids[7]
    p = SamplingParams(max_tokens=24, stop_token_ids=(eos,))
    want = generate(loaded, prompt, p)
    engine = engine_for(loaded)
    draft = with_scripted(engine, loaded, [prompt], [p], k=8)
    draft.wrong_every = 1000
    got = engine.generate([prompt], p)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert engine.kv.num_free_blocks == 256


def test_max_tokens_is_never_exceeded(loaded):
    tok = loaded.tokenizer
    prompt = tok.encode(TEXTS[2])
    for max_tokens in (1, 2, 3, 5):
        p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine = engine_for(loaded)
        draft = with_scripted(engine, loaded, [prompt], [p], k=8)
        draft.wrong_every = 1000
        got = engine.generate([prompt], p)[0]
        assert got.token_ids == generate(loaded, prompt, p).token_ids
        assert len(got.token_ids) == max_tokens


def test_ngram_draft_proposes_the_latest_continuation():
    draft = NgramDraft(min_n=2, max_n=3)
    req = Request("r", [5, 6, 7, 8, 1, 2, 5, 6], SamplingParams())
    assert draft.propose(req, 3) == [7, 8, 1]
    req.append_output_token(9)  # 6 -> 9 now: "5 6" has been followed by 7 once and ... 9 not yet
    assert draft.propose(req, 2) == []  # "6 9" and "9" never seen before
    req2 = Request("s", [1, 2, 3, 1, 2, 4, 1, 2], SamplingParams())
    # "1 2" was followed by 3 then 4: the latest (4) only half of the time -> confidence 0.5
    assert draft.propose(req2, 1) == [4]
    assert NgramDraft(min_confidence=0.6).propose(req2, 1) == []
