"""`edge-rtgi bench llm` runs end to end on a tiny model and writes its report (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tiny_models import make_tiny_hf_model


@pytest.mark.parametrize("dtype,quant", [("fp32", "auto"), ("bf16", "int8")])
def test_bench_llm_smoke(tmp_path, dtype, quant):
    folder = make_tiny_hf_model("llama", tmp_path, seed=1)
    report = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_rtgi.cli",
            "bench",
            "llm",
            "--model",
            str(folder),
            "--dtype",
            dtype,
            "--quant",
            quant,
            "--runs",
            "1",
            "--decode-tokens",
            "4",
            "--ttft-prompt-tokens",
            "96",
            "--cached-prefix-tokens",
            "64",
            "--concurrency",
            "3",
            "--concurrent-max-tokens",
            "4",
            "--threads",
            "1",
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| batch-1 decode, tok/s |" in proc.stdout and "speed-up" in proc.stdout
    results = json.loads((report / "llm.json").read_text())
    assert results["ours"]["cached_tokens"] == 64  # the shared prefix is exactly 4 blocks of 16
    assert results["ours"]["decode_tok_s"]["runs"] == 1 and results["hf"]["throughput_tok_s"]["median"] > 0
    assert (report / "llm.md").read_text().startswith("# edge-rtgi bench llm")
    # quantised weights: the same engine on full-precision weights is timed alongside (fp32 with
    # quant auto quantises where the kernels have AVX2 or AVX-512 VNNI int8-activation loops)
    from edge_rtgi.llm.quant.policy import int8_activations_fast

    quantised = quant == "int8" or int8_activations_fast()
    assert ("full_precision_decode_tok_s" in results["ours"]) == quantised


def test_bench_llm_rejects_bad_sizes():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_rtgi.cli",
            "bench",
            "llm",
            "--ttft-prompt-tokens",
            "64",
            "--cached-prefix-tokens",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--cached-prefix-tokens (64)" in proc.stderr
