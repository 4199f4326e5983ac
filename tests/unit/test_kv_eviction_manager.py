"""Importance eviction without a model: the selection rule, segments, compaction in the KV
manager, the scheduler around it, bit-exact slot copies in the storages, and config errors."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from edge_rtgi.config import ConfigError, from_dict
from edge_rtgi.errors import RequestError
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.kv.eviction import (
    KVEviction,
    local_contrast,
    observation_queries,
    segment_ids,
    select_keep,
)
from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
from edge_rtgi.llm.kv.manager import KVCacheManager
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage, PagedKVStorage
from edge_rtgi.llm.request import Request
from edge_rtgi.llm.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput


@dataclass(frozen=True)
class Params:
    max_tokens: int = 8


def req(rid: str, n_prompt: int, base: int = 1, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(base, base + n_prompt)), Params(max_tokens), eos_token_ids=frozenset({0}))


def test_eviction_policy_imports_no_torch():
    code = "import sys; import edge_rtgi.llm.kv.eviction; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- selection -----------------------------------------------------------------------------


def test_select_keep_protects_sinks_and_recent_then_takes_the_heaviest():
    policy = KVEviction("h2o", sink_tokens=2, recent_tokens=3)
    scores = [0.0, 0.0, 5.0, 1.0, 9.0, 2.0, 7.0, 0.5, 0.0, 0.0, 0.0]
    keep = select_keep(scores, 7, policy)
    # sinks 0-1, recent 8-10, then the two heaviest of 2..7: 4 (9.0) and 6 (7.0)
    assert keep == [0, 1, 4, 6, 8, 9, 10]
    assert select_keep(scores, 20, policy) == list(range(11))  # under the target: everything
    assert select_keep(scores, 4, policy) == [0, 1, 8, 9, 10]  # never below the protected tokens


def test_trims_go_slack_tokens_below_the_budget():
    assert KVEviction("h2o").trim_target(240, 16) == 224  # default: one block below
    assert KVEviction("h2o", slack_tokens=0).trim_target(240, 16) == 240
    assert KVEviction("h2o", slack_tokens=100).trim_target(120, 16) == 37  # protected 36, plus one


def test_local_contrast_ranks_a_fact_above_recent_small_talk():
    """Mass decays with distance: raw mass prefers the recent segment (2), local contrast the
    old segment whose tokens stand out from their neighbours (1)."""
    segments = [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 4]
    scores = [1.0, 1.0, 4.0, 4.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0, 9.0]
    assert local_contrast([2.0, 4.0, 6.0], 1) == [0.5, 1.0, 1.0]  # the upper median of a pair
    raw = KVEviction("segment", sink_tokens=0, recent_tokens=1, pin_system=False)
    assert select_keep(scores, 5, raw, segments) == [6, 7, 8, 9, 10]
    contrast = KVEviction("segment", sink_tokens=0, recent_tokens=1, pin_system=False, contrast_tokens=2)
    assert select_keep(scores, 5, contrast, segments) == [0, 1, 2, 3, 10]  # 1 first, then 0 fits


def test_select_keep_ties_keep_the_older_token():
    policy = KVEviction("h2o", sink_tokens=0, recent_tokens=0)
    assert select_keep([1.0, 1.0, 1.0, 1.0], 2, policy) == [0, 1]


def test_segments_are_kept_or_dropped_whole_and_the_first_is_pinned():
    policy = KVEviction("segment", sink_tokens=1, recent_tokens=2)
    #          seg:   0  0  1  1  1  2  2  3  3  4  4
    segments = [0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4]
    scores = [0.0, 0.1, 3.0, 3.0, 0.0, 9.0, 0.1, 1.0, 1.0, 0.0, 0.0]
    # protected: 0 (sink), 9-10 (recent). Free: 1 (seg 0, pinned), 2-4 (mean 2.0), 5-6 (mean 4.55),
    # 7-8 (mean 1.0). Room 8 - 3 = 5: seg 0 (1 token), seg 2 (2), then seg 1 (3) does not fit
    # the 2 left, seg 3 (2) does.
    keep = select_keep(scores, 8, policy, segments)
    assert keep == [0, 1, 5, 6, 7, 8, 9, 10]
    # token-level H2O on the same scores splits segments instead
    assert select_keep(scores, 8, KVEviction("h2o", sink_tokens=1, recent_tokens=2)) == [
        0,
        2,
        3,
        5,
        7,
        8,
        9,
        10,
    ]


def test_an_unpinned_system_prompt_competes_by_its_mass():
    segments = [0, 0, 0, 0, 1, 1, 2, 2, 3]
    scores = [0.0, 0.1, 0.1, 0.1, 5.0, 5.0, 2.0, 2.0, 0.0]
    # protected: 0 (sink), 8 (recent); room 6 - 2 = 4. Pinned, the system prompt's 3 free tokens
    # go first and no turn fits the 1 left; unpinned, the two heavier turns take the room.
    pinned = KVEviction("segment", sink_tokens=1, recent_tokens=1)
    assert select_keep(scores, 6, pinned, segments) == [0, 1, 2, 3, 8]
    unpinned = KVEviction("segment", sink_tokens=1, recent_tokens=1, pin_system=False)
    assert select_keep(scores, 6, unpinned, segments) == [0, 4, 5, 6, 7, 8]


def test_room_no_whole_segment_fits_stays_empty():
    policy = KVEviction("segment", sink_tokens=0, recent_tokens=1)
    segments = [0, 1, 1, 1, 1, 2]
    scores = [0.0, 1.0, 5.0, 0.0, 4.0, 0.0]
    # the pinned first segment (token 0) fits; segment 1 (4 tokens) does not fit the 2 left,
    # and a fact is never kept in part
    assert select_keep(scores, 4, policy, segments) == [0, 5]


def test_the_current_turn_observes_under_segment_mode():
    im_start = 1
    prompt = [im_start, 5, 5, 5, im_start, 6, 6, im_start, 7, 7, 7, im_start, 8]
    # from the question's turn start (index 7) to the end: the question and the reply's header
    assert observation_queries(KVEviction("segment"), prompt, {im_start}) == 6
    assert observation_queries(KVEviction("segment", observation_tokens=3), [5, 6, 7, 8], {im_start}) == 3
    assert observation_queries(KVEviction("snapkv", observation_tokens=3), prompt, {im_start}) == 3


def test_segment_ids_split_at_turn_starts_and_after_sentence_ends():
    im_start, dot = 1, 9
    tokens = [im_start, 5, 6, dot, 7, im_start, 8, dot, 4]
    assert segment_ids(tokens, {im_start}) == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert segment_ids(tokens, {im_start}, {dot}) == [0, 0, 0, 0, 1, 2, 2, 2, 3]


# --- the KV manager ------------------------------------------------------------------------


def held(kv: KVCacheManager, r: Request) -> list[int]:
    return kv.block_ids(r.request_id)[0]


def test_compact_packs_survivors_frees_blocks_and_counts_evicted_tokens():
    kv = KVCacheManager(16, 4)
    r = req("a", 14)
    assert kv.allocate_slots(r, 14)
    r.num_computed_tokens = 14
    before = held(kv, r)
    free_before = kv.num_free_blocks
    keep = [0, 1, 2, 3, 5, 9, 12, 13]
    moves = kv.compact(r, keep)
    assert moves is not None
    # block 0 is wholly kept in place: untouched; the 4 survivors after it fill one more block
    assert held(kv, r)[0] == before[0] and len(held(kv, r)) == 2
    assert moves.num_freed_blocks == 2 and kv.num_free_blocks == free_before + 2
    bs = 4
    expected_src = [before[i // bs] * bs + i % bs for i in keep[4:]]
    expected_dst = [held(kv, r)[1] * bs + j for j in range(4)]
    pairs = [(s, d) for s, d in zip(expected_src, expected_dst, strict=True) if s != d]
    assert list(zip(moves.src, moves.dst, strict=True)) == pairs
    assert r.num_evicted_tokens == 6 and r.num_kv_tokens == 8
    # the next token goes after the survivors: one more block
    assert kv.allocate_slots(r, 1) and len(held(kv, r)) == 3


def test_compact_keeps_untouched_prefix_blocks_cached_and_unhashes_rewritten_ones():
    kv = KVCacheManager(16, 4)
    r = req("a", 13)
    assert kv.allocate_slots(r, 13)
    r.num_computed_tokens = 12
    kv.cache_computed_blocks(r)  # three full blocks indexed
    blocks = [kv.pool.blocks[b] for b in held(kv, r)]
    assert all(b.block_hash is not None for b in blocks[:3])
    r.num_computed_tokens = 13
    kv.compact(r, [0, 1, 2, 3, 4, 5, 6, 7, 10, 12])
    # blocks 0 and 1 kept as they were: still cached; block 2 rewritten: no longer findable
    assert blocks[0].block_hash is not None and blocks[1].block_hash is not None
    assert blocks[2].block_hash is None
    # an evicted request indexes nothing more: its cache no longer holds a prefix
    r.num_computed_tokens = 16
    assert kv.allocate_slots(r, 3)
    kv.cache_computed_blocks(r)
    assert kv.pool.num_cached_blocks == 2


def prefix_sharers(kv: KVCacheManager):
    """Requests a and b of 9 tokens: a computed and cached, b's prefix-cache hit on a's blocks."""
    a, b = req("a", 9), req("b", 9)
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    return a, b, kv.get_computed_blocks(b)


def test_compact_never_writes_a_block_another_request_shares():
    kv = KVCacheManager(16, 4)
    a, b, hit = prefix_sharers(kv)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 1, hit)
    b.num_computed_tokens = 9
    shared = held(kv, b)[:2]
    assert shared == held(kv, a)[:2]
    moves = kv.compact(b, [0, 1, 6, 7, 8])  # block 0 changes: it must not be written
    assert moves is not None
    assert held(kv, b)[0] not in shared and not set(moves.dst) & {s * 4 + i for s in shared for i in range(4)}
    assert held(kv, a)[:2] == shared and all(kv.pool.blocks[s].ref_count == 1 for s in shared)


def test_compact_is_refused_without_a_block_for_copy_on_write():
    kv = KVCacheManager(4, 4)
    a, b, hit = prefix_sharers(kv)
    assert kv.allocate_slots(b, 1, hit)  # the pool's last block
    b.num_computed_tokens = 9
    assert kv.compact(b, [0, 1, 6, 7, 8]) is None
    assert b.num_evicted_tokens == 0 and len(held(kv, b)) == 3 and kv.num_free_blocks == 0


def test_compact_rejects_bad_keep_lists():
    kv = KVCacheManager(8, 4)
    r = req("a", 6)
    assert kv.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    for bad in ([], [2, 1], [0, 6], [1, 1]):
        with pytest.raises(ValueError):
            kv.compact(r, bad)


# --- the scheduler -------------------------------------------------------------------------


def fake_run(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({s.request_id: 7 for s in out.scheduled if s.sample})


def test_scheduler_runs_a_request_under_a_budget_by_evicting_after_steps():
    """The loop the engine runs, with a seeded random choice of survivors in place of scores."""
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 4, 256), kv)
    r = req("a", 30, max_tokens=20)
    s.add_request(r)
    budget, rng = 12, random.Random(0)
    most_blocks = 0
    while s.has_unfinished():
        out = s.schedule()
        for sr in out.scheduled:
            assert sr.start_position - sr.num_evicted_tokens == r.num_kv_tokens
            # the table covers the survivors and this step's tokens, no more
            assert len(sr.block_ids[0]) == -(-(r.num_kv_tokens + len(sr.token_ids)) // 4)
        s.update_from_output(out, fake_run(out))
        for over in s.over_kv_budget(budget):
            n = over.num_kv_tokens
            keep = sorted([0, *rng.sample(range(1, n - 2), budget - 5), n - 2, n - 1])
            assert kv.compact(over, keep) is not None
        most_blocks = max(most_blocks, kv.pool.num_used_blocks)
    assert r.num_output_tokens == 20 and r.num_evicted_tokens > 0
    assert most_blocks <= -(-budget // 4) + 1
    assert kv.pool.num_used_blocks == 0


def test_preemption_forgets_evictions():
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 4, 256), kv)
    r = req("a", 12)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, fake_run(out))
    assert kv.compact(r, [0, 1, 7]) is not None and r.num_evicted_tokens == 5
    s._preempt(r)
    assert r.num_evicted_tokens == 0 and r.num_kv_tokens == 0


def evict_like_the_engine(s: Scheduler, policy: KVEviction, budget: int, rng: random.Random) -> int:
    """``LLMEngine._evict`` with seeded random scores: trim every request over the budget (under
    observation scores only once its prompt is computed). Returns the most tokens one held."""
    most = max((r.num_kv_tokens for r in s.running), default=0)
    for over in s.over_kv_budget(budget):
        if not policy.scores_every_query() and over.num_computed_tokens < over.num_prompt_tokens:
            continue
        scores = [rng.random() for _ in range(over.num_kv_tokens)]
        keep = select_keep(scores, policy.trim_target(budget, s.kv.block_size), policy)
        assert s.kv.compact(over, keep) is not None
    return most


def run_under_budget(s: Scheduler, policy: KVEviction, budget: int, seed: int = 0) -> tuple[int, int]:
    """Run the scheduler to the end; the most blocks in use at once and tokens any request held."""
    rng, most_blocks, most_tokens = random.Random(seed), 0, 0
    while s.has_unfinished():
        out = s.schedule()
        s.update_from_output(out, fake_run(out))
        most_blocks = max(most_blocks, s.kv.pool.num_used_blocks)
        most_tokens = max(most_tokens, evict_like_the_engine(s, policy, budget, rng))
    return most_blocks, most_tokens


def budgeted(num_blocks: int, budget: int, policy: KVEviction | None, step: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(step, 4, 256, kv_budget_tokens=budget if policy else None, kv_eviction=policy),
        KVCacheManager(num_blocks, 4),
    )


H2O = KVEviction("h2o", sink_tokens=2, recent_tokens=4)
SNAPKV = KVEviction("snapkv", sink_tokens=2, recent_tokens=4, observation_tokens=4)


def test_admission_counts_the_budget_not_the_whole_length_under_h2o():
    """30 + 60 tokens need 23 blocks of 4; h2o under a budget of 12 holds at most 12 + one step's
    8 tokens (5 blocks), so a pool of 8 blocks runs it to its end."""
    with pytest.raises(RequestError, match=r"needs up to 89 tokens .*23 blocks of 4.* holds 8 blocks"):
        budgeted(8, 12, None).add_request(req("a", 30, max_tokens=60))
    s = budgeted(8, 12, H2O)
    r = req("a", 30, max_tokens=60)
    s.add_request(r)
    most_blocks, most_tokens = run_under_budget(s, H2O, 12)
    assert r.num_output_tokens == 60 and r.num_evicted_tokens > 0
    assert most_tokens <= 12 + 8 and most_blocks <= 5
    assert s.kv.pool.num_used_blocks == 0


def test_observation_scores_hold_the_prompt_whole_so_admission_counts_it():
    """snapkv keeps a 40-token prompt until its end: 40 + 8 tokens (12 blocks) at most."""
    s = budgeted(12, 12, SNAPKV)
    r = req("a", 40, max_tokens=60)
    s.add_request(r)
    most_blocks, most_tokens = run_under_budget(s, SNAPKV, 12)
    assert r.num_output_tokens == 60 and most_tokens == 40 and most_blocks <= 12
    # one block fewer: refused, naming the prompt held whole and h2o as a way out
    with pytest.raises(RequestError, match=r"40-token prompt, held whole until kv_eviction snapkv") as err:
        budgeted(11, 12, SNAPKV).add_request(req("b", 40, max_tokens=60))
    assert "h2o" in (err.value.hint or "") and "holds 11 blocks" in str(err.value)
    budgeted(11, 12, H2O).add_request(req("b", 40, max_tokens=60))  # h2o trims during prefill


def test_a_budget_the_pool_cannot_hold_is_refused_naming_the_sizes():
    with pytest.raises(RequestError, match=r"up to 20 tokens .*kv_budget_tokens 12 plus one step's 8") as err:
        budgeted(4, 12, H2O).add_request(req("a", 30, max_tokens=60))
    assert "lower kv_budget_tokens" in (err.value.hint or "")
    # the context window still bounds positions, eviction or not
    with pytest.raises(RequestError, match="context window is 256 tokens"):
        budgeted(64, 12, H2O).add_request(req("long", 300))
    # a request shorter than its budget is counted whole, as without eviction
    with pytest.raises(RequestError, match=r"needs up to 9 tokens"):
        budgeted(2, 64, H2O).add_request(req("short", 6, max_tokens=4))


def test_requests_longer_than_the_pool_preempt_each_other_and_all_finish():
    """Deadlock freedom under a budget: three requests each far longer than the pool, which holds
    only one of them at its budget at a time, all run to their end."""
    s = budgeted(6, 12, H2O)
    reqs = [req(f"r{i}", 30, base=1 + 40 * i, max_tokens=40) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    most_blocks, most_tokens = run_under_budget(s, H2O, 12, seed=3)
    assert all(r.num_output_tokens == 40 for r in reqs)
    assert s.num_preemptions > 0 and most_blocks <= 6 and most_tokens <= 20
    assert s.kv.pool.num_used_blocks == 0


def test_scheduler_config_takes_the_budget_and_eviction_together():
    with pytest.raises(ValueError, match="go together"):
        SchedulerConfig(kv_budget_tokens=12)
    with pytest.raises(ValueError, match="go together"):
        SchedulerConfig(kv_eviction=H2O)


# --- storage -------------------------------------------------------------------------------


@pytest.mark.parametrize("storage_cls", [PagedKVStorage, Int8PagedKVStorage])
def test_compaction_copies_surviving_keys_and_values_bit_exact(storage_cls):
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    storage = storage_cls(3, 8, 4, 2, 8, torch.bfloat16)
    kv = KVCacheManager(8, 4)
    r = req("a", 22)
    assert kv.allocate_slots(r, 22)
    r.num_computed_tokens = 22
    table = held(kv, r)
    slots = torch.tensor([table[i // 4] * 4 + i % 4 for i in range(22)])
    for layer in range(3):
        k = torch.randn(22, 2, 8, generator=gen).to(torch.bfloat16)
        storage.write(layer, slots, k, torch.randn(22, 2, 8, generator=gen).to(torch.bfloat16))
    before = [storage.gather(layer, slots) for layer in range(3)]
    # what the format stores per slot (int8: codes and their per-token scales), before the copy
    names = ("k", "v", "k_scale", "v_scale") if storage_cls is Int8PagedKVStorage else ("k", "v")
    stored = {n: [t[slots].clone() for t in getattr(storage, n)] for n in names}
    keep = sorted(random.Random(seed).sample(range(22), 9))
    moves = kv.compact(r, keep)
    assert moves is not None
    storage.copy_slots(torch.tensor(moves.src, dtype=torch.long), torch.tensor(moves.dst, dtype=torch.long))
    table = held(kv, r)
    after_slots = torch.tensor([table[j // 4] * 4 + j % 4 for j in range(9)])
    for layer in range(3):
        k, v = storage.gather(layer, after_slots)
        assert torch.equal(k, before[layer][0][keep]), f"seed {seed}"
        assert torch.equal(v, before[layer][1][keep]), f"seed {seed}"
    for n in names:  # every layer's stored codes and scales, not only what they dequantise to
        for layer, (t, old) in enumerate(zip(getattr(storage, n), stored[n], strict=True)):
            assert torch.equal(t[after_slots], old[keep]), f"{n}[{layer}], seed {seed}"


def _int4_bound(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Error of one KIVI round trip of ``x`` grouped along ``dim`` (tests/unit/test_kv_int4.py):
    half a step of the group's range, plus fp16 rounding of scale and zero."""
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    return 0.5 * (hi - lo) / 15 * (1 + 2**-8) + 2**-10 * torch.maximum(lo.abs(), hi.abs())


def _int4_sequence(seed: int, n: int) -> tuple[Int4KIVIPagedKVStorage, KVCacheManager, Request, torch.Tensor]:
    """A request of ``n`` tokens in blocks of 4, written in one step to a 2-layer int4 store
    (fp32 compute, so the bound is not blurred by bf16); returns its slots too."""
    gen = torch.Generator().manual_seed(seed)
    storage = Int4KIVIPagedKVStorage(2, 12, 4, 2, 8, torch.float32)
    kv = KVCacheManager(12, 4)
    r = req("a", n)
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens = n
    table = held(kv, r)
    slots = torch.tensor([table[i // 4] * 4 + i % 4 for i in range(n)])
    for layer in range(2):
        channels = torch.rand(1, 2, 8, generator=gen) * 4  # outlier channels, as keys have
        k = torch.randn(n, 2, 8, generator=gen) * channels + torch.randn(1, 2, 8, generator=gen)
        storage.write(layer, slots, k, torch.randn(n, 2, 8, generator=gen) * 3)
    return storage, kv, r, slots


def _compact_int4(storage, kv, r, keep) -> torch.Tensor:
    moves = kv.compact(r, keep)
    assert moves is not None
    storage.apply_compaction(
        torch.tensor(moves.src, dtype=torch.long),
        torch.tensor(moves.dst, dtype=torch.long),
        moves.dest_blocks,
        moves.num_dest_tokens,
    )
    table = held(kv, r)
    return torch.tensor([table[j // 4] * 4 + j % 4 for j in range(len(keep))])


def test_int4_compaction_moves_values_exactly_and_requantises_keys_within_the_bound():
    """Values (per token) move bit for bit; keys of untouched leading blocks and of the open last
    block stay exact; keys re-quantised into a rewritten full block are within one KIVI round
    trip's bound of what the model saw before (over the new block's tokens)."""
    seed = random.randrange(1 << 30)
    storage, kv, r, slots = _int4_sequence(seed, 23)  # blocks of 4: five full, the sixth open (3)
    before = [storage.gather(layer, slots) for layer in range(2)]
    names = ("v", "v_scale", "v_zero")
    stored = {n: [t[slots].clone() for t in getattr(storage, n)] for n in names}
    fixed_codes = [t[slots[:4]].clone() for t in storage.k]
    fixed_scale = [t[held(kv, r)[0]].clone() for t in storage.k_scale]
    rng = random.Random(seed)
    keep = [0, 1, 2, 3, *sorted(rng.sample(range(4, 20), 7)), 20, 21, 22]  # block 0 kept in place
    after = _compact_int4(storage, kv, r, keep)
    assert len(keep) == 14  # three full blocks and an open one of 2
    for layer in range(2):
        k, v = storage.gather(layer, after)
        want_k, want_v = before[layer][0][keep], before[layer][1][keep]
        assert torch.equal(v, want_v), f"seed {seed}"
        assert torch.equal(k[:4], want_k[:4]), f"seed {seed}: the untouched block changed"
        assert torch.equal(storage.k[layer][slots[:4]], fixed_codes[layer])
        assert torch.equal(storage.k_scale[layer][held(kv, r)[0]], fixed_scale[layer])
        for b in (1, 2):  # rewritten full blocks: one round trip of the keys the model saw
            rows = slice(4 * b, 4 * b + 4)
            err = (k[rows] - want_k[rows]).abs()
            assert (err <= _int4_bound(want_k[rows], 0)).all(), f"seed {seed}: block {b}, max {err.max()}"
        assert torch.equal(k[12:], want_k[12:]), f"seed {seed}: the open block is full precision"
        for n in names:
            assert torch.equal(getattr(storage, n)[layer][after], stored[n][layer][keep]), f"{n}, seed {seed}"


def test_int4_compaction_moves_whole_blocks_bit_exact_and_the_open_block_fills_as_usual():
    seed = random.randrange(1 << 30)
    storage, kv, r, slots = _int4_sequence(seed, 18)  # four full blocks, the fifth open (2 tokens)
    table = held(kv, r)
    before = [storage.gather(layer, slots) for layer in range(2)]
    codes = [t[slots[8:16]].clone() for t in storage.k]
    scales = [torch.stack([t[table[2]], t[table[3]]]).clone() for t in (*storage.k_scale, *storage.k_zero)]
    keep = [0, 1, 2, 3, *range(8, 18)]  # drop block 1: blocks 2-3 move whole, the open one too
    after = _compact_int4(storage, kv, r, keep)
    new_table = held(kv, r)
    for layer in range(2):
        k, v = storage.gather(layer, after)
        assert torch.equal(k, before[layer][0][keep]), f"seed {seed}"
        assert torch.equal(v, before[layer][1][keep]), f"seed {seed}"
        assert torch.equal(storage.k[layer][after[4:12]], codes[layer])
    got = [torch.stack([t[new_table[1]], t[new_table[2]]]) for t in (*storage.k_scale, *storage.k_zero)]
    assert all(torch.equal(a, b) for a, b in zip(got, scales, strict=True))
    # the open block (2 tokens, moved) keeps filling; once full it is quantised like any block
    gen = torch.Generator().manual_seed(seed + 1)
    more = torch.randn(2, 2, 2, 8, generator=gen)
    next_slots = torch.tensor([new_table[3] * 4 + 2, new_table[3] * 4 + 3])
    for layer in range(2):
        storage.write(layer, next_slots, more[0], more[1])
    full = torch.cat([before[0][0][16:18], more[0]])
    k, _ = storage.gather(0, torch.tensor([new_table[3] * 4 + i for i in range(4)]))
    assert (k - full).abs().max() > 0  # quantised now
    assert ((k - full).abs() <= _int4_bound(full, 0)).all(), f"seed {seed}"


# --- config --------------------------------------------------------------------------------


def test_eviction_config_errors_name_the_key_and_the_allowed_range():
    with pytest.raises(ConfigError, match=r"kv_budget_tokens must be >= 16 \(one block of 16 tokens"):
        from_dict(EngineConfig, {"kv_budget_tokens": 8, "kv_eviction": {"mode": "h2o", "recent_tokens": 2}})
    with pytest.raises(
        ConfigError, match=r"kv_budget_tokens must be >= 37 .*sink_tokens \+ recent_tokens = 36"
    ):
        from_dict(EngineConfig, {"kv_budget_tokens": 32, "kv_eviction": {"mode": "h2o"}})
    with pytest.raises(
        ConfigError, match=r"kv_eviction\.mode must be one of h2o, snapkv, segment, got 'lru'"
    ):
        from_dict(EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"mode": "lru"}})
    with pytest.raises(ConfigError, match=r"kv_eviction\.segment must be one of turn, sentence"):
        from_dict(
            EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"mode": "segment", "segment": "word"}}
        )
    with pytest.raises(ConfigError, match="kv_budget_tokens and kv_eviction go together"):
        from_dict(EngineConfig, {"kv_budget_tokens": 256})
    with pytest.raises(ConfigError, match="kv_eviction does not combine with kv_window"):
        from_dict(
            EngineConfig,
            {
                "kv_budget_tokens": 256,
                "kv_eviction": {},
                "kv_window": {"sink_tokens": 4, "window_tokens": 64},
            },
        )
    with pytest.raises(ConfigError, match=r"kv_dtype: int4 yet .*set speculative: off or kv_dtype: int8"):
        from_dict(
            EngineConfig,
            {"kv_budget_tokens": 256, "kv_eviction": {}, "kv_dtype": "int4", "speculative": "ngram:4"},
        )
    with pytest.raises(ConfigError, match=r"kv_window\.window_tokens must be > kv_window\.sink_tokens"):
        from_dict(EngineConfig, {"kv_window": {"sink_tokens": 8, "window_tokens": 4}})
    with pytest.raises(ConfigError, match=r"kv_eviction\.score must be one of accumulated, observation"):
        from_dict(EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"score": "oracle"}})
    cfg = from_dict(EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"mode": "segment"}})
    assert cfg.kv_eviction == KVEviction("segment")
    cfg = from_dict(
        EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"mode": "segment", "pin_system": False}}
    )
    assert cfg.kv_eviction == KVEviction("segment", pin_system=False)
    with pytest.raises(
        ConfigError, match=r"kv_eviction\.slack_tokens must be >= 0 \(or unset: one block\), got -1"
    ):
        from_dict(EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"slack_tokens": -1}})
    with pytest.raises(ConfigError, match=r"kv_eviction\.contrast_tokens must be >= 0, got -4"):
        from_dict(EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"contrast_tokens": -4}})
    with pytest.raises(ConfigError, match="pin_system"):
        from_dict(EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"pin_system": "no"}})


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_eviction_combines_with_full_int8_and_int4_kv(kv_dtype):
    """int8 KV keeps one scale per slot, so compaction moves codes and scales together exactly;
    int4 rebuilds the blocks it rewrites (``Int4KIVIPagedKVStorage.apply_compaction``)."""
    cfg = from_dict(
        EngineConfig, {"kv_budget_tokens": 240, "kv_eviction": {"mode": "segment"}, "kv_dtype": kv_dtype}
    )
    assert (cfg.kv_dtype, cfg.kv_budget_tokens) == (kv_dtype, 240)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"kv_dtype": "int4", "kv_window": {"sink_tokens": 4, "window_tokens": 64}}, "kv_window"),
        ({"kv_dtype": "int8", "kv_window": {"sink_tokens": 4, "window_tokens": 64}}, "kv_window"),
        ({"kv_dtype": "int8", "speculative": "ngram:4"}, "speculative"),
    ],
)
def test_combinations_compaction_cannot_do_exactly_stay_refused(extra, named):
    with pytest.raises(ConfigError, match=f"kv_eviction does not combine with {named} yet"):
        from_dict(EngineConfig, {"kv_budget_tokens": 256, "kv_eviction": {"mode": "segment"}, **extra})
