"""Bench configuration, switches, target checks, and the GPU script's reduced CPU mode end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge_rtgi.bench.metrics import SLO, summarise
from edge_rtgi.bench.rtiq import rtiq
from edge_rtgi.bench.suite import BenchConfig, Optimisations
from edge_rtgi.bench.targets_check import evaluate_targets
from edge_rtgi.config import load_config
from edge_rtgi.errors import ConfigError
from tests.tiny_models import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]


def test_each_optimisation_is_a_switch():
    base = Optimisations()
    assert base.changed("prefix_caching=false").prefix_caching is False
    assert base.changed("max_num_seqs=1").max_num_seqs == 1
    assert base.changed("quant=int8").quant == "int8"
    assert base.changed("quant=none").quant is None
    both = base.changed("scheduling=slo, token_budget=predicted,stopping=clause")
    assert (both.scheduling, both.token_budget, both.stopping) == ("slo", "predicted", "clause")
    with pytest.raises(ConfigError, match="stopping must be one of eos, clause"):
        base.changed("stopping=sentence")
    cfg = base.changed("max_num_batched_tokens=64").engine_config("m", 2)
    assert (cfg.max_num_batched_tokens, cfg.enable_prefix_caching, cfg.num_threads) == (64, True, 2)
    with pytest.raises(ConfigError, match="bad ablation"):
        base.changed("telepathy=true")
    assert base.changed("speculative=ngram:4").engine_config("m", 2).speculation().k == 4
    assert base.changed("speculative=auto").engine_config("m", 2).speculative == "auto"
    with pytest.raises(ConfigError, match=r"speculative\.k must be an integer in 1\.\.16"):
        base.changed("speculative=ngram:0")
    with pytest.raises(ConfigError, match="integer"):
        base.changed("max_num_seqs=many")
    assert base.engine_config("m", 2).int8_activations == "auto"  # as the engine ships
    assert base.changed("int8_activations=off").engine_config("m", 2).int8_activations is False
    assert base.changed("int8_activations=on").engine_config("m", 2).int8_activations is True
    with pytest.raises(ConfigError, match="int8_activations must be off, auto or on"):
        base.changed("int8_activations=maybe")
    windowed = base.changed("kv_window=4:1024")
    window = windowed.engine_config("m", 2).kv_window
    assert (window.sink_tokens, window.window_tokens) == (4, 1024) and windowed.lossy
    assert base.engine_config("m", 2).kv_window is None
    with pytest.raises(ConfigError, match="SINKS:WINDOW"):
        base.changed("kv_window=1024")
    with pytest.raises(ConfigError, match=r"window_tokens must be > kv_window\.sink_tokens"):
        base.changed("kv_window=8:4")
    evicting = base.changed("eviction=segment,kv_budget_tokens=256")
    cfg = evicting.engine_config("m", 2)
    assert cfg.kv_budget_tokens == 256 and cfg.kv_eviction.mode == "segment" and evicting.lossy
    assert base.engine_config("m", 2).kv_eviction is None
    assert base.changed("eviction=none").engine_config("m", 2).kv_eviction is None
    with pytest.raises(ConfigError, match="eviction must be none or one of h2o, snapkv, segment"):
        base.changed("eviction=lru,kv_budget_tokens=256")
    with pytest.raises(ValueError, match="kv_budget_tokens and kv_eviction go together"):
        base.changed("eviction=h2o").engine_config("m", 2)


def test_bench_config_loads_strictly_from_yaml(tmp_path):
    path = tmp_path / "bench.yaml"
    path.write_text("workloads: [voice]\noptimisations:\n  prefix_caching: false\nramp_rates_rps: [1, 2]\n")
    cfg = load_config(BenchConfig, path)
    assert cfg.workloads == ("voice",) and cfg.optimisations.prefix_caching is False
    assert cfg.ramp_rates_rps == (1.0, 2.0)
    path.write_text("workload: [voice]\n")
    with pytest.raises(ConfigError, match="unknown key 'workload'"):
        load_config(BenchConfig, path)


def test_rtiq_multiplies_retention_by_attainment():
    from tests.unit.test_bench_metrics import make_trace

    traces = [make_trace(0, 0.0, 100.0, 20.0, 5), make_trace(1, 0.0, 900.0, 20.0, 5)]
    index = rtiq("voice", 0.9, summarise(traces, SLO()))
    assert index.value == pytest.approx(0.45)
    assert (index.slo_attainment, index.ttft_attainment, index.itl_attainment) == (0.5, 0.5, 1.0)
    with pytest.raises(ValueError):
        rtiq("voice", 1.2, summarise(traces, SLO()))


def _results(decode_ratio, load_ratio, voice_p95, rate=4.0, llamacpp_skipped=True):
    ratios = [
        {
            "vs": "HF",
            "kind": "hf-fp32",
            "decode_speed": decode_ratio,
            "ttft": 0.5,
            "throughput_under_load": load_ratio,
        }
    ]
    skipped = (
        [{"name": "llamacpp", "reason": "llama-cpp-python is not installed"}] if llamacpp_skipped else []
    )
    voice = {
        "name": "voice",
        "metrics": {"ttft_ms": {"p95": voice_p95}},
        "load": {"rate_rps": rate},
        "quality": {"retention": 0.97},
    }
    return {
        "config": {"optimisations": {"quant": None}},
        "workloads": [voice],
        "peers": {"ratios": ratios, "skipped": skipped},
    }


def test_targets_are_checked_against_fixed_bars():
    statuses = [r["status"] for r in evaluate_targets(_results(2.5, 4.0, 450))]
    assert statuses == ["**met**", "not measured", "not met", "**met**", "**met**"]
    assert "not installed" in evaluate_targets(_results(2.5, 4.0, 450))[1]["measured"]
    assert [r["status"] for r in evaluate_targets(_results(1.9, 6.0, 650))][:4] == [
        "not met",
        "not measured",
        "**met**",
        "not met",
    ]
    assert evaluate_targets(_results(2.5, 6.0, 100, rate=2.0))[3]["status"].startswith("not comparable")


def test_cli_rejects_bad_settings():
    from edge_rtgi.cli import main

    assert main(["bench", "workloads", "--workloads", "chat"]) == 2
    assert main(["bench", "peers", "--peers", "vllm"]) == 2
    assert main(["bench", "ramp", "--connect", "ws://127.0.0.1:1"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(900)  # far longer than it needs, for a machine whose cores are shared
def test_gpu_script_reduced_cpu_mode_writes_a_full_report(tmp_path):
    # A tiny seeded model: the script, the CLI, every section and the report are what is tested
    # here (the real model's engine, quantisation and peers have tests of their own), and it
    # costs a few seconds instead of a minute and a half of loading and quantising SmolLM2.
    model = make_tiny_hf_model(
        "llama", tmp_path / "tiny", seed=2, max_position_embeddings=4096, rope_scaling=None
    )
    out = tmp_path / "report"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(out), "--cpu", "--model", str(model)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            **__import__("os").environ,
            "PYTHON": sys.executable,
            "EDGE_RTGI_BENCH_CACHE": str(tmp_path / "cache"),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["sections"] == ["workloads", "ramp", "ablations", "peers"]
    assert [w["name"] for w in results["workloads"]] == ["voice", "code"]
    for w in results["workloads"]:
        assert w["metrics"]["num_requests"] == 3 and 0.0 <= w["rtiq"]["value"] <= 1.0
        assert 0.0 <= w["quality"]["retention"] <= 1.0
    kinds = [e["kind"] for e in results["peers"]["entries"]]
    assert kinds[:3] == ["ours", "ours-variant", "plain"] and (
        "hf-fp32" in kinds or results["peers"]["skipped"]
    )
    assert results["peers"]["entries"][1]["variant"] == "quant=int8"
    assert results["machine"]["git"]["commit"]
    text = (out / "report.md").read_text()
    for heading in (
        "## Conditions",
        "## Where the engine stands",
        "## RTIQ per workload",
        "## Ramp",
        "## Ablations",
        "## Peers side by side",
    ):
        assert heading in text
    for png in ("latency_cdf.png", "throughput_vs_load.png", "ablations.png", "peers.png"):
        assert (out / png).stat().st_size > 1000


def test_a_faster_variant_is_named_but_the_engine_as_configured_decides():
    results = _results(1.5, 6.0, 450)
    results["peers"]["ratios"].append(
        {
            "ours": "edge-rtgi engine (quant int8)",
            "ours_kind": "ours-variant",
            "vs": "HF",
            "kind": "hf-fp32",
            "decode_speed": 2.4,
            "ttft": 0.5,
            "throughput_under_load": 7.0,
        }
    )
    row = evaluate_targets(results)[0]
    assert row["status"] == "met only with a variant"
    assert "1.50x (engine as configured)" in row["measured"] and "2.40x with (quant int8)" in row["measured"]
