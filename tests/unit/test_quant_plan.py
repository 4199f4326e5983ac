"""Plans, budgets and the allocator, on synthetic groups and sensitivity tables (no model)."""

from __future__ import annotations

import itertools

import pytest

from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.quant.allocate import Budget, allocate
from edge_rtgi.llm.quant.plan import QuantPlan, WeightGroup, plan_bits_per_weight, plan_nbytes, uniform_plan
from edge_rtgi.llm.quant.profile import SensitivityTable

SCHEMES = ("int8", "int4-g32", "int4-g64", "int4-g128")


def _groups():
    shapes = [(256, 128), (128, 128), (512, 128), (128, 256)]
    return [
        WeightGroup(f"layers.{i}.{k}", f"layers.{i}.x", *shapes[j])
        for i in range(3)
        for j, k in enumerate(("qkv", "o", "gate_up", "down"))
    ] + [WeightGroup("lm_head", "lm_head", 384, 128)]


def _table(groups):
    kl = {}
    for n, g in enumerate(groups):
        base = 0.001 * (1 + (n * 7) % 5) * (10 if g.name == "lm_head" else 1)
        kl[g.name] = {"int8": base * 0.01, "int4-g32": base * 0.3, "int4-g64": base * 0.6, "int4-g128": base}
    return SensitivityTable(kl, {g.name: (g.out_features, g.in_features) for g in groups})


def _kl_sum(resolved, table):
    return sum(0.0 if s == "none" else table.kl[g][s] for g, s in resolved.items())


def test_allocation_respects_budget_and_beats_uniform_at_equal_size():
    groups, table = _groups(), None
    table = _table(groups)
    uniform = uniform_plan(groups, "int4-g64").resolved(groups)
    budget = Budget(plan_nbytes(uniform, groups), "uniform int4-g64 size")
    mixed = allocate(groups, table, budget, SCHEMES).resolved(groups)
    assert plan_nbytes(mixed, groups) <= budget.max_bytes
    assert _kl_sum(mixed, table) < _kl_sum(uniform, table)
    assert mixed["lm_head"] != "int4-g128"  # the most sensitive group gets more bits


def _exhaustive(groups, table, max_bytes, schemes=SCHEMES):
    names = [g.name for g in groups]
    return min(
        _kl_sum(dict(zip(names, combo, strict=True)), table)
        for combo in itertools.product(schemes, repeat=len(groups))
        if plan_nbytes(dict(zip(names, combo, strict=True)), groups) <= max_bytes
    )


@pytest.mark.parametrize("max_steps", [None, 500], ids=["exact", "coarse"])
@pytest.mark.parametrize("bits", [4.3, 4.6, 5.2, 6.5])
def test_allocation_against_exhaustive_search_on_a_small_problem(bits, max_steps, monkeypatch):
    """Exact on the gcd byte axis; within budget and 5 % of the optimum on a forced coarse axis."""
    import edge_rtgi.llm.quant.allocate as allocate_module

    if max_steps is not None:
        monkeypatch.setattr(allocate_module, "DP_MAX_STEPS", max_steps)
    groups = _groups()[:5]
    table = _table(groups)
    budget = Budget(int(bits * sum(g.numel for g in groups) / 8), f"{bits}")
    plan = allocate(groups, table, budget, SCHEMES).resolved(groups)
    best = _exhaustive(groups, table, budget.max_bytes)
    assert plan_nbytes(plan, groups) <= budget.max_bytes
    if max_steps is None:
        assert _kl_sum(plan, table) == pytest.approx(best, rel=1e-12)
    else:
        assert best <= _kl_sum(plan, table) <= best * 1.05 + 1e-12


def test_one_large_sensitive_group_is_upgraded_where_a_greedy_by_ratio_stalls():
    """SmolLM2's tied head in miniature: many small groups with a slightly better KL-per-byte
    than one big group whose upgrade removes far more KL. The greedy spends the budget on the
    small ones first and the big upgrade no longer fits; the optimum takes it."""
    small = [WeightGroup(f"layers.{i}.o", f"layers.{i}.x", 128, 128) for i in range(8)]
    head = WeightGroup("lm_head", "lm_head", 2048, 128)
    groups = [*small, head]
    kl = {g.name: {"int8": 0.0, "int4-g64": 0.0012} for g in small}
    kl["lm_head"] = {"int8": 0.0, "int4-g64": 0.01}
    table = SensitivityTable(kl, {g.name: (g.out_features, g.in_features) for g in groups})
    cheap = plan_nbytes({g.name: "int4-g64" for g in groups}, groups)
    head_upgrade = plan_nbytes({"lm_head": "int8"}, [head]) - plan_nbytes({"lm_head": "int4-g64"}, [head])
    plan = allocate(groups, table, Budget(cheap + head_upgrade, "head"), ("int8", "int4-g64")).resolved(
        groups
    )
    assert plan["lm_head"] == "int8"
    assert _kl_sum(plan, table) == pytest.approx(8 * 0.0012)


def test_budget_below_int4_everywhere_names_the_minimum():
    groups = _groups()
    with pytest.raises(ConfigError, match=r"below the smallest plan.*needs 4\.\d+ bits per weight") as err:
        allocate(groups, _table(groups), Budget.from_args(groups, 3.0, None), SCHEMES)
    assert "--target-bits >=" in str(err.value)
    with pytest.raises(ConfigError, match="MB"):
        allocate(groups, _table(groups), Budget.from_args(groups, None, 0.01), SCHEMES)
    with pytest.raises(ConfigError, match="exactly one budget"):
        Budget.from_args(groups, 4.5, 3.0)


def test_generous_budget_keeps_everything_in_float_only_when_none_is_a_candidate():
    groups = _groups()
    plan = allocate(groups, _table(groups), Budget.from_args(groups, 16.0, None), SCHEMES + ("none",))
    assert set(plan.resolved(groups).values()) == {"none"}
    plan = allocate(groups, _table(groups), Budget.from_args(groups, 16.0, None))
    assert set(plan.resolved(groups).values()) == {"int8"}


def test_plan_yaml_round_trip_is_exact(tmp_path):
    groups = _groups()
    plan = allocate(groups, _table(groups), Budget.from_args(groups, 4.8, None), SCHEMES)
    plan.save(tmp_path / "plan.yaml", groups)
    again = QuantPlan.load(tmp_path / "plan.yaml")
    assert again.resolved(groups) == plan.resolved(groups)
    assert again.notes == plan.notes
    assert plan_bits_per_weight(again.resolved(groups), groups) == pytest.approx(
        plan.notes["bits_per_weight"], abs=1e-4
    )
    assert plan_bits_per_weight(again.resolved(groups), groups) <= 4.8


def test_plan_naming_missing_groups_is_refused_with_the_names():
    groups = _groups()
    plan = QuantPlan({"layers.7.qkv": "int8", "layers.0.mlp": "int8", "lm_head": "int8"})
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp, layers\.7\.qkv"):
        plan.validate(groups)


def test_plan_files_are_strict(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("format: edge-rtgi-quant-plan/1\ngroups: {lm_head: int5}\n")
    with pytest.raises(ConfigError, match="int5"):
        QuantPlan.load(path)
    path.write_text("format: edge-rtgi-quant-plan/1\nbits: 4\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        QuantPlan.load(path)
    path.write_text("groups: {}\n")
    with pytest.raises(ConfigError, match="not a quantisation plan"):
        QuantPlan.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        QuantPlan.load(tmp_path / "missing.yaml")


def test_scheme_that_does_not_fit_is_refused_and_uniform_falls_back():
    groups = _groups()  # in_features 128/256: g128 fits, but a 96-wide group would not
    odd = groups + [WeightGroup("layers.3.o", "x", 64, 96)]
    with pytest.raises(ConfigError, match=r"layers\.3\.o=int4-g64"):
        QuantPlan(default="int4-g64").validate(odd)
    resolved = uniform_plan(odd, "int4-g64").resolved(odd)
    assert resolved["layers.3.o"] == "int4-g32" and resolved["layers.0.qkv"] == "int4-g64"


def test_sensitivity_table_round_trip(tmp_path):
    groups = _groups()
    table = _table(groups)
    table.info["calibration"] = {"tokens": 512}
    table.save(tmp_path / "s.yaml")
    again = SensitivityTable.load(tmp_path / "s.yaml")
    assert again.shapes == table.shapes and again.info["calibration"] == {"tokens": 512}
    for name, row in table.kl.items():
        for scheme, value in row.items():
            assert again.kl[name][scheme] == pytest.approx(value, rel=1e-3)
