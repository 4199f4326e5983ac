"""Attention sinks plus a sliding window (``kv_window``) against a dense reference, past the context.

The reference keeps every key in one contiguous tensor (rotated at its absolute position, like
the model writes it) and, per forward pass, lets each query see the sinks and its window; the
sinks are re-rotated to sit right before the window of the pass's first query. The engine must
compute the same function with paged blocks, released blocks, padded or per-sequence decodes.
Tiny seeded models in float64, so that different kernels cannot flip near-ties.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from edge_rtgi.config import ConfigError, from_dict
from edge_rtgi.llm.engine import GenerationResult, LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.kv.window import KVWindow, sink_shift
from edge_rtgi.llm.model import Transformer, causal_window_mask
from edge_rtgi.llm.rope import apply_rope
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model

CHUNK = 16  # max_num_batched_tokens: the engine prefills one request in chunks of this size


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request, tmp_path_factory):
    folder = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=5)
    return load_model(folder, device="cpu", dtype="fp64")


class StreamingReference:
    """Dense attention with sinks and a window: the definition the paged engine must match."""

    def __init__(self, model: Transformer, window: KVWindow, max_len: int):
        cfg = model.config
        self.model, self.window = model, window
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype)
        self.v = torch.zeros(shape, dtype=model.dtype)
        self.length = 0
        self.num_new = 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        start, end = self.length, self.length + q.shape[0]
        self.k[layer, start:end], self.v[layer, start:end] = k, v
        keys, values = self.k[layer, :end].clone(), self.v[layer, :end]
        s = self.window.sink_tokens
        shift = sink_shift(start, self.window.window_tokens, s)
        if shift:
            cos, sin = self.model.rotary.shift(torch.tensor([shift]), keys.dtype)
            keys[:s] = apply_rope(keys[:s], cos, sin)
        mask = causal_window_mask(torch.arange(start, end), torch.arange(end), self.window.window_tokens, s)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> int:
        positions = torch.arange(self.length, self.length + len(ids))
        hidden = self.model(torch.tensor(ids), positions, self)
        self.length += len(ids)
        return int(self.model.compute_logits(hidden[-1:])[0].argmax())


def reference_tokens(loaded, window: KVWindow, prompt: list[int], max_tokens: int) -> list[int]:
    ref = StreamingReference(loaded.model, window, len(prompt) + max_tokens)
    for i in range(0, len(prompt), CHUNK):
        token = ref.forward(prompt[i : i + CHUNK])
    out = [token]
    while len(out) < max_tokens:
        out.append(ref.forward([out[-1]]))
    return out


def run_engine(loaded, prompts: list[list[int]], max_tokens: int, **overrides) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt, run together, and the most blocks any request held at once."""
    cfg = EngineConfig(
        **{"block_size": 4, "num_kv_blocks": 512, "max_num_batched_tokens": CHUNK, **overrides}
    )
    engine = LLMEngine.from_loaded(loaded, cfg, start=False)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results = [GenerationResult() for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, params, results[i].add, request_id=f"r{i}")
    most_held = 0
    while not all(r.finish_reason for r in results):
        engine.step()
        most_held = max([most_held, *(sum(engine.kv.num_held_blocks(f"r{i}")) for i in range(len(prompts)))])
    assert engine.stats().kv_blocks_used == 0
    return [r.token_ids for r in results], most_held


def prompts_of(loaded) -> list[list[int]]:
    tok = loaded.tokenizer
    base = tok.encode("A small model on a small device answers questions about the weather and the news. ")
    return [(base * 3)[:40], tok.encode("Hello! What is the capital of France?")]


@pytest.mark.parametrize("decode_mode", ["padded", "per_seq"])
def test_sinks_and_window_run_past_the_context_window(loaded, decode_mode):
    window = KVWindow(sink_tokens=4, window_tokens=24)
    max_tokens = 300  # prompt + 300 > the tiny model's 256 positions
    assert 40 + max_tokens > loaded.model.config.max_position_embeddings
    prompts = prompts_of(loaded)
    got, most_held = run_engine(loaded, prompts, max_tokens, kv_window=window, decode_mode=decode_mode)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_tokens(loaded, window, prompt, max_tokens)
    # bounded: the sink block, the window and one step's tokens (blocks of 4), not 340 tokens' worth
    assert most_held <= 1 + (24 + CHUNK - 1) // 4 + 1


def test_a_window_longer_than_the_sequence_changes_nothing(loaded):
    prompts = prompts_of(loaded)
    plain, _ = run_engine(loaded, prompts, 40)
    windowed, _ = run_engine(loaded, prompts, 40, kv_window=KVWindow(sink_tokens=4, window_tokens=100))
    assert windowed == plain


def test_without_sinks_the_window_alone_is_computed_too(loaded):
    window = KVWindow(sink_tokens=0, window_tokens=20)
    prompt = prompts_of(loaded)[0]
    got, most_held = run_engine(loaded, [prompt], 60, kv_window=window)
    assert got[0] == reference_tokens(loaded, window, prompt, 60)
    assert most_held <= (20 + CHUNK - 1) // 4 + 1


def test_kv_window_config_errors_name_the_key_and_range(loaded):
    with pytest.raises(ConfigError, match=r"kv_window\.window_tokens must be > kv_window\.sink_tokens"):
        from_dict(EngineConfig, {"kv_window": {"sink_tokens": 8, "window_tokens": 8}})
    with pytest.raises(ConfigError, match=r"kv_window\.sink_tokens must be >= 0"):
        from_dict(EngineConfig, {"kv_window": {"sink_tokens": -1, "window_tokens": 8}})
    with pytest.raises(ConfigError, match="kv_window needs enable_chunked_prefill"):
        from_dict(EngineConfig, {"kv_window": {"window_tokens": 64}, "enable_chunked_prefill": False})
    cfg = EngineConfig(kv_window=KVWindow(4, 250), max_num_batched_tokens=16, num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"allowed window_tokens: 5\.\.237"):
        LLMEngine.from_loaded(loaded, cfg, start=False)
