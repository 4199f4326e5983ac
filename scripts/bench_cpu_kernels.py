"""What each fused CPU kernel (edge_rtgi/llm/cpu_ops.py) is worth inside a real decode step.

Paired, per step: every configuration keeps its own KV cache and decodes one token in turn, so
that the machine's drift (tens of percent over minutes on a shared host) hits all of them alike;
the figure reported is the median over steps of each configuration's step time divided by the
step time of a reference configuration in the same round.

    python scripts/bench_cpu_kernels.py                      # SmolLM2, quant auto, 300 steps
    python scripts/bench_cpu_kernels.py --quant none --steps 200

Configurations:
- "layer loop": the shipped path (``cpu_ops.run_decode_layers``, the layer stack in one C++ call);
- "per-op": the layer loop off, the Python layers calling every fused kernel;
- "per-op without <kernel>": the same with that kernel replaced by its PyTorch ops;
- "none": ``cpu_ops.disabled()``, the plain PyTorch ops;
- "layer loop, one-row int8 on ATen": the shipped path with the LM head's one-row matmul on ATen's
  kernel instead of ``cpu_ops.int8_mm`` (``INT8_ONE_ROW_MIN_WEIGHTS``).
The per-op rows are compared with "per-op" (what each kernel is worth), the others with "layer loop".

``--multi-row``: the weight-only matmuls of one decode step (every quantised linear of the model,
in forward order, the LM head included) on inputs of 1, 2, 4, 5, 8, 9, 12 and 16 rows (the shape of
verifying k draft tokens, or of a decode batch; ``--row-counts`` for others), interleaved round by
round:
- "shipped": what ``Int4Linear`` / ``Int8Linear`` run (ATen's kernel at 1 row, ``cpu_ops.int4_mm`` /
  ``int8_mm`` at 2..32 rows);
- "int8 act": ``cpu_ops.int4_i8_mm`` on each int4 layer's repacked weights, activations rounded to
  int8 (what ``int8_activations: auto`` runs; only where the library has the VNNI loops);
- "avx512": the same kernels with their AVX-512 BF16 loops instead of AMX tiles;
- "aten": ATen's weight-only kernels at every row count (the old path, which pays the weights per row);
- "dense": ``F.linear`` on the dequantised bf16 copy that ``quant: auto`` keeps for wide inputs.
Each figure is the median over rounds of a step's time divided by the 1-row "shipped" step of the
same round.

    python scripts/bench_cpu_kernels.py --multi-row --rounds 15

``--int4-attention``: one layer's decode attention over an int4 KIVI cache (SmolLM2's 9 query / 3 KV
heads of 64, blocks of 16, bf16) at 64, 384, 2,048 and 8,192 keys, interleaved round by round:
- "int4 fused": ``cpu_ops.decode_attention_int4``, the codes read in place;
- "int4 gather + SDPA": the path without it (``storage.gather`` dequantises a copy, then SDPA);
- "bf16 gather + SDPA": a bf16 cache's path above ``DECODE_ATTENTION_MAX_KEYS``;
- "bf16 fused": ``cpu_ops.decode_attention`` on the bf16 cache (its slot write included).
Medians over rounds of each call's time and of its ratio to "int4 fused" in the same round.

    python scripts/bench_cpu_kernels.py --int4-attention --rounds 200

``--chunk-rows``: engine steps that carry a prompt chunk of n tokens beside d running decodes
(d + n <= ``runner.CHUNK_ROWS_MAX``), fresh or after a cached prefix (past
``runner.CHUNK_ROWS_MAX_KEYS`` keys both run the chunk path), the chunk run as fused one-token
rows ("rows", shipped)
against the Python layers ("chunk", ``ModelRunner.chunks_as_rows = False``), two engines over
one model, alternating round by round. Medians over rounds of the step's forward time and of
its ratio to "chunk" in the same round.

    python scripts/bench_cpu_kernels.py --chunk-rows --rounds 15

``--chunk-row-shapes 3:28:176,...`` times other shapes (decodes:chunk:prefix), and
``--chunk-rows-max-keys N`` lifts the key bound for the "rows" engine, to find where rows stop
paying.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from edge_rtgi.catalog import resolve_model
from edge_rtgi.device import release_cpu_workers
from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.quant import apply_engine_quant
from edge_rtgi.llm.rope import apply_rope
from edge_rtgi.llm.step_model import StepShape
from edge_rtgi.llm.weights import load_model

FUSED = {
    "rms_norm": cpu_ops.rms_norm,
    "rotate_qk": cpu_ops.rotate_qk,
    "silu_mul": cpu_ops.silu_mul,
    "decode_attention_usable": cpu_ops.decode_attention_usable,
}


def plain_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


PLAIN = {
    "rms_norm": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
    "rotate_qk": apply_rope,
    "silu_mul": plain_silu_mul,
    "decode_attention_usable": lambda *args: False,
}


LAYER_LOOP = cpu_ops.run_decode_layers
INT8_ONE_ROW_MIN_WEIGHTS = cpu_ops.INT8_ONE_ROW_MIN_WEIGHTS
ATEN_HEAD = "layer loop, one-row int8 on ATen"


def configure(name: str) -> contextlib.AbstractContextManager:
    # ATEN_HEAD: one-row int8 matmuls (the LM head) on ATen's kernel, as before int8_mm took them.
    cpu_ops.INT8_ONE_ROW_MIN_WEIGHTS = 1 << 62 if name == ATEN_HEAD else INT8_ONE_ROW_MIN_WEIGHTS
    for op, fused in FUSED.items():
        setattr(cpu_ops, op, PLAIN[op] if name == f"per-op without {op}" else fused)
    # Off for the per-op rows: the layer loop would take the step past the patched functions.
    cpu_ops.run_decode_layers = (lambda *args: None) if name.startswith("per-op") else LAYER_LOOP
    return cpu_ops.disabled() if name == "none" else contextlib.nullcontext()


MULTI_ROW_COUNTS = (1, 2, 4, 5, 8, 9, 12, 16)


def multi_row_step(model, rounds: int, row_counts: tuple[int, ...] = MULTI_ROW_COUNTS) -> None:
    """Time the quantised linears of one decode step at each row count (see the module docstring)."""
    from edge_rtgi.llm.quant.kernels import Int4Linear, QuantLinear

    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        raise SystemExit("--multi-row needs quantised weights (--quant auto, int8, int4-g32, ...)")
    kinds = sorted({(m.scheme_name, m.out_features, m.in_features) for m in layers})
    print(f"{len(layers)} quantised linears per step:", ", ".join(f"{s} {n}x{k}" for s, n, k in kinds))
    gen = torch.Generator().manual_seed(0)
    inputs = {
        (rows, k): torch.randn(rows, k, generator=gen).to(model.dtype)
        for rows in row_counts
        for k in {m.in_features for m in layers}
    }

    def avx512(layer, x):  # the multi-row kernels without AMX tiles (1 row: ATen, as shipped)
        if x.shape[0] == 1:
            return layer._aten(x)
        if isinstance(layer, Int4Linear):
            return cpu_ops.int4_mm(x, layer.qweight, layer.group_size, layer.scales_and_zeros, "avx512")
        return cpu_ops.int8_mm(x, layer.qweight, layer.scales, "avx512")

    # int4_i8_mm on each int4 layer's own repacked weights (the LM head keeps its int8 kernel),
    # packed here rather than switched on, so that "shipped" stays the bf16-activation path
    i8_packs = {}
    if cpu_ops.int8_activation_loops() in cpu_ops.FAST_INT8_ACTIVATION_LOOPS:
        for m in layers:
            if isinstance(m, Int4Linear) and m.int8_activations_unusable() is None:
                i8_packs[id(m)] = m.int8_activation_pack()
        release_cpu_workers()

    def int8_activations(layer, x):
        packed = i8_packs.get(id(layer))
        if packed is None:
            return layer._matmul(x)
        return cpu_ops.int4_i8_mm(x, packed, layer.group_size, layer.out_features)

    paths = {
        "shipped": lambda layer, x: layer._matmul(x),
        "int8 act": int8_activations,
        "avx512": avx512,
        "aten": lambda layer, x: layer._aten(x),
        "dense": lambda layer, x: F.linear(x, layer.dense_weight),
    }
    if any(m.dense_weight is None for m in layers):
        del paths["dense"]  # only quant: auto keeps the dense copies
    if not i8_packs:
        del paths["int8 act"]  # no VNNI loops, or no int4 layer that can take them
    times: dict[tuple[str, int], list[float]] = {(p, r): [] for p in paths for r in row_counts}
    for round_index in range(rounds + 1):  # round 0 warms up and is dropped
        for rows in row_counts:
            for path, run in paths.items():
                start = time.perf_counter()
                for layer in layers:
                    run(layer, inputs[rows, layer.in_features])
                elapsed = time.perf_counter() - start
                if round_index:
                    times[path, rows].append(elapsed)
    base = times["shipped", 1]
    print(
        f"{rounds} rounds, interleaved; medians; ratio = step time / the 1-row shipped step of the same round"
    )
    print(f"{'rows':>4} " + " ".join(f"{p + ' ms':>10} {p + ' ratio':>14}" for p in paths))
    for rows in row_counts:
        cells = []
        for path in paths:
            t = times[path, rows]
            ratio = statistics.median(a / b for a, b in zip(t, base, strict=True))
            cells.append(f"{1e3 * statistics.median(t):10.2f} {ratio:13.2f}x")
        print(f"{rows:>4} " + " ".join(cells))


def _ignore(delta: object) -> None:
    """A request sink for steps timed for their cost alone."""


# (running decodes, chunk tokens, cached prefix tokens before the chunk)
CHUNK_ROW_SHAPES = (
    (0, 4, 0),
    (0, 8, 0),
    (0, 16, 0),
    (2, 12, 0),
    (4, 12, 0),
    (8, 8, 0),
    (0, 24, 0),
    (0, 32, 0),
    (8, 16, 0),
    (16, 16, 0),
    (4, 20, 64),
    (0, 12, 256),
    (0, 12, 1024),
)


def _timed_step(engine) -> tuple[StepShape, float]:
    """Run one engine step; its shape and forward time (ms) as the step-time model saw them."""
    seen: list[tuple[StepShape, float]] = []
    observe = engine.step_model.observe

    def record(shape: StepShape, ms: float) -> None:
        seen.append((shape, ms))
        observe(shape, ms)

    engine.step_model.observe = record
    try:
        engine.step()
    finally:
        engine.step_model.observe = observe
    return seen[0]


def chunk_rows(loaded, rounds: int, shapes: tuple[tuple[int, int, int], ...] = CHUNK_ROW_SHAPES) -> None:
    """Time steps with a prompt chunk beside running decodes, chunk as rows or not (module docstring)."""
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.llm.sampling import SamplingParams

    engines = {}
    for name in ("rows", "chunk"):
        cfg = EngineConfig(quant=None, max_model_len=4096)
        engines[name] = engine = LLMEngine.from_loaded(loaded, cfg, start=False)
        engine.runner.chunks_as_rows = name == "rows"
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    decoding = SamplingParams(max_tokens=64, ignore_eos=True)
    times: dict[tuple[str, int, int, int], list[float]] = {
        (e, *shape): [] for e in engines for shape in shapes
    }
    for round_index in range(rounds + 1):  # round 0 warms up and is dropped
        for decodes, chunk, prefix_tokens in shapes:
            prefix = torch.randint(100, vocab, (prefix_tokens,), generator=gen).tolist()
            for name in list(engines)[round_index % 2 :] + list(engines)[: round_index % 2]:
                engine = engines[name]
                ids = [f"r{round_index}-{decodes}-{chunk}-{prefix_tokens}-{i}" for i in range(decodes + 2)]
                if prefix:  # cache the prefix: the timed chunk follows it
                    engine.submit(prefix, SamplingParams(max_tokens=1), _ignore, request_id=ids[-2])
                    while engine.step():
                        pass
                for rid in ids[:decodes]:
                    prompt = torch.randint(100, vocab, (8,), generator=gen).tolist()
                    engine.submit(prompt, decoding, _ignore, request_id=rid)
                requests = engine.scheduler.requests
                while any(r not in requests or requests[r].num_output_tokens == 0 for r in ids[:decodes]):
                    engine.step()
                prompt = prefix + torch.randint(100, vocab, (chunk,), generator=gen).tolist()
                engine.submit(prompt, decoding, _ignore, request_id=ids[-1])
                shape, ms = _timed_step(engine)
                for rid in ids:
                    engine.abort(rid)
                while engine.step():
                    pass
                if shape.prefill_tokens != chunk or shape.decode_rows != decodes:
                    raise RuntimeError(f"the timed step was {shape}, not {decodes} decodes + {chunk} tokens")
                if name == "rows" and shape.python_layers:
                    print(f"  note: {decodes}:{chunk}:{prefix_tokens} ran the Python layers as rows")
                if round_index:
                    times[name, decodes, chunk, prefix_tokens].append(ms)
    for engine in engines.values():
        engine.shutdown()
    print(f"{rounds} rounds, alternating; medians of the forward time; ratio = rows / chunk, same round")
    print(f"{'decodes':>7} {'chunk':>5} {'prefix':>6} {'rows ms':>8} {'chunk ms':>9} {'ratio':>6}")
    for shape in shapes:
        rows, plain = times[("rows", *shape)], times[("chunk", *shape)]
        ratio = statistics.median(a / b for a, b in zip(rows, plain, strict=True))
        rows_ms, plain_ms = statistics.median(rows), statistics.median(plain)
        print(f"{shape[0]:>7} {shape[1]:>5} {shape[2]:>6} {rows_ms:8.1f} {plain_ms:9.1f} {ratio:5.2f}x")


def int4_attention_calls(n: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The four ways to attend one query per head over ``n`` keys (see ``--int4-attention``)."""
    from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
    from edge_rtgi.llm.kv.storage import PagedKVStorage

    heads, kv_heads, dim, block, dtype = 9, 3, 64, 16, torch.bfloat16
    blocks = n // block + 1
    int4 = Int4KIVIPagedKVStorage(1, blocks, block, kv_heads, dim, dtype)
    plain = PagedKVStorage(1, blocks, block, kv_heads, dim, dtype)
    slots = torch.arange(n)
    k, v = torch.randn(n, kv_heads, dim).to(dtype), torch.randn(n, kv_heads, dim).to(dtype)
    int4.write(0, slots, k, v)
    plain.write(0, slots, k, v)
    q, key_slots, kv = torch.randn(1, heads, dim).to(dtype), slots[None], int4.fused_layer(0)

    def sdpa(storage: PagedKVStorage) -> torch.Tensor:
        keys, values = storage.gather(0, key_slots)
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), enable_gqa=True
        )

    return {
        "int4 fused": lambda: cpu_ops.decode_attention_int4(q, kv, key_slots, None, dim**-0.5),
        "int4 gather + SDPA": lambda: sdpa(int4),
        "bf16 gather + SDPA": lambda: sdpa(plain),
        "bf16 fused": lambda: cpu_ops.decode_attention(
            q, k[-1:], v[-1:], plain.k[0], plain.v[0], slots[-1:], key_slots, None, dim**-0.5
        ),
    }


def int4_attention(rounds: int, key_counts: tuple[int, ...] = (64, 384, 2048, 8192)) -> None:
    for n in key_counts:
        calls = int4_attention_calls(n)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(max(5, rounds * 2048 // max(n, 2048))):  # fewer rounds for long rows
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        base = times["int4 fused"]
        for name, ts in times.items():
            ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
            print(
                f"{n:>5} keys  {name:<20} {1e6 * statistics.median(ts):8.1f} us  "
                f"{ratio:5.2f}x int4 fused  ({len(ts)} rounds)",
                flush=True,
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quant", default="auto", help="engine quant setting (auto, none, int8, ...)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument(
        "--max-context", type=int, default=300, help="restart at the prompt after this many tokens"
    )
    ap.add_argument("--multi-row", action="store_true", help="the multi-row matmul benchmark instead")
    ap.add_argument(
        "--rounds", type=int, default=15, help="--multi-row, --int4-attention: interleaved rounds"
    )
    ap.add_argument(
        "--row-counts",
        default=",".join(map(str, MULTI_ROW_COUNTS)),
        help="--multi-row: the input row counts, comma-separated",
    )
    ap.add_argument(
        "--int4-attention", action="store_true", help="the int4 KV decode attention benchmark instead"
    )
    ap.add_argument(
        "--chunk-rows", action="store_true", help="steps with a prompt chunk: as fused rows or not"
    )
    ap.add_argument(
        "--chunk-row-shapes",
        help="--chunk-rows: decodes:chunk:prefix triples, comma-separated (default: CHUNK_ROW_SHAPES)",
    )
    ap.add_argument(
        "--chunk-rows-max-keys",
        type=int,
        help="--chunk-rows: the key bound of the rows engine in this run (default: the runner's)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.int4_attention:
        if not cpu_ops.load():
            raise SystemExit(f"fused CPU kernels unavailable: {cpu_ops.failure()}")
        print("kernels:", cpu_ops.build_info(), "threads:", torch.get_num_threads(), flush=True)
        with torch.inference_mode():
            int4_attention(args.rounds)
        return 0
    loaded = load_model(resolve_model(args.model, role="llm"), device="cpu", dtype="auto")
    if not cpu_ops.available():
        raise SystemExit(f"fused CPU kernels unavailable: {cpu_ops.failure()}")
    model, cfg = loaded.model, loaded.config
    print("weights:", apply_engine_quant(model, args.quant), "activations:", model.dtype, flush=True)
    if args.chunk_rows:
        print("kernels:", cpu_ops.build_info(), "threads:", torch.get_num_threads(), flush=True)
        if args.chunk_rows_max_keys is not None:
            import edge_rtgi.llm.runner as runner_module

            runner_module.CHUNK_ROWS_MAX_KEYS = args.chunk_rows_max_keys
        shapes = CHUNK_ROW_SHAPES
        if args.chunk_row_shapes:
            triples = (t.split(":") for t in args.chunk_row_shapes.split(","))
            shapes = tuple((int(d), int(n), int(p)) for d, n, p in triples)
        chunk_rows(loaded, args.rounds, shapes)
        return 0
    if args.multi_row:
        print("kernels:", cpu_ops.build_info(), "threads:", torch.get_num_threads(), flush=True)
        with torch.inference_mode():
            multi_row_step(model, args.rounds, tuple(int(r) for r in args.row_counts.split(",")))
        return 0
    names = ["layer loop", ATEN_HEAD, "per-op"] + [f"per-op without {op}" for op in FUSED] + ["none"]
    caches, tokens, times = {}, {}, {name: [] for name in names}
    prompt = torch.arange(args.prompt_tokens) + 100
    with torch.inference_mode():
        for name in names:
            caches[name] = cache = ContiguousKVCache(cfg, args.max_context + 1, model.dtype, model.device)
            with configure(name):
                cache.begin(len(prompt))
                hidden = model(prompt, torch.arange(len(prompt)), cache)
                cache.commit()
                tokens[name] = model.compute_logits(hidden[-1:]).argmax(-1)
        for _ in range(args.steps):
            for name in names:
                cache = caches[name]
                if cache.length >= args.max_context:
                    cache.truncate(args.prompt_tokens)
                with configure(name):
                    start = time.perf_counter()
                    cache.begin(1)
                    hidden = model(tokens[name], torch.tensor([cache.length]), cache)
                    cache.commit()
                    tokens[name] = model.compute_logits(hidden[-1:]).argmax(-1)
                    times[name].append(time.perf_counter() - start)
    configure("layer loop")
    print(f"{args.steps} steps each, interleaved; medians")
    for name in names:
        ref = "per-op" if name.startswith("per-op without") else "layer loop"
        ratio = statistics.median(t / b for t, b in zip(times[name], times[ref], strict=True))
        print(
            f"{name:<36} {1e3 * statistics.median(times[name]):7.2f} ms/step   "
            f"{ratio:5.3f}x the step time of {ref}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
