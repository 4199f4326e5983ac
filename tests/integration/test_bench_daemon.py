"""``edge-rtgi bench workloads --connect``: the load generator drives a real daemon over WebSocket."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "edge_rtgi.cli"]


@pytest.mark.slow
async def test_bench_drives_the_daemon_over_websocket(tmp_path):
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(
        f"pipelines: [{ROOT / 'pipelines' / 'translate-en-es.yaml'}]\n"
        "default_pipeline: translate-en-es\nserver: {port: 0, drain_timeout_s: 5}\n"
    )
    daemon = await asyncio.create_subprocess_exec(
        *CLI,
        "serve",
        "--config",
        str(cfg),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(daemon.stdout.readline(), 300)).decode()
        port = int(re.search(r":(\d+)/v1/native", line).group(1))
        out = tmp_path / "report"
        bench = await asyncio.create_subprocess_exec(
            *CLI,
            "bench",
            "workloads",
            "--connect",
            f"ws://127.0.0.1:{port}/v1/native",
            "--workloads",
            "translation",
            "--num-requests",
            "3",
            "--report",
            str(out),
            cwd=ROOT,
            env=dict(os.environ),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(bench.communicate(), 300)
        assert bench.returncode == 0, stderr.decode()[-2000:]
    finally:
        daemon.terminate()
        await asyncio.wait_for(daemon.wait(), 60)
    results = json.loads((out / "results.json").read_text())
    (workload,) = results["daemon"]["workloads"]
    assert workload["metrics"]["num_requests"] == 3 and workload["metrics"]["num_ok"] == 3, workload["errors"]
    # Apertium's Spanish shares character n-grams with the references
    assert workload["chrf_vs_references"] > 20.0
    assert all(e["received"].strip() for e in workload["examples"])
    assert "Workloads over WebSocket" in (out / "report.md").read_text()
