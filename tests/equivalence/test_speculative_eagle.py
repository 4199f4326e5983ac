"""The trained draft (``eagle``) is lossless and its bookkeeping exact (seeded tiny models, fp64).

An untrained draft with a seeded random layer stands in for a trained one: verification keeps the
output the plain path's whatever the draft proposes, and its head is restricted to the few tokens
the tiny models' greedy replies cycle through, so that drafts are both accepted and rejected. The
draft's own incremental state (its KV cache over true features, guesses rolled back, windows
trimmed) is checked against recomputing everything from scratch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import pytest
import torch

from edge_rtgi.errors import ModelFileError
from edge_rtgi.llm.eagle import (
    DraftKVCache,
    EagleDraft,
    EagleDraftModel,
    EagleDraftSpec,
    SequenceBackend,
    read_draft,
    save_draft,
)
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.request import Request
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.speculative import SpeculativeConfig, Speculator
from edge_rtgi.llm.tokenizer import tokenizer_fingerprint
from edge_rtgi.llm.weights import load_model
from tests.equivalence.test_engine import TEXTS, run_staggered
from tests.equivalence.test_speculative import check_prefix_hits_and_preemption
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def loaded(request, tmp_path_factory):
    folder = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    return load_model(folder, device="cpu", dtype="fp64")


def make_draft_model(loaded, head_ids: list[int], window: int = 16, seed: int = 0) -> EagleDraftModel:
    spec = EagleDraftSpec.for_target(
        loaded.model.config, "tiny", tokenizer_fingerprint(loaded.tokenizer), window, len(head_ids)
    )
    torch.manual_seed(seed)
    model = EagleDraftModel(spec)
    model.head_token_ids.copy_(torch.tensor(head_ids))
    return model.double()


def frequent_reply_tokens(loaded, prompts, count: int = 4) -> list[int]:
    counts: Counter[int] = Counter()
    for p in prompts:
        counts.update(generate(loaded, p, SamplingParams(max_tokens=30, ignore_eos=True)).token_ids)
    return sorted(t for t, _ in counts.most_common(count))


def eagle_engine(loaded, draft: EagleDraft, k: int = 4, **overrides) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 256, "max_num_batched_tokens": 16, **overrides})
    engine = LLMEngine.from_loaded(loaded, cfg, start=False)
    engine.speculator = Speculator(SpeculativeConfig("fixed", "eagle", k), [draft])
    engine.runner.collect_features = True
    return engine


def test_greedy_batch_one_and_mixed_batches_equal_plain(loaded):
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    head = frequent_reply_tokens(loaded, prompts)
    draft = EagleDraft(make_draft_model(loaded, head), loaded.model, min_confidence=0.0)
    p = SamplingParams(max_tokens=30, ignore_eos=True)
    engine = eagle_engine(loaded, draft)
    got = engine.generate([prompts[1]], p)[0]
    assert got.token_ids == generate(loaded, prompts[1], p).token_ids
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    results = run_staggered(engine, prompts, params)
    for prompt, pp, res in zip(prompts, params, results, strict=True):
        want = generate(loaded, prompt, pp)
        assert (res.token_ids, res.text) == (want.token_ids, want.text)
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0  # drafts were accepted
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # and rejected
    assert stats.kv_blocks_used == 0
    assert draft._states == {}  # every finished request was released


def test_prefix_hits_and_preemption_with_the_eagle_draft(loaded):
    def build(prompts, params, **overrides) -> LLMEngine:
        head = frequent_reply_tokens(loaded, prompts[:3])
        draft = EagleDraft(make_draft_model(loaded, head), loaded.model, min_confidence=0.0)
        return eagle_engine(loaded, draft, **overrides)

    check_prefix_hits_and_preemption(loaded, build)


def reference_proposal(model: EagleDraftModel, head: torch.Tensor, embed, feats, tokens, k: int) -> list[int]:
    """The draft's k tokens after ``tokens``, recomputed from scratch over the last window."""
    last = len(tokens) - 1
    start = max(0, last - model.spec.window_tokens)
    cache = DraftKVCache(model.spec.model_config(), torch.float64, torch.device("cpu"))
    cache.reset(start)
    pos = torch.arange(start, last)
    h = model(embed(torch.tensor(tokens[start + 1 : last + 1])), feats[start:last], pos, cache)[-1:]
    out = []
    for j in range(k):
        token = int(model.head_token_ids[int((h @ head.T).argmax(-1))])
        out.append(token)
        h = model(embed(torch.tensor([token])), h, torch.tensor([last + j]), cache)
    return out


@torch.inference_mode()
def test_incremental_state_equals_recomputing_from_scratch(loaded):
    """Features arriving in chunks, plain steps, accepted runs, a restart (preemption) and a window
    shorter than the sequence: every proposal equals one recomputed from the true features."""
    tok, target = loaded.tokenizer, loaded.model
    seq = tok.encode(" ".join(TEXTS * 2))[:60]
    assert len(seq) == 60
    cache = ContiguousKVCache(target.config, len(seq), target.dtype, target.device)
    cache.begin(len(seq))
    feats = target(torch.tensor(seq), torch.arange(len(seq)), cache)
    model = make_draft_model(loaded, list(range(0, 64)), window=12, seed=1)
    draft = EagleDraft(model, target, min_confidence=0.0)
    head, embed = draft.head.weight, target.embed_tokens

    def check(upto: int, k: int = 3) -> None:
        req = Request("r", seq[:upto], SamplingParams())
        assert draft.propose(req, k) == reference_proposal(model, head, embed, feats, seq[:upto], k)

    draft.add_features("r", 0, feats[0:7])  # a prefill chunk
    draft.add_features("r", 7, feats[7:20])  # the last chunk: the first token follows position 19
    check(21)
    draft.add_features("r", 20, feats[20:21])  # a plain step
    check(22)
    draft.add_features("r", 21, feats[21:25])  # a verification that accepted 3 drafts
    check(26)
    draft.add_features("r", 26 - 1, feats[25:40])  # many positions without a proposal (policy)
    check(41)
    draft.add_features("r", 0, feats[0:44])  # preempted and recomputed: starts again
    check(45)
    draft.release("r")
    assert draft.propose(Request("r", seq[:46], SamplingParams()), 3) == []  # nothing known


def test_draft_file_round_trip_and_refusals(loaded, tmp_path):
    model = make_draft_model(loaded, [1, 2, 3, 5, 8], seed=2).float()
    path = tmp_path / "draft.safetensors"
    save_draft(path, model, {"note": "test"})
    back, meta = read_draft(path)
    assert meta == {"note": "test"}
    assert back.spec == model.spec
    assert back.head_token_ids.tolist() == [1, 2, 3, 5, 8]
    w, w2 = model.layer.mlp.down_proj.weight, back.layer.mlp.down_proj.weight
    assert float((w - w2).abs().max().detach()) <= float(w.abs().max().detach()) / 127  # int8 per row
    EagleDraft.from_file(path, loaded.model, loaded.tokenizer)  # fits its target

    with pytest.raises(ModelFileError, match="does not exist"):
        read_draft(tmp_path / "missing.safetensors")
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="damaged"):
        read_draft(damaged)
    other = EagleDraftModel(dataclasses.replace(model.spec, tokenizer_sha256="0" * 64))
    other_path = tmp_path / "other.safetensors"
    save_draft(other_path, other, {})
    with pytest.raises(ModelFileError, match="another tokenizer"):
        EagleDraft.from_file(other_path, loaded.model, loaded.tokenizer)


def test_engine_refuses_a_bad_draft_file_with_one_warning(loaded, tmp_path, caplog):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a draft")
    caplog.set_level(logging.WARNING, logger="edge_rtgi.llm.engine")
    fixed = EngineConfig(speculative={"draft": "eagle", "k": 4, "draft_model": str(bad)})
    engine = LLMEngine.from_loaded(loaded, fixed, start=False)
    assert engine.speculator is None and not engine.runner.collect_features
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "speculative decoding is off" in warnings[0].getMessage()
    assert "damaged" in warnings[0].getMessage()
    caplog.clear()
    auto = EngineConfig(speculative={"draft": "auto", "draft_model": str(bad)})
    engine = LLMEngine.from_loaded(loaded, auto, start=False)
    assert engine.speculator is not None and list(engine.speculator.policy.drafts) == ["ngram"]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    prompt = loaded.tokenizer.encode(TEXTS[1])
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    assert engine.generate([prompt], p)[0].token_ids == generate(loaded, prompt, p).token_ids


def test_sequence_backend_matches_the_cache_path(loaded):
    """Training's one-pass attention (SequenceBackend) and drafting's cache give the same rows."""
    model = make_draft_model(loaded, [1, 2, 3], window=5, seed=4)
    T, H = 14, model.spec.hidden_size
    torch.manual_seed(0)
    e, f = torch.randn(T, H, dtype=torch.float64), torch.randn(T, H, dtype=torch.float64)
    pos = torch.arange(T)
    with torch.no_grad():
        full = model(e, f, pos, SequenceBackend(pos, 5))
        cache = DraftKVCache(model.spec.model_config(), torch.float64, torch.device("cpu"), capacity=4)
        parts = [model(e[a:b], f[a:b], pos[a:b], cache) for a, b in ((0, 3), (3, 4), (4, 11), (11, 14))]
    assert torch.allclose(full, torch.cat(parts), atol=1e-10)


def test_bf16_draft_keeps_fp32_rotary_and_refuses_ids_the_model_lacks(loaded, tmp_path):
    model = make_draft_model(loaded, [1, 2, 3]).float()
    target = load_model(loaded.source, device="cpu", dtype="bf16").model
    draft = EagleDraft(model, target)
    assert draft.model.rotary.inv_freq.dtype == torch.float32
    bad = make_draft_model(loaded, [1, 2, loaded.model.config.vocab_size + 5]).float()
    path = tmp_path / "bad-ids.safetensors"
    save_draft(path, bad, {})
    with pytest.raises(ModelFileError, match="token ids"):
        EagleDraft.from_file(path, loaded.model, loaded.tokenizer)
