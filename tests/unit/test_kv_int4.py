"""int4 KIVI KV storage: round-trip error within the stated bound, on fresh random data each run.

Bound: an asymmetric 4-bit code is off by at most half a step, step = (max - min) / 15 over its
group (a key channel over a block's tokens; a value token over 32 channels); scale and zero are
fp16, which adds at most 2^-10 of the group's largest magnitude. Keys of a block that is not
full yet are returned exactly (full precision until the group fills).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage, pack_int4, unpack_int4

BS, H, D = 4, 2, 64


def bound(x: Tensor, dim: int) -> Tensor:
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    return 0.5 * (hi - lo) / 15 * (1 + 2**-8) + 2**-10 * torch.maximum(lo.abs(), hi.abs())


def test_pack_unpack_roundtrip():
    codes = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


def test_int4_roundtrip_within_bound_on_fresh_data():
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    st = Int4KIVIPagedKVStorage(
        2, num_blocks=6, block_size=BS, num_kv_heads=H, head_dim=D, dtype=torch.float32
    )
    # a sequence in blocks 3, 1, 5: a 6-token chunk (block 3 full, block 1 half), then decodes
    table = [3, 1, 5]
    n = 11  # block 5 ends up with 3 of its 4 tokens: still open
    slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(n)])
    scale = torch.rand(1, H, D, generator=gen) * 4  # channels of different sizes, as keys have
    k = torch.randn(n, H, D, generator=gen) * scale + torch.randn(1, H, D, generator=gen)
    v = torch.randn(n, H, D, generator=gen) * 3
    for layer in range(2):
        st.write(layer, slots[:6], k[:6] * (layer + 1), v[:6])
    for i in range(6, n):  # one token per step, a new slot-mapping tensor each time
        step = slots[i : i + 1].clone()
        for layer in range(2):
            st.write(layer, step, k[i : i + 1] * (layer + 1), v[i : i + 1])
    for layer in range(2):
        gk, gv = st.gather(layer, slots)
        want_k = k * (layer + 1)
        for b in range(2):  # full blocks: per channel over the block's tokens
            rows = slice(b * BS, (b + 1) * BS)
            err = (gk[rows] - want_k[rows]).abs()
            assert (err <= bound(want_k[rows], 0)).all(), f"seed {seed}: key block {b}, max err {err.max()}"
        assert torch.equal(gk[2 * BS :], want_k[2 * BS :]), f"seed {seed}: open block not exact"
        groups = v.view(n, H, D // 32, 32)
        err = (gv.view(n, H, D // 32, 32) - groups).abs()
        assert (err <= bound(groups, -1)).all(), f"seed {seed}: values, max err {err.max()}"
        # and the error is really that of 4 bits, not of a full-precision copy
        assert (gv - v).abs().max() > 0


def test_int4_block_reused_after_free_starts_a_fresh_group():
    st = Int4KIVIPagedKVStorage(
        1, num_blocks=2, block_size=BS, num_kv_heads=H, head_dim=D, dtype=torch.float32
    )
    first = torch.randn(BS, H, D)
    st.write(0, torch.arange(BS), first, first)  # block 0 full: quantised
    again = torch.randn(2, H, D) * 100  # block 0 handed to another request: written from offset 0
    st.write(0, torch.arange(2), again, again)
    gk, _ = st.gather(0, torch.arange(2))
    assert torch.equal(gk, again)  # open again: the new keys in full precision


def test_int4_is_about_a_third_of_bf16():
    per_block = Int4KIVIPagedKVStorage.bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    bf16 = 2 * 30 * 16 * 3 * 64 * 2
    assert 0.3 < per_block / bf16 < 0.36
