"""Importance eviction (``kv_budget_tokens`` + ``kv_eviction``) against a dense reference.

The reference keeps every key in one contiguous tensor (rotated at its absolute position, as
the model writes it) plus the list of positions still kept. Per forward pass it attends over
the kept keys and the pass's own (causal), adds the attention mass every key receives (summed
over layers, heads and the counted queries) to that key's score, and after the pass, when the
request holds more than its budget, keeps what ``kv.eviction.select_keep`` picks from those
scores. The paged engine (blocks, compaction, copy-on-write, padded or per-sequence decodes)
must compute the same function. Tiny seeded models in float64, so kernels cannot flip near-ties.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from edge_rtgi.llm.engine import GenerationResult, LLMEngine, _segment_tokens
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.kv.eviction import KVEviction, observation_queries, segment_ids, select_keep
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage
from edge_rtgi.llm.runner import SNAPKV_POOL_TOKENS
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.equivalence.test_kv_window import CHUNK, prompts_of, run_engine
from tests.tiny_models import make_tiny_hf_model

BLOCK = 4  # run_engine's block size


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request, tmp_path_factory):
    folder = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=5)
    return load_model(folder, device="cpu", dtype="fp64")


class EvictionReference:
    """Dense attention over the kept positions, with the eviction rule applied after each pass."""

    def __init__(
        self,
        loaded,
        policy: KVEviction,
        budget: int,
        prompt: list[int],
        max_len: int,
        int8_kv: bool = False,
    ):
        model = loaded.model
        self.int8_kv = int8_kv
        cfg = model.config
        self.model, self.policy, self.budget = model, policy, budget
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype)
        self.v = torch.zeros(shape, dtype=model.dtype)
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.kept: list[int] = []
        self.scores: list[float] = []
        self.length = 0
        self.step_mass: Tensor | None = None
        self.score_queries = 0
        self.turn_starts, self.sentence_ends = _segment_tokens(loaded.tokenizer, policy)
        self.observed = observation_queries(policy, prompt, self.turn_starts)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[0]
        start = self.length
        if self.int8_kv:  # what an int8 store gives back: per-token codes times their scale
            k, v = (_int8_round_trip(x) for x in (k, v))
        self.k[layer, start : start + n], self.v[layer, start : start + n] = k, v
        index = torch.tensor(self.kept + list(range(start, start + n)))
        keys, values = self.k[layer, index], self.v[layer, index]  # [S, Hkv, D]
        hq, hkv = q.shape[1], keys.shape[1]
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
        logits = torch.einsum("thd,shd->hts", q, keys) * q.shape[-1] ** -0.5
        s = len(index)
        mask = torch.ones(n, s, dtype=torch.bool).tril(s - n)
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)  # [H, T, S]
        if self.score_queries:
            mass = probs[:, n - self.score_queries :].sum(dim=(0, 1))
            self.step_mass = mass if self.step_mass is None else self.step_mass + mass
        return torch.einsum("hts,shd->thd", probs, values)

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> int:
        n = len(ids)
        prompt_done = self.length + n >= self.num_prompt
        if self.policy.scores_every_query():
            self.score_queries = n
        else:  # observation: the prompt's last queries, then decodes
            self.score_queries = min(self.observed, n) if prompt_done else 0
        self.step_mass = None
        positions = torch.arange(self.length, self.length + n)
        hidden = self.model(torch.tensor(ids), positions, self)
        mass = self.step_mass if self.step_mass is not None else torch.zeros(len(self.kept) + n)
        if self.policy.mode == "snapkv" and n > 1:
            k = SNAPKV_POOL_TOKENS
            mass = F.max_pool1d(mass[None, None], k, 1, k // 2)[0, 0]
        self.scores = [a + b for a, b in zip([*self.scores, *[0.0] * n], mass.tolist(), strict=True)]
        self.kept += list(range(self.length, self.length + n))
        self.length += n
        token = int(self.model.compute_logits(hidden[-1:])[0].argmax())
        if len(self.kept) > self.budget and (self.policy.scores_every_query() or prompt_done):
            segments = None
            if self.policy.mode == "segment":
                ids_all = segment_ids(self.tokens, self.turn_starts, self.sentence_ends)
                segments = [ids_all[p] for p in self.kept]
            keep = select_keep(
                self.scores, self.policy.trim_target(self.budget, BLOCK), self.policy, segments
            )
            self.kept = [self.kept[i] for i in keep]
            self.scores = [self.scores[i] for i in keep]
        return token


def _int8_round_trip(x: Tensor) -> Tensor:
    codes, scale = Int8PagedKVStorage._quantise(x)
    return (codes.float() * scale).to(x.dtype)


def reference_tokens(
    loaded,
    policy: KVEviction,
    budget: int,
    prompt: list[int],
    chunks: list[int],
    max_tokens: int,
    int8_kv: bool = False,
) -> list[int]:
    """The reference's greedy tokens, prefilling in the engine's chunks (eviction follows steps)."""
    ref = EvictionReference(loaded, policy, budget, prompt, len(prompt) + max_tokens, int8_kv)
    start = 0
    for n in chunks:
        token = ref.forward(prompt[start : start + n])
        start += n
    assert start == len(prompt)
    out = [token]
    while len(out) < max_tokens:
        ref.tokens.append(out[-1])
        out.append(ref.forward([out[-1]]))
    return out


def chat_prompt(loaded) -> list[int]:
    turns = [
        ("user", "My cat is called Pixel."),
        ("assistant", "Nice name."),
        ("user", "The door code is 4711."),
        ("assistant", "Noted."),
        ("user", "What is my cat called?"),
    ]
    return loaded.tokenizer.encode_chat([{"role": r, "content": c} for r, c in turns])


def run_recorded(loaded, prompts: list[list[int]], max_tokens: int, **overrides):
    """``run_engine`` that also records each request's prefill chunk lengths and asserts the
    most blocks it holds after any step."""
    cfg = EngineConfig(
        **{"block_size": BLOCK, "num_kv_blocks": 512, "max_num_batched_tokens": CHUNK, **overrides}
    )
    engine = LLMEngine.from_loaded(loaded, cfg, start=False)
    results = [GenerationResult() for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(
            prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), results[i].add, request_id=f"r{i}"
        )
    chunks: list[list[int]] = [[] for _ in prompts]
    execute = engine.runner.execute

    def recording(output, params):
        for sr in output.scheduled:
            i = int(sr.request_id[1:])
            if sr.start_position < len(prompts[i]):
                chunks[i].append(len(sr.token_ids))
        return execute(output, params)

    engine.runner.execute = recording  # type: ignore[method-assign]
    most_held = 0
    while not all(r.finish_reason for r in results):
        engine.step()
        most_held = max([most_held, *(sum(engine.kv.num_held_blocks(f"r{i}")) for i in range(len(prompts)))])
    assert engine.stats().kv_blocks_used == 0
    return [r.token_ids for r in results], chunks, most_held


def long_prompt(loaded) -> list[int]:
    text = "A small model on a small device answers questions about the weather and the news. "
    return loaded.tokenizer.encode(text * 3)[:72]


@pytest.mark.parametrize(
    ("mode", "score"),
    [("h2o", None), ("snapkv", None), ("segment", None), ("segment", "accumulated"), ("h2o", "observation")],
)
@pytest.mark.parametrize("decode_mode", ["padded", "per_seq"])
def test_eviction_matches_the_dense_reference(loaded, mode, score, decode_mode):
    policy = KVEviction(mode, sink_tokens=4, recent_tokens=8, observation_tokens=8, score=score)
    budget, max_tokens = 44, 40
    prompts = [chat_prompt(loaded), long_prompt(loaded)]
    got, chunks, most_held = run_recorded(
        loaded, prompts, max_tokens, kv_budget_tokens=budget, kv_eviction=policy, decode_mode=decode_mode
    )
    for prompt, tokens, steps in zip(prompts, got, chunks, strict=True):
        assert len(prompt) > budget
        assert tokens == reference_tokens(loaded, policy, budget, prompt, steps, max_tokens)
    if policy.scores_every_query():  # never more than the budget after a step, prefill included
        assert most_held <= -(-budget // BLOCK)


def test_unpinned_segments_match_the_dense_reference(loaded):
    policy = KVEviction("segment", sink_tokens=4, recent_tokens=8, pin_system=False)
    budget, max_tokens = 44, 40
    prompts = [chat_prompt(loaded), long_prompt(loaded)]
    got, chunks, _ = run_recorded(loaded, prompts, max_tokens, kv_budget_tokens=budget, kv_eviction=policy)
    for prompt, tokens, steps in zip(prompts, got, chunks, strict=True):
        assert tokens == reference_tokens(loaded, policy, budget, prompt, steps, max_tokens)


@pytest.mark.parametrize("mode", ["h2o", "segment"])
def test_eviction_without_slack_matches_the_dense_reference_and_holds_the_budget(loaded, mode):
    """``slack_tokens: 0`` trims to the budget itself: the same rule, a different target."""
    policy = KVEviction(mode, sink_tokens=4, recent_tokens=8, observation_tokens=8, slack_tokens=0)
    budget, max_tokens = 44, 40
    prompts = [chat_prompt(loaded), long_prompt(loaded)]
    got, chunks, most_held = run_recorded(
        loaded, prompts, max_tokens, kv_budget_tokens=budget, kv_eviction=policy
    )
    for prompt, tokens, steps in zip(prompts, got, chunks, strict=True):
        assert tokens == reference_tokens(loaded, policy, budget, prompt, steps, max_tokens)
    if policy.scores_every_query():
        assert most_held <= -(-budget // BLOCK)  # after every step


def test_local_contrast_scores_match_the_dense_reference(loaded):
    """``contrast_tokens`` only changes the ranking (``kv.eviction.local_contrast``)."""
    policy = KVEviction("segment", sink_tokens=4, recent_tokens=8, pin_system=False, contrast_tokens=8)
    budget, max_tokens = 44, 40
    prompts = [chat_prompt(loaded), long_prompt(loaded)]
    got, chunks, _ = run_recorded(loaded, prompts, max_tokens, kv_budget_tokens=budget, kv_eviction=policy)
    for prompt, tokens, steps in zip(prompts, got, chunks, strict=True):
        assert tokens == reference_tokens(loaded, policy, budget, prompt, steps, max_tokens)


@pytest.mark.parametrize("mode", ["h2o", "snapkv", "segment"])
def test_int8_kv_under_eviction_matches_the_dense_reference_on_int8_keys(loaded, mode):
    """int8 KV + eviction: compaction moves each survivor's codes and scale, so the engine must
    compute what the dense reference computes over the same int8-rounded keys and values."""
    policy = KVEviction(mode, sink_tokens=4, recent_tokens=8, observation_tokens=8)
    budget, max_tokens = 44, 40
    prompts = [chat_prompt(loaded), long_prompt(loaded)]
    got, chunks, _ = run_recorded(
        loaded, prompts, max_tokens, kv_budget_tokens=budget, kv_eviction=policy, kv_dtype="int8"
    )
    for prompt, tokens, steps in zip(prompts, got, chunks, strict=True):
        assert len(prompt) > budget
        assert tokens == reference_tokens(loaded, policy, budget, prompt, steps, max_tokens, int8_kv=True)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("mode", ["h2o", "snapkv", "segment"])
def test_quantised_kv_with_a_budget_larger_than_the_sequence_is_that_kv(loaded, mode, kv_dtype):
    prompts = prompts_of(loaded)
    plain, _ = run_engine(loaded, prompts, 40, kv_dtype=kv_dtype)
    budgeted, _ = run_engine(
        loaded, prompts, 40, kv_dtype=kv_dtype, kv_budget_tokens=200, kv_eviction=KVEviction(mode)
    )
    assert budgeted == plain


@pytest.mark.parametrize("mode", ["h2o", "snapkv", "segment"])
def test_a_budget_larger_than_the_sequence_changes_nothing(loaded, mode):
    prompts = prompts_of(loaded)
    plain, _ = run_engine(loaded, prompts, 40)
    budgeted, _ = run_engine(loaded, prompts, 40, kv_budget_tokens=200, kv_eviction=KVEviction(mode))
    assert budgeted == plain


def test_eviction_off_runs_todays_path(loaded):
    """Without a budget no score is gathered and the fused decode path stays in use."""
    prompts = prompts_of(loaded)
    engine = LLMEngine.from_loaded(loaded, None, start=False)
    assert engine.runner.eviction is None
    plain, _ = run_engine(loaded, prompts, 24)
    again, _ = run_engine(loaded, prompts, 24, kv_budget_tokens=None, kv_eviction=None)
    assert again == plain


@pytest.mark.parametrize("mode", ["h2o", "snapkv", "segment"])
def test_int4_kv_under_eviction_holds_the_budget_and_batched_equals_alone(loaded, mode):
    """int4 KV + eviction re-quantises the blocks a compaction rewrites (bounded and checked in
    tests/unit/test_kv_eviction_manager.py), so there is no exact dense reference here; what must
    hold is the budget after every step, and that two requests sharing the store (their open
    blocks in one buffer, their compactions interleaved) compute exactly what each does alone."""
    policy = KVEviction(mode, sink_tokens=4, recent_tokens=8, observation_tokens=8)
    budget, max_tokens = 43, 40  # trims to 39 tokens: the last block stays partly filled, open
    prompts = [chat_prompt(loaded), long_prompt(loaded)]
    settings = {"kv_budget_tokens": budget, "kv_eviction": policy, "kv_dtype": "int4"}
    together, chunks, most_held = run_recorded(loaded, prompts, max_tokens, **settings)
    compared = 0
    for prompt, tokens, steps in zip(prompts, together, chunks, strict=True):
        alone, alone_steps, _ = run_recorded(loaded, [prompt], max_tokens, **settings)
        if alone_steps[0] == steps:  # h2o evicts per prefill chunk: compare like with like
            assert alone[0] == tokens
            compared += 1
    assert compared
    if policy.scores_every_query():
        assert most_held <= -(-budget // BLOCK)
    evicting = LLMEngine.from_loaded(loaded, EngineConfig(block_size=BLOCK, **settings), start=False)
    assert evicting.storage.__class__.__name__ == "Int4KIVIPagedKVStorage"


@pytest.mark.parametrize(("mode", "num_blocks", "held_blocks"), [("h2o", 16, 15), ("snapkv", 24, 22)])
def test_a_request_longer_than_the_pool_runs_under_its_budget(loaded, mode, num_blocks, held_blocks):
    """72 + 120 tokens need 48 blocks of 4; under a budget of 44 the request holds at most the
    budget plus one 16-token chunk (h2o: 15 blocks), or its prompt whole plus a chunk (snapkv:
    22 blocks), so admission lets it into a pool that small and it gives the reference's tokens."""
    policy = KVEviction(mode, sink_tokens=4, recent_tokens=8, observation_tokens=8)
    budget, max_tokens = 44, 120
    prompt = long_prompt(loaded)
    assert -(-(len(prompt) + max_tokens) // BLOCK) > num_blocks
    got, chunks, most_held = run_recorded(
        loaded, [prompt], max_tokens, num_kv_blocks=num_blocks, kv_budget_tokens=budget, kv_eviction=policy
    )
    assert len(got[0]) == max_tokens
    assert got[0] == reference_tokens(loaded, policy, budget, prompt, chunks[0], max_tokens)
    assert most_held <= held_blocks


def test_a_pool_too_small_for_the_budget_or_the_prompt_is_an_error_naming_sizes(loaded):
    prompt = long_prompt(loaded)
    plain = LLMEngine.from_loaded(
        loaded, EngineConfig(block_size=BLOCK, num_kv_blocks=16, max_num_batched_tokens=CHUNK), start=False
    )
    (res,) = plain.generate([prompt], SamplingParams(max_tokens=120, ignore_eos=True))
    assert res.finish_reason == "error" and "needs up to 191 tokens" in (res.error or "")

    def refused(mode: str, num_blocks: int, budget: int) -> str:
        cfg = EngineConfig(
            block_size=BLOCK,
            num_kv_blocks=num_blocks,
            max_num_batched_tokens=CHUNK,
            kv_budget_tokens=budget,
            kv_eviction=KVEviction(mode, sink_tokens=4, recent_tokens=8),
        )
        engine = LLMEngine.from_loaded(loaded, cfg, start=False)
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=120, ignore_eos=True))
        assert out.finish_reason == "error" and not out.token_ids
        return out.error or ""

    # snapkv holds the 72-token prompt whole: 88 tokens, 22 blocks, in a pool of 16
    assert "72-token prompt, held whole until kv_eviction snapkv" in refused("snapkv", 16, 44)
    # a budget of 60 plus a chunk of 16 is 19 blocks, more than the pool's 16
    assert "kv_budget_tokens 60 plus one step's 16" in refused("h2o", 16, 60)
    # the model's positions still bound a request under eviction
    long = (prompt * 4)[: loaded.model.config.max_position_embeddings]
    cfg = EngineConfig(block_size=BLOCK, kv_budget_tokens=44, kv_eviction=KVEviction("h2o"))
    (out,) = LLMEngine.from_loaded(loaded, cfg, start=False).generate([long], SamplingParams(max_tokens=4))
    assert "context window is 256 tokens" in (out.error or "")
