"""KV storage with a precision per layer (``kv_dtype: plan``): each layer is kept in the model's
dtype, int8 or int4, as a KV plan says (``quant.plan.QuantPlan.kv``, chosen by measured
sensitivity in ``quant.kv_profile`` and ``quant.allocate``).

A composite over the uniform storages: one ``PagedKVStorage``, ``Int8PagedKVStorage`` or
``Int4KIVIPagedKVStorage`` per precision the plan uses, each holding that precision's layers,
all over the same ``num_blocks * block_size`` slots. Every layer writes the same slots (one block
table), so a block id means the same thing in every part, and compaction is applied to each part.
``write``/``gather`` go to the layer's part; ``k``/``v`` list each layer's own code tensors, so the
attention backend's fused decode kernel, which reads a store whose dtype is the model's, takes the
plain layers and never an int8 or int4 one (their stores are int8 / uint8).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage, PagedKVStorage

# A layer's KV precision: the names ``kv_dtype`` takes for the whole model ("auto": the model's
# dtype), and the storage that keeps it.
LAYER_KV_DTYPES: dict[str, type[PagedKVStorage]] = {
    "auto": PagedKVStorage,
    "int8": Int8PagedKVStorage,
    "int4": Int4KIVIPagedKVStorage,
}


def check_layer_dtypes(layer_dtypes: Sequence[str], num_layers: int, source: str = "kv plan") -> None:
    """ValueError naming the first unknown precision, or a layer count other than ``num_layers``."""
    bad = [f"layer {i}: {d!r}" for i, d in enumerate(layer_dtypes) if d not in LAYER_KV_DTYPES]
    if bad:
        raise ValueError(
            f"{source}: unknown KV precision ({', '.join(bad)}); allowed: {', '.join(LAYER_KV_DTYPES)}"
        )
    if len(layer_dtypes) != num_layers:
        raise ValueError(f"{source} has {len(layer_dtypes)} layers, the model {num_layers}")


def mixed_bytes_per_block(
    layer_dtypes: Sequence[str], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Memory one block takes across all layers, each in its own precision (scales included; not
    int4's open-block buffer)."""
    total = 0
    for name in set(layer_dtypes):
        count = sum(1 for d in layer_dtypes if d == name)
        total += LAYER_KV_DTYPES[name].bytes_per_block(count, block_size, num_kv_heads, head_dim, dtype)
    return total


class MixedPagedKVStorage(PagedKVStorage):
    """Paged KV whose layer ``i`` is kept in ``layer_dtypes[i]`` (``LAYER_KV_DTYPES``)."""

    def __init__(
        self,
        layer_dtypes: Sequence[str],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        check_layer_dtypes(layer_dtypes, len(layer_dtypes))
        self.layer_dtypes = tuple(layer_dtypes)
        self.num_layers, self.num_blocks, self.block_size = len(layer_dtypes), num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.parts: dict[str, PagedKVStorage] = {}
        self._route: list[tuple[PagedKVStorage, int]] = []  # layer -> (its part, its index there)
        for name in LAYER_KV_DTYPES:  # a fixed order, so parts are built alike for equal plans
            count = self.layer_dtypes.count(name)
            if count:
                cls = LAYER_KV_DTYPES[name]
                self.parts[name] = cls(count, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        seen = dict.fromkeys(self.parts, 0)
        for name in self.layer_dtypes:
            self._route.append((self.parts[name], seen[name]))
            seen[name] += 1
        self.k = [part.k[i] for part, i in self._route]
        self.v = [part.v[i] for part, i in self._route]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Not defined by a layer count alone: use ``mixed_bytes_per_block`` with the plan."""
        raise TypeError("a mixed KV store's block size depends on its plan: use mixed_bytes_per_block")

    def layer_dtype(self, layer: int) -> str:
        """The precision layer ``layer`` is kept in."""
        return self.layer_dtypes[layer]

    def part_of(self, layer: int) -> tuple[PagedKVStorage, int]:
        """The uniform store holding ``layer`` and the layer's index in it: what a kernel for one
        precision (a fused int4 decode, say) reads, per layer."""
        return self._route[layer]

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        part, i = self._route[layer]
        part.write(i, slot_mapping, k, v)

    def gather(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        part, i = self._route[layer]
        return part.gather(i, slots)

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        # int4 refuses single-token moves (its keys share per-block scales): so does a plan with
        # it, before any other part has moved
        parts = sorted(self.parts.values(), key=lambda p: not isinstance(p, Int4KIVIPagedKVStorage))
        for part in parts:
            part.copy_slots(src, dst)

    def apply_compaction(
        self, src: Tensor, dst: Tensor, dest_blocks: Sequence[int], num_dest_tokens: int
    ) -> None:
        for part in self.parts.values():
            part.apply_compaction(src, dst, dest_blocks, num_dest_tokens)

    def bytes_held_per_block(self) -> int:
        """``mixed_bytes_per_block`` of this storage's plan."""
        return mixed_bytes_per_block(
            self.layer_dtypes, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
