"""The whole suite (workloads, ramp, ablations) and its report on a tiny seeded model, in seconds."""

import json

import pytest

from edge_rtgi.bench.report import write_report
from edge_rtgi.bench.runner import run_suite
from edge_rtgi.bench.suite import BenchConfig, Optimisations
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_hf_model(
        "llama", tmp_path_factory.mktemp("tiny"), seed=2, max_position_embeddings=4096, rope_scaling=None
    )


async def test_suite_runs_every_local_section_and_reports(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_RTGI_BENCH_CACHE", str(tmp_path / "full-outputs"))
    cfg = BenchConfig(
        model=str(tiny_folder),
        optimisations=Optimisations(dtype="fp32", quant=None),
        num_requests=3,
        max_duration_s=30.0,
        rate_scale=10.0,
        task_items=4,
        kl_prompts=2,
        ramp_rates_rps=(5.0, 50.0),
        ramp_requests=3,
        ablations=("prefix_caching=false", "max_num_seqs=1", "dtype=bf16"),
    )
    results = await run_suite(cfg, ("workloads", "ramp", "ablations"))
    assert [w["name"] for w in results["workloads"]] == ["dialogue", "code", "translation", "voice"]
    for w in results["workloads"]:
        assert w["metrics"]["num_requests"] == 3 and w["metrics"]["num_ok"] == 3, w["errors"]
        # fp32 engine against the fp32 full model: the same computation, so retention is exactly 1
        q = w["quality"]
        assert q["kl"] is None and q["fidelity_chrf"] == pytest.approx(100.0)
        assert q["retention"] == 1.0 and (q["retention_low"], q["retention_high"]) == (1.0, 1.0)
        assert q["num_items"] == 4 and q["task"]["task_set"] == w["name"]
        assert w["rtiq"]["value"] == pytest.approx(w["rtiq"]["slo_attainment"] * w["quality"]["retention"])
        assert w["metrics"]["kv_blocks_total"] > 0 and w["metrics"]["peak_rss_mb"] > 0
    rows = {r["label"]: r for r in results["ablations"]["rows"]}
    assert set(rows) == {"baseline", "prefix_caching=false", "max_num_seqs=1", "dtype=bf16"}
    assert rows["prefix_caching=false"]["prefix_hit_rate"] == 0.0
    assert rows["max_num_seqs=1"]["requests_per_step"] == pytest.approx(1.0)
    assert rows["dtype=bf16"]["quality"]["kl"]["mean"] > 0.0  # its own bf16 weights: a real KL
    assert [s["rate_rps"] for s in results["ramp"]["stages"]][0] == 5.0

    report = write_report(json.loads(json.dumps(results, default=str)), tmp_path / "out")
    text = report.read_text()
    assert "## RTIQ per workload" in text and "## Ablations" in text and "## Ramp" in text
    assert "peers section not run" in text
    assert (tmp_path / "out" / "latency_cdf.png").is_file() and not (tmp_path / "out" / "peers.png").exists()


async def test_mixed_load_runs_both_policies_and_reports(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_RTGI_BENCH_CACHE", str(tmp_path / "full-outputs"))
    cfg = BenchConfig(
        model=str(tiny_folder),
        optimisations=Optimisations(dtype="fp32", quant=None),
        mixed_rate_scales=(1.0,),
        mixed_duration_s=1.5,
        mixed_rounds=2,
    )
    results = await run_suite(cfg, ("mixed",))
    mixed = results["mixed"]
    runs = mixed["runs"]
    assert len(runs) == 2 * 2 and {r["policy"] for r in runs} == {"fcfs", "slo"}
    # policies alternate round by round, so neither always runs first
    firsts = [runs[i]["policy"] for i in range(0, len(runs), 2)]
    assert firsts[:2] == ["fcfs", "slo"]
    for run in runs:
        assert {c["workload"] for c in run["classes"]} == {"dialogue", "code", "translation", "voice"}
        assert run["sent"] == sum(c["sent"] for c in run["classes"]) > 0
        assert 0.0 <= run["attainment"] <= 1.0
        classes = {c["workload"]: c["request_class"] for c in run["classes"]}
        assert classes == {
            "dialogue": "dialogue",
            "code": "dialogue",
            "translation": "translation",
            "voice": "voice",
        }
    table = mixed["summary"]["policies"]
    assert set(table["slo"]["scales"]) == {"1"} and mixed["step_model"]["slo"]["num_observations"] > 0
    report = write_report(json.loads(json.dumps(results, default=str)), tmp_path / "out")
    assert "## Mixed load: every workload at once" in report.read_text()


def _mixed_run(policy: str, rnd: int, met: int, sent: int = 100):
    from edge_rtgi.bench.mixed import ClassResult, MixedRun

    voice = ClassResult("voice", "voice", sent, met, 100.0, 30.0, met / 20.0, 20.0)
    return MixedRun(policy, 1.0, rnd, 8.0, sent, met, met / 20.0, (voice,))


def test_the_slo_over_fcfs_ratio_comes_with_a_paired_bootstrap_interval_over_rounds():
    from edge_rtgi.bench.mixed import attainment_ratio_interval, summarise_policies

    # the same 1.5x in every round: the interval is that point
    steady = [_mixed_run("slo", i, 60) for i in range(4)] + [_mixed_run("fcfs", i, 40) for i in range(4)]
    assert attainment_ratio_interval(steady) == pytest.approx((1.5, 1.5))
    # rounds that disagree (the machine, not the policy): a wide interval around the pooled 1.5x
    noisy = [_mixed_run("slo", i, m) for i, m in enumerate((70, 50, 65, 55))]
    noisy += [_mixed_run("fcfs", i, m) for i, m in enumerate((20, 60, 30, 50))]
    low, high = attainment_ratio_interval(noisy)
    assert low < 1.0 < 1.5 < high
    ratio = summarise_policies(noisy)["slo_over_fcfs"]["1"]
    assert ratio["attainment"] == pytest.approx(240 / 160)
    assert (ratio["attainment_low"], ratio["attainment_high"]) == (low, high)
    # fcfs meeting nothing in some resamples leaves the upper end unbounded; one round, no interval
    zero = [_mixed_run("slo", i, 30) for i in range(3)] + [
        _mixed_run("fcfs", i, m) for i, m in enumerate((0, 0, 10))
    ]
    assert attainment_ratio_interval(zero)[1] is None
    assert attainment_ratio_interval([_mixed_run("slo", 0, 5), _mixed_run("fcfs", 0, 5)]) is None


def test_the_highest_sustained_scale_is_the_last_of_an_unbroken_run_from_the_lowest():
    from edge_rtgi.bench.mixed import highest_sustained_scale

    assert highest_sustained_scale({0.5: 0.95, 0.25: 1.0, 1.0: 0.7}) == 0.5
    # 94 % above a scale that missed is the rounds' noise, not a rate sustained
    assert highest_sustained_scale({0.5: 0.90, 0.625: 0.86, 0.75: 0.94}) == 0.5
    assert highest_sustained_scale({0.5: 0.85, 0.75: 0.95}) is None
    assert highest_sustained_scale({}) is None
