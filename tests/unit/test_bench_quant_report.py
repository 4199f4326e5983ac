"""scripts/bench_quant.py: how the operating point is chosen and rendered (pure logic, no models)."""

from __future__ import annotations

import json

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_quant")


def _row(mb: float, retention: tuple[float, float, float], token_accuracy: tuple[float, float]) -> dict:
    low, point, high = retention
    return {
        "groups_mb": mb,
        "quality_retention": point,
        "retention_low": low,
        "retention_high": high,
        "token_accuracy_retention": token_accuracy[0],
        "token_accuracy_ratio_low": token_accuracy[1],
    }


def test_the_smallest_mixed_plan_meeting_the_benchmark_retention_wins(bench):
    rows = {
        "mixed @ 5": _row(80, (0.90, 0.95, 0.99), (0.98, 0.97)),
        "mixed @ 6": _row(90, (0.95, 0.975, 1.0), (0.99, 0.98)),
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
