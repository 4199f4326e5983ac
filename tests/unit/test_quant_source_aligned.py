"""``quant: auto`` keeps 4-bit source blocks (GGUF Q4_1) in the kernel scheme that reproduces them.

Claims checked on a seeded tiny model written as a Q4_1 GGUF:
- the loader records each parameter's storage format in the file;
- ``auto`` on a bf16 CPU puts the Q4_1 layer weights on int4-g32 and everything else on int8;
- int4-g32 re-encodes the Q4_1 blocks: against the file's own (fp32-dequantised) weights its
  relative error is at most 1 % (bf16 rounding of the block scale and minimum, and of the
  weights the model is loaded as), where a fresh int4-g64 quantisation of the same weights is
  off by several percent; and the next-token distributions stay within KL 1e-3 of the fp32 model.
- a safetensors model (no 4-bit blocks in the file) gets int8 everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edge_rtgi.device import cpu_has_bf16
from edge_rtgi.llm.quant import apply_engine_quant, model_groups, source_aligned_plan
from edge_rtgi.llm.quant.kernels import QuantLinear
from edge_rtgi.llm.quant.policy import int8_activations_fast
from edge_rtgi.llm.quant.schemes import parse_scheme, quantize_weight
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model, write_tiny_gguf

needs_bf16 = pytest.mark.skipif(
    not (cpu_has_bf16() or int8_activations_fast()),
    reason="auto quantises only on a CPU with native bf16 or the kernels' int8-activation loops",
)


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    root = tmp_path_factory.mktemp("aligned")
    folder = make_tiny_hf_model(
        "llama",
        root,
        seed=11,
        init_std=0.05,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    return folder, write_tiny_gguf(folder, root / "tiny-q4_1.gguf", qtype="Q4_1")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_loader_records_source_formats(tiny_q4_1):
    folder, gguf = tiny_q4_1
    formats = load_model(gguf, device="cpu", dtype="fp32").model.source_weight_formats
    assert formats["layers.0.self_attn.qkv_proj.weight"] == "Q4_1"
    assert formats["layers.1.mlp.down_proj.weight"] == "Q4_1"
    assert formats["norm.weight"] == "F32"
    hf_formats = load_model(folder, device="cpu", dtype="fp32").model.source_weight_formats
    assert set(hf_formats.values()) == {"F32"}


@needs_bf16
def test_auto_keeps_q4_1_blocks_in_int4_g32(tiny_q4_1):
    _, gguf = tiny_q4_1
    source = load_model(gguf, device="cpu", dtype="fp32").model  # the file's weights, exactly
    model = load_model(gguf, device="cpu", dtype="bf16").model
    plan = source_aligned_plan(model, "int8")
    applied = apply_engine_quant(model, "auto")
    assert applied.startswith("int4-g32 x")  # 2 layers x 4 groups, and the tied head if its shape allows
    for group in model_groups(model):
        if not group.name.startswith("layers."):  # the tied head is Q4_1 here too, if its shape allows
            aligned = group.allowed(parse_scheme("int4-g32"))
            assert plan.scheme_for(group.name).name == ("int4-g32" if aligned else "int8")
            continue
        assert plan.scheme_for(group.name).name == "int4-g32"
        module = model.get_submodule(group.module_path)
        assert isinstance(module, QuantLinear)
        original = source.get_submodule(group.module_path).weight
        aligned_error = _rel(module.dequantized_weight(torch.float32), original)
        fresh_error = _rel(quantize_weight(original, parse_scheme("int4-g64")).dequantize(), original)
        assert aligned_error <= 0.01, (group.name, aligned_error)
        assert fresh_error >= 10 * aligned_error, (group.name, aligned_error, fresh_error)


@needs_bf16
def test_auto_on_q4_1_stays_close_to_the_fp32_model(tiny_q4_1):
    _, gguf = tiny_q4_1
    full = load_model(gguf, device="cpu", dtype="fp32").model
    model = load_model(gguf, device="cpu", dtype="bf16").model
    apply_engine_quant(model, "auto")
    ids = torch.randint(3, full.config.vocab_size, (48,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        from edge_rtgi.llm.quant.report import window_logits

        log_p = F.log_softmax(window_logits(full, ids).float(), -1)
        log_q = F.log_softmax(window_logits(model, ids).float(), -1)
    kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    assert kl < 1e-3, kl


@needs_bf16
def test_auto_without_4bit_source_blocks_is_int8(tiny_q4_1):
    folder, _ = tiny_q4_1
    model = load_model(folder, device="cpu", dtype="bf16").model
    applied = apply_engine_quant(model, "auto")
    assert applied.startswith("int8 x") and "int4" not in applied
