"""Block pool and KV manager bookkeeping: refcounts, free order, prefix hashing, windows."""

from __future__ import annotations

import pytest

from edge_rtgi.llm.kv.block_pool import BlockPool, hash_block_tokens
from edge_rtgi.llm.kv.manager import KVCacheManager, KVGroupSpec
from edge_rtgi.llm.request import Request


class _Params:
    max_tokens = 8


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, _Params())


def test_allocate_free_refcounts_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(b.ref_count == 1 for b in a)
    pool.touch(a[:1])
    assert a[0].ref_count == 2
    pool.free(a)
    assert pool.num_free_blocks == 3 and a[0].ref_count == 1
    pool.free(a[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_hash_is_chained_over_parent():
    h1 = hash_block_tokens(None, [1, 2])
    assert h1 == hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_uncached_blocks_are_reused_before_cached_ones_lru():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.free([a])  # cached, freed first -> evicted first among cached
    pool.free([b])
    pool.free([c])  # uncached -> handed out before any cached block
    got = pool.allocate(1)[0]
    assert got is c
    assert pool.lookup(b"A") is a and pool.lookup(b"B") is b
    got = pool.allocate(1)[0]
    assert got is a and pool.lookup(b"A") is None and pool.num_evictions == 1
    assert pool.lookup(b"B") is b


def test_touch_revives_free_cached_block():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"A")
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([pool.lookup(b"A")])
    assert pool.num_free_blocks == 1 and a.ref_count == 1


def test_prefix_hit_counts_only_full_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = _req("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    kv.cache_computed_blocks(first)  # blocks 0,1 are full; block 2 is partial
    assert kv.pool.num_cached_blocks == 2
    second = _req("b", list(range(9)) + [99])
    hits = kv.get_computed_blocks(second)
    assert hits.num_tokens == 8 and [b.block_id for b in hits.blocks[0]] == kv.block_ids("a")[0][:2]
    # a prompt that is exactly the cached blocks still leaves its last token to compute
    third = _req("c", list(range(8)))
    assert kv.get_computed_blocks(third).num_tokens == 4
    assert kv.allocate_slots(second, 2, hits)
    assert kv.block_ids("b")[0][:2] == kv.block_ids("a")[0][:2]
    assert hits.blocks[0][0].ref_count == 2
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 16
    assert kv.pool.num_cached_blocks == 2  # still findable until evicted


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = _req("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == [[]]


def test_revived_hit_blocks_are_not_counted_as_free_twice():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(8)) + [50])
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = _req("b", list(range(8)) + [60] * 6)  # 2 hit blocks (free, cached) + needs 2 more
    hits = kv.get_computed_blocks(b)
    assert hits.num_tokens == 8
    assert not kv.allocate_slots(b, 6, hits)  # 3 free blocks, but 2 of them are the hits
    assert kv.num_free_blocks == 3


def test_release_outside_window_keeps_sinks_and_window():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = _req("r", list(range(24)))
    assert kv.allocate_slots(r, 24)
    r.num_computed_tokens = 24  # next query at position 24 sees (24-8, 24] + 4 sinks
    released = kv.release_outside_window(r, window_tokens=8, sink_tokens=4)
    (ids,) = kv.block_ids("r")
    assert released == 3 and ids[0] != -1 and ids[1:4] == [-1, -1, -1] and -1 not in ids[4:]
    assert kv.num_free_blocks == 8 - 3
    kv.free(r)
    assert kv.num_free_blocks == 8


def test_windowed_prefix_hit_needs_only_the_sinks_and_the_window():
    """A windowed session's next turn reuses its sink and recent blocks after the blocks behind
    its window were handed to someone else; a group without a window would need them all."""
    kv = KVCacheManager(16, 4, groups=(KVGroupSpec((), window_tokens=8, sink_tokens=4),))
    turn = _req("t1", list(range(40)))
    for start in range(0, 40, 8):  # computed in steps of 8, released behind the window after each
        assert kv.allocate_slots(turn, 8)
        turn.num_computed_tokens = start + 8
        kv.cache_computed_blocks(turn)
        kv.release_outside_windows(turn)
    kept = kv.block_ids("t1")[0]
    assert kept[0] != -1 and kept[1:8] == [-1] * 7 and -1 not in kept[8:]
    kv.free(turn)
    other = _req("x", list(range(1000, 1000 + 4 * 13)))
    assert kv.allocate_slots(other, 4 * 13)  # every free block but the session's last 3
    kv.free(other)  # uncached blocks go to the front of the free queue; the session's stay cached
    nxt = _req("t2", list(range(40)) + [77, 78])
    hits = kv.get_computed_blocks(nxt)
    # 10 full blocks: the sink block and blocks 8, 9 are needed; 1..7 are not (and are gone)
    assert hits.num_tokens == 40
    ids = [-1 if b is None else b.block_id for b in hits.blocks[0]]
    assert ids[0] == kept[0] and ids[8:] == kept[8:10] and ids[1:8] == [-1] * 7
    assert kv.allocate_slots(nxt, 2, hits)
    assert kv.num_held_blocks("t2") == [4]  # sink block, 2 hit blocks, 1 new
    kv.free(nxt)
    assert kv.num_free_blocks == 16
    # without a window the same misses end the hit at the first missing block
    plain = KVCacheManager(16, 4)
    first = _req("p", list(range(40)))
    assert plain.allocate_slots(first, 40)
    first.num_computed_tokens = 40
    plain.cache_computed_blocks(first)
    plain.pool.uncache(plain.pool.blocks[plain.block_ids("p")[0][3]])
    assert plain.get_computed_blocks(_req("q", list(range(41)))).num_tokens == 12
