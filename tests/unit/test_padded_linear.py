"""``cpu_ops.linear`` pads bf16/fp16 CPU matmuls to a bounded set of row counts (issue #18).

oneDNN JIT-compiles and caches a kernel per distinct row count, so prefill chunks of every length
grew a long-running daemon's memory. These tests pin the bucketing, check that padding leaves the
result unchanged (to bf16 rounding: oneDNN may block the inner sum differently for another row
count), that the model's layers really see only the padded counts, and that greedy output of a
seeded tiny bf16 model is the same with and without padding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.model import Linear
from edge_rtgi.llm.quant import apply_engine_quant
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model


def test_padded_rows_buckets():
    assert [cpu_ops.padded_rows(r) for r in (1, 2, 15, 16)] == [1, 2, 15, 16]
    rows = (17, 31, 32, 33, 255, 256, 257)
    assert [cpu_ops.padded_rows(r) for r in rows] == [32, 32, 32, 48, 256, 256, 272]
    for rows in range(1, 5000):
        padded = cpu_ops.padded_rows(rows)
        assert padded >= rows
        assert padded - rows <= max(15, rows * 0.032), rows
        assert cpu_ops.padded_rows(padded) == padded  # a bucket maps to itself
    # A prefill budget of 256 tokens per step sees at most 16 + 15 distinct row counts.
    assert len({cpu_ops.padded_rows(r) for r in range(1, 257)}) == 31


@pytest.mark.parametrize("rows", [17, 33, 100, 255, 1025])
@pytest.mark.parametrize("bias", [False, True])
def test_padded_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    w = torch.randn(80, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(80, generator=gen).to(torch.bfloat16) if bias else None
    got = cpu_ops.linear(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    # 3-D inputs are flattened, padded and given their shape back
    even = rows - rows % 2
    got3 = cpu_ops.linear(x[:even].view(2, -1, 96), w, b)
    torch.testing.assert_close(got3.float(), want[:even].view(2, -1, 80).float(), rtol=1e-2, atol=1e-2)


def test_fp32_is_not_padded(monkeypatch):
    # MKL's fp32 GEMM keeps no per-shape state, so fp32 runs as it comes, bit for bit.
    seen: list[int] = []
    real = F.linear
    monkeypatch.setattr(cpu_ops.F, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or real(x, w, b))
    x, w = torch.randn(37, 8), torch.randn(4, 8)
    assert torch.equal(cpu_ops.linear(x, w), real(x, w))
    assert seen == [37]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"), seed=7)


@pytest.mark.parametrize("quant", ["none", "auto"])  # auto: quantised, with dense copies for many rows
def test_model_linears_see_only_padded_row_counts(folder, quant, monkeypatch):
    loaded = load_model(folder, device="cpu", dtype="bf16")
    apply_engine_quant(loaded.model, quant)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, Linear) == (quant == "none")
    seen: set[int] = set()
    real = F.linear
    monkeypatch.setattr(cpu_ops.F, "linear", lambda x, w, b=None: seen.add(x.shape[0]) or real(x, w, b))
    tok = loaded.tokenizer
    ids = tok.encode(" ".join(["hello world"] * 100))
    for tokens in range(3, 200, 7):
        generate(loaded, ids[:tokens], SamplingParams(max_tokens=2))
    assert seen, "no matmul went through cpu_ops.linear"
    assert all(rows <= 16 or rows % 16 == 0 for rows in seen), sorted(seen)


def test_bf16_greedy_is_unchanged_by_padding(folder, monkeypatch):
    loaded = load_model(folder, device="cpu", dtype="bf16")
    tok = loaded.tokenizer
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids = tok.encode(" ".join(["the quick brown fox"] * 40))
    prompts = [ids[:n] for n in (5, 17, 33, 90, 200)]
    padded = [generate(loaded, p, params).token_ids for p in prompts]
    monkeypatch.setattr(cpu_ops, "padded_rows", lambda rows: rows)
    plain = [generate(loaded, p, params).token_ids for p in prompts]
    assert padded == plain
