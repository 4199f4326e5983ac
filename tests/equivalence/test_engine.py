"""The engine computes the same function as plain generation, whatever the batching and paging.

Tiny seeded random models (real HF folders from tests/tiny_models.py) in float64, so that
different batch shapes cannot flip near-ties: the point is that the engine computes the same
function as the single-sequence reference path (edge_rtgi.llm.generate).
"""

from __future__ import annotations

import pytest

from edge_rtgi.llm.engine import GenerationResult, LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model

TEXTS = [
    "Hello!",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Numbers like 12, 345 and 6789 appear in text",
    "def add(a, b):",
    "A small model on a small device answers questions about the weather, the time and the news.",
    "Real-time speech translation",
    "Caf\u00e9, na\u00efve, \u00fcber",
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def loaded(request, tmp_path_factory):
    folder = make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    return load_model(folder, device="cpu", dtype="fp64")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_model(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama1"), seed=1), "cpu", "fp64")


def engine_for(loaded, **overrides) -> LLMEngine:
    """An engine for exactness tests: int8 activations (lossy, on by default where the CPU's kernels
    have them) stay off unless a test asks for them."""
    cfg = EngineConfig(
        **{
            "block_size": 4,
            "num_kv_blocks": 256,
            "max_num_batched_tokens": 16,
            "int8_activations": False,
            **overrides,
        }
    )
    return LLMEngine.from_loaded(loaded, cfg, start=False)


def reference(loaded, prompt_ids, params):
    return generate(loaded, prompt_ids, params)


def run_staggered(engine: LLMEngine, prompts, params_list, join_every_steps=2):
    """Submit request i at step i * join_every_steps; step until all are done."""
    results = [GenerationResult() for _ in prompts]
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.scheduler.has_unfinished() or not all(r.finish_reason for r in results):
        while pending and step >= pending[0] * join_every_steps:
            i = pending.pop(0)
            engine.submit(prompts[i], params_list[i], results[i].add, request_id=f"r{i}")
        engine.step()
        step += 1
        assert step < 5000
    return results


def test_batched_equals_alone(loaded):
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(8)]
    engine = engine_for(loaded)
    results = run_staggered(engine, prompts, params)
    for prompt, p, got in zip(prompts, params, results, strict=True):
        want = reference(loaded, prompt, p)
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
    stats = engine.stats()
    assert stats.requests_per_step > 1.5  # they really ran together
    assert stats.kv_blocks_used == 0


def test_per_seq_decode_mode_equals_padded(llama):
    prompts = [llama.tokenizer.encode(t) for t in TEXTS[:4]]
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 4
    a = run_staggered(engine_for(llama, decode_mode="padded"), prompts, params, 1)
    b = run_staggered(engine_for(llama, decode_mode="per_seq"), prompts, params, 1)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_paging_is_invisible_with_prefix_hits_and_preemption(llama):
    tok = llama.tokenizer
    system = tok.encode(TEXTS[5] + " " + TEXTS[1])
    prompts = [system + tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    # 30 blocks of 4 tokens: each request needs up to ~14 blocks, 8 run at once -> preemption.
    engine = engine_for(llama, num_kv_blocks=30, max_num_batched_tokens=32)
    results = run_staggered(engine, prompts, params, join_every_steps=1)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_hit_tokens > 0
    for prompt, p, got in zip(prompts, params, results, strict=True):
        assert got.token_ids == reference(llama, prompt, p).token_ids
    assert engine.kv.num_free_blocks == 30


def test_prefix_reuse_is_counted(llama):
    tok = llama.tokenizer
    system = tok.encode(TEXTS[5] + " " + TEXTS[1] + " " + TEXTS[3])
    assert len(system) > 20
    engine = engine_for(llama, block_size=8, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.generate([system + tok.encode(TEXTS[2])], p)[0]
    second = engine.generate([system + tok.encode(TEXTS[6])], p)[0]
    assert first.usage.cached_tokens == 0
    shared = 0  # tokens in the common prefix of the two prompts, rounded down to full blocks
    a, b = system + tok.encode(TEXTS[2]), system + tok.encode(TEXTS[6])
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    assert second.usage.cached_tokens == shared // 8 * 8 > 0
    assert second.token_ids == reference(llama, b, p).token_ids
    assert engine.stats().prefix_hit_rate > 0


def test_chat_messages_and_stop_strings_match_plain(llama):
    tok = llama.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode_chat(messages)
    plain = reference(llama, ids, SamplingParams(max_tokens=20, ignore_eos=True))
    stop = plain.text[5:8]
    p = SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,))
    want = reference(llama, ids, p)
    got = engine_for(llama).generate([messages], p)[0]
    assert want.finish_reason == "stop"
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)


def test_seeded_sampling_is_independent_of_batching(llama):
    tok = llama.tokenizer
    p = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    prompt = tok.encode(TEXTS[1])
    alone = engine_for(llama).generate([prompt], p)[0]
    others = [tok.encode(t) for t in TEXTS[:4]]
    batched = engine_for(llama).generate([prompt, *others], p)[0]
    assert alone.token_ids == batched.token_ids == reference(llama, prompt, p).token_ids


def test_int8_kv_stays_close(llama):
    prompts = [llama.tokenizer.encode(t) for t in TEXTS[:4]]
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    full = engine_for(llama).generate(prompts, p)
    int8 = engine_for(llama, kv_dtype="int8").generate(prompts, p)
    agree = sum(
        a == b for x, y in zip(full, int8, strict=True) for a, b in zip(x.token_ids, y.token_ids, strict=True)
    )
    assert agree >= 0.75 * 32


def test_switches_off_give_the_same_output(llama):
    """Ablation settings (no chunked prefill, no prefix cache, one sequence at a time) stay exact."""
    prompts = [llama.tokenizer.encode(t) for t in TEXTS[:4]]
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [reference(llama, x, p).token_ids for x in prompts]
    for overrides in (
        {"enable_chunked_prefill": False},
        {"enable_prefix_caching": False},
        {"max_num_seqs": 1},
    ):
        got = engine_for(llama, **overrides).generate(prompts, p)
        assert [r.token_ids for r in got] == want, overrides


def test_fcfs_without_budgets_is_todays_engine_whatever_the_classes(llama):
    """``scheduling: fcfs`` with budgets off reads no class or SLO: requests of every class with
    tight objectives run step for step as plain ones (same steps, preemptions and batches) and
    give the plain path's tokens, text and finish reasons."""
    from edge_rtgi.llm.request import RequestClass, RequestSLO

    tok = llama.tokenizer
    system = tok.encode(TEXTS[5] + " " + TEXTS[1])
    prompts = [system + tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=8 + i, ignore_eos=True) for i in range(8)]
    classes = [RequestClass.BULK, RequestClass.VOICE, RequestClass.DIALOGUE, RequestClass.TRANSLATION] * 2

    def run(decorated: bool):
        engine = engine_for(llama, scheduling="fcfs", num_kv_blocks=30, max_num_batched_tokens=32)
        results = [GenerationResult() for _ in prompts]
        for i in range(len(prompts)):
            extra = {"request_class": classes[i], "slo": RequestSLO(1.0, 1.0)} if decorated else {}
            engine.submit(prompts[i], params[i], results[i].add, request_id=f"r{i}", **extra)
            engine.step()
        for _ in range(2000):
            if not engine.step():
                break
        return results, engine.stats()

    (got, stats), (plain, plain_stats) = run(True), run(False)
    for prompt, p, a, b in zip(prompts, params, got, plain, strict=True):
        want = reference(llama, prompt, p)
        assert (a.token_ids, a.text, a.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert (b.token_ids, b.finish_reason) == (want.token_ids, want.finish_reason)
    assert stats.num_preemptions > 0
    for field in ("num_steps", "num_batched_tokens", "num_preemptions", "num_row_deferrals"):
        assert getattr(stats, field) == getattr(plain_stats, field), field


def test_slo_scheduling_computes_the_same_tokens(llama):
    """The slo policy changes only when tokens are computed: row caps, small prefill chunks and a
    bulk request preempted for voice ones still give each request the reference's greedy text."""
    from edge_rtgi.llm.request import RequestClass
    from tests.unit.test_scheduler_slo import trained_model

    class Frozen(type(trained_model())):  # the synthetic costs, not this machine's
        def observe(self, shape, run_ms):
            pass

    engine = engine_for(llama, scheduling="slo", min_prefill_chunk_tokens=4, max_num_batched_tokens=64)
    model = Frozen()
    model.__dict__.update(trained_model(fixed=5.0, per_row=10.0, per_token=0.5).__dict__)
    engine.step_model = engine.scheduler.step_model = model  # 3 rows fit a 50 ms ITL, a 4th does not
    tok = llama.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=10 + 2 * i, ignore_eos=True) for i in range(8)]
    classes = [RequestClass.BULK, RequestClass.BULK, *[RequestClass.VOICE] * 3, *[RequestClass.DIALOGUE] * 3]
    results = [GenerationResult() for _ in prompts]
    for i in range(len(prompts)):
        engine.submit(prompts[i], params[i], results[i].add, request_id=f"r{i}", request_class=classes[i])
        engine.step()
    for _ in range(2000):
        if not engine.step():
            break
    for prompt, p, got in zip(prompts, params, results, strict=True):
        assert got.token_ids == reference(llama, prompt, p).token_ids
    stats = engine.stats()
    assert stats.num_preemptions >= 1 and stats.num_row_deferrals >= 1 and stats.kv_blocks_used == 0


def test_token_budget_stops_the_engine_where_the_plain_path_stops(llama):
    """Budgets end replies at the same token, with the same text and reason, batched or alone."""
    tok = llama.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    params = [
        SamplingParams(max_tokens=40, token_budget=4 + i, boundary_grace_tokens=i % 3, ignore_eos=True)
        for i in range(8)
    ]
    results = run_staggered(engine_for(llama), prompts, params)
    reasons = set()
    for prompt, p, got in zip(prompts, params, results, strict=True):
        want = reference(llama, prompt, p)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        reasons.add(got.finish_reason)
        if (
            got.finish_reason == "budget"
        ):  # past the budget, up to the next whitespace (the hard cap bounds it)
            assert p.token_budget <= len(got.token_ids) < p.max_tokens
    assert "budget" in reasons


def test_a_deadline_ends_the_reply_at_a_boundary(llama):
    engine = engine_for(llama)
    prompt = llama.tokenizer.encode(TEXTS[1])
    got = engine.generate([prompt], SamplingParams(max_tokens=200, deadline_ms=1e-3, ignore_eos=True))[0]
    want = reference(llama, prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    assert got.finish_reason == "deadline" and len(got.token_ids) < 200
    assert want.text.startswith(got.text) and got.usage.completion_tokens == len(got.token_ids)
    assert engine.stats().kv_blocks_used == 0
