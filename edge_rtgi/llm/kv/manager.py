"""Per-request block tables on top of the block pool: allocation, prefix hits, release.

The scheduler talks to this class only (never to the storage tensors). The model's layers are
split into *KV groups* (``KVGroupSpec``): layers of one group attend over the same span of
positions, so they share one block table per request. A model whose layers all see the whole
context (Llama) has one group; Gemma 3, whose local layers see a 512-token window and whose
global layers see everything, has a group of global layers and groups of local ones.

All groups draw their blocks from one pool, as vLLM's hybrid allocator does: a block holds
``block_size`` token slots of the layers of whichever group it was given to, so every group has
the same number of layers (``layers_per_block``) and a block released behind a local window is
free for any group, the global one included. A table entry is ``None`` where the block was
released because no future query of that group can attend to it. The runner turns tables into
slot indices; this class never touches torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from edge_rtgi.llm.kv.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from edge_rtgi.llm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroupSpec:
    """Layers that share one block table per request, and what their queries can see.

    ``layers``: model layer indices (empty: every layer, for a model with one group).
    ``window_tokens``: a query at position p sees keys in ``(p - window_tokens, p]``, plus the
    first ``sink_tokens`` positions; None: the whole context.
    """

    layers: tuple[int, ...] = ()
    window_tokens: int | None = None
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        if self.window_tokens is not None and self.window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1 or None, got {self.window_tokens}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")


@dataclass(frozen=True)
class SlotMoves:
    """A compaction's copies: the KV at ``src[i]`` goes to ``dst[i]`` in every layer (read all
    sources before writing any: they may overlap). ``num_freed_blocks``: blocks given back.

    ``dest_blocks``: the blocks the survivors now fill from offset 0, in table order, after the
    leading blocks left untouched; ``num_dest_tokens``: how many survivors they hold (slots of
    them not in ``dst`` kept their token in place). A format whose data spans a block (int4
    keys, quantised per block) rebuilds these blocks from them.
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]
    num_freed_blocks: int
    dest_blocks: tuple[int, ...] = ()
    num_dest_tokens: int = 0


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache hit: per group, the cached blocks that start the request, and their tokens.

    None marks a block a windowed group does not need (behind its window, after its sinks).
    """

    blocks: tuple[tuple[KVBlock | None, ...], ...]
    num_tokens: int


class KVCacheManager:
    """Owns the block pool and every request's block table (one per KV group)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        groups: Sequence[KVGroupSpec] = (KVGroupSpec(),),
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.block_size = block_size
        self.groups = tuple(groups)
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[list[KVBlock | None]]] = {}
        self._num_hashed: dict[str, list[int]] = {}  # per group: leading entries already indexed
        # Prefix-cache counters over all admissions: tokens looked up and tokens found.
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_for(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` can hold at once, summed over the groups,
        when at most ``max_step_tokens`` are computed per step (a windowed group releases what
        falls behind its window after every step)."""
        total = 0
        for g in self.groups:
            full = self.blocks_for_tokens(num_tokens)
            if g.window_tokens is None:
                total += full
            else:
                live = cdiv(g.window_tokens + max_step_tokens - 1, self.block_size) + 1
                total += min(full, live + cdiv(g.sink_tokens, self.block_size))
        return total

    # --- hashing ---------------------------------------------------------------------------

    def _block_hash(self, request: Request, index: int) -> bytes:
        """Chained hash of the request's full block ``index`` (computed once, kept on it)."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes[index]

    def _group_key(self, group: int, block_hash: BlockHash) -> BlockHash:
        # One pool serves every group: the same tokens hold different layers' KV in each.
        return block_hash if group == 0 else group.to_bytes(2, "little") + block_hash

    # --- admission -------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Most cached full blocks that can stand for the start of the request in every group.

        A group without a window needs every block of the hit; a windowed group only its sink
        blocks and those the next query's window reaches (so a long windowed session finds its
        recent blocks even after the ones behind its window were reused). At least the last
        token is always left to compute, because its logits are needed. Blocks are not
        referenced yet; pass the result to ``allocate_slots``.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks(tuple(() for _ in self.groups), 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[list[KVBlock | None]] = []
        usable = [True] * (max_blocks + 1)  # usable[n]: a hit of n blocks serves every group
        for g, spec in enumerate(self.groups):
            blocks: list[KVBlock | None] = []
            for i in range(max_blocks):
                block = self.pool.lookup(self._group_key(g, self._block_hash(request, i)))
                if block is None and spec.window_tokens is None:
                    break  # nothing past a miss can be used
                blocks.append(block)
            found.append(blocks)
            misses = [0]  # misses[i]: blocks[:i] that are not cached
            for b in blocks:
                misses.append(misses[-1] + (b is None))
            for n in range(max_blocks + 1):
                if n > len(blocks):
                    usable[n] = False
                    continue
                usable[n] = usable[n] and all(
                    misses[stop] == misses[start] for start, stop in self._needed(spec, n)
                )
        n = max(i for i, ok in enumerate(usable) if ok)
        hits = []
        for spec, blocks in zip(self.groups, found, strict=True):
            needed = {i for start, stop in self._needed(spec, n) for i in range(start, stop)}
            hits.append(tuple(b if i in needed else None for i, b in enumerate(blocks[:n])))
        return ComputedBlocks(tuple(hits), n * self.block_size)

    def _needed(self, spec: KVGroupSpec, num_blocks: int) -> list[tuple[int, int]]:
        """The index ranges [start, stop) of the blocks a group needs from a hit of ``num_blocks``."""
        if spec.window_tokens is None:
            return [(0, num_blocks)]
        sinks = min(cdiv(spec.sink_tokens, self.block_size), num_blocks)
        computed = num_blocks * self.block_size
        first = max(0, computed - spec.window_tokens + 1) // self.block_size  # as release_outside_window
        return [(0, sinks), (max(first, sinks), num_blocks)]

    def prefix_in_flight(self, request: Request, num_hit_tokens: int, computing: Iterable[Request]) -> bool:
        """Whether one of ``computing`` (requests that compute tokens in this step) shares the
        full block of ``request`` just past its cache hit of ``num_hit_tokens`` and has not
        computed it yet: it caches that block within a step or a few, and ``request`` would
        reuse it then instead of computing the same tokens beside it (a burst of turns under one
        uncached system prompt). A holder already past the block (its copy may never be found:
        a duplicate, or a windowed group's hole) or one whose tokens were evicted (its blocks
        are no longer cached) does not count, so no request waits on a block that never comes."""
        bs = self.block_size
        index = num_hit_tokens // bs
        end = (index + 1) * bs
        if not self.enable_prefix_caching or end > request.num_tokens - 1:
            return False  # no full block left to share (the last token is always computed)
        mine = self._block_hash(request, index)
        return any(
            o is not request
            and o.num_computed_tokens < end <= o.num_tokens
            and not o.num_evicted_tokens
            and self._block_hash(o, index) == mine
            for o in computing
        )

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_tokens
        self.prefix_hits_tokens += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` after the request's computed tokens, in every group.

        ``computed`` (from ``get_computed_blocks``, only on first admission) is referenced and
        put at the head of the tables. Returns False, changing nothing, when the pool cannot
        supply the blocks.
        """
        tables = self._tables.setdefault(request.request_id, [[] for _ in self.groups])
        hit_tokens = computed.num_tokens if computed is not None else 0
        hit_blocks = computed.blocks if computed is not None and hit_tokens else ()
        if hit_blocks and any(tables):
            raise RuntimeError(f"request {request.request_id} already has blocks; no prefix hit")
        total_blocks = self.blocks_for_tokens(request.num_kv_tokens + hit_tokens + num_new_tokens)
        hits_of = [hit_blocks[g] if hit_blocks else () for g in range(self.num_groups)]
        needed = [max(0, total_blocks - len(t) - len(h)) for t, h in zip(tables, hits_of, strict=True)]
        # A hit on a free cached block removes it from the free queue, so it cannot count twice.
        revived = sum(1 for hits in hits_of for b in hits if b is not None and b.ref_count == 0)
        if sum(needed) > self.pool.num_free_blocks - revived:
            if not any(tables):
                del self._tables[request.request_id]
            return False
        for table, hits, n in zip(tables, hits_of, needed, strict=True):
            self.pool.touch(b for b in hits if b is not None)
            table.extend(hits)
            if n > 0:
                table.extend(self.pool.allocate(n))
        if hit_blocks:
            self._num_hashed[request.request_id] = [len(h) for h in hits_of]
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's blocks that are now full and computed (call after a step).

        Caching happens after the forward pass rather than at allocation, so a hash never
        points at a block whose keys and values have not been written yet.
        """
        if not self.enable_prefix_caching or request.num_evicted_tokens:
            return  # after an eviction the cache no longer holds a prefix (``compact``)
        tables = self._tables.get(request.request_id)
        if not tables:
            return
        done = self._num_hashed.setdefault(request.request_id, [0] * self.num_groups)
        for g, table in enumerate(tables):
            num_full = min(request.num_computed_tokens // self.block_size, len(table))
            for i in range(done[g], num_full):
                block = table[i]
                if block is not None:
                    self.pool.cache_block(block, self._group_key(g, self._block_hash(request, i)))
            done[g] = max(done[g], num_full)

    # --- release ---------------------------------------------------------------------------

    def truncate(self, request: Request) -> int:
        """Give back the blocks past ``request.num_computed_tokens`` (the slots of rejected draft
        tokens). Their contents were never hashed: caching stops at the computed tokens.
        Returns the number of blocks released."""
        tables = self._tables.get(request.request_id)
        if not tables:
            return 0
        keep = self.blocks_for_tokens(request.num_kv_tokens)
        released = 0
        for table in tables:
            tail = [b for b in table[keep:] if b is not None]
            del table[keep:]
            self.pool.free(reversed(tail))
            released += len(tail)
        return released

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks; its cached blocks stay findable until evicted."""
        tables = self._tables.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        for table in tables or ():
            # Tail first: the end of a sequence is the least likely part to be shared.
            self.pool.free(b for b in reversed(table) if b is not None)

    def release_outside_window(
        self, request: Request, window_tokens: int, sink_tokens: int = 0, group: int | None = None
    ) -> int:
        """Free blocks that no future query can attend to under a sliding window with sinks,
        in ``group`` (None: every group).

        The next query is at position ``num_computed_tokens``; it sees keys in
        ``(pos - window_tokens, pos]`` plus the first ``sink_tokens`` positions. Blocks wholly
        between the sinks and the window are released and become ``None`` in the table.
        Returns the number of blocks released.
        """
        tables = self._tables.get(request.request_id)
        if not tables:
            return 0
        first_needed = request.num_computed_tokens - window_tokens + 1
        first_block = cdiv(sink_tokens, self.block_size)
        last_block = first_needed // self.block_size  # exclusive: blocks below are fully outside
        released: list[KVBlock] = []
        for g, table in enumerate(tables):
            if group is not None and g != group:
                continue
            for i in range(first_block, min(last_block, len(table))):
                block = table[i]
                if block is not None:
                    released.append(block)
                    table[i] = None
        self.pool.free(released)
        return len(released)

    def release_outside_windows(self, request: Request) -> int:
        """``release_outside_window`` for every group with a window, by its spec."""
        return sum(
            self.release_outside_window(request, g.window_tokens, g.sink_tokens, index)
            for index, g in enumerate(self.groups)
            if g.window_tokens is not None
        )

    # --- eviction ----------------------------------------------------------------------------

    def compact(self, request: Request, keep: Sequence[int]) -> SlotMoves | None:
        """Keep only the cached tokens at indices ``keep`` (ascending, into the request's
        ``num_kv_tokens`` cached tokens), packed in order into the fewest blocks; give the rest
        back. Returns the slot copies the storage must make, or None (nothing changed) when a
        copy-on-write block cannot be had.

        Leading blocks whose every token is kept at its place are not touched: they keep their
        prefix hash and may stay shared. The other destination blocks are the request's own
        unshared blocks, in table order (a shared block is never written; a fresh one stands in
        for it), and lose their hash, since their content stops matching it; the request then
        stops indexing blocks (``cache_computed_blocks``). One KV group only (the engine refuses
        eviction on models with several).
        """
        if self.num_groups != 1:
            raise RuntimeError("KV compaction supports models with one KV group")
        table = self._tables.get(request.request_id)
        num_old, bs = request.num_kv_tokens, self.block_size
        if not table or not keep:
            raise ValueError(f"request {request.request_id}: nothing cached to keep")
        if any(b >= a for a, b in zip(keep[1:], keep, strict=False)) or keep[0] < 0 or keep[-1] >= num_old:
            raise ValueError(f"keep must ascend within 0..{num_old - 1}")
        blocks = table[0]
        same = 0
        while same < len(keep) and keep[same] == same:
            same += 1
        fixed = same // bs  # leading blocks left as they are
        num_new = self.blocks_for_tokens(len(keep))
        own = [b for b in blocks[fixed:] if b is not None and b.ref_count == 1]
        dest = own[: num_new - fixed]
        if len(dest) < num_new - fixed:
            extra = num_new - fixed - len(dest)
            if extra > self.pool.num_free_blocks:
                return None
            dest += self.pool.allocate(extra)
        src, dst = [], []
        for j in range(fixed * bs, len(keep)):
            i = keep[j]
            old = blocks[i // bs]
            if old is None:
                raise RuntimeError(f"request {request.request_id}: token {i} is in a released block")
            s, d = old.block_id * bs + i % bs, dest[j // bs - fixed].block_id * bs + j % bs
            if s != d:
                src.append(s)
                dst.append(d)
        for b in dest:
            self.pool.uncache(b)
        taken = {id(b) for b in dest}
        gone = [b for b in blocks[fixed:] if b is not None and id(b) not in taken]
        self.pool.free(reversed(gone))
        table[0] = [*blocks[:fixed], *dest]
        request.num_evicted_tokens += num_old - len(keep)
        return SlotMoves(
            tuple(src), tuple(dst), len(gone), tuple(b.block_id for b in dest), len(keep) - fixed * bs
        )

    # --- views -----------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block tables as ids, one list per group, ``-1`` where a block was released."""
        tables = self._tables.get(request_id)
        if tables is None:
            return [[] for _ in self.groups]
        return [[-1 if b is None else b.block_id for b in table] for table in tables]

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds now, per group."""
        return [
            sum(b is not None for b in t) for t in self._tables.get(request_id, [[] for _ in self.groups])
        ]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0
