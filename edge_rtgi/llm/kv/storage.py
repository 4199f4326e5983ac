"""The KV tensors behind the block pool, one pair per layer of a block.

Layout: every layer of a block owns its own ``k`` and ``v`` tensors of shape
``[num_slots, Hkv, D]`` with ``num_slots = num_blocks * block_size``; block ``b`` owns slots
``b*bs .. b*bs+bs-1`` in every one of them. With one KV group (``kv.manager.KVGroupSpec``)
storage layer ``i`` is model layer ``i``; with several, each group's layers map onto the same
``num_layers`` storage layers, and a block holds the group it was allocated to.

A flat slot dimension keeps the hot path to two kernels per layer per step: ``index_copy_``
of the new keys/values at their slots (the *slot mapping*), and ``index_select`` of a
sequence's slots for attention (a *gather*).

Per-layer tensors (rather than one ``[L, ...]`` tensor) are deliberate: a layer can hold a
different precision (int8 KV with per-slot scales for insensitive layers) or a different
number of live blocks (sliding window) without touching the other layers. Subclasses
override ``write`` and ``gather``; the runner only calls those two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class PagedKVStorage:
    """Full-precision paged KV storage."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes across all layers (keys and values)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        """Store new keys/values. slot_mapping: [T] int64; k, v: [T, Hkv, D]."""
        self.k[layer].index_copy_(0, slot_mapping, k)
        self.v[layer].index_copy_(0, slot_mapping, v)

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy every layer's stored KV (and whatever per-slot data the format keeps) from
        slots ``src`` to ``dst`` ([N] int64 each), bit for bit: compaction after eviction. All
        sources are read before any destination is written, so the two may overlap."""
        for tensors in self._per_slot():
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))

    def apply_compaction(
        self, src: Tensor, dst: Tensor, dest_blocks: Sequence[int], num_dest_tokens: int
    ) -> None:
        """Follow ``KVCacheManager.compact`` (its ``SlotMoves``): the KV at ``src`` moves to
        ``dst``, and the survivors now fill ``dest_blocks`` from offset 0 (``num_dest_tokens`` of
        them). Per-slot formats only copy (``copy_slots``, bit-exact); formats with data per
        block (int4 keys) also rebuild the rewritten blocks."""
        if src.numel():
            self.copy_slots(src, dst)

    def _per_slot(self) -> list[list[Tensor]]:
        """The per-layer tensors indexed by slot."""
        return [self.k, self.v]

    def gather(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values at ``slots`` ([S] or [B, S] int64) -> [..., Hkv, D] each."""
        flat = slots.reshape(-1)
        k = self.k[layer].index_select(0, flat)
        v = self.v[layer].index_select(0, flat)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])


class Int8PagedKVStorage(PagedKVStorage):
    """KV stored as int8 with one fp32 scale per slot and head (symmetric, absmax).

    Halves (bf16) or quarters (fp32) the KV memory; dequantised on gather into the compute
    dtype. Per-slot scales mean a block never needs requantising when tokens are appended.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(num_layers)]
        scale_shape = (num_blocks * block_size, num_kv_heads, 1)
        self.k_scale = [torch.ones(scale_shape, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.ones(scale_shape, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes across all layers: int8 codes and an fp32 scale per slot and
        head, for keys and values (``dtype``, the compute dtype, does not enter)."""
        return 2 * num_layers * block_size * num_kv_heads * (head_dim + 4)

    def _per_slot(self) -> list[list[Tensor]]:
        return [self.k, self.v, self.k_scale, self.v_scale]

    @staticmethod
    def _quantise(x: Tensor) -> tuple[Tensor, Tensor]:
        x32 = x.float()
        scale = x32.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
        return (x32 / scale).round_().clamp_(-127, 127).to(torch.int8), scale

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        qk, sk = self._quantise(k)
        qv, sv = self._quantise(v)
        self.k[layer].index_copy_(0, slot_mapping, qk)
        self.v[layer].index_copy_(0, slot_mapping, qv)
        self.k_scale[layer].index_copy_(0, slot_mapping, sk)
        self.v_scale[layer].index_copy_(0, slot_mapping, sv)

    def gather(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        flat = slots.reshape(-1)
        k = self.k[layer].index_select(0, flat).float() * self.k_scale[layer].index_select(0, flat)
        v = self.v[layer].index_select(0, flat).float() * self.v_scale[layer].index_select(0, flat)
        k, v = k.to(self.dtype), v.to(self.dtype)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])
