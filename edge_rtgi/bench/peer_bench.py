"""Our engine, the plain reference path and the peer engines, side by side on the same token ids.

Two measurements per engine, all in one process, one after the other, with the same thread count:

- Batch 1: a ``decode_prompt_tokens``-token prompt, ``decode_new_tokens`` greedy tokens with
  EOS ignored, cold caches (prefix caches reset before each run); one short warm-up run,
  then ``decode_runs`` timed runs. TTFT = first token time - send time; decode speed =
  (tokens - 1) / (last token time - first token time). Medians are reported.
- Throughput under load: ``load_requests`` voice-workload prompts sent at once, each
  generating exactly ``load_max_tokens`` tokens. Our engine batches them; the plain path and
  the peers serve them one by one ("request by request"). Throughput = output tokens / makespan.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Any

from edge_rtgi.bench.loadgen import LoadSpec, run_load
from edge_rtgi.bench.metrics import SLO, median
from edge_rtgi.bench.peers import PeerUnavailable, build_peer
from edge_rtgi.bench.targets import EngineTarget, ThreadedTarget, plain_stream_fn
from edge_rtgi.bench.workloads import PreparedRequest, get_workload, prepare, system_prompt

log = logging.getLogger(__name__)


def decode_prompt_ids(tokenizer: Any, num_tokens: int) -> tuple[int, ...]:
    """Exactly ``num_tokens`` tokens of plain English prose (the system prompt, repeated)."""
    text = system_prompt()
    ids = tokenizer.encode(text)
    while len(ids) < num_tokens:
        ids = ids + tokenizer.encode(" " + text)
    return tuple(ids[:num_tokens])


async def timed_stream(target: Any, request: PreparedRequest) -> tuple[list[int], float, list[float]]:
    """Token ids, send time and per-token arrival times (perf_counter seconds) of one request."""
    ids: list[int] = []
    times: list[float] = []
    sent = time.perf_counter()
    async for chunk in target.stream(request):
        now = time.perf_counter()
        ids.extend(chunk.token_ids)
        times.extend([now] * chunk.num_tokens)
    return ids, sent, times


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def batch1(
    target: Any, request: PreparedRequest, runs: int, reset: Any, reference: list[int] | None
) -> dict:
    """Warm up once (8 tokens), then ``runs`` cold timed runs of ``request``."""
    reset()
    await timed_stream(target, replace(request, max_tokens=8))
    ttft_ms: list[float] = []
    decode_tok_s: list[float] = []
    ids: list[int] = []
    for _ in range(runs):
        reset()
        ids, sent, times = await timed_stream(target, request)
        if not times:
            raise RuntimeError(f"{target.name} produced no tokens")
        ttft_ms.append((times[0] - sent) * 1e3)
        span = times[-1] - times[0]
        decode_tok_s.append((len(times) - 1) / span if span > 0 else float("nan"))
    return {
        "ttft_ms": median(ttft_ms),
        "decode_tok_s": median(decode_tok_s),
        "runs": runs,
        "ttft_ms_runs": ttft_ms,
        "decode_tok_s_runs": decode_tok_s,
        "tokens": len(ids),
        "reference_prefix_match": _common_prefix(ids, reference) if reference is not None else None,
    }


async def under_load(target: Any, requests: list[PreparedRequest], num_requests: int) -> dict:
    spec = LoadSpec(
        pattern="burst",
        rate_rps=1000.0,
        burst_size=num_requests,
        num_requests=num_requests,
        max_duration_s=1.0,
        drain_timeout_s=900.0,
        seed=0,
    )
    result = await run_load(target, requests, spec, workload="load")
    m = result.metrics(SLO())
    return {
        "throughput_tok_s": m.throughput_tok_s,
        "duration_s": m.duration_s,
        "output_tokens": m.output_tokens,
        "num_requests": m.num_requests,
        "num_failed": m.num_failed,
        "ttft_ms": asdict(m.ttft_ms),
        "e2e_ms": asdict(m.e2e_ms),
        "peak_rss_mb": m.peak_rss_mb,
    }


async def _measure(
    label: str,
    kind: str,
    target: Any,
    reset: Any,
    decode_req: PreparedRequest,
    load_reqs: list[PreparedRequest],
    cfg: Any,
    reference: list[int] | None,
) -> dict:
    log.info("peers: measuring %s", label)
    entry: dict[str, Any] = {"name": label, "kind": kind}  # a JSON record of the report
    entry["batch1"] = await batch1(target, decode_req, cfg.decode_runs, reset, reference)
    reset()
    entry["load"] = await under_load(target, load_reqs, cfg.load_requests)
    return entry


async def run_peers_section(models: Any, engine: Any, cfg: Any, gguf_path: Any) -> dict:
    """Batch-1 and under-load numbers for our engine, the plain path and each available peer."""
    tok = models.optimised.tokenizer
    decode_req = PreparedRequest(
        key="decode",
        workload="decode",
        max_tokens=cfg.decode_new_tokens,
        prompt_token_ids=decode_prompt_ids(tok, cfg.decode_prompt_tokens),
        ignore_eos=True,
    )
    load_reqs = [
        replace(r, max_tokens=cfg.load_max_tokens, ignore_eos=True)
        for r in prepare(get_workload("voice"), tok)
    ]
    plain = ThreadedTarget("plain", plain_stream_fn(models.full))
    reference, _, _ = await timed_stream(plain, decode_req)
    entries, skipped = [], []
    ours = f"edge-rtgi engine ({_describe(cfg.optimisations)})"
    entries.append(
        await _measure(
            ours,
            "ours",
            EngineTarget(engine, ours),
            engine.reset_prefix_cache,
            decode_req,
            load_reqs,
            cfg,
            reference,
        )
    )
    for spec in cfg.peer_variants:
        entries.append(await _measure_variant(models, cfg, spec, decode_req, load_reqs, reference))
    entries.append(
        await _measure(
            "edge-rtgi plain path (fp32, request by request)",
            "plain",
            plain,
            lambda: None,
            decode_req,
            load_reqs,
            cfg,
            reference,
        )
    )
    plain.close()
    for name in cfg.peers:
        try:
            peer = build_peer(name, gguf_path, cfg.model, cfg.num_threads)
        except PeerUnavailable as exc:
            skipped.append({"name": name, "reason": str(exc)})
            log.warning("peers: skipping %s: %s", name, exc)
            continue
        target = ThreadedTarget(peer.name, peer.stream)
        reset = getattr(peer, "reset", lambda: None)
        try:
            entries.append(
                await _measure(
                    f"{peer.name} (request by request)",
                    name,
                    target,
                    reset,
                    decode_req,
                    load_reqs,
                    cfg,
                    reference,
                )
            )
        finally:
            target.close()
            peer.close()
    return {
        "decode_prompt_tokens": cfg.decode_prompt_tokens,
        "decode_new_tokens": cfg.decode_new_tokens,
        "load_requests": cfg.load_requests,
        "load_max_tokens": cfg.load_max_tokens,
        "entries": entries,
        "skipped": skipped,
        "ratios": ratios(entries),
    }


async def _measure_variant(
    models: Any,
    cfg: Any,
    spec: str,
    decode_req: PreparedRequest,
    load_reqs: list[PreparedRequest],
    reference: list[int],
) -> dict:
    """Our engine with one switch changed (its own weights when dtype or quantisation differ)."""
    from edge_rtgi.bench.suite import load_optimised, make_engine, model_for

    opt = cfg.optimisations.changed(spec)
    loaded = model_for(models, opt, cfg.optimisations)
    if loaded is None:
        loaded, _ = load_optimised(models.source, opt)
    engine = make_engine(loaded, opt, cfg)
    name = f"edge-rtgi engine ({_describe(opt)})"
    try:
        entry = await _measure(
            name,
            "ours-variant",
            EngineTarget(engine, name),
            engine.reset_prefix_cache,
            decode_req,
            load_reqs,
            cfg,
            reference,
        )
    finally:
        engine.shutdown()
    entry["variant"] = spec
    return entry


def _describe(opt: Any) -> str:
    parts = [
        f"dtype {opt.dtype}",
        f"batch<={opt.max_num_seqs}",
        "prefix cache" if opt.prefix_caching else "no prefix cache",
    ]
    if opt.quant:
        parts.append(f"quant {opt.quant}")
    return ", ".join(parts)


def ratios(entries: list[dict]) -> list[dict]:
    """For each of our engines, ours / theirs for decode speed, TTFT (lower is better) and throughput."""
    out = []
    for ours in (e for e in entries if e["kind"].startswith("ours")):
        for e in entries:
            if e["kind"].startswith("ours"):
                continue
            out.append(
                {
                    "ours": ours["name"],
                    "ours_kind": ours["kind"],
                    "vs": e["name"],
                    "kind": e["kind"],
                    "decode_speed": ours["batch1"]["decode_tok_s"] / e["batch1"]["decode_tok_s"],
                    "ttft": ours["batch1"]["ttft_ms"] / e["batch1"]["ttft_ms"],
                    "throughput_under_load": ours["load"]["throughput_tok_s"] / e["load"]["throughput_tok_s"],
                }
            )
    return out
