"""Our model, loader and plain generation against HF transformers on tiny seeded random models.

llama: llama3 rope scaling and tied embeddings; qwen2: q/k/v biases and a sharded
checkpoint; mistral: a sliding window (8) much shorter than the prompt plus continuation.
"""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model, write_tiny_gguf

ARCHS = ["llama", "qwen2", "mistral"]
PROMPT = "The quick brown fox asks: what is the capital of France? Numbers like 12 and caf\u00e9."


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(arch, folder, our fp32 LoadedModel, HF model) for one architecture."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    shard = "100KB" if arch == "qwen2" else None
    folder = make_tiny_hf_model(arch, tmp_path_factory.mktemp(arch), seed=1, max_shard_size=shard)
    ours = load_model(folder, device="cpu", dtype="fp32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return arch, folder, ours, hf


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    cache = ContiguousKVCache(loaded.config, len(ids), loaded.model.dtype, loaded.model.device)
    cache.begin(len(ids))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache)
        return loaded.model.compute_logits(hidden)


def test_config_features_are_exercised(pair):
    arch, folder, ours, _ = pair
    cfg = ours.config
    if arch == "llama":
        assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "llama3"
    if arch == "qwen2":
        assert cfg.attention_bias and (folder / "model.safetensors.index.json").is_file()
    if arch == "mistral":
        assert cfg.sliding_window == 8
        assert len(ours.tokenizer.encode(PROMPT)) > 3 * cfg.sliding_window


def test_logits_match_hf_fp32(pair):
    _, _, ours, hf = pair
    ids = ours.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = our_logits(ours, ids)
    assert torch.allclose(got[-1], ref[-1], atol=1e-4, rtol=0), (got[-1] - ref[-1]).abs().max()
    assert (got - ref).abs().max() < 1e-4  # every position, so the sliding-window mask is checked too


def test_greedy_continuation_matches_hf(pair):
    _, _, ours, hf = pair
    ids = ours.tokenizer.encode(PROMPT)
    result = generate(ours, ids, SamplingParams(max_tokens=32))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
    assert result.token_ids == ref
    assert len(ref) >= 8  # a continuation that ended at once would check little


def test_tokenizer_and_chat_template_match_hf(pair):
    from transformers import AutoTokenizer

    _, folder, ours, _ = pair
    hf_tok = AutoTokenizer.from_pretrained(folder)
    for text in (PROMPT, "  two spaces\nnewline \U0001f600", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Capital of France?"},
    ]
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(messages) == rendered
    hf_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ours.tokenizer.encode_chat(messages) == list(hf_ids)


def test_bf16_smoke(pair):
    _, folder, ours, _ = pair
    bf16 = load_model(folder, device="cpu", dtype="bf16")
    assert bf16.model.dtype == torch.bfloat16
    ids = ours.tokenizer.encode(PROMPT)
    ref, got = our_logits(ours, ids)[-1], our_logits(bf16, ids)[-1]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.corrcoef(torch.stack([ref, got]))[0, 1] > 0.99
    assert len(generate(bf16, ids, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids) == 8


def test_gguf_f32_conversion_is_exact(pair, tmp_path):
    arch, folder, ours, _ = pair
    gguf = load_model(write_tiny_gguf(folder, tmp_path / f"{arch}.gguf", "F32"), device="cpu", dtype="fp32")
    ids = ours.tokenizer.encode(PROMPT)
    assert gguf.tokenizer.encode(PROMPT) == ids
    assert gguf.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    ) == ours.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (our_logits(gguf, ids) - our_logits(ours, ids)).abs().max() < 1e-5


def test_gguf_q8_0_weights_within_quantisation_error(pair, tmp_path):
    arch, folder, ours, _ = pair
    gguf = load_model(
        write_tiny_gguf(folder, tmp_path / f"{arch}-q8.gguf", "Q8_0"), device="cpu", dtype="fp32"
    )
    for name, ref in ours.model.state_dict().items():
        got = gguf.model.state_dict()[name]
        if ref.dim() == 2:  # Q8_0: blocks of 32 with one scale, error at most half a step
            step = ref.abs().reshape(ref.shape[0], -1, 32).amax(-1) / 127
            err = (got - ref).abs().reshape(ref.shape[0], -1, 32)
            assert (err <= step[..., None] * 0.5 + 1e-3).all(), name
        else:
            assert torch.equal(got, ref), name
