#!/usr/bin/env python
"""Gemma 3 270M (the catalogue's Q4_K_M GGUF): speed against HF transformers and llama.cpp on the
same file, and how the engine's KV cache grows over a long session.

Speed, each a median of --runs runs after one warm-up, the contenders interleaved run by run:

- batch-1 decode tok/s: a 64-token prompt, --decode-tokens new tokens, greedy, EOS ignored;
  rate = (n - 1) / (last token time - first token time), so the prefill is excluded;
- 16-way throughput: 16 different prompts of 24-54 tokens, --concurrent-tokens new tokens
  each; the engine takes them together (continuous batching), HF and llama.cpp one after
  another (neither batches requests here).

Engine: ``quant: auto`` (on a bf16 CPU: the file's Q4_K blocks as int4-g32, the rest int8, a
dense bf16 copy for many-row inputs). HF transformers: its own GGUF loading, fp32, eager.
llama.cpp: llama-cpp-python on the GGUF itself (skipped when not installed), 2 threads.

KV growth: one request of --kv-tokens prompt tokens plus 16 new ones, chunked prefill; KV
bytes held after each step, with Gemma 3's windows and with every layer made global (the
same engine and pool, the config's layer types replaced); the ratio of the two growth rates
past the window is what the windows save.

    .venv/bin/python scripts/bench_gemma.py [--runs 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from edge_rtgi.bench.llm import LLMBenchConfig, _measure_interleaved, _Ours, _prompt
from edge_rtgi.catalog import resolve_model
from edge_rtgi.llm.prepared import load_prepared

MODEL = "gemma-3-270m"


class _TimedGreedy:
    """Greedy decoding timed token by token: ``_stamps`` gives one time per generated token."""

    def _stamps(self, prompt: list[int], n: int) -> list[float]:
        raise NotImplementedError

    def decode_rate(self, prompt: list[int], n: int) -> float:
        s = self._stamps(prompt, n)
        return (len(s) - 1) / (s[-1] - s[0])

    def throughput(self, prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        for p in prompts:
            self._stamps(p, n)
        return len(prompts) * n / (time.perf_counter() - start)


class HFGGUF(_TimedGreedy):
    """HF transformers fp32 eager on the GGUF through transformers' own loader."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def _stamps(self, prompt: list[int], n: int) -> list[float]:
        from transformers.generation.streamers import BaseStreamer

        stamps: list[float] = []

        class Stamps(BaseStreamer):
            seen = False

            def put(self, value: Any) -> None:
                if self.seen:
                    stamps.append(time.perf_counter())
                self.seen = True

            def end(self) -> None:
                pass

        ids = torch.tensor([prompt])
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                streamer=Stamps(),
            )
        return stamps


class LlamaCpp(_TimedGreedy):
    """llama.cpp (llama-cpp-python) on the same GGUF, greedy, one sequence at a time."""

    def __init__(self, path: Path, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)

    def _stamps(self, prompt: list[int], n: int) -> list[float]:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        stamps = []
        for _ in range(n):
            token = int(llm.scores[llm.n_tokens - 1].argmax())  # greedy on the last logits
            stamps.append(time.perf_counter())
            llm.eval([token])
        return stamps


def kv_growth(loaded: Any, num_tokens: int, all_global: bool) -> list[tuple[int, int]]:
    """(computed tokens, KV bytes held) after each step of one long request."""
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.llm.kv.storage import PagedKVStorage
    from edge_rtgi.llm.model import FULL
    from edge_rtgi.llm.sampling import SamplingParams

    model, cfg = loaded.model, loaded.config
    saved = model.config
    if all_global:
        model.config = dataclasses.replace(cfg, layer_types=(FULL,) * cfg.num_layers)
    try:
        config = EngineConfig(num_kv_blocks=2048, quant="none")
        engine = LLMEngine(model, loaded.tokenizer, config, start=False)
        per_block = PagedKVStorage.bytes_per_block(
            engine.storage.num_layers, engine.kv.block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype
        )
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(10, cfg.vocab_size, (num_tokens,), generator=gen).tolist()
        engine.submit(prompt, SamplingParams(max_tokens=16, ignore_eos=True), lambda d: None, request_id="r")
        points = []
        while engine.step():
            req = engine.scheduler.requests.get("r")
            if req is not None:
                points.append((req.num_computed_tokens, engine.kv.pool.num_used_blocks * per_block))
        return points
    finally:
        model.config = saved


def slope(points: list[tuple[int, int]], from_tokens: int) -> float:
    """Bytes per token between the first point past ``from_tokens`` and the last."""
    past = [p for p in points if p[0] >= from_tokens]
    (t0, b0), (t1, b1) = past[0], past[-1]
    return (b1 - b0) / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--concurrent-tokens", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=3000)
    ap.add_argument("--skip", default="", help="comma-separated: hf, llamacpp, kv")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(args.threads)
    path = resolve_model(MODEL, role="llm")
    load = [os.getloadavg()[0]]
    out: dict[str, Any] = {"model": MODEL, "runs": args.runs, "threads": args.threads}
    prepared = load_prepared(path, "cpu", "auto", "auto")
    out["engine_weights"] = prepared.quant
    loaded = prepared.loaded
    ours = _Ours(loaded, LLMBenchConfig(model=MODEL, num_threads=args.threads))
    tok = loaded.tokenizer
    decode_prompt = _prompt(tok, 64)
    concurrent = [_prompt(tok, 24 + 2 * i, salt=f"Question {i}. ") for i in range(16)]
    peers: dict[str, Any] = {"ours": ours}
    if "hf" not in skip:
        peers["hf-fp32"] = HFGGUF(path)
    if "llamacpp" not in skip:
        try:
            peers["llamacpp"] = LlamaCpp(path, args.threads)
        except ImportError:
            print("llama-cpp-python is not installed: llama.cpp skipped")
    n, m = args.decode_tokens, args.concurrent_tokens
    decode = _measure_interleaved(
        {k: (lambda p=p: p.decode_rate(decode_prompt, n)) for k, p in peers.items()}, args.runs
    )
    load.append(os.getloadavg()[0])
    through = _measure_interleaved(
        {k: (lambda p=p: p.throughput(concurrent, m)) for k, p in peers.items()}, args.runs
    )
    load.append(os.getloadavg()[0])
    ours.engine.shutdown()
    out["decode_tok_s"] = {k: v["values"] for k, v in decode.items()}
    out["throughput_16_tok_s"] = {k: v["values"] for k, v in through.items()}
    print(f"load average (1 min): {min(load):.1f}-{max(load):.1f}")
    for title, res in (("batch-1 decode", decode), ("16-way throughput", through)):
        base = res["ours"]["median"]
        for k, v in res.items():
            print(f"{title:18s} {k:10s} {v['median']:7.1f} tok/s  (ours / this = {base / v['median']:.2f}x)")
    if "kv" not in skip:
        full = load_prepared(path, "cpu", "auto", "none").loaded  # no dense copies: leaner for 3,000 tokens
        windowed = kv_growth(full, args.kv_tokens, all_global=False)
        global_only = kv_growth(full, args.kv_tokens, all_global=True)
        window = full.config.sliding_window or 0
        ratio = slope(windowed, 2 * window) / slope(global_only, 2 * window)
        out["kv"] = {
            "windowed": windowed,
            "global_only": global_only,
            "bytes_at_end": {"windowed": windowed[-1][1], "global_only": global_only[-1][1]},
            "growth_ratio": ratio,
        }
        print(
            f"KV after {windowed[-1][0]} tokens: {windowed[-1][1] / 2**20:.1f} MiB with windows, "
            f"{global_only[-1][1] / 2**20:.1f} MiB all-global; growth past {2 * window} tokens: "
            f"{ratio:.3f}x the all-global rate"
        )
    out["load_average"] = load
    out["median"] = {
        "decode": {k: statistics.median(v) for k, v in out["decode_tok_s"].items()},
        "throughput_16": {k: statistics.median(v) for k, v in out["throughput_16_tok_s"].items()},
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
