#!/usr/bin/env python
"""The fused CPU kernels of another commit against the working tree's, in one process, step by step.

This machine's speed drifts by a third over minutes (other tenants), which hides a change of a few
percent between two runs of two builds. This script builds the kernel source of ``--base``
(``git show REV:edge_rtgi/llm/csrc/cpu_ops.cpp``) as a second library under its own op namespace
(``edge_rtgi_base``) and swaps the two libraries in ``cpu_ops`` between steps of one engine
(SmolLM2-135M as the daemon runs it), so that both see the same drift:

- decode steps of a batch of B requests (``--batches``, default 1 and 8; ``--context-tokens``
  of earlier conversation before each): every engine step runs on one library, the next on the
  other; each base step is divided by the mean of the working tree's steps on either side of it;
- steps that verify n - 1 draft tokens of one request (``--verify``, default 2, 3, 5 and 9 tokens):
  the same scheduled step re-run on each library in turn, as ``bench_speculative.py --step-costs``
  times it.

Prints medians of the per-step ratios (base / working tree; above 1: the working tree is faster)
and the step times. Only the kernels differ: the Python around them is the working tree's.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_kernel_ab.py --base HEAD~1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from edge_rtgi.bench.suite import stepped_engine
from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SOURCE = "edge_rtgi/llm/csrc/cpu_ops.cpp"
NAMESPACE = "edge_rtgi_base"


def build_base(rev: str):
    """The kernel library at ``rev``, registered as ``torch.ops.edge_rtgi_base``."""
    text = subprocess.run(
        ["git", "show", f"{rev}:{SOURCE}"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        text = text.replace(f"{macro}(edge_rtgi,", f"{macro}({NAMESPACE},")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    folder = cpu_ops.build_dir().parent / f"ab-{commit}"
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "cpu_ops_base.cpp"
    if not source.exists() or source.read_text() != text:
        source.write_text(text)
    cpu_ops.build_library(f"edge_rtgi_cpu_ops_base_{commit}", source, folder)
    return getattr(torch.ops, NAMESPACE), commit


def decode_batches(
    engine: LLMEngine, libraries: dict, batch: int, rounds: int, context_tokens: int = 0
) -> list[tuple[float, float]]:
    """(base step, mean of the neighbouring working-tree steps) in ms, over ``rounds`` batches of
    ``batch`` requests of 64 new tokens, the library swapped at every step; ``context_tokens``
    of earlier text before each request's question (a long conversation)."""
    tok = engine.tokenizer
    assert tok is not None
    history = tok.decode(tok.encode("We talked about boats, tides and the weather. " * 200)[:context_tokens])
    questions = [f"{history}Tell me a long story about the sea, number {i}." for i in range(batch)]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    pairs: list[tuple[float, float]] = []
    names = list(libraries)
    started: set[str] = set()  # this round's requests past their prefill (a token delivered)
    for _ in range(rounds):
        started.clear()
        for i, ids in enumerate(prompts):
            rid = f"b{i}-{time.monotonic_ns()}"
            engine.submit(
                ids,
                SamplingParams(max_tokens=64, ignore_eos=True),
                lambda d: started.add(d.request_id),
                request_id=rid,
            )
        decode: list[tuple[str, float]] = []  # steps in which every request decoded
        step = 0
        while True:
            name = names[step % 2]
            cpu_ops._ops = libraries[name]
            all_decoding = len(started) == batch
            start = time.perf_counter()
            if not engine.step():
                break
            if all_decoding:
                decode.append((name, (time.perf_counter() - start) * 1e3))
            step += 1
        for i in range(1, len(decode) - 1):
            name, ms = decode[i]
            if name == "base" and decode[i - 1][0] == decode[i + 1][0] == "tree":
                pairs.append((ms, (decode[i - 1][1] + decode[i + 1][1]) / 2))
    return pairs


def verify_steps(engine: LLMEngine, libraries: dict, sizes: tuple[int, ...], rounds: int) -> dict:
    """Per n: (base ms, working tree ms) of one batch-1 step carrying n tokens, re-run each round."""
    tok = engine.tokenizer
    assert tok is not None
    ids = tok.encode("The history of the printing press begins in the fifteenth century. " * 6)[:64]
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    delivered: list = []
    engine.submit(ids, params, delivered.append, request_id="verify")
    while not delivered:
        engine.step()
    req = engine.scheduler.requests["verify"]
    out: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            ms = {}
            for name, ops in libraries.items():
                cpu_ops._ops = ops
                req.draft_token_ids = list(ids[1:n])
                scheduled = engine.scheduler.schedule()
                start = time.perf_counter()
                engine.runner.execute(scheduled, {"verify": params})
                ms[name] = (time.perf_counter() - start) * 1e3
            out[n].append((ms["base"], ms["tree"]))
    req.draft_token_ids = []
    engine.abort("verify")
    engine.step()
    return out


def report(label: str, pairs: list[tuple[float, float]], unit: str) -> None:
    base = statistics.median(b for b, _ in pairs)
    tree = statistics.median(t for _, t in pairs)
    ratio = statistics.median(b / t for b, t in pairs)
    print(f"{label}: base {base:6.2f} ms, tree {tree:6.2f} ms, base / tree {ratio:.3f} ({len(pairs)} {unit})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit whose kernels are the baseline (git rev)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes, comma-separated ('' for none)")
    ap.add_argument("--rounds", type=int, default=4, help="batches of 64 tokens per batch size")
    ap.add_argument(
        "--context-tokens", type=int, default=0, help="earlier text before each decode request (tokens)"
    )
    ap.add_argument("--verify", default="2,3,5,9", help="verification step sizes ('' for none)")
    ap.add_argument("--verify-rounds", type=int, default=40)
    args = ap.parse_args()
    engine = stepped_engine(args.threads)
    if not cpu_ops.available():
        raise SystemExit(f"fused CPU kernels unavailable: {cpu_ops.failure()}")
    base_ops, commit = build_base(args.base)
    libraries = {"tree": cpu_ops._ops, "base": base_ops}
    load = os.getloadavg()[0]
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, kernels of {commit} (base) against the "
        f"working tree, threads {torch.get_num_threads()}, load {load:.2f}"
    )
    try:
        for batch in (int(b) for b in args.batches.split(",") if b):
            pairs = decode_batches(engine, libraries, batch, args.rounds, args.context_tokens)
            report(f"decode batch {batch:>2}", pairs, "steps")
        sizes = tuple(int(n) for n in args.verify.split(",") if n)
        if sizes:
            for n, pairs in verify_steps(engine, libraries, (1, *sizes), args.verify_rounds).items():
                report(f"step of {n:>2} tokens", pairs, "rounds")
    finally:
        cpu_ops._ops = libraries["tree"]
    print(f"# load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
