"""int4 KV in the KIVI style (``kv_dtype: int4``): keys per channel, values per token, grouped.

Keys have outlier *channels* (a few dimensions are large for every token), so they are
quantised per channel over a group of tokens; values have no such structure and are quantised
per token over groups of ``VALUE_GROUP`` channels (Liu et al., "KIVI", 2024). Both asymmetric,
4 bits, two codes per byte, scale and zero in fp16.

The key group is one KV block (``block_size`` tokens). A block's keys stay in full precision in
a small *open-block* buffer until the block is full; then they are quantised together and the
buffer slot is reused. A sequence has one partly filled block per KV group, so the buffer holds
about one block per running request (it grows when a step needs more). Values are quantised as
they are written. A decode-only step on the CPU reads the codes in place
(``cpu_ops.decode_attention_int4``, through ``fused_layer``); other steps (prefill chunks, scored
or sink-rotated decodes, CUDA, kernels off) dequantise on gather, into the compute dtype.

Bookkeeping (which blocks are open, where their buffer is) is done once per step, at the first
layer's write of a slot mapping, and shared by every layer: all layers write the same slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.kv.storage import PagedKVStorage

VALUE_GROUP = 32  # channels per value scale (KIVI's group size); the head dim when not a multiple


def quantise_int4(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit codes of ``x`` with one fp16 (scale, zero) per slice along ``dim``.

    Returns codes (uint8, 0..15, the shape of ``x``), scale and zero (``x``'s shape with ``dim``
    of size 1). ``x ~ codes * scale + zero``, off by at most half a step plus fp16 rounding.
    """
    x32 = x.float()
    lo, hi = x32.amin(dim=dim, keepdim=True), x32.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    zero = lo.half()
    codes = ((x32 - zero.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)
    return codes, scale, zero


def dequantise_int4(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """fp32 values of ``codes`` (uint8) with broadcastable fp16 ``scale`` and ``zero``."""
    return codes.float() * scale.float() + zero.float()


def pack_int4(codes: Tensor) -> Tensor:
    """[..., D] uint8 codes 0..15 -> [..., D/2] bytes (even channel low nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """[..., D/2] bytes -> [..., D] uint8 codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


class _StepPlan:
    """Where one step's written slots go: open-block buffer rows, and the blocks it fills."""

    def __init__(self, buffer_row: Tensor, offset: Tensor, closing: list[tuple[int, int]]):
        self.buffer_row = buffer_row  # [T] buffer row of each written token's block
        self.offset = offset  # [T] its offset in the block
        self.closing = closing  # (block id, buffer row) of blocks this step fills


class Int4KIVIPagedKVStorage(PagedKVStorage):
    """Paged KV in int4, KIVI style (module docstring). ``write``/``gather`` like the parent's."""

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
        if head_dim % 2:
            raise ValueError(f"int4 KV packs two channels per byte; head_dim {head_dim} is odd")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.value_group = VALUE_GROUP if head_dim % VALUE_GROUP == 0 else head_dim
        slots, h = num_blocks * block_size, num_kv_heads
        u8, f16 = torch.uint8, torch.float16

        def zeros(*shape: int, dt: torch.dtype) -> list[Tensor]:
            return [torch.zeros(shape, dtype=dt, device=device) for _ in range(num_layers)]

        self.k = zeros(slots, h, head_dim // 2, dt=u8)
        self.v = zeros(slots, h, head_dim // 2, dt=u8)
        self.k_scale = zeros(num_blocks, h, head_dim, dt=f16)  # per block (token group), channel
        self.k_zero = zeros(num_blocks, h, head_dim, dt=f16)
        groups = head_dim // self.value_group
        self.v_scale = zeros(slots, h, groups, dt=f16)  # per token, channel group
        self.v_zero = zeros(slots, h, groups, dt=f16)
        # Open blocks' keys in full precision: [rows, block_size, H, D] per layer.
        self.k_open = zeros(0, block_size, h, head_dim, dt=dtype)
        self.open_row = torch.full((num_blocks,), -1, dtype=torch.long, device=device)  # block -> row
        self._free_rows: list[int] = []
        self._released: list[int] = []  # rows of blocks filled last step, free from the next
        self._plan_key: Tensor | None = None
        self._plan: _StepPlan | None = None

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        # a block's keys share per-channel scales over its positions: a token cannot move alone
        raise RuntimeError("int4 KV moves tokens only through apply_compaction, which rebuilds whole blocks")

    @torch.inference_mode()  # the open-block buffer grows inside steps: inference tensors
    def apply_compaction(
        self, src: Tensor, dst: Tensor, dest_blocks: Sequence[int], num_dest_tokens: int
    ) -> None:
        """Rebuild the blocks a compaction rewrote (``PagedKVStorage.apply_compaction``).

        Values are per token: codes, scale and zero move bit for bit. Keys share per-channel
        scales over a block, so a rewritten block whose tokens are one closed block's, in order,
        takes that block's codes and scales bit for bit; any other full block is re-quantised
        from the keys the model saw (dequantised), so a key ends within half a step of its new
        block's per-channel range (plus fp16 rounding of scale and zero) of what it was; a
        partly filled last block goes back to the open-block buffer in full precision and is
        quantised when it fills, as any block is. Why re-quantise rather than evict whole blocks:
        the selection rule then keeps its token and segment granularity, which is what keeps a
        fact whole, at the cost of a second rounding of the moved keys.
        """
        bs = self.block_size
        if not dest_blocks:
            if src.numel():
                raise ValueError("slot moves without the destination blocks they fill")
            return
        moved = dict(zip(dst.tolist(), src.tolist(), strict=True))
        dest_slots = [dest_blocks[j // bs] * bs + j % bs for j in range(num_dest_tokens)]
        source_slots = [moved.get(d, d) for d in dest_slots]
        n_full, tail = divmod(num_dest_tokens, bs)
        exact_dst, exact_src, requant = [], [], []
        for k in range(n_full):
            first = source_slots[k * bs]
            whole = first % bs == 0 and source_slots[k * bs : (k + 1) * bs] == list(range(first, first + bs))
            if whole and int(self.open_row[first // bs]) < 0:
                if first // bs != dest_blocks[k]:
                    exact_dst.append(dest_blocks[k])
                    exact_src.append(first // bs)
            else:
                requant.append(k)
        # Open rows of the blocks involved (sources, and destinations that may carry a stale row
        # from a request that ended with them partly filled); the last block keeps or takes one.
        involved = {s // bs for s in source_slots} | set(dest_blocks)
        old_rows = {b: int(self.open_row[b]) for b in involved if int(self.open_row[b]) >= 0}
        last = dest_blocks[-1] if tail else -1
        tail_row = old_rows.get(last, -1)
        if tail and tail_row < 0:
            tail_row = self._take_row()
        d_idx = torch.tensor(dest_slots, dtype=torch.long, device=self.device)
        s_idx = torch.tensor(source_slots, dtype=torch.long, device=self.device)
        req_idx = torch.tensor(requant, dtype=torch.long, device=self.device)
        req_blocks = torch.tensor([dest_blocks[k] for k in requant], dtype=torch.long, device=self.device)
        ex_src = torch.tensor(exact_src, dtype=torch.long, device=self.device)
        ex_dst = torch.tensor(exact_dst, dtype=torch.long, device=self.device)
        h, d = self.num_kv_heads, self.head_dim
        for layer in range(self.num_layers):
            keys, _ = self.gather(layer, s_idx)  # what the model saw, before any write
            for t in (self.v[layer], self.v_scale[layer], self.v_zero[layer]):
                t.index_copy_(0, d_idx, t.index_select(0, s_idx))
            codes_by_block = self.k[layer].view(self.num_blocks, bs, h, d // 2)
            copied = [
                codes_by_block.index_select(0, ex_src),
                self.k_scale[layer].index_select(0, ex_src),
                self.k_zero[layer].index_select(0, ex_src),
            ]
            if requant:
                full = keys[: n_full * bs].view(n_full, bs, h, d).index_select(0, req_idx)
                codes, scale, zero = quantise_int4(full, dim=1)  # per block and channel
                codes_by_block.index_copy_(0, req_blocks, pack_int4(codes))
                self.k_scale[layer].index_copy_(0, req_blocks, scale[:, 0])
                self.k_zero[layer].index_copy_(0, req_blocks, zero[:, 0])
            if exact_dst:
                codes_by_block.index_copy_(0, ex_dst, copied[0])
                self.k_scale[layer].index_copy_(0, ex_dst, copied[1])
                self.k_zero[layer].index_copy_(0, ex_dst, copied[2])
            if tail:
                self.k_open[layer][tail_row, :tail] = keys[n_full * bs :]
        for block, row in old_rows.items():
            self.open_row[block] = -1
            if row != tail_row:
                self._free_rows.append(row)
        if tail:
            self.open_row[last] = tail_row

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes across all layers (codes, scales and zeros; not the open-block
        buffer, which is about one block per running request)."""
        value_group = VALUE_GROUP if head_dim % VALUE_GROUP == 0 else head_dim
        per_layer_head = (
            block_size * head_dim  # key and value codes, half a byte each
            + 2 * 2 * head_dim  # key scale and zero per channel for the block, fp16
            + block_size * 2 * 2 * (head_dim // value_group)  # value scale and zero per token group
        )
        return num_layers * num_kv_heads * per_layer_head

    # --- the step's bookkeeping -----------------------------------------------------------

    def _plan_for(self, slot_mapping: Tensor) -> _StepPlan:
        if self._plan is not None and self._plan_key is slot_mapping:
            return self._plan
        self._free_rows += self._released
        self._released = []
        bs = self.block_size
        slots = slot_mapping.tolist()
        rows: dict[int, int] = {}
        for slot in slots:
            block = slot // bs
            if block in rows:
                continue
            row = int(self.open_row[block])
            if row < 0 or slot % bs == 0:  # a block (re)starts at offset 0: a fresh group
                row = row if row >= 0 else self._take_row()
                self.open_row[block] = row
            rows[block] = row
        last_slots = {s for s in slots if s % bs == bs - 1}
        closing = [(b, r) for b, r in rows.items() if b * bs + bs - 1 in last_slots]
        for block, row in closing:
            self.open_row[block] = -1
            self._released.append(row)
        index = torch.tensor([rows[s // bs] for s in slots], dtype=torch.long, device=self.device)
        offset = slot_mapping % bs
        self._plan_key, self._plan = slot_mapping, _StepPlan(index, offset, closing)
        return self._plan

    def _take_row(self) -> int:
        if not self._free_rows:
            grow = max(4, self.k_open[0].shape[0])
            start = self.k_open[0].shape[0]
            self.k_open = [
                torch.cat((t, torch.zeros((grow, *t.shape[1:]), dtype=t.dtype, device=t.device)))
                for t in self.k_open
            ]
            self._free_rows = list(range(start, start + grow))
        return self._free_rows.pop(0)

    # --- write and gather -----------------------------------------------------------------

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        plan = self._plan_for(slot_mapping)
        buffer = self.k_open[layer]
        buffer[plan.buffer_row, plan.offset] = k.to(self.dtype)
        for block, row in plan.closing:  # a full block: quantise its keys per channel
            codes, scale, zero = quantise_int4(buffer[row], dim=0)  # over the block's tokens
            start = block * self.block_size
            self.k[layer][start : start + self.block_size] = pack_int4(codes)
            self.k_scale[layer][block] = scale[0]
            self.k_zero[layer][block] = zero[0]
        t, h, d = v.shape
        grouped = v.reshape(t, h, d // self.value_group, self.value_group)
        codes, scale, zero = quantise_int4(grouped, dim=-1)  # per token and channel group
        self.v[layer].index_copy_(0, slot_mapping, pack_int4(codes.reshape(t, h, d)))
        self.v_scale[layer].index_copy_(0, slot_mapping, scale[..., 0])
        self.v_zero[layer].index_copy_(0, slot_mapping, zero[..., 0])

    def fused_layer(self, layer: int) -> cpu_ops.Int4KVLayer:
        """``layer``'s tensors for ``cpu_ops.decode_attention_int4``. Take it after the step's
        ``write``: the open-block buffer may grow there (a new tensor)."""
        return cpu_ops.Int4KVLayer(
            self.k[layer],
            self.k_scale[layer],
            self.k_zero[layer],
            self.k_open[layer],
            self.open_row,
            self.v[layer],
            self.v_scale[layer],
            self.v_zero[layer],
            self.block_size,
            self.value_group,
        )

    def gather(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        flat = slots.reshape(-1)
        blocks = flat // self.block_size
        keys = dequantise_int4(
            unpack_int4(self.k[layer].index_select(0, flat)),
            self.k_scale[layer].index_select(0, blocks),
            self.k_zero[layer].index_select(0, blocks),
        ).to(self.dtype)
        rows = self.open_row.index_select(0, blocks)
        open_ = (rows >= 0).nonzero().squeeze(1)
        if open_.numel():  # tokens of blocks not full yet: their full-precision keys
            keys[open_] = self.k_open[layer][rows[open_], flat[open_] % self.block_size]
        s, h, d = keys.shape
        g = self.value_group
        codes = unpack_int4(self.v[layer].index_select(0, flat)).view(s, h, d // g, g)
        scale = self.v_scale[layer].index_select(0, flat)[..., None]
        values = dequantise_int4(codes, scale, self.v_zero[layer].index_select(0, flat)[..., None])
        values = values.view(s, h, d).to(self.dtype)
        return keys.view(*slots.shape, h, d), values.view(*slots.shape, h, d)
