"""Fixed-size KV blocks: a free list, reference counts, and an LRU of reusable cached blocks.

Pure bookkeeping (no torch). A block is ``block_size`` token slots in every layer's KV
storage; block ``b`` owns slots ``b * block_size .. (b + 1) * block_size - 1``.

Invariants:
- a block with ``ref_count > 0`` is held by at least one request and is not in the free queue;
- a block with ``ref_count == 0`` is in the free queue; if it still carries a hash it is a
  prefix-cache entry that can be revived by a hit until allocation evicts it;
- the free queue is ordered by eviction preference: blocks that hold nothing useful sit at the
  front and are handed out first; freed cached blocks join at the back, so the least
  recently freed cached block is evicted first (LRU).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of a full block: chained over the parent block's hash and this block's tokens.

    Chaining makes a block's hash identify the whole prefix up to its end, so equal hashes
    mean equal keys and values. blake2b (128 bit) keeps accidental collisions out of reach,
    which Python's 64-bit ``hash`` of a tuple would not for a long-running daemon.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(eq=False)
class KVBlock:
    """Metadata of one block; the tensors live in the KV storage."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        cached = " cached" if self.block_hash is not None else ""
        return f"KVBlock({self.block_id}, refs={self.ref_count}{cached})"


class BlockPool:
    """Hands out blocks, takes them back, and keeps the prefix cache index."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict as an O(1) doubly-linked queue that also supports removal by id.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    # --- queries ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (including evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with this hash, held or free, or None."""
        return self._cached.get(block_hash)

    # --- allocation -----------------------------------------------------------------------

    def allocate(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks (ref_count 1 each), evicting cached ones if needed."""
        if count > len(self._free):
            raise RuntimeError(f"cannot allocate {count} blocks, {len(self._free)} free")
        out = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference on blocks found by a prefix-cache hit."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in eviction order (first = evicted first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    # Holds nothing reusable: hand it out before any cached block.
                    self._free.move_to_end(block.block_id, last=False)

    # --- prefix cache ----------------------------------------------------------------------

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its chained hash.

        If another block already holds the same content the index keeps the existing one:
        block tables are append-only, so the duplicate stays with its request and is simply
        not findable (it is freed like any uncached block).
        """
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Forget a block's hash (its content is about to change, e.g. after eviction)."""
        if block.block_hash is not None:
            self._evict(block)
            if block.ref_count == 0:
                self._free.move_to_end(block.block_id, last=False)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> int:
        """Drop every cache entry on free blocks (for benchmarks' cold runs). Returns how many."""
        dropped = 0
        for block in list(self._free.values()):
            if block.block_hash is not None:
                self.uncache(block)
                dropped += 1
        return dropped
