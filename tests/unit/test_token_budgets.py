"""Token budgets: the length predictor's features, its file, and the harness's budget switches."""

from __future__ import annotations

import math

import pytest

from edge_rtgi.bench.budgets import BudgetPolicy
from edge_rtgi.bench.workloads import PreparedRequest
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.budget import FEATURES, LengthPredictor, text_features


def predictor(**changes) -> LengthPredictor:
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("bias")] = math.log1p(20)  # 20 tokens for anything ...
    coef[FEATURES.index("open_request")] = math.log(3)  # ... about three times that to explain
    fields = dict(coefficients=tuple(coef), sigma=0.0, quantile_z=1.0, min_budget_tokens=8)
    fields |= {"translation_ratios": {"en-es": 1.5}}
    return LengthPredictor(**{**fields, **changes})


def test_features_read_the_question_word_and_the_request():
    f = dict(zip(FEATURES, text_features("how many legs does a spider have"), strict=True))
    assert f["how_quantity"] == 1.0 and f["how_other"] == 0.0 and f["wh_fact"] == 0.0
    f = dict(zip(FEATURES, text_features("Explain why the sky is blue, and what clouds are"), strict=True))
    assert f["open_request"] == 1.0 and f["log_clauses"] == pytest.approx(math.log1p(2))
    assert dict(zip(FEATURES, text_features("is it raining"), strict=True))["yes_no"] == 1.0
    assert text_features("")[0] == 1.0  # empty text still has the intercept


def test_budgets_follow_the_prediction_within_their_bounds():
    p = predictor()
    assert p.predict_tokens("what time is it") == pytest.approx(20.0)
    assert p.budget("what time is it", cap=48) == 20
    assert p.budget("explain how tides work", cap=48) == 48  # 62 predicted, capped
    assert p.budget("what time is it", cap=5) == 5
    assert predictor(min_budget_tokens=30).budget("what time is it", cap=48) == 30
    wide = predictor(sigma=0.5)  # a quantile above the median
    assert wide.budget("what time is it", cap=100) == math.ceil(math.expm1(math.log1p(20) + 0.5))
    assert p.translation_budget(10, "en-es", cap=64) == 15 + 4
    assert p.translation_budget(10, "en-fr", cap=64) == 20 + 4  # unknown pair: the default ratio


def test_the_predictor_file_round_trips_and_bad_files_are_refused(tmp_path):
    p = predictor(meta={"model": "m"})
    p.save(tmp_path / "lp.json")
    assert LengthPredictor.load(tmp_path / "lp.json") == p
    (tmp_path / "bad.json").write_text('{"coefficients": [1, 2]}')
    with pytest.raises(ConfigError, match="bad.json.*train_length_predictor"):
        LengthPredictor.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read the length predictor"):
        LengthPredictor.load(tmp_path / "missing.json")


def test_the_harness_budget_switches(monkeypatch):
    monkeypatch.setattr(BudgetPolicy, "predictor", predictor())
    req = PreparedRequest("v/1", "voice", (1, 2, 3), max_tokens=48, source_text="explain how tides work")
    short = PreparedRequest("v/2", "voice", (1, 2, 3), max_tokens=48, source_text="what time is it")
    code = PreparedRequest("c/1", "code", (1,), max_tokens=32, source_text="def f():")
    assert BudgetPolicy().sampling(short, None)["max_tokens"] == 48  # off: the cap alone
    soft = BudgetPolicy("predicted", "clause").sampling(short, None)
    assert soft["max_tokens"] == 48 and soft["token_budget"] == 20
    hard = BudgetPolicy("predicted", "eos").sampling(short, None)
    assert hard["max_tokens"] == 20 and "token_budget" not in hard
    assert "token_budget" not in BudgetPolicy("predicted", "clause").sampling(req, None)  # budget = cap
    assert BudgetPolicy("predicted", "clause").budget(code, None) is None
    with pytest.raises(ConfigError, match="stopping must be one of eos, clause"):
        BudgetPolicy("predicted", "sentence")


def test_the_shipped_predictor_loads_with_its_training_record():
    from edge_rtgi.llm.budget import default_predictor

    p = default_predictor()
    assert p.meta["model"] == "smollm2-135m-instruct" and p.meta["held_out"]["voice"]["n"] > 0
    assert "en-es" in p.translation_ratios and 1 <= p.budget("what is the capital of france", 48) <= 48
