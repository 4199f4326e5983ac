"""Paged KV storage and the paged attention backend against dense reference attention."""

from __future__ import annotations

import torch

import edge_rtgi.llm.runner as runner_module
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage, PagedKVStorage
from edge_rtgi.llm.model import ModelConfig, Transformer, causal_window_mask, sdpa
from edge_rtgi.llm.rope import apply_rope
from edge_rtgi.llm.runner import ModelRunner
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.scheduler import ScheduledRequest, SchedulerOutput


def test_write_then_gather_roundtrip_and_int8_error_is_small():
    torch.manual_seed(0)
    for cls, tol in ((PagedKVStorage, 0.0), (Int8PagedKVStorage, 0.02)):
        st = cls(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
        k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
        slots = torch.tensor([3, 9, 0, 15, 4])
        st.write(1, slots, k, v)
        gk, gv = st.gather(1, slots)
        assert gk.shape == (5, 2, 8)
        assert (gk - k).abs().max() <= tol * k.abs().max() + 1e-7
        assert (gv - v).abs().max() <= tol * v.abs().max() + 1e-7
        pk, _ = st.gather(1, slots.view(1, 5))  # batched gather keeps the index shape
        assert pk.shape == (1, 5, 2, 8)
        assert st.gather(0, slots)[0].abs().max() == 0  # other layers untouched


def test_mixed_batch_attention_matches_dense_reference():
    """Two decodes of different lengths and a mid-sequence chunk, with a window and a released block."""
    torch.manual_seed(1)
    cfg = ModelConfig(
        arch="mistral",
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        sliding_window=6,
    )
    model = Transformer(cfg).double().eval()
    bs = 4
    storage = PagedKVStorage(1, 16, bs, 2, 8, torch.float64)
    runner = ModelRunner(model, storage)
    seqs = {"a": list(range(1, 12)), "b": list(range(20, 26)), "c": list(range(30, 44))}
    tables = {"a": [5, 1, 7], "b": [2, 3], "c": [-1, 8, 9, 10]}  # c's block 0 is outside the window
    # Fill the cache for the already-computed prefixes by running each one as a chunk.
    computed = {"a": 10, "b": 5, "c": 9}
    prefill = [
        ScheduledRequest(r, seqs[r][: computed[r]], 0, [[11 if b < 0 else b for b in tables[r]]], False)
        for r in seqs
    ]
    runner.execute(SchedulerOutput(prefill, 0), {})
    step = SchedulerOutput(
        [
            ScheduledRequest("a", seqs["a"][10:11], 10, [tables["a"]], True),
            ScheduledRequest("c", seqs["c"][9:14], 9, [tables["c"]], True),
            ScheduledRequest("b", seqs["b"][5:6], 5, [tables["b"]], True),
        ],
        7,
    )
    captured = {}

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def attend(self, layer, q, k, v):
            out = self.inner.attend(layer, q, k, v)
            captured["q"], captured["out"] = q, out
            return out

    real = runner_module.PagedAttentionBackend
    runner_module.PagedAttentionBackend = lambda st, md, layer_map: Spy(real(st, md, layer_map))
    try:
        runner.execute(step, {r: SamplingParams() for r in seqs})
    finally:
        runner_module.PagedAttentionBackend = real
    # Dense reference: recompute each sequence's keys from scratch and attend with the window mask.
    q_order = [("a", 10, 11), ("b", 5, 6), ("c", 9, 14)]  # decodes first, then the chunk
    row = 0
    for rid, start, end in q_order:
        ids = torch.tensor(seqs[rid][:end])
        pos = torch.arange(end)
        x = model.embed_tokens(ids)
        cos, sin = model.rotary(pos, x.dtype)
        attn = model.layers[0].self_attn
        h = model.layers[0].input_layernorm(x)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = apply_rope(q.view(end, 4, 8), cos, sin)[start:end]
        k = apply_rope(k.view(end, 2, 8), cos, sin)
        want = sdpa(q, k, v.view(end, 2, 8), causal_window_mask(pos[start:end], pos, cfg.sliding_window))
        got = captured["out"][row : row + end - start]
        assert torch.allclose(got, want, atol=1e-10), rid
        row += end - start
