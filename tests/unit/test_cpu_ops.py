"""The fused CPU kernels (edge_rtgi/llm/csrc/cpu_ops.cpp) against the PyTorch ops they replace.

Fresh random inputs every run (no fixed seed): the bounds must hold for any input, not for one.
Bounds: fp32 within a few ulp (sums run in another order); bf16 bit-identical where the kernel
rounds where eager rounds (RMSNorm, RoPE, SwiGLU: at least 99 % of elements equal, the rest one
bf16 ulp from exp's last bit), attention within bf16 output rounding.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.model import causal_window_mask, sdpa
from edge_rtgi.llm.rope import apply_rope

pytestmark = pytest.mark.skipif(
    not cpu_ops.load(), reason=f"fused CPU kernels not built: {cpu_ops.failure()}"
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def no_grad():
    """The kernels step aside when gradients are on (they have no backward); inference is no-grad."""
    with torch.no_grad():
        yield


def rope_tables(positions: torch.Tensor, dim: int, dtype: torch.dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, min_equal: float = 0.99):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        equal = (got == want).float().mean().item()
        assert equal >= min_equal, f"only {equal:.4f} of bf16 elements equal"
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_gives_a_value_the_same_bits_in_the_vector_loop_and_in_the_tail(dtype):
    """Eight lanes at a time where the CPU has AVX2 and FMA, one element at a time for the rest of
    a row: a gate and up value give the same bits in either loop, over the whole range the
    exponential clamps (|gate| up to 100) and at its edges."""
    torch.manual_seed(3)
    gate = torch.cat(
        [torch.randn(4000) * 10, torch.linspace(-100, 100, 2001), torch.tensor([-88.7, -87.3, 87.3, 88.7])]
    )
    up = torch.randn(gate.numel())
    inter = 9  # lanes 0-7 in the vector loop, 8 in the tail
    gate_up = torch.cat([gate[:, None].expand(-1, inter), up[:, None].expand(-1, inter)], dim=1).to(dtype)
    out = cpu_ops.silu_mul(gate_up)
    assert torch.equal(out[:, 0], out[:, inter - 1]) and torch.equal(out[:, 7], out[:, inter - 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (300, 100)])
def test_rms_norm(dtype, rows, dim):
    x = torch.randn(rows, dim, dtype=dtype) * 3
    w = (1 + 0.1 * torch.randn(dim)).to(dtype)
    assert_matches(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (dim,), w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 64), (5, 6, 16), (64, 3, 128)])
def test_rotate_qk_in_place(dtype, tokens, heads, dim):
    qkv = torch.randn(tokens, (heads + 2) * dim, dtype=dtype)
    cos, sin = rope_tables(torch.randint(0, 4000, (tokens,)), dim, dtype)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)  # a strided view, as in the model
    want = apply_rope(qk, cos, sin)
    untouched = qkv[:, heads * dim :].clone()
    got = cpu_ops.rotate_qk(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(qkv[:, heads * dim :], untouched)  # v is not touched
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (9, 256), (2, 3, 40)])
def test_silu_mul(dtype, shape):
    gate_up = torch.randn(shape, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, dtype)


def reference_decode(q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask):
    k_store, v_store = k_store.clone(), v_store.clone()
    k_store[new_slots], v_store[new_slots] = k_new, v_new
    outs = []
    for b in range(q.shape[0]):
        slots = key_slots[b] if key_mask is None else key_slots[b][key_mask[b]]
        outs.append(sdpa(q[b : b + 1], k_store[slots], v_store[slots], None))
    return torch.cat(outs), k_store, v_store


def paged_decode_inputs(dtype, rows, keys, heads, kv_heads, dim, num_slots):
    """Random q, k_new, v_new, stores, slots and a mask for a paged decode-attention call; each
    row's new token is among its own keys, and its last key is never masked."""
    k_store = torch.randn(num_slots, kv_heads, dim, dtype=dtype)
    v_store = torch.randn(num_slots, kv_heads, dim, dtype=dtype)
    q = torch.randn(rows, heads, dim, dtype=dtype)
    k_new = torch.randn(rows, kv_heads, dim, dtype=dtype)
    v_new = torch.randn(rows, kv_heads, dim, dtype=dtype)
    key_slots = torch.stack([torch.randperm(num_slots)[:keys] for _ in range(rows)])
    new_slots = key_slots[:, -1].clone()
    key_mask = torch.rand(rows, keys) > 0.3
    key_mask[:, -1] = True
    return q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 2, 20)])
def test_decode_attention_paged_with_mask(dtype, heads, kv_heads, dim):
    inputs = paged_decode_inputs(dtype, 3, 37, heads, kv_heads, dim, 200)
    q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask = inputs
    want, want_k, want_v = reference_decode(q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask)
    got = cpu_ops.decode_attention(
        q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask[:, None, None, :], dim**-0.5
    )  # SDPA's mask shape is accepted
    assert torch.equal(k_store, want_k) and torch.equal(v_store, want_v)  # the writes are exact
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,keys,dim", [(1, 701, 64), (2, 530, 128), (1, 300, 40)])
def test_decode_attention_long_rows_with_masked_runs(dtype, rows, keys, dim):
    # Hundreds of keys, four at a time where the head dim allows, with a long masked run at the start
    # and scattered masked keys after it (head dims 64 and 128 keep their value sums in registers).
    inputs = paged_decode_inputs(dtype, rows, keys, 9, 3, dim, 1024)
    q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask = inputs
    key_mask[:, : keys // 3] = False
    want, _, _ = reference_decode(q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask)
    got = cpu_ops.decode_attention(
        q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask, dim**-0.5
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def attend(inputs: tuple, slots: torch.Tensor, mask: torch.Tensor, rows: int) -> torch.Tensor:
    """``decode_attention`` of the first ``rows`` rows of ``paged_decode_inputs`` over ``slots``
    (fresh copies of the stores), the first row's output."""
    q, k_new, v_new, k_store, v_store, new_slots = inputs[:6]
    dim = q.shape[-1]
    out = cpu_ops.decode_attention(
        q[:rows],
        k_new[:rows],
        v_new[:rows],
        k_store.clone(),
        v_store.clone(),
        new_slots[:rows],
        slots,
        mask,
        dim**-0.5,
    )
    return out[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 40])
def test_decode_attention_row_does_not_depend_on_the_padded_keys_after_it(dtype, dim):
    """A query row's output is the same bits whatever masked keys its step pads it with (the other
    rows' lengths in a batch, the draft rows after it in a verification) and wherever its last key
    falls in the kernel's blocks of four: with int8 activations downstream, a last-bit difference
    here changes greedy tokens. Rows with masked keys of their own (a window's, a masked first key of
    the last block) included, alone and beside a longer row. (fp32 shows the old kernel's
    differences; bf16 rounding hides most of them.)"""
    num_slots, heads, kv_heads = 96, 9, 3
    for keys in (1, 2, 3, 4, 5, 9, 17, 30, 33):
        inputs = paged_decode_inputs(dtype, 2, keys + 19, heads, kv_heads, dim, num_slots)
        key_slots, new_slots = inputs[6], inputs[5]
        own = torch.ones(keys, dtype=torch.bool)
        if keys >= 5:
            own[keys // 2] = False  # a masked key inside the row
            own[(keys - 1) // 4 * 4] = False  # and the first key of its last block of four
        own[-1] = True  # (its own key, as a decode row's)

        alone = attend(inputs, key_slots[:1, :keys], own[None], 1)
        for pad in (1, 2, 3, 4, 7, 16):
            mask = torch.cat([own, torch.zeros(pad, dtype=torch.bool)])[None]
            padded = torch.cat([key_slots[:1, :keys], key_slots[:1, :1].expand(1, pad)], dim=1)
            assert torch.equal(attend(inputs, padded, mask, 1), alone), (keys, pad)
        # beside a row 19 keys longer (its slots apart from this row's, as two sequences' are, so
        # that its own key written this step is not one this row reads): the batch pads this row
        others = torch.tensor([x for x in range(num_slots) if x not in key_slots[0, :keys].tolist()])
        key_slots[1] = others[torch.randperm(len(others))[: keys + 19]]
        new_slots[1] = key_slots[1, -1]
        mask = torch.ones(2, keys + 19, dtype=torch.bool)
        mask[0, :keys], mask[0, keys:] = own, False
        assert torch.equal(attend(inputs, key_slots, mask, 2), alone), keys


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_reads_strided_qkv_views_in_place(dtype):
    # The layer loop passes q, k and v as views of one [rows, (Hq + 2 Hkv) D] projection, strided
    # between tokens; the result and the cache writes must equal those of contiguous copies.
    rows, heads, kv_heads, dim, keys, num_slots = 4, 6, 2, 16, 23, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    qk = qkv.narrow(1, 0, (heads + kv_heads) * dim).view(rows, heads + kv_heads, dim)
    q, k_new = qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads)
    v_new = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view(rows, kv_heads, dim)
    assert not q.is_contiguous() and not k_new.is_contiguous() and not v_new.is_contiguous()
    key_slots = torch.stack([torch.randperm(num_slots)[:keys] for _ in range(rows)])
    new_slots = key_slots[:, -1].clone()
    stores = [torch.randn(num_slots, kv_heads, dim, dtype=dtype) for _ in range(2)]
    copies = [s.clone() for s in stores]
    got = cpu_ops.decode_attention(q, k_new, v_new, *stores, new_slots, key_slots, None, dim**-0.5)
    want = cpu_ops.decode_attention(
        q.contiguous(), k_new.contiguous(), v_new.contiguous(), *copies, new_slots, key_slots, None, dim**-0.5
    )
    assert torch.equal(got, want)
    assert torch.equal(stores[0], copies[0]) and torch.equal(stores[1], copies[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_contiguous_window(dtype):
    """The contiguous cache's case: slots are cache rows, a sliding window drops the oldest."""
    end, window = 50, 16
    k_store, v_store = torch.randn(64, 2, 32, dtype=dtype), torch.randn(64, 2, 32, dtype=dtype)
    q, k_new, v_new = (
        torch.randn(1, 4, 32, dtype=dtype),
        torch.randn(1, 2, 32, dtype=dtype),
        torch.randn(1, 2, 32, dtype=dtype),
    )
    want_k, want_v = k_store.clone(), v_store.clone()
    want_k[end - 1], want_v[end - 1] = k_new[0], v_new[0]
    mask = causal_window_mask(torch.tensor([end - 1]), torch.arange(end), window)
    want = sdpa(q, want_k[:end], want_v[:end], mask)
    slots = torch.arange(64)
    got = cpu_ops.decode_attention(
        q,
        k_new,
        v_new,
        k_store,
        v_store,
        slots[end - 1 : end],
        slots[None, end - window : end],
        None,
        32**-0.5,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def int4_cache(dtype, kv_heads, dim, block_size, lengths, gen):
    """An int4 KIVI storage (2 layers) holding one sequence per entry of ``lengths`` in shuffled
    blocks, written as the engine writes (a chunk, then one token per step), so that sequences
    whose length is not a multiple of ``block_size`` end in an open block. Returns the storage
    and each sequence's slots in position order."""
    from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage

    need = sum(-(-n // block_size) for n in lengths)
    num_blocks = need + 3
    st = Int4KIVIPagedKVStorage(2, num_blocks, block_size, kv_heads, dim, dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seq_slots = []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // block_size))]
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(n)])
        channel = torch.rand(1, kv_heads, dim, generator=gen) * 3  # outlier channels, as keys have
        k = torch.randn(n, kv_heads, dim, generator=gen) * channel + torch.randn(
            1, kv_heads, dim, generator=gen
        )
        v = torch.randn(n, kv_heads, dim, generator=gen) * 2
        chunk = max(1, n - 3)
        steps = [slice(0, chunk)] + [slice(i, i + 1) for i in range(chunk, n)]
        for step in steps:
            mapping = slots[step].clone()  # a new slot-mapping tensor per step, as the runner's
            for layer in range(2):
                st.write(layer, mapping, k[step].to(dtype), v[step].to(dtype))
        seq_slots.append(slots)
    return st, seq_slots


def int4_reference(st, layer, q, key_slots, key_mask):
    """fp64 attention over the storage's dequantised keys and values, not rounded to the compute
    dtype (the kernel keeps them in fp32; ``gather`` rounds them to bf16)."""
    from edge_rtgi.llm.kv.int4 import dequantise_int4, unpack_int4

    outs = []
    for b in range(q.shape[0]):
        flat = key_slots[b][key_mask[b]] if key_mask is not None else key_slots[b]
        blocks = flat // st.block_size
        keys = dequantise_int4(
            unpack_int4(st.k[layer][flat]), st.k_scale[layer][blocks], st.k_zero[layer][blocks]
        ).double()
        rows = st.open_row[blocks]
        is_open = rows >= 0
        keys[is_open] = st.k_open[layer][rows[is_open], flat[is_open] % st.block_size].double()
        s, h, d = keys.shape
        g = st.value_group
        codes = unpack_int4(st.v[layer][flat]).view(s, h, d // g, g)
        values = dequantise_int4(codes, st.v_scale[layer][flat][..., None], st.v_zero[layer][flat][..., None])
        outs.append(sdpa(q[b : b + 1].double(), keys, values.view(s, h, d).double(), None))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 2, 20), (6, 2, 96)])
@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_decode_attention_int4_matches_gather_then_sdpa(dtype, heads, kv_heads, dim, block_size):
    """Batched rows of different lengths (padding masked), paged blocks, open last blocks, GQA.

    Bounds: fp32 against ``gather`` + SDPA within 1e-5 (the same dequantised numbers; the sums run
    in another order and q.k is formed as (q*scale).codes + q.zero). bf16 against an fp64
    reference over the same dequantised numbers within bf16 output rounding (2^-8 relative), and
    on average closer to it than bf16 ``gather`` + SDPA, which rounds every dequantised key and
    value to bf16 first."""
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed {seed}")  # fresh data each run; pytest shows this line when the test fails
    gen = torch.Generator().manual_seed(seed)
    lengths = [block_size * 3, 2 * block_size + 1, 37, 1]  # full, just opened, any, one key
    st, seqs = int4_cache(dtype, kv_heads, dim, block_size, lengths, gen)
    rows, width = len(lengths), max(lengths) + 2
    key_slots = torch.zeros(rows, width, dtype=torch.long)  # padded with slot 0, as the runner pads
    key_mask = torch.zeros(rows, width, dtype=torch.bool)
    for b, slots in enumerate(seqs):
        key_slots[b, : len(slots)], key_mask[b, : len(slots)] = slots, True
    key_mask[0, 2] = False  # a masked key inside a sequence too
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype) * 2
    got = cpu_ops.decode_attention_int4(q, st.fused_layer(1), key_slots, key_mask[:, None, None], dim**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    keys, values = st.gather(1, key_slots)
    want = torch.cat(
        [sdpa(q[b : b + 1], keys[b][key_mask[b]], values[b][key_mask[b]], None) for b in range(rows)]
    )
    exact = int4_reference(st, 1, q, key_slots, key_mask)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3)
        # gather + SDPA adds the bf16 rounding of every key and value to its output's
        closer = (got.double() - exact).abs().mean() <= (want.double() - exact).abs().mean()
        assert closer, "the fused kernel is farther from the exact result than gather + SDPA"


def test_decode_attention_int4_long_rows_split_over_threads():
    """Thousands of keys: the work is split into stretches whose softmax sums are merged."""
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed {seed}")  # fresh data each run; pytest shows this line when the test fails
    gen = torch.Generator().manual_seed(seed)
    st, seqs = int4_cache(torch.float32, 3, 64, 16, [3001, 700], gen)
    key_slots = torch.zeros(2, 3001, dtype=torch.long)
    key_mask = torch.zeros(2, 3001, dtype=torch.bool)
    for b, slots in enumerate(seqs):
        key_slots[b, : len(slots)], key_mask[b, : len(slots)] = slots, True
    q = torch.randn(2, 9, 64, generator=gen) * 3
    got = cpu_ops.decode_attention_int4(q, st.fused_layer(0), key_slots, key_mask, 0.125)
    torch.testing.assert_close(
        got.double(), int4_reference(st, 0, q, key_slots, key_mask), rtol=1e-5, atol=1e-5
    )
    # without a mask (one full row)
    got = cpu_ops.decode_attention_int4(q[:1], st.fused_layer(0), key_slots[:1], None, 0.125)
    torch.testing.assert_close(
        got.double(), int4_reference(st, 0, q[:1], key_slots[:1], None), rtol=1e-5, atol=1e-5
    )


def test_decode_attention_int4_refuses_bad_inputs():
    import dataclasses

    gen = torch.Generator().manual_seed(0)
    st, seqs = int4_cache(torch.float32, 2, 32, 4, [9], gen)
    kv, q, slots = st.fused_layer(0), torch.randn(1, 4, 32), seqs[0][None]

    def call(kv=kv, q=q, slots=slots, mask=None, **changes):
        return cpu_ops.decode_attention_int4(q, dataclasses.replace(kv, **changes), slots, mask, 0.2)

    with pytest.raises(RuntimeError, match=r"key slot 999 out of range \[0, "):
        call(slots=torch.tensor([[0, 999]]))
    with pytest.raises(RuntimeError, match="k_open must be BFloat16, got Float"):
        call(q=q.bfloat16())
    with pytest.raises(RuntimeError, match="v_scale must be Half, got Float"):
        call(v_scale=kv.v_scale.float())
    with pytest.raises(RuntimeError, match=r"k_scale must be \[6, 2, 32\]"):
        call(k_scale=kv.k_scale[:, :1])
    with pytest.raises(RuntimeError, match=r"open_row\[0\] = 7 is outside \[-1, "):
        call(open_row=torch.full_like(kv.open_row, 7))
    with pytest.raises(RuntimeError, match="value_group 12 must be even and divide the head dim 32"):
        call(value_group=12)
    with pytest.raises(RuntimeError, match="block_size 5 must be positive and divide the 24 slots"):
        call(block_size=5)
    with pytest.raises(RuntimeError, match="query heads are not a multiple"):
        call(q=torch.randn(1, 3, 32))
    with pytest.raises(RuntimeError, match="key_mask must have one flag per key slot"):
        call(mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="k_codes must be contiguous"):
        call(k_codes=kv.k_codes.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 activations only"):
        call(q=q.double())
    with pytest.raises(RuntimeError, match="q needs at least one row and one head"):  # not a crash
        call(q=torch.randn(0, 4, 32), slots=slots[:0])
    # usable: kernels on, CPU, the store's dtype; off inside disabled()
    assert cpu_ops.decode_attention_int4_usable(q, kv.k_open)
    assert not cpu_ops.decode_attention_int4_usable(q.bfloat16(), kv.k_open)
    with cpu_ops.disabled():
        assert not cpu_ops.decode_attention_int4_usable(q, kv.k_open)
    with cpu_ops.disabled("decode_attention_int4"):  # this kernel alone
        assert not cpu_ops.decode_attention_int4_usable(q, kv.k_open)
        assert cpu_ops.available()
    assert cpu_ops.decode_attention_int4_usable(q, kv.k_open)
    with pytest.raises(ValueError, match="unknown kernel"):
        with cpu_ops.disabled("rms_norm"):
            pass


def test_bad_slots_are_refused_with_the_slot():
    k_store = torch.zeros(8, 1, 16)
    q, k = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="slot 9 out of range"):
        cpu_ops.decode_attention(
            q, k, k, k_store, k_store.clone(), torch.tensor([1]), torch.tensor([[0, 9]]), None, 0.25
        )
    with pytest.raises(RuntimeError, match="slot 8 out of range"):
        cpu_ops.decode_attention(
            q, k, k, k_store, k_store.clone(), torch.tensor([8]), torch.tensor([[0, 1]]), None, 0.25
        )
    with pytest.raises(RuntimeError, match="must be Float"):
        cpu_ops.decode_attention(
            q, k.bfloat16(), k, k_store, k_store.clone(), torch.tensor([1]), torch.tensor([[0]]), None, 0.25
        )


def test_disabled_runs_the_pytorch_ops():
    x, w = torch.randn(2, 32), torch.ones(32)
    assert cpu_ops.available()
    with cpu_ops.disabled():
        assert not cpu_ops.available()
        assert not cpu_ops.decode_attention_usable(torch.zeros(1, 2, 8), torch.zeros(4, 1, 8), 3)
        assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6))
    assert cpu_ops.available()
    # float64 and long contexts always take the PyTorch path
    assert not cpu_ops.decode_attention_usable(
        torch.zeros(1, 2, 8, dtype=torch.float64), torch.zeros(4, 1, 8, dtype=torch.float64), 3
    )
    assert not cpu_ops.decode_attention_usable(
        torch.zeros(1, 2, 8), torch.zeros(4, 1, 8), cpu_ops.DECODE_ATTENTION_MAX_KEYS + 1
    )


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension 'edge_rtgi_cpu_ops': g++: not found")

    monkeypatch.setattr(cpu_ops, "_ops", None)
    monkeypatch.setattr(cpu_ops, "_failure", None)
    monkeypatch.setattr(cpu_ops, "_build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="edge_rtgi.llm.cpu_ops"):
        assert cpu_ops.load() is False
    assert "g++: not found" in cpu_ops.failure()
    assert "apt-get install g++ ninja-build" in caplog.text
    assert cpu_ops.load() is False  # tried once, not on every call
    x, w = torch.randn(2, 32), torch.ones(32)
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6))


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_ops", None)
    monkeypatch.setattr(cpu_ops, "_failure", None)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    assert cpu_ops.load() is False
    assert "switched off" in cpu_ops.failure()


def test_build_dir_is_per_torch_cpu_and_checkout(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGE_RTGI_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_ops.ENV_MARCH, raising=False)
    path = cpu_ops.build_dir()
    assert path.parent == tmp_path / f"torch-{torch.__version__.replace('+', '-')}"
    assert path.name.startswith(__import__("platform").machine())
    # Another checkout of the source gets a folder of its own.
    monkeypatch.setattr(cpu_ops, "SOURCE", tmp_path / "elsewhere" / "csrc" / "cpu_ops.cpp")
    assert cpu_ops.build_dir() != path
    assert cpu_ops.build_dir().parent == path.parent


def test_a_stale_build_lock_is_removed(monkeypatch, tmp_path):
    """A build killed half-way leaves torch's lock file; the next load must not wait on it forever."""
    import os
    import time

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("EDGE_RTGI_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_ops.ENV_MARCH, raising=False)
    lock = cpu_ops.build_dir() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - cpu_ops.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    seen = {}

    def fake_load(**kwargs):
        seen["lock present"] = lock.exists()
        seen["flags"] = kwargs["extra_cflags"]

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    cpu_ops._build()
    assert seen == {"lock present": False, "flags": ["-O3", "-march=native", "-fopenmp"]}
    # A fresh lock belongs to a build in progress: waited on until it goes.
    import threading

    lock.touch()
    threading.Timer(1.0, lambda: lock.unlink()).start()
    started = time.time()
    cpu_ops._build()
    assert seen["lock present"] is False and time.time() - started >= 0.9


def test_layer_loop_refuses_mismatched_arguments():
    x, cos = torch.zeros(1, 8), torch.ones(1, 1, 4)
    store, slots = torch.zeros(4, 1, 4), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="1 layers need 14 params and 8 meta entries"):
        torch.ops.edge_rtgi.decode_layers(
            x, cos, cos, [None] * 3, [0] * 8, [store], [store], slots[0], slots, None, 2, 1, 1e-6, 0.5
        )


@pytest.mark.slow
@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64-v3 is an x86 baseline")
@pytest.mark.parametrize(
    "aten_capability,int4_pack", [("avx2", "32"), ("default", "32-adjacent-pairs")], ids=["avx2", "generic"]
)
def test_portable_loops_pass_the_same_tests(tmp_path_factory, aten_capability, int4_pack):
    """CPUs without AVX-512 (AVX2 laptops, Arm Jetsons) run the portable loops: build the library
    for an AVX2 baseline in a fresh folder and run this file's kernel tests (the AVX2 loops among
    them), the quantised layers' tests and the model equivalence tests against it, in a subprocess
    (one process can load only one copy), with ATen on its AVX2 code, which packs int4 weights in
    blocks of 32 rows as it does on an AVX2 CPU, and on its generic code, which packs them in
    adjacent pairs (presumably Arm's): the kernels and the layers once read only the AVX-512 pack."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        cpu_ops.ENV_MARCH: "x86-64-v3",
        # one build for both (the library does not depend on ATen's capability)
        "EDGE_RTGI_KERNEL_DIR": str(tmp_path_factory.getbasetemp() / "x86-64-v3-kernels"),
        "ATEN_CPU_CAPABILITY": aten_capability,
    }
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from edge_rtgi.llm import cpu_ops; assert cpu_ops.load(), cpu_ops.failure(); "
            "from edge_rtgi.llm.quant.kernels import cpu_int4_layout; "
            "print(cpu_ops.build_info(), cpu_ops.build_dir().name, cpu_ops.int8_activation_loops(), "
            "cpu_int4_layout().key)",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    info, folder, i8_loops, pack = probe.stdout.split()
    assert (info, i8_loops, pack) == ("portable", "avx2", int4_pack)
    assert folder.startswith("march-x86-64-v3-src")
    tests = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_cpu_ops.py",
            "tests/unit/test_quant_kernels.py",
            "tests/equivalence/test_cpu_ops_model.py",
            "-k",
            "not portable and not stale and not build_dir",
            "-m",
            "not slow",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert tests.returncode == 0, tests.stdout[-3000:]


def test_registered_ops_refuse_malformed_shapes():
    """The ops are public through torch.ops: shapes that would read or write out of bounds are refused."""
    k_store, q, k = torch.zeros(8, 1, 16), torch.zeros(1, 2, 16), torch.zeros(1, 1, 16)
    slots, new = torch.tensor([[0, 1]]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="v_store"):
        cpu_ops.decode_attention(q, k, k, k_store, torch.zeros(4, 1, 16), new, slots, None, 0.25)
    with pytest.raises(RuntimeError, match="k_new and v_new must be"):
        cpu_ops.decode_attention(
            q, k, torch.zeros(1, 3, 16), k_store, k_store.clone(), new, slots, None, 0.25
        )
    with pytest.raises(RuntimeError, match="k_new and v_new must be"):
        cpu_ops.decode_attention(
            q, torch.zeros(2, 1, 16), k, k_store, k_store.clone(), new, slots, None, 0.25
        )
    x, cos = torch.zeros(1, 16), torch.ones(1, 1, 16)
    params = [torch.ones(16), None] + [torch.zeros(48, 16), None, None] * 4  # a missing norm weight
    with pytest.raises(RuntimeError, match="lacks a norm weight"):
        torch.ops.edge_rtgi.decode_layers(
            x, cos, cos, params, [0, 0] * 4, [k_store], [k_store], new, slots, None, 2, 1, 1e-6, 0.25
        )


def test_disabled_blocks_nest():
    assert cpu_ops.available()
    with cpu_ops.disabled():
        with cpu_ops.disabled():
            assert not cpu_ops.available()
        assert not cpu_ops.available()  # the outer block is still open
    assert cpu_ops.available()


def test_gradients_take_the_pytorch_path():
    assert cpu_ops._use(torch.zeros(1, 4))  # no-grad (this file's fixture): the kernels
    with torch.enable_grad():
        assert not cpu_ops._use(torch.zeros(1, 4))
        x = torch.randn(3, 32, requires_grad=True)
        w = torch.nn.Parameter(torch.ones(32))
        cpu_ops.rms_norm(x, w, 1e-6).sum().backward()  # F.rms_norm, which has a backward
    assert x.grad is not None and w.grad is not None


# --- multi-row weight-only matmuls (int4_mm, int8_mm) ---------------------------------------------


def quant_layer(scheme: str, out_features: int, in_features: int, dtype: torch.dtype):
    from edge_rtgi.llm.quant.kernels import make_quant_linear
    from edge_rtgi.llm.quant.schemes import parse_scheme, quantize_weight

    packed = quantize_weight(torch.randn(out_features, in_features), parse_scheme(scheme))
    return packed, make_quant_linear(packed, None, dtype, torch.device("cpu"))


def dequantised(packed, layer) -> torch.Tensor:
    """The weights as the kernels see them, in fp32 (scales and zeros as the layer stores them)."""
    if packed.scheme.bits == 8:
        return layer.qweight.float() * layer.scales.float()[:, None]
    sz, g = layer.scales_and_zeros.float(), layer.group_size
    scale = sz[..., 0].T.repeat_interleave(g, dim=1)
    zero = sz[..., 1].T.repeat_interleave(g, dim=1)
    return (packed.codes().float() - 8) * scale + zero


def multi_row(layer, x: torch.Tensor, loops: str) -> torch.Tensor:
    if hasattr(layer, "scales_and_zeros"):
        return cpu_ops.int4_mm(x, layer.qweight, layer.group_size, layer.scales_and_zeros, loops)
    return cpu_ops.int8_mm(x, layer.qweight, layer.scales, loops)


# (N, K): SmolLM2's gate_up, whole 64-row int4 blocks, a short last block (80, 48), odd K; int8
# also odd N and a K that is no multiple of 32 (the plain loops).
SHAPES = {
    "int4-g32": [(3072, 576), (192, 256), (80, 64), (48, 96)],
    "int4-g64": [(576, 1536), (80, 128)],
    "int4-g128": [(128, 256), (16, 128)],
    "int8": [(960, 576), (33, 70), (100, 64), (7, 40)],
}


@pytest.mark.parametrize("loops", cpu_ops.LOOPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "scheme,shape", [(scheme, shape) for scheme, shapes in SHAPES.items() for shape in shapes]
)
def test_multi_row_matmuls_match_dequantise_then_matmul(scheme, shape, dtype, loops):
    """Every row count 1..33 (AMX holds 32 rows per pass over the weights, the other loops 16; 33
    takes two or three passes) against the weights dequantised to
    fp32 and multiplied in fp64. Bound per output: fp32 sums, 1e-5 of sum |x| |w|; bf16 outputs
    add their own rounding, 2^-8 of |y|. ATen's kernels, the plain path, meet the same bound
    (but for int8 with K not a multiple of 16, where ATen's bf16 kernel reads out of bounds)."""
    packed, layer = quant_layer(scheme, *shape, dtype)
    aten_ok = scheme != "int8" or shape[1] % 16 == 0
    w = dequantised(packed, layer).double()
    for rows in range(1, 34):
        x = torch.randn(rows, shape[1]).to(dtype)
        want = x.double() @ w.T
        bound = 1e-5 * (x.double().abs() @ w.abs().T) + (2**-8 * want.abs() if dtype == torch.bfloat16 else 0)
        results = [("multi-row", multi_row(layer, x, loops))] + (
            [("aten", layer._aten(x))] if aten_ok else []
        )
        for name, got in results:
            assert got.dtype == dtype and got.shape == (rows, shape[0])
            excess = ((got.double() - want).abs() - bound).max().item()
            assert excess <= 0, f"{name}, {rows} rows: {excess}"


@pytest.mark.parametrize("loops", cpu_ops.LOOPS)
def test_float32_int8_matmul_gives_each_row_the_bits_it_gets_alone(loops):
    """fp32 rows against int8 weights (an LM head without AVX-512 BF16): the AVX2 loops take the
    rows in threes, then twos and ones, over each four weight rows; a row's sums must not depend on
    which group it fell in, so a row's logits do not depend on the rows beside it in a step. N not a
    multiple of 4 and K not one of 8 take the loops' tails."""
    for n, k in ((960, 576), (70, 70), (13, 40)):
        _, layer = quant_layer("int8", n, k, torch.float32)
        x = torch.randn(7, k)
        alone = torch.cat(
            [cpu_ops.int8_mm(x[i : i + 1], layer.qweight, layer.scales, loops) for i in range(7)]
        )
        for rows in range(1, 8):
            assert torch.equal(cpu_ops.int8_mm(x[:rows], layer.qweight, layer.scales, loops), alone[:rows])


def test_quant_layers_use_the_multi_row_kernels_for_2_rows_to_their_widest(monkeypatch):
    calls = []
    real4, real8 = cpu_ops.int4_mm, cpu_ops.int8_mm
    monkeypatch.setattr(cpu_ops, "int4_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real4(*a, **k))
    monkeypatch.setattr(cpu_ops, "int8_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real8(*a, **k))
    for scheme in ("int4-g32", "int8"):
        _, layer = quant_layer(scheme, 64, 64, torch.bfloat16)
        for rows in (1, 2, 16, 17, 32, 33):
            layer(torch.randn(rows, 64, dtype=torch.bfloat16))
        with cpu_ops.disabled():
            layer(torch.randn(4, 64, dtype=torch.bfloat16))
    # 32 rows with the AVX-512 BF16 loops (AMX or not) and on an AVX2 build without AVX-512, 16 with
    # the plain loops
    widest = cpu_ops.multi_row_max()
    avx2 = cpu_ops.build_info() == "portable" and cpu_ops.int8_activation_loops() == "avx2"
    assert widest == (32 if cpu_ops.build_info().startswith("avx512-bf16") or avx2 else 16)
    assert calls == [r for r in (2, 16, 17, 32) if r <= widest] * 2


def test_one_row_int8_takes_the_kernel_only_for_large_weights(monkeypatch):
    calls = []
    real8 = cpu_ops.int8_mm
    monkeypatch.setattr(cpu_ops, "int8_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real8(*a, **k))
    monkeypatch.setattr(cpu_ops, "INT8_ONE_ROW_MIN_WEIGHTS", 96 * 64)
    packed, small = quant_layer("int8", 64, 64, torch.bfloat16)
    packed, large = quant_layer("int8", 96, 64, torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    small(x)
    got = large(x)
    kernel_built = cpu_ops.build_info().startswith("avx512-bf16")
    assert calls == ([1] if kernel_built else [])
    w = dequantised(packed, large).double()
    want = x.double() @ w.T
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 2**-8 * want.abs()
    assert ((got.double() - want).abs() - bound).max().item() <= 0


def test_multi_row_ops_refuse_malformed_weights():
    _, layer4 = quant_layer("int4-g32", 64, 64, torch.float32)
    _, layer8 = quant_layer("int8", 64, 64, torch.float32)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="multiple of the"):
        cpu_ops.int4_mm(x, layer4.qweight, 48, layer4.scales_and_zeros)
    with pytest.raises(RuntimeError, match="qweight must be"):
        cpu_ops.int4_mm(x, layer4.qweight[:10], 32, layer4.scales_and_zeros)
    with pytest.raises(RuntimeError, match="scales must be in"):
        cpu_ops.int4_mm(x, layer4.qweight, 32, layer4.scales_and_zeros.bfloat16())
    with pytest.raises(RuntimeError, match="one scale per output row"):
        cpu_ops.int8_mm(x, layer8.qweight, layer8.scales[:5])
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.int8_mm(x[None], layer8.qweight, layer8.scales)


def test_int8_matmul_hands_over_its_float32_sums_for_logits():
    """``float_out``: each output's fp32 sum times its scale, not rounded to bf16 (whose steps of
    0.125 at logit magnitudes tie often); rounded, it is the bf16 output bit for bit, at one row and
    several, with each set of loops; fp32 inputs give what they gave."""
    packed, layer = quant_layer("int8", 256, 128, torch.bfloat16)
    for loops in ("best", "avx512", "portable"):
        for rows in (1, 3, 5, 17):
            x = torch.randn(rows, 128).to(torch.bfloat16)
            got = cpu_ops.int8_mm(x, layer.qweight, layer.scales, loops, float_out=True)
            assert got.dtype == torch.float32
            assert torch.equal(got.to(torch.bfloat16), cpu_ops.int8_mm(x, layer.qweight, layer.scales, loops))
            want = (x.double() @ layer.qweight.double().T) * layer.scales.double()
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
            assert not torch.equal(got, got.to(torch.bfloat16).float())  # finer than bf16
            xf, sf = x.float(), layer.scales.float()
            assert torch.equal(
                cpu_ops.int8_mm(xf, layer.qweight, sf, loops, float_out=True),
                cpu_ops.int8_mm(xf, layer.qweight, sf, loops),
            )


def test_int8_head_gives_float32_logits_only_where_one_row_does_too():
    """``Int8Linear.forward_float32`` (what ``compute_logits`` calls): the kernel's fp32 sums at every
    row count where a one-row input takes the kernel (a large enough head with the AVX-512 BF16
    loops); elsewhere, and with a hook on the module, the rounded output as before, at every row
    count, so that a row's logits never depend on how many rows share its step."""
    _, small = quant_layer("int8", 256, 128, torch.bfloat16)
    x = torch.randn(1, 3, 128).to(torch.bfloat16)
    assert torch.equal(small.forward_float32(x), small(x).float())  # too small for the one-row kernel
    _, head = quant_layer("int8", (1 << 24) // 512 + 64, 512, torch.bfloat16)
    one_row = cpu_ops.int8_kernel_usable(torch.zeros(1, 512, dtype=torch.bfloat16), head.qweight.numel())
    for rows in (1, 3):
        x = torch.randn(1, rows, 512).to(torch.bfloat16)
        got = head.forward_float32(x)
        assert got.dtype == torch.float32 and got.shape == (1, rows, head.out_features)
        if one_row:
            fp32 = cpu_ops.int8_mm(x[0], head.qweight, head.scales, float_out=True)
            assert torch.equal(got[0], fp32)
        else:
            assert torch.equal(got, head(x).float())
    calls = []
    handle = head.register_forward_hook(lambda *_: calls.append(1))
    try:
        assert torch.equal(head.forward_float32(x), head(x).float()) and calls
    finally:
        handle.remove()


# --- int4 weights against int8 activations (int4_i8_mm) -----------------------------------------


def rounded_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations and their scales, per 32 inputs, computed as it does in fp32:
    q = round(x * (127 / max|x|)) to nearest even, scale = max|x| / 127."""
    xb = x.float().view(x.shape[0], -1, 32)
    top = xb.abs().amax(-1, keepdim=True)
    # a true division: ``127.0 / top`` is computed as top.reciprocal() * 127, rounded twice
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    return torch.round(xb * inv).view(x.shape), (top / 127.0).squeeze(-1)


def i8_reference(x: torch.Tensor, packed, layer) -> torch.Tensor:
    """The kernel's definition in fp64: int8 activations against (code - 8) * scale, plus the zero
    term on the unrounded activations."""
    q, scale = rounded_activations(x)
    sz, g = layer.scales_and_zeros.double(), layer.group_size
    w_scaled = (packed.codes().double() - 8) * sz[..., 0].T.repeat_interleave(g, dim=1)
    zero = sz[..., 1].T.repeat_interleave(g, dim=1)
    xq = q.double() * scale.double().repeat_interleave(32, dim=1)
    return xq @ w_scaled.T + x.double() @ zero.T


I8_SHAPES = [
    ("int4-g32", (960, 576)),
    ("int4-g32", (576, 1536)),
    ("int4-g64", (128, 256)),
    ("int4-g128", (64, 256)),
]


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("scheme,shape", I8_SHAPES)
def test_int8_activation_matmul_is_its_definition_and_within_the_rounding_of_the_activations(
    scheme, shape, x_dtype
):
    """``int4_i8_mm`` against its own definition in fp64 (bound: fp32 sums, 1e-5 of the sum of
    |terms|, plus bf16 output rounding), the VNNI and plain loops bit for bit, and against
    dequantise-then-matmul on the unrounded activations within what rounding them can move: half a
    step, max|x| / 254, per input."""
    packed, layer = quant_layer(scheme, *shape, torch.bfloat16)
    i8 = cpu_ops.int4_pack_i8(layer.qweight, layer.group_size, layer.scales_and_zeros)
    w = dequantised(packed, layer).double()
    for rows in (1, 2, 3, 4, 5, 7, 16, 33):  # every pass size of the VNNI loops
        x = torch.randn(rows, shape[1]).to(x_dtype)
        x[0, :32] *= 50  # an outlier block: its scale is coarse, the others are not
        got = cpu_ops.int4_i8_mm(x, i8, layer.group_size, shape[0])
        assert got.dtype == x_dtype and got.shape == (rows, shape[0])
        assert torch.equal(got, cpu_ops.int4_i8_mm(x, i8, layer.group_size, shape[0], "portable"))
        rounding = 2**-8 * got.double().abs() if x_dtype == torch.bfloat16 else 0
        want = i8_reference(x, packed, layer)
        bound = 1e-5 * (x.double().abs() @ w.abs().T) + rounding
        assert ((got.double() - want).abs() - bound).max().item() <= 0, rows
        _, scale = rounded_activations(x)
        half_step = (scale.double() / 2).repeat_interleave(32, dim=1)
        exact = x.double() @ w.T
        bound = half_step @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T) + rounding
        assert ((got.double() - exact).abs() - bound).max().item() <= 0, rows


def test_int8_activation_ops_refuse_what_they_cannot_read():
    _, layer = quant_layer("int4-g32", 128, 64, torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    i8 = cpu_ops.int4_pack_i8(layer.qweight, 32, layer.scales_and_zeros)
    with pytest.raises(RuntimeError, match="packed must be"):
        cpu_ops.int4_i8_mm(x, i8[:-1], 32, 128)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        cpu_ops.int4_i8_mm(x, i8, 32, 96)
    with pytest.raises(RuntimeError, match="multiple of the group size"):
        cpu_ops.int4_i8_mm(torch.randn(2, 48, dtype=torch.bfloat16), i8, 32, 128)
    with pytest.raises(RuntimeError, match="loops must be"):
        cpu_ops.int4_i8_mm(x, i8, 32, 128, "avx512")
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_ops.int4_pack_i8(layer.qweight, 32, layer.scales_and_zeros.float())
    _, short = quant_layer("int4-g32", 80, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        cpu_ops.int4_pack_i8(short.qweight, 32, short.scales_and_zeros)
    assert short.int8_activations_unusable() is not None


def test_int4_layers_with_int8_activations_take_the_kernel_for_1_row_to_their_widest(monkeypatch):
    """Switched on, an int4 layer runs ``int4_i8_mm`` for 1..multi_row_max() rows and its other
    paths beyond; switched off it is back on its weight-only kernels. Where the library has neither VNNI
    nor AVX2 loops the switch is refused with the reason (the plain loops are slower than ATen's)."""
    _, layer = quant_layer("int4-g32", 128, 64, torch.bfloat16)
    if cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS:
        assert "VNNI" in (layer.int8_activations_unusable() or "")
        with pytest.raises(ValueError, match="VNNI"):
            layer.use_int8_activations()
        return
    calls = []
    real = cpu_ops.int4_i8_mm
    monkeypatch.setattr(cpu_ops, "int4_i8_mm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    plain = layer(x := torch.randn(1, 64, dtype=torch.bfloat16))
    layer.use_int8_activations()
    widest = cpu_ops.multi_row_max()
    for rows in (1, 2, widest, widest + 1):
        layer(torch.randn(rows, 64, dtype=torch.bfloat16))
    with cpu_ops.disabled():
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    assert calls == [1, 2, widest]
    # rounded activations: another result (how close: the op's test above)
    assert torch.equal(layer(x), real(x, layer.i8_packed, 32, 128)) and not torch.equal(layer(x), plain)
    layer.use_int8_activations(False)
    assert layer.i8_packed is None and torch.equal(layer(x), plain)


def test_int8_activation_quantiser_keeps_tiny_and_zero_blocks_finite_and_alike_in_both_loops():
    """A block whose max|x| is so small that 127 / max|x| overflows (or all zeros) rounds to q = 0
    in both loops instead of saturating; the rest of the row is unaffected."""
    packed, layer = quant_layer("int4-g32", 64, 128, torch.bfloat16)
    i8 = cpu_ops.int4_pack_i8(layer.qweight, 32, layer.scales_and_zeros)
    for x_dtype in DTYPES:
        x = torch.randn(2, 128).to(x_dtype)
        x[0, :32] = 1e-38  # 127 / 1e-38 is not a finite float
        x[1, 32:64] = 0.0
        got = cpu_ops.int4_i8_mm(x, i8, 32, 64)
        assert torch.isfinite(got).all()
        assert torch.equal(got, cpu_ops.int4_i8_mm(x, i8, 32, 64, "portable"))
        rest = x.clone()
        rest[0, :32] = 0.0
        # the same up to one rounding: the tiny zero term can tip an exact tie in a later sum
        want = cpu_ops.int4_i8_mm(rest, i8, 32, 64).float()
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-6)


def probe_i8_weights(k: int, scale: float, zero: float) -> torch.Tensor:
    """``int4_i8_mm``'s layout of a [64, K] int4 weight whose output j reads input j mod K alone:
    code 9 there (weight ``scale`` + ``zero``), code 8 (weight ``zero``) elsewhere."""
    codes = torch.full((64, k), 8, dtype=torch.int32)
    codes[torch.arange(64), torch.arange(64) % k] = 9
    qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    pairs = torch.tensor([scale, zero]).expand(k // 32, 64, 2).to(torch.bfloat16).contiguous()
    return cpu_ops.int4_pack_i8(qweight, 32, pairs)


@pytest.mark.parametrize("x_dtype", DTYPES)
def test_int8_activation_quantiser_rounds_and_sums_as_its_definition_bit_for_bit(x_dtype):
    """The activations' int8 codes, their scales and the blocks' fp32 sums, read off exactly
    through weights that pick one input per output, against their definition in fp32: q =
    round(x * (127 / max|x|)) to nearest even, scale = max|x| / 127, the sum in halving order
    (lane i with i + 16, then + 8, + 4, + 2, + 1). The AVX-512, AVX2 and plain quantisers must all
    give these bits: the kernels' results depend on them."""
    torch.manual_seed(7)
    x = (torch.randn(3, 64) * torch.tensor([0.01, 1.0, 300.0])[:, None]).to(x_dtype)
    x[1, 5] = 0.0
    got_q = cpu_ops.int4_i8_mm(x, probe_i8_weights(64, 1.0, 0.0), 32, 64).float()
    q, scale = rounded_activations(x)
    assert torch.equal(got_q, (q * scale.repeat_interleave(32, dim=1)).to(x_dtype).float())
    # one block, scale 0 and zero 1: the output is the block's sum (q * 0 adds nothing)
    block = x[:, :32]
    got_sum = cpu_ops.int4_i8_mm(block.contiguous(), probe_i8_weights(32, 0.0, 1.0), 32, 64)[:, 0].float()
    halves = block.float()
    width = 16
    while width >= 1:
        halves = halves[:, :width] + halves[:, width : 2 * width]
        width //= 2
    assert torch.equal(got_sum, halves[:, 0].to(x_dtype).float())


def test_an_fp32_layer_takes_int8_activations_on_its_scales_rounded_to_bf16():
    """An fp32 model's int4 layer (a CPU without native bf16) rounds its activations to int8 too:
    the kernel reads bf16 (scale, zero) pairs, so a bf16 layer moved to fp32 packs the same copy."""
    from edge_rtgi.llm.quant.kernels import set_int8_activations

    if cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS:
        pytest.skip("no AVX-512 VNNI or AVX2 loops in this build")
    model = torch.nn.Sequential(quant_layer("int4-g32", 128, 64, torch.bfloat16)[1])
    assert set_int8_activations(model, True) == 1 and model[0].i8_packed is not None
    bf16_copy = model[0].i8_packed
    model[0].scales_and_zeros = model[0].scales_and_zeros.float()  # as model.float() leaves it
    assert set_int8_activations(model, False) == 0 and model[0].i8_packed is None
    assert set_int8_activations(model, True) == 1 and torch.equal(model[0].i8_packed, bf16_copy)
    x = torch.randn(2, 64)
    got = model[0](x)
    assert got.dtype == torch.float32
    exact = x.double() @ model[0].dequantized_weight(torch.float32).double().T
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.03  # int8 steps of max|x| / 127


def test_the_int8_activation_switch_makes_copies_once_and_flips_them():
    from edge_rtgi.llm.quant.kernels import Int8ActivationSwitch

    model = torch.nn.Sequential(
        quant_layer("int4-g32", 128, 64, torch.bfloat16)[1],
        quant_layer("int4-g32", 80, 128, torch.bfloat16)[1],
    )
    switch = Int8ActivationSwitch.build(model)
    if cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS:
        assert switch.layers == [] and model[0].i8_packed is None
        return
    assert switch.layers == [model[0]]  # 80 outputs: not a whole 64-row tile
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    rounded = model[0](x)
    switch.set(False)
    assert model[0].i8_packed is None and not torch.equal(model[0](x), rounded)
    switch.set(True)
    assert model[0].i8_packed is switch.packed[0] and torch.equal(model[0](x), rounded)
