#!/usr/bin/env python
"""Start-up: launch to first token of ``edge-rtgi generate``, and ``edge-rtgi serve`` to health 200.

Each figure is the median of --runs cold starts (a new process each time, the page cache
warm), this tree (B) interleaved run by run with another checkout (A, e.g. the commit before
the fast-start work: ``git worktree add /tmp/base-gemma <commit>``), so load on the shared
machine hits both alike. Before timing, each side starts once untimed, which builds its
prepared weights (llm.prepared) where it has them. Gemma 3 runs on B only where A does not
know the architecture.

    .venv/bin/python scripts/bench_startup.py --base /tmp/base-gemma [--runs 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("EDGE_RTGI_PREPARED", None)
    # The fused kernels are built per source path: two checkouts sharing one build folder would
    # rebuild each other's library on every start.
    kernels = Path(os.environ.get("EDGE_RTGI_KERNEL_DIR", "/tmp/edge-rtgi-bench-kernels"))
    env["EDGE_RTGI_KERNEL_DIR"] = str(kernels / tree.name)
    return env


def first_token_s(tree: Path, model: str) -> float:
    """Seconds from launching ``generate`` to its first byte of output."""
    cmd = [sys.executable, "-m", "edge_rtgi.cli", "generate", "--model", model, "--max-tokens", "4", PROMPT]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.wait(timeout=300)
    if not first or proc.returncode != 0:
        raise RuntimeError(f"{tree}: generate --model {model} failed (exit {proc.returncode})")
    return elapsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_ready_s(tree: Path, timeout_s: float = 300.0) -> float:
    """Seconds from launching ``serve`` (shipped config and pipelines) to /healthz answering 200."""
    port = _free_port()
    cmd = [sys.executable, "-m", "edge_rtgi.cli", "serve", "--config", "config/edge-rtgi.yaml"]
    cmd += ["--port", str(port)]
    start = time.perf_counter()
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), stdout=quiet, stderr=quiet)
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{tree}: serve not ready in {timeout_s} s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (A)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = ap.parse_args()
    trees = {"base": args.base.resolve(), "this": HERE}
    cases: list[tuple[str, str, object]] = []
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        for side, tree in trees.items():
            if side == "base" and name.startswith("gemma"):
                continue  # the base commit does not know the gemma3 architecture
            cases.append((f"generate {name}", side, lambda t=tree, m=name: first_token_s(t, m)))
    for side, tree in trees.items():
        cases.append(("serve", side, lambda t=tree: serve_ready_s(t)))
    results: dict[str, dict[str, list[float]]] = {}
    load = [os.getloadavg()[0]]
    for label, side, fn in cases:  # one untimed start each: builds prepared weights, warms the page cache
        print(f"warm-up {label} [{side}]: {fn():.2f} s", flush=True)
    for run in range(args.runs):
        for label, side, fn in cases:
            value = fn()
            results.setdefault(label, {}).setdefault(side, []).append(value)
            print(f"run {run + 1} {label} [{side}]: {value:.2f} s", flush=True)
        load.append(os.getloadavg()[0])
    summary = {
        label: {side: {"median_s": statistics.median(v), "runs_s": v} for side, v in sides.items()}
        for label, sides in results.items()
    }
    print(f"\nload average (1 min) during the runs: {min(load):.1f}-{max(load):.1f}")
    for label, sides in summary.items():
        line = ", ".join(f"{side} {s['median_s']:.2f} s" for side, s in sides.items())
        ratio = ""
        if "base" in sides:
            ratio = f" (base / this = {sides['base']['median_s'] / sides['this']['median_s']:.2f}x)"
        print(f"{label}: {line}{ratio}")
    if args.out:
        doc = {"load_average": load, "runs": args.runs, "results": summary}
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
