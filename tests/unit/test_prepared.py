"""Prepared weights (llm.prepared): the same model as a fresh load, and never used when stale."""

from __future__ import annotations

import json

import pytest
import torch

from edge_rtgi.llm import prepared, quant
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.prepared import load_prepared
from edge_rtgi.llm.quant import policy
from edge_rtgi.llm.quant.kernels import QuantLinear
from tests.tiny_models import make_tiny_hf_model, write_tiny_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    return write_tiny_gguf(make_tiny_hf_model("llama", root, seed=7), root / "tiny.gguf", "Q4_1")


def logits(loaded) -> torch.Tensor:
    ids = loaded.tokenizer.encode("The quick brown fox asks: what is the capital of France?")
    cache = ContiguousKVCache(loaded.config, len(ids), loaded.model.dtype, loaded.model.device)
    cache.begin(len(ids))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache))


def layer_types(model) -> list[str]:
    return [type(m).__name__ for m in model.modules()]


def test_prepared_copy_is_the_model_a_fresh_load_builds(gguf, tmp_path):
    first = load_prepared(gguf, "cpu", "bf16", "auto", cache_dir=tmp_path)
    second = load_prepared(gguf, "cpu", "bf16", "auto", cache_dir=tmp_path)
    assert not first.hit and second.hit and first.cache_path == second.cache_path
    assert second.quant == first.quant and layer_types(second.loaded.model) == layer_types(first.loaded.model)
    assert torch.equal(logits(first.loaded), logits(second.loaded))
    text = "caf\u00e9 <|im_start|>user"
    assert second.loaded.tokenizer.encode(text) == first.loaded.tokenizer.encode(text)
    assert second.loaded.tokenizer.eos_token_ids == first.loaded.tokenizer.eos_token_ids
    assert second.loaded.config == first.loaded.config
    weights = second.cache_path / "weights.bin"
    # the weights are views of the mapped file, not copies
    assert any(
        t.untyped_storage().nbytes() == weights.stat().st_size
        for t in second.loaded.model.state_dict().values()
    )


def test_full_precision_and_tied_head_round_trip(gguf, tmp_path):
    fresh = load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path)
    again = load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path)
    assert again.hit and again.quant is None
    model = again.loaded.model
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    assert torch.equal(logits(fresh.loaded), logits(again.loaded))


def test_a_changed_source_is_rebuilt(tmp_path):
    path = write_tiny_gguf(make_tiny_hf_model("llama", tmp_path / "a", seed=1), tmp_path / "m.gguf")
    old = load_prepared(path, "cpu", "fp32", "none", cache_dir=tmp_path)
    write_tiny_gguf(make_tiny_hf_model("llama", tmp_path / "b", seed=2), path)  # same path, new weights
    new = load_prepared(path, "cpu", "fp32", "none", cache_dir=tmp_path)
    assert not new.hit and new.cache_path != old.cache_path
    fresh = load_prepared(path, "cpu", "fp32", "none", cache_dir=tmp_path / "elsewhere")
    assert torch.equal(logits(new.loaded), logits(fresh.loaded))
    assert not torch.equal(logits(new.loaded), logits(old.loaded))


def test_another_code_version_is_never_used(gguf, tmp_path, monkeypatch):
    built = load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path)
    monkeypatch.setattr(prepared.keys, "code_version", lambda: "0123456789abcdef")
    other = load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path)
    assert not other.hit and other.cache_path != built.cache_path


def test_a_copy_made_under_another_kernel_row_limit_is_never_used(gguf, tmp_path, monkeypatch):
    # quant "auto"'s row limit (dense copies above it) depends on the CPU's kernels (AMX or
    # not) and the layers store it, so a copy made where it differed must be rebuilt here
    def limits(model) -> set[int]:
        return {m.max_kernel_rows for m in model.modules() if isinstance(m, QuantLinear)}

    built = load_prepared(gguf, "cpu", "bf16", "auto", cache_dir=tmp_path)
    here = policy.auto_quant_kernel_max_rows()
    assert limits(built.loaded.model) == {here}
    other = 8 if here != 8 else 16
    for module in (policy, quant):  # quant imported the function by name
        monkeypatch.setattr(module, "auto_quant_kernel_max_rows", lambda: other)
    moved = load_prepared(gguf, "cpu", "bf16", "auto", cache_dir=tmp_path)
    assert not moved.hit and moved.cache_path != built.cache_path
    assert limits(moved.loaded.model) == {other}
    assert load_prepared(gguf, "cpu", "bf16", "auto", cache_dir=tmp_path).hit


@pytest.mark.parametrize(
    "build,i8_loops,widest,cpu_amx,rows",
    [
        ("avx512-bf16-amx", "avx512-vnni", 32, True, 32),  # AMX tiles beat the dense copy to 32 rows
        ("avx512-bf16", "avx512-vnni", 32, False, 32),  # neither has AMX: the AVX-512 loops beat it to 32 too
        ("avx512-bf16", "avx512-vnni", 32, True, 8),  # the dense copy has AMX (oneDNN), the kernels do not
        ("portable", "avx2", 32, False, 32),  # AVX2: int8 activations beat the dense fp32 copy to 32 rows
        ("avx512", "avx2", 16, False, 16),  # AVX-512 without VNNI: AVX2's loops, kernels to 16 rows
        ("portable", "portable", 16, False, 8),
        (None, None, 0, False, 8),  # no kernels
    ],
)
def test_the_auto_row_limit_follows_the_kernels_and_the_cpu(
    monkeypatch, build, i8_loops, widest, cpu_amx, rows
):
    from edge_rtgi import device
    from edge_rtgi.llm import cpu_ops

    monkeypatch.setattr(cpu_ops, "build_info", lambda: build)
    monkeypatch.setattr(cpu_ops, "int8_activation_loops", lambda: i8_loops)
    monkeypatch.setattr(cpu_ops, "multi_row_max", lambda: widest)
    monkeypatch.setattr(device, "cpu_has_amx", lambda: cpu_amx)
    assert policy.auto_quant_kernel_max_rows() == rows


def test_a_copy_recorded_under_another_key_or_damaged_is_rebuilt(gguf, tmp_path, caplog):
    built = load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path)
    meta_file = built.cache_path / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "source_sha256": "0" * 64}))
    again = load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path)
    assert not again.hit and "do not match (source_sha256)" in caplog.text
    assert json.loads(meta_file.read_text())["source_sha256"] == meta["source_sha256"]  # rewritten
    weights = built.cache_path / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert not load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path).hit
    assert load_prepared(gguf, "cpu", "fp32", "none", cache_dir=tmp_path).hit
