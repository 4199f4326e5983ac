"""Quantised models against the full model: tiny seeded models of each architecture, plus SmolLM2.

KL bounds are mean KL(full || quantised) of next-token distributions, nats per token.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from edge_rtgi.errors import ConfigError, ModelFileError
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.quant import apply_quant, load_quantized_checkpoint, save_quantized_checkpoint
from edge_rtgi.llm.quant.checkpoint import read_checkpoint_plan
from edge_rtgi.llm.quant.kernels import Int4Linear, Int8Linear, TiedQuantEmbedding
from edge_rtgi.llm.quant.plan import QuantPlan, apply_quant_plan, model_groups
from edge_rtgi.llm.quant.profile import calibration_text, collect_importance, profile_sensitivity
from edge_rtgi.llm.quant.report import (
    compare_quality,
    greedy_continuation,
    greedy_continuations,
    window_logits,
)
from edge_rtgi.llm.weights import load_model
from edge_rtgi.scoring.retention import retention_interval
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_hf_model(request.param, tmp_path_factory.mktemp("q"), seed=5)
    return load_model(folder, device="cpu", dtype="fp32")


def _ids(loaded, n=96):
    return torch.tensor(loaded.tokenizer.encode(calibration_text())[:n])


def _mean_kl(full, quant, ids):
    logp = F.log_softmax(window_logits(full, ids).double(), -1)
    logq = F.log_softmax(window_logits(quant, ids).double(), -1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def test_int8_everything_stays_close_to_full(tiny):
    quant = copy.deepcopy(tiny.model)
    apply_quant(quant, "int8")
    assert isinstance(quant.lm_head, Int8Linear)
    if tiny.config.tie_word_embeddings:
        assert isinstance(quant.embed_tokens, TiedQuantEmbedding)
    ids = _ids(tiny)
    kl8 = _mean_kl(tiny.model, quant, ids)
    quant4 = copy.deepcopy(tiny.model)
    apply_quant(quant4, "int4sym-g64")
    kl4 = _mean_kl(tiny.model, quant4, ids)
    # Tiny random models (init std 0.25) are far peakier than trained ones: int4 costs 0.3-0.9 nats here.
    assert kl8 < 0.02
    assert kl4 > 10 * kl8  # the 4-bit model is measurably further away: the metric sees bits


def test_bf16_activation_path_runs_and_stays_close(tiny):
    quant = copy.deepcopy(tiny.model)
    apply_quant_plan(quant, QuantPlan(default="int8"), dtype=torch.bfloat16)
    assert quant.dtype == torch.bfloat16 and quant.lm_head.scales.dtype == torch.bfloat16
    assert _mean_kl(tiny.model, quant, _ids(tiny)) < 0.05


def test_checkpoint_round_trip_is_bit_exact(tiny, tmp_path):
    groups = model_groups(tiny.model)
    plan = QuantPlan(
        {
            g.name: s
            for g, s in zip(groups, ["int8", "int4-g32", "int4sym-g64", "int4-g64"] * 99, strict=False)
        },
        "none",
    )
    path = tmp_path / "m.q.safetensors"
    resolved = save_quantized_checkpoint(tiny.model, plan, path)
    direct = copy.deepcopy(tiny.model)
    assert apply_quant_plan(direct, plan) == resolved
    loaded = copy.deepcopy(tiny.model)
    assert load_quantized_checkpoint(path, loaded) == resolved
    direct_buffers = dict(direct.named_buffers())
    for name, buf in loaded.named_buffers():
        assert torch.equal(buf, direct_buffers[name]), name
    ids = _ids(tiny)
    assert torch.equal(window_logits(loaded, ids), window_logits(direct, ids))
    assert any(isinstance(m, Int4Linear) for m in loaded.modules())


def test_checkpoint_for_another_model_is_refused_with_the_names(tiny, tmp_path):
    path = tmp_path / "m.q.safetensors"
    save_quantized_checkpoint(tiny.model, QuantPlan(default="int8"), path)
    other = load_model(
        make_tiny_hf_model("llama", tmp_path, seed=1, num_hidden_layers=3, intermediate_size=192),
        device="cpu",
        dtype="fp32",
    )
    with pytest.raises(ModelFileError, match=r"does not match.*num_layers: checkpoint 2 vs model 3") as err:
        load_quantized_checkpoint(path, other.model)
    assert "intermediate_size" in str(err.value)
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelFileError, match="cannot read quantised checkpoint"):
        load_quantized_checkpoint(tmp_path / "junk.safetensors", other.model)


def test_applying_a_plan_twice_is_refused(tiny):
    quant = copy.deepcopy(tiny.model)
    apply_quant(quant, "int8")
    with pytest.raises(ConfigError, match="already quantised"):
        apply_quant(quant, "int8")


def test_cpu_without_bf16_runs_on_the_fp32_path_with_a_warning(tiny, monkeypatch, caplog):
    """Without native bf16 the quantised layers take fp32 activations: a warning that they are slow,
    unless the fused kernels' int8-activation loops (AVX2, AVX-512 VNNI) take them."""
    monkeypatch.setattr("edge_rtgi.device.cpu_has_bf16", lambda: False)
    monkeypatch.setattr("edge_rtgi.llm.quant.plan.cpu_has_bf16", lambda: False)
    from edge_rtgi.device import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr("edge_rtgi.llm.quant.policy.int8_activations_fast", lambda: False)
    quant = copy.deepcopy(tiny.model)
    with caplog.at_level(logging.WARNING):
        apply_quant(quant, "int4-g32")
    assert "no native bf16" in caplog.text and "fp32 path" in caplog.text
    assert quant.lm_head.scales_and_zeros.dtype == torch.float32
    assert torch.isfinite(window_logits(quant, _ids(tiny))).all()
    caplog.clear()
    monkeypatch.setattr("edge_rtgi.llm.quant.policy.int8_activations_fast", lambda: True)
    with caplog.at_level(logging.WARNING):
        apply_quant(copy.deepcopy(tiny.model), "int4-g32")
    assert "no native bf16" not in caplog.text


def test_profile_table_covers_every_group_and_int8_is_least_sensitive(tiny):
    schemes = ("int8", "int4-g32", "int4sym-g64")
    table = profile_sensitivity(
        tiny.model, tiny.tokenizer, schemes, window_tokens=48, max_windows=2, progress=False
    )
    groups = model_groups(tiny.model)
    assert set(table.kl) == {g.name for g in groups}
    for name, row in table.kl.items():
        assert set(row) == set(schemes), name
        assert all(v >= -1e-9 for v in row.values())
    mean = {s: sum(r[s] for r in table.kl.values()) / len(groups) for s in schemes}
    assert mean["int8"] < mean["int4-g32"] and mean["int8"] < mean["int4sym-g64"]
    assert table.info["calibration"]["tokens"] == 96
    # the model is left as it was
    assert all(isinstance(tiny.model.get_submodule(g.module_path), torch.nn.Linear) for g in groups)


@pytest.mark.slow
def test_smollm2_int8_everything_is_close_and_int4_g64_is_not_free():
    loaded = load_model("smollm2-135m-instruct", device="cpu", dtype="fp32")
    ids = torch.tensor(loaded.tokenizer.encode(calibration_text("heldout"))[:128])
    quant = copy.deepcopy(loaded.model)
    apply_quant_plan(quant, QuantPlan(default="int8"), dtype=torch.bfloat16)
    kl8 = _mean_kl(loaded.model, quant, ids)
    del quant
    quant4 = copy.deepcopy(loaded.model)
    apply_quant_plan(quant4, QuantPlan(default="int4sym-g64"), dtype=torch.bfloat16)
    kl4 = _mean_kl(loaded.model, quant4, ids)
    assert kl8 < 0.02
    assert kl4 > 2 * kl8


def test_batched_greedy_continuations_equal_one_by_one(tiny):
    """The report decodes its evaluation prompts as one batch; each row must be the batch-1 result."""
    ids = _ids(tiny, 120)
    prompts = torch.stack([ids[i * 20 : i * 20 + 16] for i in range(5)])
    quant = copy.deepcopy(tiny.model)
    apply_quant_plan(quant, QuantPlan(default="int8"))
    for model in (tiny.model, quant):
        batched = greedy_continuations(model, prompts, 12)
        assert batched == [greedy_continuation(model, p, 12) for p in prompts]


def test_compare_quality_of_the_full_model_against_itself_is_perfect(tiny):
    text = calibration_text("heldout")
    result = compare_quality(
        tiny.model,
        tiny.model,
        tiny.tokenizer,
        text,
        window_tokens=64,
        prompt_tokens=16,
        new_tokens=8,
        max_prompts=6,
        resamples=200,
    )
    assert result.mean_kl == pytest.approx(0.0, abs=1e-9) and result.next_token_agreement == 1.0
    assert result.quality_retention == result.retention_low == result.retention_high == 1.0
    assert (
        result.token_accuracy_full == result.token_accuracy_quant and result.token_accuracy_retention == 1.0
    )
    assert result.prompts == 6 and sum(result.window_tokens) == result.tokens
    assert result.kl_low <= result.mean_kl <= result.kl_high + 1e-12


def test_overlapping_evaluation_prompts_are_resampled_in_blocks(tiny, monkeypatch):
    """More prompts than the text holds side by side: they overlap, and the interval resamples runs of
    prompts spanning two prompts plus continuations; prompts side by side are resampled one by one."""
    import edge_rtgi.llm.quant.report as report

    blocks_used = []

    def spy(*args, **kwargs):
        blocks_used.append(kwargs.get("block_prompts", 1))
        return retention_interval(*args, **kwargs)

    monkeypatch.setattr(report, "retention_interval", spy)
    quant = copy.deepcopy(tiny.model)
    apply_quant_plan(quant, QuantPlan(default="int4-g32"))  # a different model: a real interval
    text = calibration_text("heldout")
    result = compare_quality(
        tiny.model,
        quant,
        tiny.tokenizer,
        text,
        window_tokens=64,
        prompt_tokens=16,
        new_tokens=8,
        max_prompts=200,
        resamples=200,
    )
    assert result.prompts == 200 and result.prompt_stride_tokens < 24
    assert blocks_used[-1] == result.bootstrap_block_prompts == 2 * -(-24 // result.prompt_stride_tokens)
    assert result.retention_low <= result.quality_retention <= result.retention_high
    apart = compare_quality(
        tiny.model,
        quant,
        tiny.tokenizer,
        text,
        window_tokens=64,
        prompt_tokens=16,
        new_tokens=8,
        max_prompts=12,
        resamples=50,
    )
    assert apart.prompt_stride_tokens >= 24 and blocks_used[-1] == apart.bootstrap_block_prompts == 1
    with pytest.raises(ValueError, match="max_prompts"):
        compare_quality(tiny.model, quant, tiny.tokenizer, text, max_prompts=0)


def test_collect_importance_is_the_mean_squared_input_of_each_linear(tiny):
    text = calibration_text("heldout")
    importance = collect_importance(tiny.model, tiny.tokenizer, text, window_tokens=32, max_windows=3)
    groups = model_groups(tiny.model)
    assert set(importance) == {g.name for g in groups}
    assert all(importance[g.name].shape == (g.in_features,) for g in groups)
    # the LM head's input is the final normed hidden state of each window
    ids = torch.tensor(tiny.tokenizer.encode(text)[:96]).view(3, 32)
    finals = []
    for window in ids:
        cache = ContiguousKVCache(tiny.model.config, 32, tiny.model.dtype, tiny.model.device)
        cache.begin(32)
        with torch.no_grad():
            finals.append(tiny.model(window, torch.arange(32), cache))
    expected = (torch.cat(finals) ** 2).mean(0)
    torch.testing.assert_close(importance["lm_head"], expected, rtol=1e-4, atol=1e-7)
    assert all(
        isinstance(tiny.model.get_submodule(g.module_path), torch.nn.Linear) for g in groups
    )  # no hooks left
    assert not any(m._forward_pre_hooks for m in tiny.model.modules())


def test_fitted_checkpoint_round_trip_is_bit_exact_and_says_how_it_was_quantised(tiny, tmp_path):
    importance = collect_importance(
        tiny.model, tiny.tokenizer, calibration_text("heldout"), window_tokens=32, max_windows=2
    )
    plan = QuantPlan({"lm_head": "int8"}, "int4-g32")
    path = tmp_path / "fitted.safetensors"
    save_quantized_checkpoint(tiny.model, plan, path, importance)
    direct = copy.deepcopy(tiny.model)
    apply_quant_plan(direct, plan, importance=importance)
    loaded = copy.deepcopy(tiny.model)
    load_quantized_checkpoint(path, loaded)
    ids = _ids(tiny, 40)
    assert torch.equal(window_logits(direct, ids), window_logits(loaded, ids))
    saved_plan, _, _ = read_checkpoint_plan(path)
    assert saved_plan.notes["quantiser"] == "importance-fitted"


@pytest.mark.slow
def test_smollm2_fitted_int4_g64_loses_far_less_than_min_max_grids():
    """Measured on the held-out text: uniform int4-g64 with fitted grids has about a quarter of the
    min-max grids' KL (0.074 vs 0.285 over the layers on the evaluation text); bound 0.6x."""
    loaded = load_model("smollm2-135m-instruct", device="cpu", dtype="fp32")
    ids = torch.tensor(loaded.tokenizer.encode(calibration_text("heldout"))[:256])
    importance = collect_importance(loaded.model, loaded.tokenizer)
    kls = {}
    for name, weights in (("min-max", None), ("fitted", importance)):
        quant = copy.deepcopy(loaded.model)
        apply_quant_plan(
            quant, QuantPlan({"lm_head": "int8"}, "int4-g64"), dtype=torch.bfloat16, importance=weights
        )
        kls[name] = _mean_kl(loaded.model, quant, ids)
        del quant
    assert kls["fitted"] < 0.6 * kls["min-max"], kls


def test_importance_that_misses_a_planned_group_is_refused_with_its_name(tiny):
    importance = collect_importance(
        tiny.model, tiny.tokenizer, calibration_text("heldout"), window_tokens=32, max_windows=1
    )
    del importance["lm_head"]
    quant = copy.deepcopy(tiny.model)
    with pytest.raises(ConfigError, match="the importance has no entry for lm_head"):
        apply_quant_plan(quant, QuantPlan(default="int8"), importance=importance)
    assert all(isinstance(quant.get_submodule(g.module_path), torch.nn.Linear) for g in model_groups(quant))


def test_scheme_on_a_quantised_model_is_refused_before_the_calibration_pass(tiny, monkeypatch):
    import edge_rtgi.llm.quant.profile as profile

    quant = copy.deepcopy(tiny.model)
    apply_quant_plan(quant, QuantPlan(default="int8"))
    monkeypatch.setattr(profile, "collect_importance", lambda *a, **k: pytest.fail("calibrated first"))
    with pytest.raises(ConfigError, match="already quantised"):
        apply_quant(quant, "int8", tiny.tokenizer)
