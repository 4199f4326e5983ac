"""``edge-rtgi bench llm``: the engine against HF transformers, same model, same prompts, same run.

Four figures, each a median over ``runs`` timed runs after one untimed warm-up (the
throughput passes, already warm from the earlier figures, skip it). Engine and HF runs
alternate run by run, so a change in machine load during the benchmark hits both alike:

- batch-1 decode tok/s: one greedy request, ``decode_tokens`` new tokens after a
  ``prompt_tokens`` prompt. Rate = (n - 1) / (time of last token - time of first token), so
  prefill is excluded on both sides (HF: token times taken by a streamer);
- TTFT of a ``ttft_prompt_tokens`` prompt, cold (prefix cache emptied) and with the first
  ``cached_prefix_tokens`` already cached by an earlier request (a shared system prompt);
- total throughput of ``concurrency`` requests submitted together (HF: one after another,
  since it has no continuous batching).

Our plain path (``edge_rtgi.llm.generate``, contiguous cache, same dtype as the engine) is
timed too, so the engine's own overhead at batch 1 is visible.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_rtgi.bench.metrics import median

if TYPE_CHECKING:
    from edge_rtgi.llm.engine import GenerationResult
    from edge_rtgi.llm.request import Usage

log = logging.getLogger(__name__)

_TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. Later, towers of "
    "stone carried lamps of oil, and lenses gathered their light into beams that reached far out to sea. "
    "Keepers lived beside them, trimming wicks, cleaning glass, and writing the weather into logbooks. "
)


@dataclass(frozen=True)
class LLMBenchConfig:
    """What ``bench llm`` measures. Token counts are exact (prompts are cut to length)."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    quant: str | None = "auto"  # our weights, as the engine's ``quant`` setting: auto, none, int8, a plan...
    prompt_tokens: int = 64
    decode_tokens: int = 64
    ttft_prompt_tokens: int = 512
    cached_prefix_tokens: int = 448
    concurrency: int = 16
    concurrent_max_tokens: int = 32
    runs: int = 3
    num_threads: int = 2
    hf: bool = True


def _prompt(tokenizer: Any, num_tokens: int, salt: str = "") -> list[int]:
    ids: list[int] = []
    text = salt + _TEXT
    while len(ids) < num_tokens:
        ids = tokenizer.encode(text)
        text += _TEXT
    return ids[:num_tokens]


def _usage(result: GenerationResult) -> Usage:
    """The usage of a request the engine finished (RuntimeError where it reports none: it failed)."""
    if result.usage is None:
        raise RuntimeError(
            f"the engine finished a request without usage: {result.error or result.finish_reason}"
        )
    return result.usage


class _Ours:
    """The engine (and the plain path) on our loaded model."""

    def __init__(self, loaded: Any, cfg: LLMBenchConfig):
        from edge_rtgi.llm.engine import LLMEngine
        from edge_rtgi.llm.engine_config import EngineConfig

        self.loaded = loaded
        self.engine = LLMEngine.from_loaded(loaded, EngineConfig(num_threads=cfg.num_threads))

    def decode_rate(self, prompt: list[int], n: int) -> float:
        from edge_rtgi.llm.sampling import SamplingParams

        before = self.engine.stats()
        usage = _usage(self.engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0])
        after = self.engine.stats()
        steps = after.num_steps - before.num_steps
        self.step_breakdown_ms = {  # mean per step of this run (prefill step included)
            phase: round((getattr(after, phase) - getattr(before, phase)) / steps * 1e3, 3)
            for phase in ("schedule_s", "run_s", "update_s")
        }
        times = usage.token_times_ms
        return (len(times) - 1) / ((times[-1] - times[0]) / 1e3)

    def plain_decode_rate(self, prompt: list[int], n: int) -> float:
        from edge_rtgi.llm.generate import generate_stream
        from edge_rtgi.llm.sampling import SamplingParams

        stamps = [
            time.perf_counter()
            for _ in generate_stream(self.loaded, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        ]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def ttft_ms(self, prompt: list[int]) -> tuple[float, int]:
        from edge_rtgi.llm.sampling import SamplingParams

        usage = _usage(self.engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0])
        if usage.ttft_ms is None:
            raise RuntimeError("the engine finished a one-token request without a first token")
        return usage.ttft_ms, usage.cached_tokens

    def throughput(self, prompts: list[list[int]], n: int) -> float:
        from edge_rtgi.llm.sampling import SamplingParams

        self.engine.reset_prefix_cache()  # repeated passes must not gain from the previous one
        start = time.perf_counter()
        results = self.engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        elapsed = time.perf_counter() - start
        return sum(len(r.token_ids) for r in results) / elapsed


class _HF:
    """HF transformers fp32 with eager attention: the baseline named in issue 3."""

    def __init__(self, source: Path, model_name: str):
        import torch
        from transformers import AutoModelForCausalLM

        from edge_rtgi.bench.peers import ensure_hf_folder

        folder = ensure_hf_folder(source, model_name)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def _generate(self, prompt: list[int], n: int) -> tuple[float, list[float]]:
        """Wall time of ``generate`` and the time each new token reached the streamer."""
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        stamps: list[float] = []

        class Stamps(BaseStreamer):
            def __init__(self) -> None:
                self.prompt_seen = False

            def put(self, value: Any) -> None:  # first call: the prompt; then one call per token
                if self.prompt_seen:
                    stamps.append(time.perf_counter())
                self.prompt_seen = True

            def end(self) -> None:
                pass

        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                streamer=Stamps(),
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] == len(prompt) + n
        return elapsed, stamps

    def _generate_s(self, prompt: list[int], n: int) -> float:
        return self._generate(prompt, n)[0]

    def decode_rate(self, prompt: list[int], n: int) -> float:
        stamps = self._generate(prompt, n)[1]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def ttft_ms(self, prompt: list[int]) -> float:
        return self._generate_s(prompt, 1) * 1e3

    def throughput(self, prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        for p in prompts:
            self._generate_s(p, n)
        return len(prompts) * n / (time.perf_counter() - start)


def _run(fn: Any) -> Any:
    """One timed call, then free this thread's OpenMP workers: HF and the plain path run on this
    thread, the engine on its own, and an idle pool left by one would slow the other's every
    parallel op (edge_rtgi.device.release_cpu_workers; the engine frees its own when idle)."""
    from edge_rtgi.device import release_cpu_workers

    try:
        return fn()
    finally:
        release_cpu_workers()


def _measure(fn: Any, runs: int, warmup: bool = True) -> dict[str, Any]:
    if warmup:
        _run(fn)
    values = [_run(fn) for _ in range(runs)]
    return {"median": median(values), "runs": runs, "values": values}


def _measure_interleaved(fns: dict[str, Any], runs: int, warmup: bool = True) -> dict[str, dict[str, Any]]:
    """Like ``_measure`` for several contenders, alternating them run by run, so that a change
    in machine load during the benchmark hits every contender alike."""
    if warmup:
        for fn in fns.values():
            _run(fn)
    values: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            values[name].append(_run(fn))
    return {name: {"median": median(v), "runs": runs, "values": v} for name, v in values.items()}


def run_llm_bench(cfg: LLMBenchConfig) -> dict[str, Any]:
    """Run every measurement; returns a JSON-ready dict (see ``render``)."""
    import torch

    from edge_rtgi.catalog import resolve_model
    from edge_rtgi.llm.quant import apply_engine_quant
    from edge_rtgi.llm.quant.policy import resolve_weight_quant
    from edge_rtgi.llm.weights import load_model

    torch.set_num_threads(cfg.num_threads)
    source = resolve_model(cfg.model, role="llm")
    loaded = load_model(source, device="cpu", dtype=cfg.dtype)
    # With quantised weights, the same engine on full-precision weights decodes in the same
    # interleaved runs, so the report separates what the weights gain from the rest.
    quantised = resolve_weight_quant(cfg.quant, loaded.model.device, loaded.model.dtype) is not None
    full = load_model(source, device="cpu", dtype=cfg.dtype) if quantised else None
    applied = apply_engine_quant(loaded.model, cfg.quant, loaded.tokenizer)
    cfg = replace(cfg, quant=f"{applied} ({cfg.quant})" if applied and cfg.quant == "auto" else applied)
    ours = _Ours(loaded, cfg)
    ours_full = _Ours(full, cfg) if full is not None and applied else None
    tok = loaded.tokenizer
    decode_prompt = _prompt(tok, cfg.prompt_tokens)
    long_prompt = _prompt(tok, cfg.ttft_prompt_tokens)
    prefix = long_prompt[: cfg.cached_prefix_tokens]
    tail_len = cfg.ttft_prompt_tokens - cfg.cached_prefix_tokens
    concurrent = [_prompt(tok, 24 + 2 * i, salt=f"Question {i}. ") for i in range(cfg.concurrency)]
    counter = iter(range(10**6))

    def cold() -> float:
        ours.engine.reset_prefix_cache()
        return ours.ttft_ms(long_prompt)[0]

    def cached() -> float:
        ours.ttft_ms(prefix + _prompt(tok, tail_len, salt="Warm-up. "))  # make sure the prefix is cached
        ttft, hit = ours.ttft_ms(prefix + _prompt(tok, tail_len, salt=f"Variant {next(counter)}. "))
        cached_tokens.append(hit)
        return ttft

    cached_tokens: list[int] = []
    out: dict[str, Any] = {
        "config": asdict(cfg),
        "engine_dtype": str(loaded.model.dtype).replace("torch.", ""),
    }
    hf = _HF(Path(source), cfg.model) if cfg.hf else None
    log.info("measuring the engine%s, interleaved run by run", " and HF transformers fp32" if hf else "")

    def pair(
        ours_fn: Any, hf_fn: Any | None, warmup: bool = True, more: dict[str, Any] | None = None
    ) -> dict[str, dict[str, Any]]:
        fns = {"ours": ours_fn, **({"hf": hf_fn} if hf and hf_fn else {}), **(more or {})}
        return _measure_interleaved(fns, cfg.runs, warmup)

    full_decode = (
        {"full": lambda: ours_full.decode_rate(decode_prompt, cfg.decode_tokens)} if ours_full else {}
    )
    decode = pair(
        lambda: ours.decode_rate(decode_prompt, cfg.decode_tokens),
        hf and (lambda: hf.decode_rate(decode_prompt, cfg.decode_tokens)),
        more=full_decode,
    )
    if ours_full:
        ours_full.engine.shutdown()
    plain = _measure(lambda: ours.plain_decode_rate(decode_prompt, cfg.decode_tokens), cfg.runs)
    ttft = pair(cold, hf and (lambda: hf.ttft_ms(long_prompt)))
    cached_ttft = _measure(cached, cfg.runs)
    # HF is already warm from the runs above; a request-by-request pass is long enough
    throughput = pair(
        lambda: ours.throughput(concurrent, cfg.concurrent_max_tokens),
        hf and (lambda: hf.throughput(concurrent, cfg.concurrent_max_tokens)),
        warmup=False,
    )
    out["ours"] = {
        "decode_tok_s": decode["ours"],
        "plain_decode_tok_s": plain,
        "ttft_cold_ms": ttft["ours"],
        "ttft_cached_ms": cached_ttft,
        "throughput_tok_s": throughput["ours"],
    }
    out["ours"]["cached_tokens"] = cached_tokens[-1] if cached_tokens else 0
    if "full" in decode:
        out["ours"]["full_precision_decode_tok_s"] = decode["full"]
    out["ours"]["decode_step_breakdown_ms"] = ours.step_breakdown_ms
    out["ours"]["engine_stats"] = ours.engine.stats().as_dict()
    ours.engine.shutdown()
    if hf:
        out["hf"] = {
            "decode_tok_s": decode["hf"],
            "ttft_cold_ms": ttft["hf"],
            "throughput_tok_s": throughput["hf"],
        }
    return out


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Engine / HF ratios (speed-ups: higher is better) and the prefix-cache TTFT reduction."""
    o, h = results["ours"], results.get("hf")
    cfg = results["config"]
    out = {
        "ttft_reduction_from_cache": 1 - o["ttft_cached_ms"]["median"] / o["ttft_cold_ms"]["median"],
        "cached_share_of_prompt": o["cached_tokens"] / cfg["ttft_prompt_tokens"],
        "engine_vs_plain_decode": o["decode_tok_s"]["median"] / o["plain_decode_tok_s"]["median"],
    }
    if h:
        out["decode_vs_hf"] = o["decode_tok_s"]["median"] / h["decode_tok_s"]["median"]
        if "full_precision_decode_tok_s" in o:
            out["full_precision_decode_vs_hf"] = (
                o["full_precision_decode_tok_s"]["median"] / h["decode_tok_s"]["median"]
            )
        out["ttft_cold_speedup_vs_hf"] = h["ttft_cold_ms"]["median"] / o["ttft_cold_ms"]["median"]
        out["throughput_vs_hf"] = o["throughput_tok_s"]["median"] / h["throughput_tok_s"]["median"]
    return out


def render(results: dict[str, Any]) -> str:
    """A markdown table: medians, run counts and ratios."""
    cfg, o, h = results["config"], results["ours"], results.get("hf")
    r = ratios(results)

    def cell(section: dict | None, key: str, fmt: str) -> str:
        if not section or key not in section:
            return "-"
        m = section[key]
        return f"{m['median']:{fmt}} (n={m['runs']})"

    rows = [
        ("batch-1 decode, tok/s", "decode_tok_s", ".1f", r.get("decode_vs_hf")),
        (
            f"TTFT {cfg['ttft_prompt_tokens']}-token prompt, cold, ms",
            "ttft_cold_ms",
            ".0f",
            r.get("ttft_cold_speedup_vs_hf"),
        ),
        (f"TTFT, {o['cached_tokens']} tokens cached, ms", "ttft_cached_ms", ".0f", None),
        (
            f"{cfg['concurrency']} concurrent requests x {cfg['concurrent_max_tokens']} tokens, total tok/s",
            "throughput_tok_s",
            ".1f",
            r.get("throughput_vs_hf"),
        ),
    ]
    quant = f" + {cfg['quant']} weights" if cfg.get("quant") else ""
    lines = [
        f"model {cfg['model']}, engine dtype {results['engine_dtype']}{quant}, HF transformers fp32 eager, "
        f"{cfg['num_threads']} threads; medians of n timed runs after a warm-up",
        "",
        "| measurement | engine | HF fp32 | speed-up |",
        "|---|---|---|---|",
    ]
    for label, key, fmt, ratio in rows:
        lines.append(
            f"| {label} | {cell(o, key, fmt)} | {cell(h, key, fmt)} | {f'{ratio:.2f}x' if ratio else '-'} |"
        )
    lines += [
        "",
        f"- plain path (contiguous cache, same dtype) batch-1 decode: {cell(o, 'plain_decode_tok_s', '.1f')}"
        f" tok/s; engine/plain = {r['engine_vs_plain_decode']:.2f}",
        f"- prefix cache: TTFT falls by {r['ttft_reduction_from_cache']:.0%} with "
        f"{r['cached_share_of_prompt']:.0%} of the prompt cached",
    ]
    if "full_precision_decode_tok_s" in o:
        vs_hf = r.get("full_precision_decode_vs_hf")
        lines.append(
            f"- the engine on full-precision {results['engine_dtype']} weights, same interleaved runs: "
            f"{cell(o, 'full_precision_decode_tok_s', '.1f')} tok/s batch-1 decode"
            + (f", {vs_hf:.2f}x HF fp32" if vs_hf else "")
        )
    b = o.get("decode_step_breakdown_ms")
    if b:
        lines.append(
            f"- batch-1 engine step, mean ms: schedule {b['schedule_s']}, forward + sampling "
            f"{b['run_s']}, update + detokenise + deliver {b['update_s']}"
        )
    return "\n".join(lines)
