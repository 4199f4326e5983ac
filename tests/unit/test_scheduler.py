"""Scheduler policy with fake runner outputs and no model (as vLLM tests its scheduler)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from edge_rtgi.errors import RequestError
from edge_rtgi.llm.kv.manager import KVCacheManager, KVGroupSpec
from edge_rtgi.llm.request import Request, RequestStatus
from edge_rtgi.llm.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput

EOS = 0


@dataclass(frozen=True)
class Params:
    max_tokens: int = 4


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=256, chunked=True):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(budget, max_seqs, max_len, chunked)
    return Scheduler(cfg, kv)


def req(rid, n_prompt, max_tokens=4, priority=0, t=0.0, base=1):
    return Request(
        rid,
        list(range(base, base + n_prompt)),
        Params(max_tokens),
        priority=priority,
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=t,
    )


def fake_run(out: SchedulerOutput, token=7, errors=None) -> ModelRunnerOutput:
    """Sample a fixed token for every request that reached the end of its known tokens."""
    return ModelRunnerOutput({s.request_id: token for s in out.scheduled if s.sample}, errors or {})


def step(s: Scheduler, token=7, errors=None):
    out = s.schedule()
    return out, s.update_from_output(out, fake_run(out, token, errors))


def test_scheduler_imports_no_torch():
    code = (
        "import sys; import edge_rtgi.llm.scheduler, edge_rtgi.llm.kv.manager; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_then_decode_until_max_tokens():
    s = make(budget=8)
    s.add_request(req("a", 20, max_tokens=3))
    sizes = []
    while s.has_unfinished():
        out, updates = step(s)
        sizes.append([len(x.token_ids) for x in out.scheduled])
    assert sizes == [[8], [8], [4], [1], [1]]  # 20-token prompt in chunks, then 2 decodes
    assert s.kv.num_free_blocks == 64


def test_decodes_keep_pace_while_long_prompt_is_chunked():
    s = make(budget=6)
    s.add_request(req("a", 3, max_tokens=10, t=0))
    step(s)  # a: prompt done, first token sampled
    s.add_request(req("b", 40, max_tokens=2, t=1, base=100))
    for _ in range(5):
        out, _ = step(s)
        by_id = {x.request_id: x for x in out.scheduled}
        assert len(by_id["a"].token_ids) == 1 and by_id["a"].sample  # one decode every step
        assert len(by_id["b"].token_ids) == 5  # b gets the rest of the budget
        assert out.num_batched_tokens <= 6


def test_eos_finishes_and_frees():
    s = make()
    s.add_request(req("a", 5, max_tokens=50))
    _, updates = step(s, token=EOS)
    assert updates[0].finish_reason == "stop" and not s.has_unfinished()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_prefix_hit_skips_cached_blocks_and_is_reported():
    s = make(block_size=4, budget=64)
    s.add_request(req("a", 18, max_tokens=1))
    step(s)
    s.add_request(req("b", 18, max_tokens=1))  # same prompt
    out, _ = step(s)
    (sr,) = out.scheduled
    assert sr.start_position == 16 and len(sr.token_ids) == 2  # 4 full blocks hit, last 2 computed
    assert s.kv.prefix_hits_tokens == 16 and s.kv.prefix_queries_tokens == 36


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=5, t=i))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["r0", "r1"]


def test_priority_orders_admission():
    s = make(budget=4)
    s.add_request(req("low", 4, t=0))
    s.add_request(req("high", 4, priority=5, t=1))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["high"]


def test_preemption_picks_lowest_priority_then_newest_and_recomputes():
    # 6 blocks of 4 tokens. Three requests of 8 prompt tokens each fill all 6 blocks after their
    # first decode; the next block anyone needs forces a preemption.
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add_request(req("old", 8, max_tokens=8, t=0, base=10))
    s.add_request(req("new", 8, max_tokens=8, t=2, base=30))
    s.add_request(req("vip", 8, max_tokens=8, priority=1, t=3, base=50))
    step(s)  # all three prefill, 2 blocks each
    out, _ = step(s)  # each needs a 3rd block for position 8: no room -> preempt
    assert out.preempted_ids == ["new"]  # priority 0 and newest
    assert {x.request_id for x in out.scheduled} == {"old", "vip"}
    victim = next(r for r in s.waiting if r.request_id == "new")
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_output_tokens == 1  # its sampled token survives; it is recomputed later
    while s.has_unfinished():  # never deadlocks; everyone finishes
        step(s)
    assert s.kv.num_free_blocks == 6
    assert s.num_preemptions >= 1


def test_recompute_after_preemption_samples_next_token_only_at_the_end():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("a", 7, max_tokens=9, t=0))
    s.add_request(req("b", 7, max_tokens=9, t=1, base=40))
    seen_b_tokens = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        out, updates = step(s)
        for u in updates:
            if u.request_id == "b":
                seen_b_tokens += u.new_token_ids
    assert not s.has_unfinished()
    assert len(seen_b_tokens) == 9  # exactly max_tokens, no token sampled twice


def test_too_big_request_rejected_with_sizes():
    s = make(num_blocks=4, block_size=4)
    with pytest.raises(RequestError, match=r"needs up to 19 tokens .*5 blocks of 4.* holds 4 blocks"):
        s.add_request(req("big", 10, max_tokens=10))
    with pytest.raises(RequestError, match="context window is 256 tokens"):
        s.add_request(req("long", 300))
    with pytest.raises(RequestError, match="empty"):
        s.add_request(req("empty", 0))
    assert not s.has_unfinished()


def test_error_fails_one_request_alone():
    s = make()
    s.add_request(req("good", 3, max_tokens=3, t=0))
    s.add_request(req("bad", 3, max_tokens=3, t=1, base=20))
    _, updates = step(s, errors={"bad": "sampling failed"})
    by_id = {u.request_id: u for u in updates}
    assert by_id["bad"].finish_reason == "error" and by_id["bad"].error == "sampling failed"
    while s.has_unfinished():
        _, updates = step(s)
    assert updates[-1].request_id == "good" and updates[-1].finish_reason == "length"
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_waiting_and_running_frees_blocks():
    s = make(budget=4)
    s.add_request(req("a", 10, t=0))
    s.add_request(req("b", 10, t=1))
    step(s)  # a partially prefilled
    assert s.kv.num_free_blocks < s.kv.num_blocks
    ups = s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert [u.finish_reason for u in ups] == ["abort", "abort"]
    assert not s.has_unfinished() and s.kv.num_free_blocks == s.kv.num_blocks


def test_context_window_ends_generation():
    s = make(max_len=8)
    s.add_request(req("a", 6, max_tokens=100))
    reasons = []
    while s.has_unfinished():
        _, ups = step(s)
        reasons += [u.finish_reason for u in ups]
    assert reasons == [None, "length"]


def test_no_chunking_waits_for_room_in_budget():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=False)
    s = make(budget=16, chunked=False, max_len=16)
    s.add_request(req("a", 3, max_tokens=5, t=0))
    s.add_request(req("a2", 3, max_tokens=5, t=0.5))
    step(s)
    s.add_request(req("big", 15, max_tokens=1, t=1))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "a2"]  # 2 decodes + 15 > 16: big waits
    s.finish_requests(["a", "a2"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert [len(x.token_ids) for x in out.scheduled] == [15]


def test_sliding_window_releases_blocks_behind_the_window():
    kv = KVCacheManager(64, 4, groups=[KVGroupSpec(window_tokens=8)])
    s = Scheduler(SchedulerConfig(64, 8, 256), kv)
    s.add_request(req("a", 30, max_tokens=10))
    out, _ = step(s)
    (ids,) = s.kv.block_ids("a")
    # next query at 30 sees (22, 30]: blocks 0..4 (tokens 0..19) are released
    assert ids[:5] == [-1] * 5 and -1 not in ids[5:]
    while s.has_unfinished():
        out, _ = step(s)
        assert sum(b >= 0 for b in out.scheduled[0].block_ids[0]) <= 4
    assert s.kv.num_free_blocks == 64


def test_local_and_global_groups_share_one_pool_and_only_local_blocks_are_released():
    """Gemma-like: a global group keeps every block, two local groups (window 8) only their window."""
    groups = [KVGroupSpec((2,)), KVGroupSpec((0,), 8), KVGroupSpec((1,), 8)]
    kv = KVCacheManager(40, 4, groups=groups)
    s = Scheduler(SchedulerConfig(16, 8, 256), kv)
    s.add_request(req("a", 40, max_tokens=20))
    held = []
    while s.has_unfinished():
        out, _ = step(s)
        if out.scheduled:
            tables = out.scheduled[0].block_ids
            assert len(tables) == 3 and len({len(t) for t in tables}) == 1  # one entry per 4 tokens
        held.append(kv.num_held_blocks("a") if "a" in s.requests else None)
    live = [h for h in held if h is not None]
    # global: 1 block per 4 tokens, all kept (59 computed tokens -> 15 blocks); local: at most 4 each
    assert live[-1][0] == 15 and max(h[1] for h in live) <= 4 and max(h[2] for h in live) <= 4
    assert kv.num_free_blocks == 40
    # The worst case counts the windows: a 16-token step over a window of 8 spans at most 7 blocks.
    assert kv.max_blocks_for(60, 16) == 15 + 2 * 7


def test_a_prompt_waits_a_step_for_the_prefix_another_is_computing_then_reuses_it():
    """A burst under one uncached system prompt: the first request computes the shared blocks,
    the others wait (one step, or as many as its chunks take) and then hit them, instead of
    computing the same prefix beside it. Those without the prefix go ahead."""
    s = make(budget=64, max_seqs=8)
    system = list(range(100, 124))  # 24 tokens: 6 blocks of 4
    turns = [
        Request(f"t{i}", system + [200 + i, 300 + i], Params(2), eos_token_ids=frozenset({EOS}))
        for i in range(3)
    ]
    for r in turns:
        s.add_request(r)
    s.add_request(req("other", 10, max_tokens=2, base=500))
    out, _ = step(s)
    assert {x.request_id: len(x.token_ids) for x in out.scheduled} == {"t0": 26, "other": 10}
    assert s.num_prefix_waits == 2
    out, _ = step(s)
    firsts = {
        x.request_id: (x.start_position, len(x.token_ids)) for x in out.scheduled if x.request_id != "t0"
    }
    assert firsts["t1"] == firsts["t2"] == (24, 2)  # the 6 shared blocks hit, 2 tokens computed
    assert s.kv.prefix_hits_tokens == 48
    # a budget that chunks the first prompt: the others wait until its blocks are all cached
    c = make(budget=8, max_seqs=8)
    for i in range(2):
        c.add_request(
            Request(f"u{i}", system + [200 + i, 300 + i], Params(2), eos_token_ids=frozenset({EOS}))
        )
    scheduled = []
    while c.has_unfinished():
        out, _ = step(c)
        scheduled.append([(x.request_id, x.start_position, len(x.token_ids)) for x in out.scheduled])
    assert scheduled[:4] == [[("u0", 0, 8)], [("u0", 8, 8)], [("u0", 16, 8)], [("u0", 24, 2), ("u1", 24, 2)]]


def test_only_a_request_still_computing_the_block_makes_another_wait_for_it():
    """A holder past the shared block (its copy cached elsewhere or not at all: a duplicate, a
    windowed hole) or one whose tokens were evicted never caches it again: nobody waits on it."""
    kv = KVCacheManager(64, 4)
    system = list(range(100, 124))
    waiter = Request("w", system + [1, 2], Params(2), eos_token_ids=frozenset({EOS}))
    holder = Request("h", system + [3, 4], Params(2), eos_token_ids=frozenset({EOS}))
    stranger = Request("s", list(range(500, 526)), Params(2), eos_token_ids=frozenset({EOS}))
    assert kv.prefix_in_flight(waiter, 0, [holder]) and not kv.prefix_in_flight(waiter, 0, [stranger])
    holder.num_computed_tokens = 8
    assert kv.prefix_in_flight(waiter, 8, [holder])  # still to compute block 2
    assert not kv.prefix_in_flight(waiter, 0, [holder])  # block 0 is behind it
    holder.num_evicted_tokens = 4
    assert not kv.prefix_in_flight(waiter, 8, [holder])
    assert not kv.prefix_in_flight(waiter, 24, [holder])  # no full block left past the hit
    off = KVCacheManager(64, 4, enable_prefix_caching=False)
    assert not off.prefix_in_flight(waiter, 0, [Request("h2", system + [5], Params(2))])


def test_prefix_hits_need_every_group_and_do_not_cross_groups():
    groups = [KVGroupSpec((1,)), KVGroupSpec((0,), 8)]
    kv = KVCacheManager(32, 4, groups=groups)
    a = req("a", 13)
    assert kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    kv.cache_computed_blocks(a)
    hit = kv.get_computed_blocks(req("b", 13))
    assert hit.num_tokens == 12 and [len(h) for h in hit.blocks] == [3, 3]
    ids = kv.block_ids("a")
    # the local group's block 0 is behind the next query's window (it sees (4, 12]): not taken
    assert [[-1 if b is None else b.block_id for b in h] for h in hit.blocks] == [
        ids[0][:3],
        [-1, *ids[1][1:3]],
    ]
    # a local block behind the window that is then evicted is not needed: the hit stands
    kv.release_outside_window(a, 8, group=1)  # next query at 13 sees (5, 13]: block 0 released
    kv.free(a)
    kv.pool.uncache(kv.pool.blocks[ids[1][0]])
    hit = kv.get_computed_blocks(req("c", 13))  # next query at 12 sees (4, 12]: blocks 1, 2
    assert hit.num_tokens == 12 and hit.blocks[1][0] is None
    assert [b.block_id for b in hit.blocks[0]] == ids[0][:3]
    # an evicted local block inside the window ends the hit for both groups there
    kv.pool.uncache(kv.pool.blocks[ids[1][2]])
    assert kv.get_computed_blocks(req("d", 13)).num_tokens == 0
