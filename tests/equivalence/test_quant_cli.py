"""``edge-rtgi quantize`` end to end on a tiny seeded model: profile -> plan -> checkpoint -> report."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from edge_rtgi.cli import main
from edge_rtgi.llm.quant import apply_quant, load_quantized_checkpoint
from edge_rtgi.llm.quant.plan import QuantPlan, model_groups, plan_bits_per_weight
from edge_rtgi.llm.quant.report import window_logits
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("cli"), seed=7)


def test_profile_allocate_save_report(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDGE_RTGI_BENCH_CACHE", str(tmp_path / "full-outputs"))
    sens, plan, ckpt, report = (tmp_path / n for n in ("sens.yaml", "plan.yaml", "m.q.safetensors", "rep"))
    rc = main(
        [
            "quantize",
            str(tiny_dir),
            "--dtype",
            "fp32",
            "--profile",
            "--out",
            str(sens),
            "-q",
            "--schemes",
            "int8,int4-g32,int4-g64",
            "--window-tokens",
            "64",
            "--calib-windows",
            "2",
            "--target-bits",
            "5.5",
            "--plan-out",
            str(plan),
            "--save",
            str(ckpt),
            "--report",
            str(report),
            "--eval-prompts",
            "200",
            "--task-items",
            "2",
        ]
    )  # more than fit side by side: overlapping, resampled in runs
    assert rc == 0
    assert "groups:" in sens.read_text() and "layers.1.down:" in sens.read_text()
    loaded = load_model(tiny_dir, device="cpu", dtype="fp32")
    groups = model_groups(loaded.model)
    resolved = QuantPlan.load(plan).resolved(groups)
    assert plan_bits_per_weight(resolved, groups) <= 5.5
    assert len(set(resolved.values())) > 1  # a real mix, not one scheme
    summary = json.loads((report / "report.json").read_text())
    assert summary["plan"] == resolved and 0 < summary["quality_retention"] <= 1
    assert 0 <= summary["token_accuracy_quant"] <= 1 and 0 < summary["token_accuracy_retention"] <= 1
    assert (report / "bits.png").stat().st_size > 1000
    assert summary["prompts"] == 200 and summary["bootstrap_block_prompts"] > 1
    out = capsys.readouterr().out
    assert "Task retention" in out and "continuation chrF ratio (fidelity" in out
    tasks = {t["workload"]: t for t in summary["task_retention"]}
    assert (
        set(tasks) <= {"voice", "dialogue", "code", "translation"} and "code" in tasks
    )  # what fits 256 tokens
    assert all(t["items"] == 2 and 0 <= t["retention"] <= 1 for t in tasks.values())
    # The checkpoint and the plan give the same model.
    from_ckpt, from_plan = copy.deepcopy(loaded.model), copy.deepcopy(loaded.model)
    load_quantized_checkpoint(ckpt, from_ckpt)
    apply_quant(from_plan, str(plan), loaded.tokenizer)  # fitted grids, as the CLI saved them
    ids = torch.arange(3, 40)
    assert torch.equal(window_logits(from_ckpt, ids), window_logits(from_plan, ids))


def test_budget_below_minimum_is_one_line_error(tiny_dir, tmp_path, capsys):
    sens = tmp_path / "sens.yaml"
    assert (
        main(
            [
                "quantize",
                str(tiny_dir),
                "--dtype",
                "fp32",
                "--profile",
                "--out",
                str(sens),
                "-q",
                "--schemes",
                "int8,int4-g64",
                "--window-tokens",
                "64",
                "--calib-windows",
                "1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    rc = main(
        [
            "quantize",
            str(tiny_dir),
            "--sensitivity",
            str(sens),
            "--target-bits",
            "3",
            "--plan-out",
            str(tmp_path / "p.yaml"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "below the smallest plan" in err and "bits per weight" in err
    assert len(err.strip().splitlines()) == 1


def test_plan_naming_missing_layer_is_refused(tiny_dir, tmp_path, capsys):
    plan = tmp_path / "p.yaml"
    plan.write_text("format: edge-rtgi-quant-plan/1\ngroups:\n  layers.9.qkv: int8\n  lm_head: int8\n")
    rc = main(["quantize", str(tiny_dir), "--plan", str(plan), "--save", str(tmp_path / "x.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and "layers.9.qkv" in err and "does not have" in err
    assert not (tmp_path / "x.safetensors").exists()


def test_eval_prompts_must_be_positive(tiny_dir, tmp_path, capsys):
    rc = main(
        [
            "quantize",
            str(tiny_dir),
            "--uniform",
            "int8",
            "--report",
            str(tmp_path / "r"),
            "--eval-prompts",
            "0",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--eval-prompts must be at least 1" in err and len(err.strip().splitlines()) == 1
    rc = main(
        [
            "quantize",
            str(tiny_dir),
            "--uniform",
            "int8",
            "--report",
            str(tmp_path / "r"),
            "--task-items",
            "-1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--task-items must be at least 0" in err and len(err.strip().splitlines()) == 1


def test_profile_kv_and_allocate_a_kv_plan_the_engine_loads(tiny_dir, tmp_path, capsys):
    """--profile-kv writes layers.N.kv rows into the table; --target-kv-bits writes a plan whose
    kv section the engine runs (kv_dtype: plan) within the budget; too small a budget is refused."""
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.llm.kv.mixed import MixedPagedKVStorage
    from edge_rtgi.llm.quant.profile import SensitivityTable
    from edge_rtgi.llm.sampling import SamplingParams

    sens, plan = tmp_path / "kv-sens.yaml", tmp_path / "kv-plan.yaml"
    common = ["quantize", str(tiny_dir), "--dtype", "fp32", "-q", "--window-tokens", "64"]
    assert main([*common, "--profile-kv", "--out", str(sens)]) == 0
    table = SensitivityTable.load(sens)
    assert set(table.kl) == {"layers.0.kv", "layers.1.kv"}
    assert all(set(row) == {"int8", "int4"} and row["int4"] > 0 for row in table.kl.values())
    assert main([*common, "--sensitivity", str(sens), "--target-kv-bits", "10", "--plan-out", str(plan)]) == 0
    kv = QuantPlan.load(plan).kv
    assert kv is not None and kv.notes["kv_bits"] <= 10
    loaded = load_model(tiny_dir, device="cpu", dtype="fp32")
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(num_kv_blocks=32, kv_dtype="plan", kv_plan=str(plan)), start=False
    )
    assert isinstance(engine.storage, MixedPagedKVStorage)
    assert list(engine.storage.layer_dtypes) == kv.layer_dtypes(2)
    [result] = engine.generate(
        [loaded.tokenizer.encode("Hello there")], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert len(result.token_ids) == 4
    assert main([*common, "--sensitivity", str(sens), "--target-kv-bits", "3", "--plan-out", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "below the smallest plan" in err and "--target-kv-bits >= 6.000" in err
