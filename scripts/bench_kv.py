#!/usr/bin/env python
"""KV compression on SmolLM2-135M: attention sinks + sliding window (``kv_window``) against the
full-KV engine, every figure measured in the same run.

- **KV bytes per token** of each storage (fp = the model's dtype, int8 with its scales), from the
  storage's own tensors.
- **Long-text perplexity**: one request whose prompt is --text-tokens tokens of this project's
  docs (markdown prose and tables), prefilled in chunks of 256 through the engine; the
  hidden states of every step are scored against the next token (a forward hook on the model,
  nothing in the engine changes). Full cache vs sinks + window vs the same window without
  sinks, overall and per 1,000-token stretch. --past-context-tokens adds a sinks + window run
  longer than the model's 8,192 positions.
- **Decode tok/s** at 2k and 8k context (--decode-lengths): 32 greedy tokens after a 2k prompt
  and after the long text (no scoring hook), rate = (n - 1) / (last token time - first token
  time); full cache against sinks + window, or (--decode-configs) h2o / snapkv eviction under
  --budget-tokens, the configurations interleaved over --decode-runs runs, medians and ratios to
  the first.
- **Dialogue recall** (--recall-items, spread over distances 1, 4, 12, 30 turns back): the
  full-KV engine's replies against, at a quarter (4x) and an eighth (8x) of the items' mean
  prompt length: sinks + window, and importance eviction under that ``kv_budget_tokens``
  (``kv_eviction`` h2o, snapkv, segment by turn); int8 / int4 KV alone; and int8 or int4 KV
  combined with eviction (h2o, snapkv, segment by turn or by sentence) at the largest budget
  whose bytes held, scales included (and int4's open-block buffer), are at most a quarter / an
  eighth of the full bf16 cache's (--recall-configs picks some; --slack-tokens and
  --contrast-tokens set those ``kv_eviction`` fields on every row with eviction); task
  retention per distance with its paired-bootstrap
  interval (``bench.task_eval.task_retention``), and each configuration's KV held relative to
  the full bf16 cache (tokens, bytes, a pool's whole blocks) and mean bytes per session.
- **Endless session**: --turns voice-like turns through the engine, each a new request whose
  prompt is the whole history plus a 24-token utterance, 12 greedy tokens of reply; per turn the
  KV blocks in use, the tokens actually prefilled (prefix hits on the sink and window blocks
  cover the rest), the process RSS and the mean inter-token latency. The full-KV engine runs the
  same turns until its context window is full.

Run under the shared lock, and write down ``uptime`` beside the figures:

    flock /tmp/bench.lock .venv/bin/python scripts/bench_kv.py --out docs/benchmarks/kv/window.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edge_rtgi.catalog import resolve_model
from edge_rtgi.llm.engine import GenerationResult, LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.kv.eviction import KVEviction
from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage, PagedKVStorage
from edge_rtgi.llm.kv.window import KVWindow
from edge_rtgi.llm.prepared import load_prepared
from edge_rtgi.llm.sampling import SamplingParams

MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parent.parent


def long_text_tokens(tokenizer: Any, num_tokens: int) -> list[int]:
    """The project's docs, concatenated in name order, as ``num_tokens`` token ids."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    if len(ids) < num_tokens:
        raise SystemExit(f"the docs hold only {len(ids)} tokens, fewer than --text-tokens {num_tokens}")
    return list(ids[:num_tokens])


def kv_bytes_per_token(loaded: Any) -> dict[str, float]:
    cfg, out = loaded.config, {}
    kinds = (("fp", PagedKVStorage), ("int8", Int8PagedKVStorage), ("int4", Int4KIVIPagedKVStorage))
    for name, cls in kinds:
        storage = cls(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, loaded.model.dtype)
        names = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")  # not int4's open-block buffer
        tensors = [t for n in names for t in getattr(storage, n, [])]
        out[name] = sum(t.numel() * t.element_size() for t in tensors) / (4 * 16)
    # int4's open-block buffer: one block of full-precision keys per running request, on top of
    # the pool (``kv.int4``); counted per session in the int4 rows' bytes held
    elem = torch.empty((), dtype=loaded.model.dtype).element_size()
    out["int4_open_block"] = float(16 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem)
    return out


class NextTokenScorer:
    """Forward hook: log-likelihood of each known next token from every step's hidden states."""

    def __init__(self, model: Any, tokens: list[int]):
        self.model, self.tokens = model, tokens
        self.nll: dict[int, float] = {}  # position of the predicted token -> -log p
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: tuple[Any, ...], hidden: torch.Tensor) -> None:
        positions = args[1].tolist()
        rows = [i for i, p in enumerate(positions) if p + 1 < len(self.tokens)]
        if not rows:
            return
        logits = module.compute_logits(hidden[rows])
        targets = torch.tensor([self.tokens[positions[i] + 1] for i in rows])
        logp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
        for i, lp in zip(rows, logp.tolist(), strict=True):
            self.nll[positions[i] + 1] = -lp

    def close(self) -> None:
        self.handle.remove()


def engine_for(
    loaded: Any,
    window: KVWindow | None,
    num_blocks: int,
    kv_dtype: str = "auto",
    budget_tokens: int | None = None,
    eviction: KVEviction | None = None,
) -> LLMEngine:
    cfg = EngineConfig(
        model=MODEL,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=256,
        kv_window=window,
        kv_dtype=kv_dtype,
        kv_budget_tokens=budget_tokens,
        kv_eviction=eviction,
        num_threads=2,
    )
    return LLMEngine.from_loaded(loaded, cfg, start=False)


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[GenerationResult, int]:
    """Run one greedy request to its end; also the most KV blocks in use at once."""
    result = GenerationResult()
    engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), result.add)
    most = 0
    while engine.step():
        most = max(most, engine.kv.pool.num_used_blocks)
    if result.error:
        raise RuntimeError(result.error)
    return result, most


def decode_rate(result: GenerationResult) -> float:
    times = result.usage.token_times_ms if result.usage else ()
    return (len(times) - 1) / ((times[-1] - times[0]) / 1e3)


def long_text(
    loaded: Any, tokens: list[int], window: KVWindow | None, decode_tokens: int, kv_dtype: str = "auto"
) -> dict[str, Any]:
    engine = engine_for(loaded, window, -(-len(tokens) // 16) + 64, kv_dtype)
    scorer = NextTokenScorer(loaded.model, tokens)
    start = time.perf_counter()
    try:
        result, most_blocks = run_one(engine, tokens, decode_tokens)
    finally:
        scorer.close()
    nll = [scorer.nll[p] for p in range(1, len(tokens))]
    stretches = [nll[i : i + 1000] for i in range(0, len(nll), 1000)]
    return {
        "tokens": len(tokens),
        "ppl": math.exp(statistics.fmean(nll)),
        "ppl_per_1000": [round(math.exp(statistics.fmean(s)), 3) for s in stretches],
        "kv_blocks_peak": most_blocks,
        "decode_tok_s": decode_rate(result),
        "wall_s": time.perf_counter() - start,
    }


def endless_session(
    loaded: Any, text: list[int], window: KVWindow | None, turns: int, num_blocks: int
) -> list[dict[str, float]]:
    """Per turn: KV blocks in use, prefilled tokens, RSS (MiB), mean inter-token latency (ms)."""
    engine = engine_for(loaded, window, num_blocks)
    history: list[int] = []
    points = []
    for turn in range(turns):
        utterance = text[(turn * 24) % (len(text) - 24) :][:24]
        prompt = history + utterance
        if len(prompt) + 12 >= engine.max_model_len:
            break  # the full-KV engine: its context window is full
        result, most = run_one(engine, prompt, 12)
        usage = result.usage
        assert usage is not None
        gaps = [b - a for a, b in zip(usage.token_times_ms, usage.token_times_ms[1:], strict=False)]
        points.append(
            {
                "turn": turn,
                "context_tokens": len(prompt),
                "prefilled_tokens": usage.prompt_tokens - usage.cached_tokens,
                "kv_blocks_peak": most,
                "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "itl_ms": statistics.fmean(gaps),
                "ttft_ms": usage.ttft_ms or 0.0,
            }
        )
        history = prompt + result.token_ids
    return points


def summarise_session(points: list[dict[str, float]]) -> dict[str, Any]:
    if not points:
        return {}
    tenth = max(1, len(points) // 10)
    first, last = points[:tenth], points[-tenth:]
    return {
        "turns": len(points),
        "context_tokens_at_end": points[-1]["context_tokens"],
        "kv_blocks_peak_first_10pct": max(p["kv_blocks_peak"] for p in first),
        "kv_blocks_peak_last_10pct": max(p["kv_blocks_peak"] for p in last),
        "itl_ms_median_first_10pct": statistics.median(p["itl_ms"] for p in first),
        "itl_ms_median_last_10pct": statistics.median(p["itl_ms"] for p in last),
        "ttft_ms_median_first_10pct": statistics.median(p["ttft_ms"] for p in first),
        "ttft_ms_median_last_10pct": statistics.median(p["ttft_ms"] for p in last),
        "prefilled_tokens_median_last_10pct": statistics.median(p["prefilled_tokens"] for p in last),
    }


RECALL_CONFIGS = (
    "window_4x",
    "window_8x",
    "h2o_4x",
    "h2o_8x",
    "snapkv_4x",
    "snapkv_8x",
    "segment_4x",
    "segment_8x",
    "int8",
    "int4",
    "int8_h2o_4x",
    "int8_h2o_8x",
    "int8_snapkv_4x",
    "int8_snapkv_8x",
    "int8_segment_4x",
    "int8_segment_8x",
    "int8_sentence_4x",
    "int8_sentence_8x",
    "int8_unpinned_4x",
    "int8_unpinned_8x",
    "int4_h2o_8x",
    "int4_snapkv_8x",
    "int4_segment_8x",
    "int4_sentence_8x",
    "int4_unpinned_8x",
    "int4_unpinned_4x",
)
BLOCK_TOKENS = 16  # EngineConfig's default block_size, which engine_for keeps


@dataclass(frozen=True)
class EvictionTuning:
    """``kv_eviction`` settings every recall row with eviction gets (--slack-tokens,
    --contrast-tokens)."""

    slack_tokens: int | None = None
    contrast_tokens: int = 0


def held_fractions(
    lengths: list[int], cap: int | None, bytes_ratio: float, session_extra: float = 0.0
) -> dict[str, float]:
    """KV a configuration holds against the full bf16 cache on the same items, at most ``cap``
    tokens per item (None: all of it), each token costing ``bytes_ratio`` of a bf16 token, plus
    ``session_extra`` bf16 tokens' worth per item (int4's open-block buffer):
    ``tokens`` (mean over items of held / full tokens), ``bytes`` (the same in bytes, scales
    and the extra included), ``pool_bytes`` (whole 16-token blocks, summed over items: what a
    pool serving them all at once needs against what the full cache needs)."""
    held = [min(n, cap) if cap else n for n in lengths]
    full_blocks = sum(-(-n // BLOCK_TOKENS) for n in lengths)
    blocks = sum(-(-h // BLOCK_TOKENS) for h in held) / full_blocks
    tokens = statistics.fmean(h / n for h, n in zip(held, lengths, strict=True))
    pairs = zip(held, lengths, strict=True)
    byte_share = statistics.fmean((h * bytes_ratio + session_extra) / n for h, n in pairs)
    pool = blocks * bytes_ratio + session_extra * len(lengths) / (full_blocks * BLOCK_TOKENS)
    return {"tokens": tokens, "bytes": byte_share, "pool_bytes": pool}


def session_bytes(
    lengths: list[int], cap: int | None, bytes_per_token: float, session_extra_bytes: float = 0.0
) -> float:
    """Mean KV bytes one item's request holds at its end, in whole blocks (at most ``cap``
    tokens), plus ``session_extra_bytes`` (int4's open-block buffer): 1e9 / this is the
    concurrent sessions per GB of KV on this item mix."""
    held = [min(n, cap) if cap else n for n in lengths]
    return statistics.fmean(
        -(-h // BLOCK_TOKENS) * BLOCK_TOKENS * bytes_per_token + session_extra_bytes for h in held
    )


def budget_for_bytes(lengths: list[int], bytes_ratio: float, factor: int, session_extra: float = 0.0) -> int:
    """The largest budget, in whole blocks, at which both the mean and the pool byte fractions
    (``held_fractions``) are at most 1/``factor`` of the full bf16 cache's."""
    budget = BLOCK_TOKENS
    while True:
        f = held_fractions(lengths, budget + BLOCK_TOKENS, bytes_ratio, session_extra)
        if max(f["bytes"], f["pool_bytes"]) > 1 / factor:
            return budget
        budget += BLOCK_TOKENS


def recall_eviction(mode: str, sinks: int, tuning: EvictionTuning) -> KVEviction:
    """``kv_eviction`` of a recall row's MODE: h2o, snapkv, segment (by turn), sentence (segment
    by sentence) or unpinned (segment by turn, the system prompt not pinned), with ``tuning``'s
    ``slack_tokens`` and ``contrast_tokens``."""
    extra = {"slack_tokens": tuning.slack_tokens, "contrast_tokens": tuning.contrast_tokens}
    if mode == "sentence":
        return KVEviction("segment", sink_tokens=sinks, segment="sentence", **extra)
    if mode == "unpinned":
        return KVEviction("segment", sink_tokens=sinks, pin_system=False, **extra)
    return KVEviction(mode, sink_tokens=sinks, **extra)


def is_recall_config(name: str) -> bool:
    """One of RECALL_CONFIGS, or [int8_|int4_]MODE_bN (MODE of ``recall_eviction``)."""
    if name in RECALL_CONFIGS:
        return True
    kind, _, budget = name.rpartition("_")
    mode = kind.removeprefix("int8_").removeprefix("int4_")
    modes = ("h2o", "snapkv", "segment", "sentence", "unpinned")
    return mode in modes and budget[:1] == "b" and budget[1:].isdigit()


def recall_config(
    name: str,
    mean_prompt: float,
    sinks: int,
    lengths: list[int],
    bytes_per_token: dict[str, float],
    tuning: EvictionTuning = EvictionTuning(),
) -> dict[str, Any]:
    """``engine_for`` keywords of a recall configuration. [int8_]MODE_bN: a budget of N tokens.
    NAME_4x / NAME_8x hold a quarter / an eighth of the mean prompt's tokens (a window of that
    many tokens, or that KV budget);
    int8_MODE_4x / _8x, int4_MODE_4x / _8x: int8 / int4 KV with the largest budget at which the
    bytes held are at most a quarter / an eighth of the full bf16 cache's (``budget_for_bytes``,
    scales included, and for int4 its open-block buffer); MODE as in ``recall_eviction``."""
    if name in ("int8", "int4"):
        return {"kv_dtype": name}
    kind, _, factor_text = name.rpartition("_")
    if factor_text.startswith("b"):  # NAME_bN: a budget of N tokens, to compare dtypes at one budget
        kv_dtype, _, mode = kind.rpartition("_")
        eviction = recall_eviction(mode, sinks, tuning)
        return {"kv_dtype": kv_dtype or "auto", "budget_tokens": int(factor_text[1:]), "eviction": eviction}
    factor = int(factor_text.rstrip("x"))
    if kind.startswith(("int8_", "int4_")):
        kv_dtype, _, mode = kind.partition("_")
        ratio = bytes_per_token[kv_dtype] / bytes_per_token["fp"]
        budget = budget_for_bytes(lengths, ratio, factor, open_block_tokens(kv_dtype, bytes_per_token))
        eviction = recall_eviction(mode, sinks, tuning)
        return {"kv_dtype": kv_dtype, "budget_tokens": budget, "eviction": eviction}
    tokens = round(mean_prompt / factor)
    if kind == "window":
        return {"window": KVWindow(sinks, tokens)}
    return {"budget_tokens": tokens, "eviction": recall_eviction(kind, sinks, tuning)}


def open_block_tokens(kv_dtype: str, bytes_per_token: dict[str, float]) -> float:
    """int4's open-block buffer per session, in bf16 tokens' worth (0 for other dtypes)."""
    return bytes_per_token["int4_open_block"] / bytes_per_token["fp"] if kv_dtype == "int4" else 0.0


def recall(
    loaded: Any,
    num_items: int,
    sinks: int,
    names: list[str],
    bytes_per_token: dict[str, float],
    tuning: EvictionTuning = EvictionTuning(),
) -> dict[str, Any]:
    from edge_rtgi.bench.task_eval import prepare_items, run_on_engine, select_items, task_retention
    from edge_rtgi.bench.tasks import load_task_set

    task_set = load_task_set("dialogue")
    requests = prepare_items(select_items(task_set, num_items), loaded.tokenizer)
    lengths = [len(r.prompt_token_ids) + r.max_tokens for r in requests]
    mean = statistics.fmean(len(r.prompt_token_ids) for r in requests)
    configs = {name: recall_config(name, mean, sinks, lengths, bytes_per_token, tuning) for name in names}
    start = time.perf_counter()
    full = run_on_engine(engine_for(loaded, None, 2048), task_set, num_items)
    out: dict[str, Any] = {
        "items": len(requests),
        "mean_prompt_tokens": mean,
        "full_s": time.perf_counter() - start,
        "full_kv_bytes_per_session_mean": session_bytes(lengths, None, bytes_per_token["fp"]),
        "item_ids": list(full.item_ids),
        "full_replies": list(full.texts),
    }
    for name, kwargs in configs.items():
        start = time.perf_counter()
        engine = engine_for(loaded, num_blocks=2048, **{"window": None, **kwargs})
        outputs = run_on_engine(engine, task_set, num_items)
        ret = task_retention(task_set, outputs, full)
        window, budget = kwargs.get("window"), kwargs.get("budget_tokens")
        cap = budget if budget else window.window_tokens + window.sink_tokens if window else None
        kv_dtype = kwargs.get("kv_dtype", "auto")
        dtype_key = "fp" if kv_dtype == "auto" else kv_dtype
        ratio = bytes_per_token[dtype_key] / bytes_per_token["fp"]
        extra = open_block_tokens(kv_dtype, bytes_per_token)
        held = held_fractions(lengths, cap, ratio, extra)
        eviction = kwargs.get("eviction")
        out[name] = {
            "window": None if window is None else [window.sink_tokens, window.window_tokens],
            "kv_budget_tokens": budget,
            "kv_eviction": None if eviction is None else eviction.__dict__,
            "evicted_tokens": engine.stats().kv_evicted_tokens,
            "kv_dtype": kv_dtype,
            "kv_fraction_of_full_tokens": held["tokens"],
            "kv_fraction_of_full_bytes": held["bytes"],
            "kv_pool_fraction_of_full_bytes": held["pool_bytes"],
            "kv_bytes_per_session_mean": session_bytes(
                lengths, cap, bytes_per_token[dtype_key], extra * bytes_per_token["fp"]
            ),
            "retention": ret.retention,
            "full_score": ret.interval.full_score,
            "optimised_score": ret.interval.optimised_score,
            "interval": [ret.interval.low, ret.interval.high],
            "per_distance": [
                {
                    "distance": d.distance_turns,
                    "n": d.n,
                    "full": d.full_score,
                    "opt": d.optimised_score,
                    "retention": d.retention,
                }
                for d in ret.per_distance
            ],
            "wall_s": time.perf_counter() - start,
        }
        print(f"recall {name}: {out[name]}", flush=True)
        out[name]["replies"] = list(outputs.texts)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text-tokens", type=int, default=8000)
    ap.add_argument("--past-context-tokens", type=int, default=0, help="0: skip the run past 8,192")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument(
        "--decode-lengths", default="", help="comma-separated contexts; default 2000,--text-tokens"
    )
    ap.add_argument(
        "--decode-configs",
        default="full,sinks_window",
        help="comma-separated, the first is the baseline: full, sinks_window, window_only, h2o, snapkv",
    )
    ap.add_argument("--decode-runs", type=int, default=1)
    ap.add_argument(
        "--budget-tokens", type=int, default=512, help="kv_budget_tokens of the h2o/snapkv decode runs"
    )
    ap.add_argument(
        "--slack-tokens",
        type=int,
        default=None,
        help="kv_eviction.slack_tokens of the recall rows with eviction (default: one block)",
    )
    ap.add_argument(
        "--contrast-tokens",
        type=int,
        default=0,
        help="kv_eviction.contrast_tokens of the recall rows with eviction (0: raw attention mass)",
    )
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--recall-items", type=int, default=0, help="dialogue items; 0: skip")
    ap.add_argument(
        "--recall-configs",
        default=",".join(RECALL_CONFIGS),
        help=f"comma-separated recall configurations against the full cache, of: {', '.join(RECALL_CONFIGS)}",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated: ppl (fp: its full-precision runs, quant: its int8/int4 runs), decode, session",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(2)
    load = [os.getloadavg()[0]]
    loaded = load_prepared(resolve_model(MODEL, role="llm"), "cpu", "auto", "auto").loaded
    sinks = KVWindow(args.sinks, args.window)
    no_sinks = KVWindow(0, args.window)
    configs: dict[str, KVWindow | None] = {"full": None, "sinks_window": sinks, "window_only": no_sinks}
    out: dict[str, Any] = {
        "model": MODEL,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dtype": str(loaded.model.dtype),
        "window": {"sink_tokens": args.sinks, "window_tokens": args.window},
        "runs": 1,
        "kv_bytes_per_token": kv_bytes_per_token(loaded),
    }
    print("KV bytes/token:", out["kv_bytes_per_token"], flush=True)
    text = long_text_tokens(loaded.tokenizer, max(args.text_tokens, args.past_context_tokens))
    if "ppl" not in skip:
        out["long_text"] = {}
        for name, window in configs.items() if "fp" not in skip else ():
            res = long_text(loaded, text[: args.text_tokens], window, args.decode_tokens)
            out["long_text"][name] = res
            load.append(os.getloadavg()[0])
            print(
                f"long text {name}: ppl {res['ppl']:.3f}, per 1000 {res['ppl_per_1000']}, "
                f"peak blocks {res['kv_blocks_peak']}, decode at {len(text[: args.text_tokens])} "
                f"tokens {res['decode_tok_s']:.1f} tok/s",
                flush=True,
            )
        for kv_dtype in ("int8", "int4") if "quant" not in skip else ():
            for name, window in (("full", None), ("sinks_window", sinks)):
                res = long_text(loaded, text[: args.text_tokens], window, args.decode_tokens, kv_dtype)
                out["long_text"][f"{name}_{kv_dtype}"] = res
                print(
                    f"long text {name} {kv_dtype}: ppl {res['ppl']:.3f}, decode "
                    f"{res['decode_tok_s']:.1f} tok/s",
                    flush=True,
                )
        if args.past_context_tokens:
            res = long_text(loaded, text[: args.past_context_tokens], sinks, args.decode_tokens)
            out["long_text"]["sinks_window_past_context"] = res
            print(f"past the context: ppl {res['ppl']:.3f}, per 1000 {res['ppl_per_1000']}", flush=True)
    if "decode" not in skip:
        out["decode"] = {}
        lengths = (
            [int(n) for n in args.decode_lengths.split(",")]
            if args.decode_lengths
            else [2000, args.text_tokens]
        )
        names = args.decode_configs.split(",")
        for length in lengths:
            rates: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(args.decode_runs):  # configurations interleaved, so load drifts hit all alike
                for name in names:
                    kwargs: dict[str, Any] = {"window": configs.get(name)}
                    if name in ("h2o", "snapkv"):
                        kwargs = {
                            "window": None,
                            "budget_tokens": args.budget_tokens,
                            "eviction": KVEviction(name),
                        }
                    engine = engine_for(loaded, num_blocks=-(-length // 16) + 64, **kwargs)
                    result, _ = run_one(engine, text[:length], args.decode_tokens)
                    rates[name].append(decode_rate(result))
            for name in names:
                out["decode"][f"{name}_{length}"] = statistics.median(rates[name])
                out["decode"][f"{name}_{length}_runs"] = rates[name]
                ratio = statistics.median(rates[name]) / statistics.median(rates[names[0]])
                print(
                    f"decode at {length} {name}: median {statistics.median(rates[name]):.1f} tok/s over "
                    f"{args.decode_runs} runs ({ratio:.2f}x {names[0]})",
                    flush=True,
                )
        load.append(os.getloadavg()[0])
    if "session" not in skip:
        out["session"] = {}
        for name in ("full", "sinks_window"):
            points = endless_session(loaded, text, configs[name], args.turns, num_blocks=640)
            out["session"][name] = {"summary": summarise_session(points), "points": points}
            print(f"session {name}: {out['session'][name]['summary']}", flush=True)
            load.append(os.getloadavg()[0])
    if args.recall_items:
        names = [n for n in args.recall_configs.split(",") if n]
        unknown = sorted(n for n in names if not is_recall_config(n))
        if unknown:
            raise SystemExit(
                f"unknown --recall-configs {unknown}; choose from {', '.join(RECALL_CONFIGS)}, or "
                "[int8_|int4_]MODE_bN for a budget of N tokens "
                "(MODE: h2o, snapkv, segment, sentence, unpinned)"
            )
        out["recall"] = recall(
            loaded,
            args.recall_items,
            args.sinks,
            names,
            out["kv_bytes_per_token"],
            EvictionTuning(args.slack_tokens, args.contrast_tokens),
        )
        load.append(os.getloadavg()[0])
    out["load_avg_1m"] = load
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
