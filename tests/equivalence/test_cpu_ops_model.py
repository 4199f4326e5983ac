"""The fused CPU decode path leaves the model's function unchanged: greedy output with it equals
greedy output on the plain PyTorch ops (``cpu_ops.disabled()``), on the plain path and in the
engine, in both of its forms:

- "per-op": the Python layers calling the fused kernels (``run_decode_layers`` switched off);
- "layer loop": ``cpu_ops.run_decode_layers``, the whole layer stack in one C++ call.

Seeded tiny models (tests/tiny_models.py) in fp32: llama (tied head, llama3 RoPE scaling), qwen2
(q/k/v biases) and mistral (sliding window of 8, so long decodes drop keys), with full-precision,
int8 and int4 weights. In bf16 the attention sums round differently, so there the bound is on
the logits instead. Counters check that the fused code really ran.
"""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.kv.window import KVWindow
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.quant import apply_engine_quant
from edge_rtgi.llm.quant.policy import auto_quant_kernel_max_rows
from edge_rtgi.llm.runner import CHUNK_ROWS_MAX
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.scheduler import ScheduledRequest, SchedulerOutput
from edge_rtgi.llm.step_model import StepShape
from edge_rtgi.llm.weights import load_model
from tests.equivalence.test_engine import TEXTS, engine_for, run_staggered
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.skipif(
    not cpu_ops.load(), reason=f"fused CPU kernels not built: {cpu_ops.failure()}"
)

MODES = ["per-op", "layer loop"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def folder(request, tmp_path_factory):
    return make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=5)


@pytest.fixture
def fused_mode(request, monkeypatch) -> dict[str, int]:
    """Put the fused path in ``request.param`` mode; count what ran."""
    counts = {"layer loops": 0, "attention calls": 0}
    real_loop, real_attention = cpu_ops.run_decode_layers, cpu_ops.decode_attention

    def loop(*args):
        out = real_loop(*args) if request.param == "layer loop" else None
        counts["layer loops"] += out is not None
        return out

    def attention(*args):
        counts["attention calls"] += 1
        return real_attention(*args)

    monkeypatch.setattr(cpu_ops, "run_decode_layers", loop)
    monkeypatch.setattr(cpu_ops, "decode_attention", attention)
    return counts


def check_counts(counts: dict[str, int], mode: str, min_steps: int) -> None:
    if mode == "layer loop":
        assert counts["layer loops"] >= min_steps
    else:
        assert counts["layer loops"] == 0 and counts["attention calls"] >= min_steps


@pytest.mark.parametrize("fused_mode", MODES, indirect=True)
@pytest.mark.parametrize("quant", ["none", "int8", "int4-g32", "auto"])
def test_plain_path_greedy_is_unchanged(folder, fused_mode, quant, request):
    loaded = load_model(folder, device="cpu", dtype="fp32")
    apply_engine_quant(loaded.model, quant)
    tok = loaded.tokenizer
    params = SamplingParams(max_tokens=24, ignore_eos=True)  # past mistral's window of 8
    for text in TEXTS:
        fused = generate(loaded, tok.encode(text), params)
        with cpu_ops.disabled():
            plain = generate(loaded, tok.encode(text), params)
        assert fused.token_ids == plain.token_ids, text
    check_counts(fused_mode, request.node.callspec.params["fused_mode"], len(TEXTS) * 23)


@pytest.mark.parametrize("fused_mode", MODES, indirect=True)
@pytest.mark.parametrize("quant", ["int8", "int4-g32"])
def test_engine_matches_plain_path_without_kernels(folder, fused_mode, quant, request):
    """Decode batches of 2..8 rows run the multi-row int4 / int8 kernels (the plain path: ATen's)."""
    loaded = load_model(folder, device="cpu", dtype="fp32")
    apply_engine_quant(loaded.model, quant)
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(TEXTS))]
    engine = engine_for(loaded, max_num_batched_tokens=64)
    multi_row_before = cpu_ops.multi_row_calls()
    results = run_staggered(engine, prompts, params)  # padded decode batches with masks
    check_counts(fused_mode, request.node.callspec.params["fused_mode"], 10)  # decode-only steps
    assert cpu_ops.multi_row_calls() - multi_row_before >= 20 * 4 * loaded.config.num_layers
    with cpu_ops.disabled():
        for prompt, p, got in zip(prompts, params, results, strict=True):
            assert got.token_ids == generate(loaded, prompt, p).token_ids


def test_plan_follows_every_kind_of_weight_replacement(folder):
    """The layer loop caches its arguments; whatever replaces a weight or a module must be seen."""
    loaded = load_model(folder, device="cpu", dtype="fp32")
    model = loaded.model
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = loaded.tokenizer.encode(TEXTS[1])

    def check() -> list[int]:
        with cpu_ops.disabled():
            want = generate(loaded, prompt, params).token_ids
        got = generate(loaded, prompt, params).token_ids
        assert got == want
        return got

    first = check()  # builds a plan on full-precision weights
    apply_engine_quant(model, "int4-g32")  # swaps every linear through setattr
    check()
    # Behind nn.Module's back: a new tensor in the dict, no registration hook runs.
    o_proj = model.layers[0].self_attn.o_proj
    o_proj._buffers["scales_and_zeros"] = o_proj.scales_and_zeros * 3
    check()
    cfg = loaded.config  # a module swapped behind nn.Module's back, to a full-precision layer
    model.layers[-1].mlp._modules["down_proj"] = torch.nn.Linear(
        cfg.intermediate_size, cfg.hidden_size, bias=False
    )
    changed = check()
    assert changed != first


def test_functional_call_and_hooks_and_short_stacks_fall_back_or_follow(folder):
    loaded = load_model(folder, device="cpu", dtype="fp32")
    model, cfg = loaded.model, loaded.config
    ids = torch.tensor(loaded.tokenizer.encode(TEXTS[2]))

    def last_hidden(**overrides) -> torch.Tensor:
        cache = ContiguousKVCache(cfg, 64, model.dtype, model.device)
        with torch.inference_mode():
            cache.begin(len(ids) - 1)
            model(ids[:-1], torch.arange(len(ids) - 1), cache)
            cache.commit()
            cache.begin(1)  # the decode step: the layer loop's case
            if overrides:
                return torch.func.functional_call(
                    model, overrides, (ids[-1:], torch.tensor([len(ids) - 1]), cache)
                )
            return model(ids[-1:], torch.tensor([len(ids) - 1]), cache)

    base = last_hidden()
    zeros = {"layers.0.self_attn.o_proj.weight": torch.zeros_like(model.layers[0].self_attn.o_proj.weight)}
    with cpu_ops.disabled():
        want = last_hidden(**zeros)
    torch.testing.assert_close(last_hidden(**zeros), want)
    torch.testing.assert_close(last_hidden(), base)  # and back to the model's own weights

    calls = []
    handle = model.layers[1].register_forward_hook(lambda *args: calls.append(1))
    last_hidden()
    handle.remove()
    assert calls  # the hook ran: the Python layers took the step

    model.layers = model.layers[:1]  # fewer layers than the cache has
    with cpu_ops.disabled():
        want = last_hidden()
    torch.testing.assert_close(last_hidden(), want)


@pytest.mark.parametrize("fused_mode", MODES, indirect=True)
def test_bf16_logits_stay_close(folder, fused_mode):
    loaded = load_model(folder, device="cpu", dtype="bf16")
    model, cfg = loaded.model, loaded.config
    ids = torch.tensor(loaded.tokenizer.encode(TEXTS[5]))

    def teacher_forced_logits() -> torch.Tensor:
        cache = ContiguousKVCache(cfg, 128, model.dtype, model.device)
        rows = []
        with torch.inference_mode():
            for pos, token in enumerate(ids.tolist()):  # one token per step: the decode path runs
                cache.begin(1)
                hidden = model(torch.tensor([token]), torch.tensor([pos]), cache)
                cache.commit()
                rows.append(model.compute_logits(hidden))
        return torch.cat(rows)

    fused = teacher_forced_logits()
    with cpu_ops.disabled():
        plain = teacher_forced_logits()
    kl = torch.nn.functional.kl_div(
        fused.log_softmax(-1), plain.log_softmax(-1), log_target=True, reduction="batchmean"
    ).item()
    assert kl < 1e-3, kl
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize(
    ("quant", "step_tokens"),
    [("int4-g32", 5), ("int8", 5), ("auto", 5), ("auto", 12), ("auto", 16), ("auto", 24), ("auto", 30)],
)
def test_bf16_verification_shaped_steps_stay_close(folder, quant, step_tokens):
    """Steps of 5 tokens of one sequence (the shape of verifying 4 draft tokens) run every linear on
    the multi-row kernels (AVX-512 BF16 or AMX where built); teacher-forced bf16 logits stay within
    the bounds of the bf16 test above against ATen's kernels one row at a time. Under ``auto``,
    steps of 12 to 30 tokens take the kernels up to ``auto_quant_kernel_max_rows()`` rows (32
    with AMX or on an AVX2 build, 8 on most others) and the dense bf16 copies above it."""
    loaded = load_model(folder, device="cpu", dtype="bf16")
    apply_engine_quant(loaded.model, quant)
    kernel_rows = auto_quant_kernel_max_rows() if quant == "auto" else cpu_ops.multi_row_max()
    model, cfg = loaded.model, loaded.config
    ids = torch.tensor(loaded.tokenizer.encode(TEXTS[5] + " " + TEXTS[1]))

    def teacher_forced_logits(step_tokens: int) -> torch.Tensor:
        cache = ContiguousKVCache(cfg, 128, model.dtype, model.device)
        rows = []
        with torch.inference_mode():
            for start in range(0, len(ids), step_tokens):
                chunk = ids[start : start + step_tokens]
                cache.begin(len(chunk))
                hidden = model(chunk, torch.arange(start, start + len(chunk)), cache)
                cache.commit()
                rows.append(model.compute_logits(hidden))
        return torch.cat(rows)

    assert len(ids) >= 2 * step_tokens
    before = cpu_ops.multi_row_calls()
    fused = teacher_forced_logits(step_tokens)
    if step_tokens <= kernel_rows:
        assert cpu_ops.multi_row_calls() - before >= (len(ids) // step_tokens) * 4 * cfg.num_layers
    else:
        assert cpu_ops.multi_row_calls() - before < (len(ids) // step_tokens) * 4 * cfg.num_layers
    with cpu_ops.disabled():
        plain = teacher_forced_logits(1)
    kl = torch.nn.functional.kl_div(
        fused.float().log_softmax(-1), plain.float().log_softmax(-1), log_target=True, reduction="batchmean"
    ).item()
    assert kl < 1e-3, kl
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("quant", ["none", "int4-g32"])
def test_int4_kv_fused_decode_equals_gather_then_sdpa(folder, quant, monkeypatch):
    """``kv_dtype: int4``: decode steps read the int4 codes in place
    (``cpu_ops.decode_attention_int4``, padded batches with masks, blocks filling and closing);
    the same engine with the kernels off gathers a dequantised copy and runs SDPA. In fp32 the two
    differ only in the order of the sums, so the greedy tokens are identical."""
    loaded = load_model(folder, device="cpu", dtype="fp32")
    apply_engine_quant(loaded.model, quant)
    calls = 0
    real = cpu_ops.decode_attention_int4

    def counted(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(cpu_ops, "decode_attention_int4", counted)
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(TEXTS))]
    fused = run_staggered(engine_for(loaded, max_num_batched_tokens=64, kv_dtype="int4"), prompts, params)
    fused_calls = calls
    assert fused_calls >= 20 * loaded.config.num_layers
    with cpu_ops.disabled():
        plain = run_staggered(engine_for(loaded, max_num_batched_tokens=64, kv_dtype="int4"), prompts, params)
    assert calls == fused_calls  # the kernels off: gather + SDPA
    for got, want in zip(fused, plain, strict=True):
        assert got.error is None and want.error is None
        assert got.token_ids == want.token_ids


@pytest.mark.parametrize("fused_mode", MODES, indirect=True)
def test_paged_decode_past_384_keys_takes_the_fused_path_and_keeps_the_tokens(tmp_path, fused_mode, request):
    """A paged cache has no key-count cut-off (``PAGED_DECODE_ATTENTION_MAX_KEYS``): SDPA would
    first gather the keys, so the fused loop runs at any length. Requests of 400-700 tokens,
    batched with padding masks: the same greedy tokens as the PyTorch path (fp32)."""
    folder = make_tiny_hf_model("llama", tmp_path, seed=7, max_position_embeddings=1024)
    loaded = load_model(folder, device="cpu", dtype="fp32")
    rng = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in (400, 560, 700)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    engine = engine_for(loaded, num_kv_blocks=512, max_num_batched_tokens=128)
    fused = run_staggered(engine, prompts, params)
    with cpu_ops.disabled():
        plain = run_staggered(
            engine_for(loaded, num_kv_blocks=512, max_num_batched_tokens=128), prompts, params
        )
    for got, want in zip(fused, plain, strict=True):
        assert got.error is None and got.token_ids == want.token_ids
    check_counts(fused_mode, request.node.callspec.params["fused_mode"], 10)  # decode-only steps


@pytest.mark.parametrize("fused_mode", ["layer loop"], indirect=True)
@pytest.mark.parametrize("quant", ["none", "int8", "int4-g32"])
def test_small_prompt_chunks_run_as_fused_rows_with_the_same_tokens(folder, quant, fused_mode):
    """A step whose prompt chunks and decodes come to at most ``runner.CHUNK_ROWS_MAX`` tokens
    runs the chunks as one-token rows on the C++ layer loop (each row attends up to its own
    position, as verification rows do; only the chunk's last row samples): the same greedy
    tokens and log-probabilities as the chunk path, and the plain path's tokens without kernels,
    for short prompts, prompts chunked by a ``CHUNK_ROWS_MAX`` budget, turns after a cached prefix
    (mistral: across its sliding window of 8), joined mid-stream by other requests. The engine
    tells its scheduler the fused step's size and its step-time model which steps ran fused."""
    loaded = load_model(folder, device="cpu", dtype="fp32")
    apply_engine_quant(loaded.model, quant)
    tok = loaded.tokenizer
    prefix = tok.encode(TEXTS[5])
    prompts = [tok.encode(t) for t in TEXTS] + [prefix + tok.encode(" " + t) for t in TEXTS[:3]]
    params = [
        SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True, logprobs=i % 2 == 1)
        for i in range(len(prompts))
    ]
    engine = engine_for(loaded, max_num_batched_tokens=CHUNK_ROWS_MAX)
    # the quantised layers' kernels take 16 rows on a build with neither AVX-512 BF16 nor AVX2-only loops
    rows = min(CHUNK_ROWS_MAX, engine.runner.fused_decode_rows())
    assert rows >= 16
    assert engine.runner.fused_step_tokens() == engine.scheduler.config.fused_step_tokens == rows
    shapes: dict[str, list[StepShape]] = {"rows": [], "chunks": []}

    def watch(engine, name):
        observe = engine.step_model.observe
        engine.step_model.observe = lambda shape, ms: (shapes[name].append(shape), observe(shape, ms))

    watch(engine, "rows")
    as_rows: list[bool] = []
    real = engine.runner._chunks_as_rows

    def spy(output):
        as_rows.append(real(output))
        return as_rows[-1]

    engine.runner._chunks_as_rows = spy
    loops_before = cpu_ops.multi_row_calls()
    results = run_staggered(engine, prompts, params)
    assert sum(as_rows) >= len(prompts)  # steps with chunks as rows, at least one per prompt's worth
    assert fused_mode["layer loops"] == len(as_rows)  # every step ran the layer loop
    if quant != "none":
        assert cpu_ops.multi_row_calls() > loops_before
    assert engine.stats().prefix_hit_tokens > 0
    chunk_engine = engine_for(loaded, max_num_batched_tokens=CHUNK_ROWS_MAX)
    chunk_engine.runner.chunks_as_rows = False
    watch(chunk_engine, "chunks")
    as_chunks = run_staggered(chunk_engine, prompts, params)
    # the step-time model is told the path each step really took
    assert not any(s.python_layers for s in shapes["rows"])
    chunk_steps = [s.python_layers for s in shapes["chunks"] if s.prefill_tokens]
    assert chunk_steps and all(chunk_steps)
    for p, got, want in zip(params, results, as_chunks, strict=True):
        assert got.error is None and got.token_ids == want.token_ids
        assert len(got.logprobs) == len(want.logprobs) == (len(want.token_ids) if p.logprobs else 0)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    with cpu_ops.disabled():
        for prompt, p, got in zip(prompts, params, results, strict=True):
            assert got.token_ids == generate(loaded, prompt, p).token_ids


def test_chunks_stay_chunks_where_rows_would_cost_more_or_the_fused_path_does_not_run(folder):
    """Rows only where the fused path runs them and they read few keys: not after a long
    prefix (each row would read it again), not with int8 KV, the per-sequence decode mode or
    attention sinks."""
    loaded = load_model(folder, device="cpu", dtype="fp32")
    runner = engine_for(loaded).runner

    def step_of(start_position: int, num_tokens: int) -> SchedulerOutput:
        chunk = ScheduledRequest("r", list(range(3, 3 + num_tokens)), start_position, [[0]], True)
        return SchedulerOutput([chunk], num_tokens)

    assert runner._chunks_as_rows(step_of(0, 12))
    assert runner._chunks_as_rows(step_of(200, 12))  # 12 rows reading about 2,500 keys
    assert not runner._chunks_as_rows(step_of(400, 12))  # about 4,900: past CHUNK_ROWS_MAX_KEYS
    assert not runner._chunks_as_rows(step_of(0, CHUNK_ROWS_MAX + 1))
    for overrides in (
        {"kv_dtype": "int8"},
        {"decode_mode": "per_seq"},
        {"kv_window": KVWindow(sink_tokens=4, window_tokens=64)},
    ):
        other = engine_for(loaded, **overrides).runner
        if "kv_window" in overrides and not other.groups[0].sink_tokens:
            continue  # mistral keeps its own window of 8, without sinks: rows apply there
        assert not other._chunks_as_rows(step_of(0, 12)), overrides


@pytest.mark.parametrize("quant", ["int8", "int4-g32"])
def test_bf16_wide_decode_batches_run_the_layer_loop_on_the_multi_row_kernels(folder, quant, monkeypatch):
    """24 sequences decoding together in bf16: their steps of 17..24 rows run the layer loop on
    the multi-row kernels where the build takes that many rows (AMX's two 16-row tiles per pass;
    two passes with the AVX-512 loops; a plain build: ATen's kernels, still with at least 16-row
    steps on the multi-row kernels), and every token the engine picks is the argmax of the plain path's
    teacher-forced logits (no kernels) for at least 90 % of them (bf16 sums round differently,
    as in the bf16 tests above)."""
    loaded = load_model(folder, device="cpu", dtype="bf16")
    apply_engine_quant(loaded.model, quant)
    model, tok = loaded.model, loaded.tokenizer
    widths: list[int] = []
    real_loop = cpu_ops.run_decode_layers

    def loop(_model, x, *args):
        out = real_loop(_model, x, *args)
        if out is not None:
            widths.append(x.shape[0])
        return out

    monkeypatch.setattr(cpu_ops, "run_decode_layers", loop)
    prompts = [tok.encode(f"{text} {i}") for i in range(3) for text in TEXTS]
    params = [SamplingParams(max_tokens=6 + i % 5, ignore_eos=True) for i in range(len(prompts))]
    engine = engine_for(loaded, max_num_batched_tokens=512, max_num_seqs=32)
    before = cpu_ops.multi_row_calls()
    results = run_staggered(engine, prompts, params, join_every_steps=0)
    assert max(widths) == len(prompts) and sum(w > 16 for w in widths) >= 3, widths
    assert cpu_ops.multi_row_calls() - before >= 3 * 4 * loaded.config.num_layers
    agree = total = 0
    with cpu_ops.disabled(), torch.inference_mode():
        for prompt, got in zip(prompts, results, strict=True):
            ids = torch.tensor(prompt + got.token_ids)
            cache = ContiguousKVCache(loaded.config, len(ids), model.dtype, model.device)
            cache.begin(len(ids))
            logits = model.compute_logits(model(ids, torch.arange(len(ids)), cache))
            picks = logits[len(prompt) - 1 : -1].argmax(-1)
            agree += int((picks == torch.tensor(got.token_ids)).sum())
            total += len(got.token_ids)
    assert agree >= 0.9 * total, f"{agree} of {total}"


def decode_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits one token per step (the decode path) over a contiguous cache."""
    model, cfg = loaded.model, loaded.config
    cache = ContiguousKVCache(cfg, len(ids), model.dtype, model.device)
    rows = []
    with torch.inference_mode():
        for pos, token in enumerate(ids.tolist()):
            cache.begin(1)
            rows.append(model.compute_logits(model(torch.tensor([token]), torch.tensor([pos]), cache)))
            cache.commit()
    return torch.cat(rows).float()


@pytest.mark.skipif(
    cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS,
    reason="int8 activations need the AVX-512 VNNI or AVX2 loops",
)
@pytest.mark.parametrize("fused_mode", MODES, indirect=True)
def test_int8_activations_stay_within_their_tolerance_of_the_plain_path(folder, fused_mode, request):
    """A lossy kernel (``int8_activations``): int4-g32 layers in bf16 with their activations
    rounded to int8 per 32 inputs, teacher-forced one token per step, against the same weights on
    ATen's kernels with no fused code. Stated tolerance: mean KL below 5e-3 nats and argmax agreement
    of at least 90 % (the bf16 kernels alone, above: 1e-3 and 90 %), on the layer loop and on the
    Python layers alike, which give the same bits (the same op per layer)."""
    from edge_rtgi.llm.quant.kernels import set_int8_activations

    loaded = load_model(folder, device="cpu", dtype="bf16")
    apply_engine_quant(loaded.model, "int4-g32")
    ids = torch.tensor(loaded.tokenizer.encode(TEXTS[5] + " " + TEXTS[1]))
    with cpu_ops.disabled():
        plain = decode_logits(loaded, ids)
    assert set_int8_activations(loaded.model, True) > 0
    before = cpu_ops.multi_row_calls()
    rounded = decode_logits(loaded, ids)
    assert cpu_ops.multi_row_calls() - before >= len(ids) * 2 * loaded.config.num_layers
    check_counts(fused_mode, request.node.callspec.params["fused_mode"], len(ids) - 1)
    kl = torch.nn.functional.kl_div(
        rounded.log_softmax(-1), plain.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert kl.item() < 5e-3, kl.item()
    assert (rounded.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.9
    assert not torch.equal(rounded, plain)


@pytest.mark.skipif(
    cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS,
    reason="int8 activations need the AVX-512 VNNI or AVX2 loops",
)
def test_int8_activations_give_the_same_bits_in_the_layer_loop_and_the_python_layers(folder, monkeypatch):
    from edge_rtgi.llm.quant.kernels import set_int8_activations

    loaded = load_model(folder, device="cpu", dtype="bf16")
    apply_engine_quant(loaded.model, "int4-g32")
    set_int8_activations(loaded.model, True)
    ids = torch.tensor(loaded.tokenizer.encode(TEXTS[2]))
    steps = cpu_ops.layer_loop_steps()
    loop = decode_logits(loaded, ids)
    assert cpu_ops.layer_loop_steps() - steps == len(ids)
    monkeypatch.setattr(cpu_ops, "run_decode_layers", lambda *args: None)
    assert torch.equal(loop, decode_logits(loaded, ids))
    # no dense copies under an explicit int4 scheme: the layer loop stops where the kernel does
    assert cpu_ops.fused_decode_max_rows(loaded.model) == cpu_ops.multi_row_max()


@pytest.mark.skipif(
    cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS,
    reason="int8 activations need the AVX-512 VNNI or AVX2 loops",
)
def test_engine_with_int8_activations_decodes_what_the_plain_path_would_pick(folder):
    """``int8_activations: auto`` in the engine: batched decode steps on the int8-activation kernel
    pick the plain path's teacher-forced argmax (no kernels, bf16 ATen) for at least 90 % of tokens."""
    loaded = load_model(folder, device="cpu", dtype="bf16")
    apply_engine_quant(loaded.model, "int4-g32")
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(TEXTS))]
    engine = engine_for(loaded, max_num_batched_tokens=64, int8_activations="auto")
    assert engine.int8_activation_layers > 0
    results = run_staggered(engine, prompts, params)
    agree = total = 0
    with cpu_ops.disabled(), torch.inference_mode():
        for prompt, got in zip(prompts, results, strict=True):
            ids = torch.tensor(prompt + got.token_ids)
            picks = decode_logits(loaded, ids)[len(prompt) - 1 : -1].argmax(-1)
            agree += int((picks == torch.tensor(got.token_ids)).sum())
            total += len(got.token_ids)
    assert agree >= 0.9 * total, f"{agree} of {total}"
    # a later engine on the same model with the setting off puts the layers back
    assert engine_for(loaded, int8_activations=False).int8_activation_layers == 0
    assert all(m.i8_packed is None for m in loaded.model.modules() if hasattr(m, "i8_packed"))
    # the default (auto) is on, with speculative decoding too (its drafts stay within the kernel's rows)
    from edge_rtgi.llm.engine_config import EngineConfig

    assert EngineConfig().int8_activations == "auto"
    assert engine_for(loaded, int8_activations="auto").int8_activation_layers > 0
    assert engine_for(loaded, int8_activations="auto", speculative="ngram:2").int8_activation_layers > 0


@pytest.mark.skipif(
    cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS,
    reason="int8 activations need the AVX-512 VNNI or AVX2 loops",
)
def test_speculation_on_int8_activations_is_lossless_and_stays_within_the_kernels_rows(folder):
    """Drafts on int8 activations: greedy output is the plain engine's on the same kernel, token for
    token, alone and in staggered batches (the kernel rounds each row alone, so verifying rows is a
    plain step's arithmetic); and with a kernel of 3 rows (as if ``quant: auto`` kept dense copies
    past 3 rows) a step verifies drafts only while it holds decodes alone within them, so output
    alone is still the plain engine's (with drafts of 4 and no limit, verification steps of 5 rows
    would run on the unrounded dense copies)."""
    from edge_rtgi.llm.quant.kernels import keep_dense_copies
    from edge_rtgi.llm.speculative import SpeculativeConfig, Speculator
    from tests.equivalence.test_speculative import ScriptedDraft

    loaded = load_model(folder, device="cpu", dtype="bf16")
    apply_engine_quant(loaded.model, "int4-g32")
    tok = loaded.tokenizer
    prompts = [tok.encode(TEXTS[i] + " " + TEXTS[i]) for i in range(4)]
    params = [SamplingParams(max_tokens=24 + 4 * i, ignore_eos=True) for i in range(4)]

    def run(batch, reference=None, join_every_steps=2, **overrides):
        """The plain engine's outputs, or with ``reference`` a speculating engine's and its steps
        (each with how many requests were waiting)."""
        engine = engine_for(loaded, int8_activations="auto", **overrides)
        assert engine.int8_activation_layers > 0
        steps: list[tuple[SchedulerOutput, int]] = []
        if reference is not None:
            # the scripted draft proposes the plain engine's own continuation, every third token wrong
            script = {tuple(p): r.token_ids for p, r in zip(prompts, reference, strict=True)}
            engine.speculator = Speculator(SpeculativeConfig("fixed", "scripted", 4), [ScriptedDraft(script)])
            execute = engine.runner.execute

            def record(output, params):
                steps.append((output, len(engine.scheduler.waiting)))
                return execute(output, params)

            engine.runner.execute = record
        got = (
            run_staggered(engine, prompts, params, join_every_steps)
            if batch
            else [engine.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
        )
        if reference is not None:
            assert engine.stats().spec_accepted_tokens > 0
        return got, steps

    for narrow in (False, True):
        if narrow:
            keep_dense_copies(loaded.model, 3)
        for batch in (False, True):
            plain, _ = run(batch)
            got, steps = run(batch, plain)
            drafted = [s for s, _ in steps if any(r.num_draft_tokens for r in s.scheduled)]
            assert drafted
            if narrow:
                assert all(s.num_batched_tokens <= 3 for s in drafted)
                assert all(len(r.token_ids) - r.num_draft_tokens == 1 for s in drafted for r in s.scheduled)
            if not (narrow and batch):  # there drafts change which steps the decodes share
                assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    # a backlog that cannot be admitted (max_num_seqs) leaves the running request its drafts
    plain, _ = run(False)
    got, steps = run(True, plain, join_every_steps=0, max_num_seqs=1)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert any(waiting and any(r.num_draft_tokens for r in s.scheduled) for s, waiting in steps)


def test_int8_activations_setting_is_checked_and_says_when_it_cannot_apply(folder, caplog, monkeypatch):
    from edge_rtgi.llm.engine_config import EngineConfig

    for bad in ("yes", 0, 1):  # 0 == False in Python; a YAML 0 must not pass for false
        with pytest.raises(ValueError, match="int8_activations"):
            EngineConfig(int8_activations=bad)
    loaded = load_model(folder, device="cpu", dtype="fp32")
    apply_engine_quant(loaded.model, "int4-g32")
    monkeypatch.setattr(cpu_ops, "int8_activation_loops", lambda: "portable")  # a CPU without AVX2
    with caplog.at_level("WARNING"):
        engine = engine_for(loaded, int8_activations=True)
    assert engine.int8_activation_layers == 0
    assert any("int8_activations" in r.getMessage() and "kept off" in r.getMessage() for r in caplog.records)
    assert engine_for(loaded, int8_activations="auto").int8_activation_layers == 0  # silently
