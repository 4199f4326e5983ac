"""The fused CPU kernels leave the model's function unchanged: greedy output with them equals
greedy output without them (``cpu_ops.disabled()``), on the plain path and in the engine.

Seeded tiny models (tests/tiny_models.py) in fp32: llama (tied head, llama3 RoPE scaling), qwen2
(q/k/v biases) and mistral (sliding window of 8, so long decodes drop keys). In bf16 the
attention sums round differently, so there the bound is on the logits instead.
"""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.equivalence.test_engine import TEXTS, engine_for, run_staggered
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason=f"fused CPU kernels not built: {cpu_ops.failure()}")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def folder(request, tmp_path_factory):
    return make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=5)


@pytest.fixture
def decode_calls(monkeypatch) -> list[int]:
    """Counts fused decode-attention calls, so a test fails if the kernel path silently never ran."""
    calls: list[int] = []
    real = cpu_ops.decode_attention

    def counted(q, *args):
        calls.append(q.shape[0])
        return real(q, *args)

    monkeypatch.setattr(cpu_ops, "decode_attention", counted)
    return calls


def test_plain_path_greedy_is_unchanged(folder, decode_calls):
    loaded = load_model(folder, device="cpu", dtype="fp32")
    tok = loaded.tokenizer
    params = SamplingParams(max_tokens=24, ignore_eos=True)  # past mistral's window of 8
    for text in TEXTS:
        fused = generate(loaded, tok.encode(text), params)
        with cpu_ops.disabled():
            plain = generate(loaded, tok.encode(text), params)
        assert fused.token_ids == plain.token_ids, text
    assert len(decode_calls) >= len(TEXTS) * 23 * loaded.config.num_layers


def test_engine_with_kernels_matches_plain_path_without(folder, decode_calls):
    loaded = load_model(folder, device="cpu", dtype="fp32")
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(TEXTS))]
    engine = engine_for(loaded, max_num_batched_tokens=64)
    results = run_staggered(engine, prompts, params)  # padded decode batches with masks
    assert max(decode_calls) > 1  # several sequences per kernel call
    with cpu_ops.disabled():
        for prompt, p, got in zip(prompts, params, results, strict=True):
            assert got.token_ids == generate(loaded, prompt, p).token_ids


def test_bf16_logits_stay_close(folder):
    loaded = load_model(folder, device="cpu", dtype="bf16")
    model, cfg = loaded.model, loaded.config
    ids = torch.tensor(loaded.tokenizer.encode(TEXTS[5]))

    def teacher_forced_logits() -> torch.Tensor:
        cache = ContiguousKVCache(cfg, 128, model.dtype, model.device)
        rows = []
        with torch.inference_mode():
            for pos, token in enumerate(ids.tolist()):  # one token per step: the decode kernels run
                cache.begin(1)
                hidden = model(torch.tensor([token]), torch.tensor([pos]), cache)
                cache.commit()
                rows.append(model.compute_logits(hidden))
        return torch.cat(rows)

    fused = teacher_forced_logits()
    with cpu_ops.disabled():
        plain = teacher_forced_logits()
    kl = torch.nn.functional.kl_div(fused.log_softmax(-1), plain.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    assert kl < 1e-3, kl
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.9
