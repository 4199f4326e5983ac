"""scripts/bench_quant.py: how the operating point is chosen and rendered (pure logic, no models)."""

from __future__ import annotations

import json

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_quant")


def _row(
    mb: float, retention: tuple[float, float, float], token_accuracy: tuple[float, float], worst: str = "code"
) -> dict:
    """A plan whose task retention is ``retention`` (low, point, high) on its worst workload and
    comfortably above the target on the others."""
    low, point, high = retention
    tasks = {
        name: {"interval": {"low": 0.985, "ratio": 1.0, "high": 1.0}}
        for name in ("voice", "dialogue", "code")
    }
    tasks[worst] = {"interval": {"low": low, "ratio": point, "high": high}}
    return {
        "groups_mb": mb,
        "tasks": tasks,
        "quality_retention": 0.9,  # the continuation chrF (a fidelity diagnostic): never decides
        "retention_low": 0.85,
        "retention_high": 0.95,
        "token_accuracy_retention": token_accuracy[0],
        "token_accuracy_ratio_low": token_accuracy[1],
    }


def test_the_smallest_mixed_plan_meeting_task_retention_on_every_workload_wins(bench):
    rows = {
        "mixed @ 5": _row(80, (0.90, 0.95, 0.99), (0.98, 0.97)),
        "mixed @ 6": _row(90, (0.95, 0.975, 1.0), (0.99, 0.98), worst="dialogue"),
        "mixed @ 7": _row(100, (0.971, 0.99, 1.0), (0.99, 0.98)),
        "uniform int8": _row(135, (0.99, 1.0, 1.0), (1.0, 0.99)),
    }  # not mixed: never the operating point
    point = bench.choose_operating_point(rows, 0.97)
    assert (point["by_interval"], point["by_point_estimate"], point["not_significantly_below"]) == (
        "mixed @ 7",
        "mixed @ 6",
        "mixed @ 5",
    )
    assert (point["chosen"], point["chosen_by"]) == ("mixed @ 7", "by_interval")
    assert point["token_accuracy_by_interval"] == "mixed @ 5"


def test_one_workload_below_the_target_rules_a_plan_out(bench):
    row = _row(80, (0.99, 1.0, 1.0), (0.99, 0.98))
    row["tasks"]["translation"] = {"interval": {"low": 0.90, "ratio": 0.96, "high": 0.99}}
    point = bench.choose_operating_point({"mixed @ 5": row}, 0.97)
    assert point["by_point_estimate"] is None and point["not_significantly_below"] == "mixed @ 5"


def test_token_accuracy_chooses_only_when_no_plan_meets_the_benchmark_retention(bench):
    rows = {
        "mixed @ 5": _row(80, (0.90, 0.93, 0.96), (0.975, 0.965)),
        "mixed @ 6": _row(90, (0.91, 0.94, 0.965), (0.985, 0.972)),
    }
    point = bench.choose_operating_point(rows, 0.97)
    assert point["by_interval"] is point["by_point_estimate"] is point["not_significantly_below"] is None
    assert (point["chosen"], point["chosen_by"]) == ("mixed @ 6", "token_accuracy_by_interval")
    assert bench.chosen_operating_point({}) == (None, None)


def test_rendered_table_names_the_operating_point_and_its_criterion(bench, tmp_path):
    row = {
        **_row(80, (0.90, 0.93, 0.96), (0.985, 0.972)),
        "bits_per_weight": 5.25,
        "resident_weights_mb": 88.3,
        "mean_kl": 0.07,
        "kl_low": 0.06,
        "kl_high": 0.08,
        "perplexity_quant": 20.2,
        "perplexity_full": 18.9,
        "next_token_agreement": 0.85,
        "token_accuracy_ratio_high": 0.99,
    }
    point = bench.choose_operating_point({"mixed @ 5.25": row}, 0.97)
    (tmp_path / "quality.json").write_text(
        json.dumps({"models": {"mixed @ 5.25": row}, "operating_point": point})
    )
    table = bench.render_markdown(tmp_path)
    assert "**mixed @ 5.25** (operating point, token accuracy by interval)" in table
    assert "93.0 % [90.0, 96.0]" in table and "98.5 % [97.2, 99.0]" in table
    assert "task retention code [95 % CI]" in table and "90.0 % [85.0, 95.0]" in table  # the fidelity column


def test_spearman_of_task_retention_and_kl(bench):
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert bench.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.866, abs=1e-3)  # ties share ranks
    rows = {f"m{i}": {"tasks": {}, "task_retention_mean": 1.0 - i / 10, "mean_kl": i / 100} for i in range(4)}
    assert bench.spearman_task_vs_kl(rows)["rho"] == pytest.approx(-1.0)


def test_the_same_computation_row_is_rendered_without_kl_and_stays_out_of_the_spearman(bench, tmp_path):
    same = {
        "resident_weights_mb": 538.1,
        "kl_note": "same weights: 0",
        "tasks": {"voice": {"interval": {"low": 1.0, "ratio": 1.0, "high": 1.0}}},
        "task_retention_mean": 1.0,
    }
    rows = {f"m{i}": {"tasks": {}, "task_retention_mean": 1.0 - i / 10, "mean_kl": i / 100} for i in range(4)}
    assert bench.spearman_task_vs_kl({bench.SAME_COMPUTATION: same, **rows})["models"] == 4
    (tmp_path / "quality.json").write_text(json.dumps({"models": {bench.SAME_COMPUTATION: same}}))
    line = next(x for x in bench.render_markdown(tmp_path).splitlines() if bench.SAME_COMPUTATION in x)
    assert "| 32 | 538.1 | 100.0 % [100.0, 100.0] | 0 (same weights) |" in line
