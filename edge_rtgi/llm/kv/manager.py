"""Per-request block tables on top of the block pool: allocation, prefix hits, release.

The scheduler talks to this class only (never to the storage tensors). A block table is a
list with one entry per ``block_size`` tokens of the request; an entry is ``None`` where the
block was released because no future query can attend to it (sliding window). The runner
turns tables into slot indices; this class never touches torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge_rtgi.llm.kv.block_pool import BlockPool, KVBlock, hash_block_tokens
from edge_rtgi.llm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and every request's block table."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[KVBlock | None]] = {}
        self._num_hashed: dict[str, int] = {}  # leading table entries already in the cache index
        # Prefix-cache counters over all admissions: tokens looked up and tokens found.
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- hashing ---------------------------------------------------------------------------

    def _block_hash(self, request: Request, index: int) -> bytes:
        """Chained hash of the request's full block ``index`` (computed once, kept on it)."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes[index]

    # --- admission -------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks that prefixes the request, and its token count.

        At least the last token is always left to compute, because its logits are needed.
        Blocks are not referenced yet; pass them to ``allocate_slots``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(self._block_hash(request, i))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_tokens
        self.prefix_hits_tokens += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` after the request's computed tokens.

        ``computed_blocks`` (from ``get_computed_blocks``, only on first admission) are
        referenced and put at the head of the table. Returns False, changing nothing, when
        the pool cannot supply the blocks.
        """
        table = self._tables.setdefault(request.request_id, [])
        if computed_blocks and table:
            raise RuntimeError(f"request {request.request_id} already has blocks; no prefix hit")
        total_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = self.blocks_for_tokens(total_tokens) - len(table) - len(computed_blocks)
        # A hit on a free cached block removes it from the free queue, so it cannot count twice.
        revived = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - revived:
            if not table:
                del self._tables[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        table.extend(computed_blocks)
        if num_needed > 0:
            table.extend(self.pool.allocate(num_needed))
        if computed_blocks:
            self._num_hashed[request.request_id] = len(computed_blocks)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's blocks that are now full and computed (call after a step).

        Caching happens after the forward pass rather than at allocation, so a hash never
        points at a block whose keys and values have not been written yet.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        start = self._num_hashed.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        for i in range(start, num_full):
            block = table[i]
            if block is not None:
                self.pool.cache_block(block, self._block_hash(request, i))
        self._num_hashed[request.request_id] = max(start, num_full)

    # --- release ---------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks; its cached blocks stay findable until evicted."""
        table = self._tables.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        if table:
            # Tail first: the end of a sequence is the least likely part to be shared.
            self.pool.free(b for b in reversed(table) if b is not None)

    def release_outside_window(self, request: Request, window_tokens: int, sink_tokens: int = 0) -> int:
        """Free blocks that no future query can attend to under a sliding window with sinks.

        The next query is at position ``num_computed_tokens``; it sees keys in
        ``(pos - window_tokens, pos]`` plus the first ``sink_tokens`` positions. Blocks wholly
        between the sinks and the window are released and become ``None`` in the table.
        Returns the number of blocks released.
        """
        table = self._tables.get(request.request_id)
        if not table:
            return 0
        first_needed = request.num_computed_tokens - window_tokens + 1
        first_block = cdiv(sink_tokens, self.block_size)
        last_block = first_needed // self.block_size  # exclusive: blocks below are fully outside
        released: list[KVBlock] = []
        for i in range(first_block, min(last_block, len(table))):
            block = table[i]
            if block is not None:
                released.append(block)
                table[i] = None
        self.pool.free(released)
        return len(released)

    # --- views -----------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids, ``-1`` where a block was released."""
        return [-1 if b is None else b.block_id for b in self._tables.get(request_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0
