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
  --budget-tokens, or int8 / int4 KV (int4_gather: int4 with its fused decode kernel off), the
  configurations interleaved over --decode-runs runs, medians and ratios to the first.
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
- **KV precision per layer** (--kv-plans LABEL=PLAN.yaml,...: plans from ``edge-rtgi quantize
  --profile-kv --target-kv-bits``, engine ``kv_dtype: plan``): each plan is a recall row named
  ``plan_LABEL`` beside the int8 / int4 rows, with its bytes per token (``kv.mixed``, scales
  included, plus int4 layers' open-block buffer per session); and with --kl-tokens N, the mean
  KL(full || configuration) of the next-token distributions over N tokens of the quantisation
  evaluation text (``bench/data/quant_eval.txt``, not the calibration text the plans were
  profiled on), prefilled through the engine in chunks of 256, for every recall row without
  eviction.
- **Endless session** (--turns, --reply-tokens): one voice session through one engine, each turn
  a new request whose prompt is the whole conversation in the chat template (system prompt, the
  dialogue set's user turns in order, the replies) plus the next utterance, --reply-tokens greedy
  tokens of reply; the full cache until its context window is full, and sinks + window (a fixed
  KV budget of --sinks + --window tokens) for every turn. Per turn: KV blocks in use, tokens held,
  RSS now, prefill ms, TTFT, decode ms/token, wall ITL, load; --session-plot draws them against
  the turn. A 2,000-turn session holds the lock for long: --session-lock PATH takes it for
  --session-lock-turns turns at a time, so each turn's timing is taken under it.

Run under the shared lock, and write down ``uptime`` beside the figures:

    flock /tmp/bench.lock .venv/bin/python scripts/bench_kv.py --out docs/benchmarks/kv/window.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edge_rtgi.catalog import resolve_model
from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.engine import GenerationResult, LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.kv.eviction import KVEviction
from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
from edge_rtgi.llm.kv.mixed import mixed_bytes_per_block
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
    kv_plan: str | None = None,
) -> LLMEngine:
    cfg = EngineConfig(
        model=MODEL,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=256,
        kv_window=window,
        kv_dtype=kv_dtype,
        kv_plan=kv_plan,
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


SESSION_SYSTEM_PROMPT = "You are a voice assistant. Answer in one short sentence."
SESSION_COLUMNS = (
    "turn",
    "context_tokens",  # the turn's prompt: system prompt, every earlier turn, this utterance
    "prefilled_tokens",  # what prefix hits left to compute
    "kv_blocks_used",  # most pool blocks in use during the turn (this session is alone)
    "kv_tokens_held",  # most tokens whose KV the request held at once (released blocks excluded)
    "rss_mib",  # the process's resident set after the turn (VmRSS, not the peak)
    "prefill_ms",  # forward pass(es) up to the first token
    "ttft_ms",  # submit to first token: prefill plus the per-turn bookkeeping (hashing the history...)
    "decode_ms_per_token",  # decode forward passes, mean per token
    "itl_ms",  # wall time between the reply's tokens, mean
    "turn_ms",  # wall time of the whole turn
    "load_1m",
    "locked",  # 1 when the turn ran while this process held --session-lock
)


def session_utterances(tokenizer: Any) -> list[list[int]]:
    """A voice session's turns, as the chat template renders each one: the user turns of the
    dialogue task set (questions and facts one says to an assistant), in order, each followed
    by the assistant header the reply is generated after."""
    from edge_rtgi.bench.tasks import DialogueItem, load_task_set

    items = [item for item in load_task_set("dialogue").items if isinstance(item, DialogueItem)]
    said = dict.fromkeys(m.content for item in items for m in item.messages if m.role == "user")
    system = [{"role": "system", "content": SESSION_SYSTEM_PROMPT}]
    head = tokenizer.encode_chat(system, add_generation_prompt=False)
    out = []
    for text in said:
        ids = tokenizer.encode_chat([*system, {"role": "user", "content": text}], add_generation_prompt=True)
        if ids[: len(head)] != head:
            raise SystemExit("the chat template does not render a turn as a suffix of the system prompt")
        out.append(ids[len(head) :])
    return out


def rss_mib() -> float:
    """The process's resident set now (not ``ru_maxrss``, the peak, which can only grow)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def session_turn(
    engine: LLMEngine, prompt: list[int], reply_tokens: int, rid: str
) -> tuple[dict[str, float], list[int]]:
    """One turn through the engine, stepped here: what ``SESSION_COLUMNS`` records of it, and the reply."""
    result = GenerationResult()
    start = time.perf_counter()
    engine.submit(
        prompt, SamplingParams(max_tokens=reply_tokens, ignore_eos=True), result.add, request_id=rid
    )
    blocks = held = 0
    prefill_s = decode_s = 0.0
    decode_steps = 0
    while True:
        run_before = engine.stats().run_s
        prefilling = not result.token_ids
        req = engine.scheduler.requests.get(rid)
        if not engine.step():
            break
        ran = engine.stats().run_s - run_before
        if prefilling:
            prefill_s += ran
        else:
            decode_s += ran
            decode_steps += 1
        blocks = max(blocks, engine.kv.pool.num_used_blocks)
        if req is not None and not req.is_finished:
            released = sum(b < 0 for b in engine.kv.block_ids(rid)[0])
            held = max(held, req.num_kv_tokens - released * engine.kv.block_size)
    turn_ms = (time.perf_counter() - start) * 1e3
    if result.error or result.usage is None:
        raise RuntimeError(f"turn {rid}: {result.error}")
    usage = result.usage
    times = usage.token_times_ms
    return {
        "context_tokens": len(prompt),
        "prefilled_tokens": usage.prompt_tokens - usage.cached_tokens,
        "kv_blocks_used": blocks,
        "kv_tokens_held": held,
        "prefill_ms": prefill_s * 1e3,
        "ttft_ms": usage.ttft_ms or 0.0,
        "decode_ms_per_token": decode_s * 1e3 / max(1, decode_steps),
        "itl_ms": (times[-1] - times[0]) / max(1, len(times) - 1),
        "turn_ms": turn_ms,
    }, result.token_ids


class SessionLock:
    """Holds ``path`` (flock, as ``flock /tmp/bench.lock``) for ``turns`` turns at a time and
    lets go between, so a long session never keeps other benchmarks off the lock for long."""

    def __init__(self, path: Path | None, turns: int):
        self.path, self.turns, self.fd = path, turns, -1

    def before(self, turn: int) -> bool:
        if self.path is None:
            return False
        if turn % self.turns == 0:
            self.release()
            import fcntl

            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return True

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


def session_end_of_turn(tok: Any) -> list[int]:
    """The tokens the chat template puts after a reply ("<|im_end|>\\n" for SmolLM2)."""
    ids = tok.encode_chat(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], add_generation_prompt=False
    )
    return list(ids[ids.index(tok.encode("y")[0]) + 1 :])


def session_depth_probe(
    loaded: Any, window: KVWindow, depths: list[int], rounds: int, reply_tokens: int
) -> dict[str, Any]:
    """Sessions at different depths in one engine, their turns interleaved so that load hits
    them alike: the same-run baseline for "latency does not grow with the turn count". Each
    session starts from a history of ``depth`` turns (the dialogue set's utterances, each
    answered by a fixed ``reply_tokens``-token reply) and then runs ``rounds`` real turns,
    round-robin; the first round (the deep sessions' long first prefill) is not counted.
    Per depth: medians of decode ms/token, prefill ms and TTFT, and their ratio to the first."""
    tok = loaded.tokenizer
    utterances, end_of_turn = session_utterances(tok), session_end_of_turn(tok)
    filler = tok.encode(" Noted, I will keep that in mind for you.")[:reply_tokens]
    system = tok.encode_chat(
        [{"role": "system", "content": SESSION_SYSTEM_PROMPT}], add_generation_prompt=False
    )
    histories = {}
    for depth in depths:
        h = list(system)
        for turn in range(depth):
            h += utterances[turn % len(utterances)] + filler + end_of_turn
        histories[depth] = h
    engine = engine_for(loaded, window, 640)
    rows: dict[int, list[dict[str, float]]] = {d: [] for d in depths}
    for r in range(rounds + 1):
        for depth in depths:
            turn = depth + r
            prompt = histories[depth] + utterances[turn % len(utterances)]
            point, reply = session_turn(engine, prompt, reply_tokens, f"probe-{depth}-{r}")
            histories[depth] = prompt + reply + end_of_turn
            if r:
                rows[depth].append({**point, "load_1m": os.getloadavg()[0]})
    del engine
    gc.collect()
    out: dict[str, Any] = {"depths": depths, "rounds": rounds, "reply_tokens": reply_tokens}
    base = str(depths[0])
    for depth in depths:
        med = {k: statistics.median(p[k] for p in rows[depth]) for k in rows[depth][0]}
        out[str(depth)] = {
            "context_tokens_first": rows[depth][0]["context_tokens"],
            "kv_blocks_used_max": max(p["kv_blocks_used"] for p in rows[depth]),
            **{f"{k}_median": round(v, 2) for k, v in med.items()},
        }
    for depth in depths:
        for k in ("decode_ms_per_token", "prefill_ms", "ttft_ms"):
            ratio = out[str(depth)][f"{k}_median"] / out[base][f"{k}_median"]
            out[str(depth)][f"{k}_ratio_to_{base}"] = round(ratio, 3)
    return out


def endless_session(
    loaded: Any,
    window: KVWindow | None,
    turns: int,
    num_blocks: int,
    reply_tokens: int,
    lock: SessionLock,
) -> dict[str, list[float]]:
    """A voice session of ``turns`` turns in one engine, each a new request whose prompt is the
    whole conversation so far (system prompt, every user turn and reply, in the chat template)
    plus the next utterance; ``reply_tokens`` greedy tokens of reply, which join the history with
    the template's end of turn. The full cache (``window`` None) stops when the next turn would
    not fit its context window. Returns ``SESSION_COLUMNS``, one value per turn."""
    engine = engine_for(loaded, window, num_blocks)
    tok = loaded.tokenizer
    utterances = session_utterances(tok)
    end_of_turn = session_end_of_turn(tok)
    history = tok.encode_chat(
        [{"role": "system", "content": SESSION_SYSTEM_PROMPT}], add_generation_prompt=False
    )
    columns: dict[str, list[float]] = {name: [] for name in SESSION_COLUMNS}
    try:
        for turn in range(turns):
            prompt = history + utterances[turn % len(utterances)]
            if len(prompt) + reply_tokens >= engine.max_model_len:
                break  # the full cache: its context window is full
            locked = lock.before(turn)
            point, reply = session_turn(engine, prompt, reply_tokens, f"turn-{turn}")
            point.update(turn=turn, rss_mib=rss_mib(), load_1m=os.getloadavg()[0], locked=int(locked))
            for name in SESSION_COLUMNS:
                columns[name].append(round(point[name], 2))
            history = prompt + reply + end_of_turn
            if turn % 100 == 0:
                print(f"  turn {turn}: {point}", flush=True)
    finally:
        lock.release()
        del engine
        gc.collect()  # the next configuration's RSS must not include this engine's pool
    return columns


def summarise_session(columns: dict[str, list[float]]) -> dict[str, Any]:
    """Medians over the first and the last 100 turns (or tenth, if shorter), the least-squares
    slope of decode ms/token and RSS per 1,000 turns past the first 100, and the peaks."""
    n = len(columns["turn"])
    if not n:
        return {}
    k = min(100, max(1, n // 10))

    def med(name: str, part: slice) -> float:
        return round(statistics.median(columns[name][part]), 2)

    def slope_per_1000(name: str) -> float | None:
        xs, ys = columns["turn"][k:], columns[name][k:]
        return round(statistics.linear_regression(xs, ys).slope * 1000, 3) if len(xs) > 2 else None

    first, last = slice(0, k), slice(n - k, n)
    out: dict[str, Any] = {
        "turns": n,
        "stretch_turns": k,
        "context_tokens_at_end": columns["context_tokens"][-1],
    }
    for name in ("decode_ms_per_token", "itl_ms", "prefill_ms", "ttft_ms", "prefilled_tokens", "turn_ms"):
        out[f"{name}_median_first"] = med(name, first)
        out[f"{name}_median_last"] = med(name, last)
    out["decode_ms_per_token_slope_per_1000_turns"] = slope_per_1000("decode_ms_per_token")
    out["ttft_ms_slope_per_1000_turns"] = slope_per_1000("ttft_ms")
    out["rss_mib_slope_per_1000_turns"] = slope_per_1000("rss_mib")
    for name in ("kv_blocks_used", "kv_tokens_held", "rss_mib"):
        out[f"{name}_max_first"] = max(columns[name][first])
        out[f"{name}_max_last"] = max(columns[name][last])
        out[f"{name}_max"] = max(columns[name])
    out["rss_mib_first"], out["rss_mib_last"] = columns["rss_mib"][0], columns["rss_mib"][-1]
    out["turns_locked"] = int(sum(columns["locked"]))
    out["load_1m_range"] = [min(columns["load_1m"]), max(columns["load_1m"])]
    return out


def session_title(out: dict[str, Any]) -> str:
    """The session plot's title: model, reply length, window, date and the load over the turns."""
    runs = [v for v in out["session"].values() if isinstance(v, dict) and "columns" in v]
    loads = [x for run in runs for x in run["columns"]["load_1m"]]
    return (
        f"{out['model']}: one voice session, whole history each turn, "
        f"{out['session']['reply_tokens']}-token replies\n"
        f"sinks_window = kv_window {out['window']['sink_tokens']} sinks + {out['window']['window_tokens']}; "
        f"{out['date']}, 1-min load {min(loads):.1f}-{max(loads):.1f}"
    )


def plot_session(session: dict[str, Any], path: Path, title: str) -> None:
    """KV blocks in use, RSS, decode ms/token and prefill ms against the turn, one line per
    configuration (decode and prefill: a rolling median over 25 turns, the turns as dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("kv_blocks_used", "KV blocks in use (16 tokens each)", False),
        ("rss_mib", "process RSS (MiB)", False),
        ("decode_ms_per_token", "decode ms per token", True),
        ("prefill_ms", "prefill ms (new tokens only)", True),
        ("load_1m", "1-min load average (2 cores)", False),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 13), sharex=True)
    for ax, (name, label, rolling) in zip(axes, panels, strict=True):
        for config, run in session.items():
            cols = run["columns"]
            xs, ys = cols["turn"], cols[name]
            if rolling:
                (line,) = ax.plot([], [], label=config)
                ax.scatter(xs, ys, s=1, alpha=0.25, color=line.get_color())
                smooth = [statistics.median(ys[max(0, i - 12) : i + 13]) for i in range(len(ys))]
                ax.plot(xs, smooth, color=line.get_color())
            else:
                ax.plot(xs, ys, label=config)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if rolling:  # a few slow outliers under load would flatten the lines
            values = sorted(v for run in session.values() for v in run["columns"][name])
            ax.set_ylim(0, values[int(len(values) * 0.99) - 1] * 1.2 if values else None)
    axes[0].legend(loc="upper left")
    axes[-1].set_xlabel("turn")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def plan_bytes(loaded: Any, plan_path: str, bytes_per_token: dict[str, float]) -> dict[str, Any]:
    """A KV plan's layers, bytes per token (``kv.mixed``, scales included) and open-block
    buffer per session (int4 layers' share of int4's), as ``bytes_per_token`` keys would be."""
    cfg = loaded.config
    dtypes = EngineConfig(kv_dtype="plan", kv_plan=plan_path).kv_layer_dtypes(cfg.num_layers)
    per_block = mixed_bytes_per_block(
        dtypes, BLOCK_TOKENS, cfg.num_kv_heads, cfg.head_dim, loaded.model.dtype
    )
    int4_share = dtypes.count("int4") / cfg.num_layers
    return {
        "layers": dtypes,
        "counts": {d: dtypes.count(d) for d in ("auto", "int8", "int4")},
        "bytes_per_token": per_block / BLOCK_TOKENS,
        "bits_per_value": 8
        * per_block
        / (2 * BLOCK_TOKENS * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim),
        "open_block_bytes": bytes_per_token["int4_open_block"] * int4_share,
    }


def next_token_logprobs(loaded: Any, tokens: list[int], **kwargs: Any) -> torch.Tensor:
    """[len(tokens) - 1, vocab] fp32 log-probabilities of each next token, the prompt prefilled
    through an engine built with ``kwargs`` (``engine_for``) in chunks of 256."""
    rows: dict[int, torch.Tensor] = {}

    def hook(module: Any, args: tuple[Any, ...], hidden: torch.Tensor) -> None:
        positions = args[1].tolist()
        keep = [i for i, p in enumerate(positions) if p + 1 < len(tokens)]
        if keep:
            logp = torch.log_softmax(module.compute_logits(hidden[keep]), dim=-1)
            for row, i in enumerate(keep):
                rows[positions[i]] = logp[row]

    handle = loaded.model.register_forward_hook(hook)
    try:
        engine = engine_for(loaded, num_blocks=-(-len(tokens) // 16) + 64, **{"window": None, **kwargs})
        run_one(engine, tokens, 1)
    finally:
        handle.remove()
    return torch.stack([rows[p] for p in range(len(tokens) - 1)])


def kl_rows(ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || q) per row, nats, from two [N, vocab] log-probability tensors."""
    return (ref.exp() * (ref - logp)).sum(-1)


KL_BLOCK_TOKENS = 64  # bootstrap unit of the KL comparisons: neighbouring tokens are not independent


def kl_summary(per_row: torch.Tensor) -> dict[str, Any]:
    """Mean, p95 and the per-token KLs (6 digits) of one configuration."""
    return {
        "mean": float(per_row.mean()),
        "p95": float(per_row.quantile(0.95)),
        "tokens": len(per_row),
        "per_token": [round(float(x), 6) for x in per_row],
    }


def kl_comparisons(rows: dict[str, list[float]], baselines: tuple[str, ...]) -> dict[str, Any]:
    """Mean KL of each row over each baseline's (and over its ``inv`` control's, for a plan),
    with a paired bootstrap 95 % interval (2,000 resamples, seed 0) over blocks of
    KL_BLOCK_TOKENS tokens, the same blocks drawn for both rows; not capped."""
    import numpy as np

    def blocks(values: list[float]) -> Any:
        n = len(values) // KL_BLOCK_TOKENS
        return np.asarray(values[: n * KL_BLOCK_TOKENS]).reshape(n, KL_BLOCK_TOKENS).mean(1)

    out: dict[str, Any] = {}
    for name, values in rows.items():
        partners = [b for b in baselines if b in rows and b != name]
        if name.startswith("plan_") and f"{name}inv" in rows:
            partners.append(f"{name}inv")
        for other in partners:
            a, b = blocks(values), blocks(rows[other])
            draws = np.random.default_rng(0).integers(0, len(a), size=(2000, len(a)))
            ratios = a[draws].sum(1) / b[draws].sum(1)
            low, high = np.percentile(ratios, [2.5, 97.5])
            out[f"{name}/{other}"] = {
                "ratio": float(a.sum() / b.sum()),
                "interval": [float(low), float(high)],
                "blocks": len(a),
            }
    return out


def recall(
    loaded: Any,
    num_items: int,
    sinks: int,
    names: list[str],
    bytes_per_token: dict[str, float],
    tuning: EvictionTuning = EvictionTuning(),
    plans: dict[str, str] | None = None,
    kl_tokens: list[int] | None = None,
) -> dict[str, Any]:
    from edge_rtgi.bench.task_eval import prepare_items, run_on_engine, select_items, task_retention
    from edge_rtgi.bench.tasks import load_task_set

    task_set = load_task_set("dialogue")
    requests = prepare_items(select_items(task_set, num_items), loaded.tokenizer)
    lengths = [len(r.prompt_token_ids) + r.max_tokens for r in requests]
    mean = statistics.fmean(len(r.prompt_token_ids) for r in requests)
    configs = {name: recall_config(name, mean, sinks, lengths, bytes_per_token, tuning) for name in names}
    plan_info = {}
    for label, path in (plans or {}).items():  # KV precision per layer: bytes from the plan itself
        configs[f"plan_{label}"] = {"kv_dtype": "plan", "kv_plan": path}
        plan_info[f"plan_{label}"] = plan_bytes(loaded, path, bytes_per_token)
    reference = next_token_logprobs(loaded, kl_tokens) if kl_tokens else None
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
        if name in plan_info:
            token_bytes = plan_info[name]["bytes_per_token"]
            extra = plan_info[name]["open_block_bytes"] / bytes_per_token["fp"]
        else:
            token_bytes = bytes_per_token["fp" if kv_dtype == "auto" else kv_dtype]
            extra = open_block_tokens(kv_dtype, bytes_per_token)
        ratio = token_bytes / bytes_per_token["fp"]
        held = held_fractions(lengths, cap, ratio, extra)
        eviction = kwargs.get("eviction")
        kl = None
        if reference is not None and kl_tokens and eviction is None and window is None:
            kl = kl_summary(kl_rows(reference, next_token_logprobs(loaded, kl_tokens, **kwargs)))
        out[name] = {
            "window": None if window is None else [window.sink_tokens, window.window_tokens],
            "kv_budget_tokens": budget,
            "kv_eviction": None if eviction is None else eviction.__dict__,
            "evicted_tokens": engine.stats().kv_evicted_tokens,
            "kv_dtype": kv_dtype,
            "kv_plan": plan_info.get(name),
            "kv_bytes_per_token": token_bytes,
            "kl_eval_text": kl,
            "kv_fraction_of_full_tokens": held["tokens"],
            "kv_fraction_of_full_bytes": held["bytes"],
            "kv_pool_fraction_of_full_bytes": held["pool_bytes"],
            "kv_bytes_per_session_mean": session_bytes(
                lengths, cap, token_bytes, extra * bytes_per_token["fp"]
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
    kls = {
        n: v["kl_eval_text"]["per_token"]
        for n, v in out.items()
        if isinstance(v, dict) and v.get("kl_eval_text")
    }
    if kls:
        out["kl_comparisons"] = kl_comparisons(kls, ("int8", "int4"))
        print(f"kl comparisons: {out['kl_comparisons']}", flush=True)
    return out


def kl_only(loaded: Any, args: argparse.Namespace, bytes_per_token: dict[str, float]) -> dict[str, Any]:
    """KL(full || configuration) over --kl-tokens of the evaluation text for --recall-configs
    int8 / int4 and every --kv-plans plan, without the recall set (its replies cost minutes per
    row on this machine; the KL costs one prefill)."""
    from edge_rtgi.llm.quant.profile import calibration_text

    tokens = list(loaded.tokenizer.encode(calibration_text("eval")))[: args.kl_tokens]
    configs: dict[str, dict[str, Any]] = {
        n: {"kv_dtype": n} for n in args.recall_configs.split(",") if n in ("int8", "int4")
    }
    plans = dict(item.split("=", 1) for item in args.kv_plans.split(",") if item)
    for label, path in plans.items():
        configs[f"plan_{label}"] = {"kv_dtype": "plan", "kv_plan": path}
    reference = next_token_logprobs(loaded, tokens)
    out: dict[str, Any] = {"tokens": len(tokens) - 1}
    for name, kwargs in configs.items():
        start = time.perf_counter()
        per_row = kl_rows(reference, next_token_logprobs(loaded, tokens, **kwargs))
        info = plan_bytes(loaded, kwargs["kv_plan"], bytes_per_token) if "kv_plan" in kwargs else None
        out[name] = {
            "kv_plan": info,
            "kv_bytes_per_token": info["bytes_per_token"] if info else bytes_per_token[kwargs["kv_dtype"]],
            "kl_mean": float(per_row.mean()),
            "kl_p95": float(per_row.quantile(0.95)),
            "kl_per_256": [round(float(c.mean()), 6) for c in per_row.split(256)],
            "kl": kl_summary(per_row),
            "wall_s": time.perf_counter() - start,
        }
        print(f"kl {name}: {out[name]['kl_mean']:.5f} (p95 {out[name]['kl_p95']:.5f})", flush=True)
    rows = {n: v["kl"]["per_token"] for n, v in out.items() if isinstance(v, dict)}
    out["comparisons"] = kl_comparisons(rows, ("int8", "int4"))
    print(f"kl comparisons: {out['comparisons']}", flush=True)
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
        help="comma-separated, the first is the baseline: full, sinks_window, window_only, h2o, snapkv, "
        "int8, int4 (KV dtypes, full cache), int4_gather (int4 with its fused decode kernel off), "
        "full_cutoff (bf16 with the paged cache's old 384-key cut-off to gather + SDPA)",
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
    ap.add_argument("--turns", type=int, default=200, help="endless session: turns")
    ap.add_argument("--reply-tokens", type=int, default=8, help="endless session: greedy tokens per reply")
    ap.add_argument("--session-plot", type=Path, help="endless session: write its plot (PNG) here")
    ap.add_argument(
        "--session-lock", type=Path, help="endless session: hold this flock (/tmp/bench.lock) while timing"
    )
    ap.add_argument("--session-lock-turns", type=int, default=250, help="turns per hold of --session-lock")
    ap.add_argument(
        "--probe-rounds", type=int, default=0, help="endless session: interleaved turns per depth; 0: skip"
    )
    ap.add_argument(
        "--plot-from", type=Path, help="endless session: draw --session-plot from this JSON and stop"
    )
    ap.add_argument("--probe-depths", default="50,1900", help="endless session: the probe's starting turns")
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
    ap.add_argument(
        "--kv-plans",
        default="",
        help="comma-separated LABEL=PLAN.yaml: KV precision per layer (kv_dtype: plan), a recall row each",
    )
    ap.add_argument(
        "--kl-tokens",
        type=int,
        default=0,
        help="KL against the full cache over this many tokens of the evaluation text, for recall rows "
        "without eviction (0: skip)",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.plot_from and args.session_plot:
        saved = json.loads(args.plot_from.read_text())
        runs = {k: v for k, v in saved["session"].items() if isinstance(v, dict) and "columns" in v}
        plot_session(runs, args.session_plot, session_title(saved))
        return 0
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
                    if name in ("int8", "int4", "int4_gather"):
                        kwargs = {"window": None, "kv_dtype": name.removesuffix("_gather")}
                    if name in ("h2o", "snapkv"):
                        kwargs = {
                            "window": None,
                            "budget_tokens": args.budget_tokens,
                            "eviction": KVEviction(name),
                        }
                    engine = engine_for(loaded, num_blocks=-(-length // 16) + 64, **kwargs)
                    # int4_gather: int4 KV with its fused decode kernel off (gather + SDPA);
                    # full_cutoff: bf16 KV with the paged cache's old 384-key cut-off to SDPA
                    off = ("decode_attention_int4",) if name == "int4_gather" else None
                    paged_cutoff = cpu_ops.PAGED_DECODE_ATTENTION_MAX_KEYS
                    if name == "full_cutoff":
                        cpu_ops.PAGED_DECODE_ATTENTION_MAX_KEYS = cpu_ops.DECODE_ATTENTION_MAX_KEYS
                    try:
                        with cpu_ops.disabled(*off) if off else contextlib.nullcontext():
                            result, _ = run_one(engine, text[:length], args.decode_tokens)
                    finally:
                        cpu_ops.PAGED_DECODE_ATTENTION_MAX_KEYS = paged_cutoff
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
        out["decode_runs"] = args.decode_runs
        load.append(os.getloadavg()[0])
    if "session" not in skip or args.probe_rounds:
        session_configs = () if "session" in skip else ("full", "sinks_window")
        out["session"] = {"reply_tokens": args.reply_tokens, "system_prompt": SESSION_SYSTEM_PROMPT}
        lock = SessionLock(args.session_lock, args.session_lock_turns)
        for name in session_configs:
            columns = endless_session(loaded, configs[name], args.turns, 640, args.reply_tokens, lock)
            out["session"][name] = {"summary": summarise_session(columns), "columns": columns}
            print(f"session {name}: {out['session'][name]['summary']}", flush=True)
            load.append(os.getloadavg()[0])
        if args.probe_rounds:
            depths = [int(d) for d in args.probe_depths.split(",")]
            lock.before(0)
            try:
                probe = session_depth_probe(loaded, sinks, depths, args.probe_rounds, args.reply_tokens)
            finally:
                lock.release()
            out["session"]["depth_probe"] = probe
            print(f"session depth probe: {probe}", flush=True)
        runs = {k: v for k, v in out["session"].items() if isinstance(v, dict) and "columns" in v}
        if args.session_plot and runs:
            plot_session(runs, args.session_plot, session_title(out))
    if args.kl_tokens and not args.recall_items:  # KL alone: every configuration without eviction
        out["kl"] = kl_only(loaded, args, out["kv_bytes_per_token"])
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
        plans = dict(item.split("=", 1) for item in args.kv_plans.split(",") if item)
        kl_tokens = None
        if args.kl_tokens:
            from edge_rtgi.llm.quant.profile import calibration_text

            kl_tokens = list(loaded.tokenizer.encode(calibration_text("eval")))[: args.kl_tokens]
        out["recall"] = recall(
            loaded,
            args.recall_items,
            args.sinks,
            names,
            out["kv_bytes_per_token"],
            EvictionTuning(args.slack_tokens, args.contrast_tokens),
            plans,
            kl_tokens,
        )
        load.append(os.getloadavg()[0])
    out["load_avg_1m"] = load
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # a session's per-turn columns, one number a line, would nearly double the file: one line
        indent = None if "session" in out else 1
        args.out.write_text(json.dumps(out, indent=indent) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
