"""Load generator: schedules and prompt choice are reproducible from the seed; runs are bounded."""

import threading
import time

import pytest

from edge_rtgi.bench.loadgen import LoadSpec, arrival_times_s, request_order, run_load
from edge_rtgi.bench.metrics import SLO
from edge_rtgi.bench.targets import EngineTarget, ThreadedTarget, plain_stream_fn
from edge_rtgi.bench.workloads import PreparedRequest


def test_poisson_schedule_is_seeded_and_has_the_right_rate():
    spec = LoadSpec(pattern="poisson", rate_rps=4.0, num_requests=2000, max_duration_s=1e9, seed=7)
    a, b = arrival_times_s(spec), arrival_times_s(spec)
    assert a == b and len(a) == 2000 and a[0] == 0.0
    assert a != arrival_times_s(
        LoadSpec(pattern="poisson", rate_rps=4.0, num_requests=2000, max_duration_s=1e9, seed=8)
    )
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.1)
    assert all(y >= x for x, y in zip(a, a[1:], strict=False))


def test_schedules_are_bounded_in_count_and_time():
    spec = LoadSpec(pattern="poisson", rate_rps=10.0, num_requests=1000, max_duration_s=2.0, seed=1)
    times = arrival_times_s(spec)
    assert times and max(times) < 2.0 and len(times) < 1000
    burst = LoadSpec(pattern="burst", rate_rps=2.0, burst_size=4, num_requests=10, max_duration_s=1e9, seed=3)
    times = arrival_times_s(burst)
    assert len(times) == 10
    assert times[:4] == [0.0] * 4 and len(set(times[4:8])) == 1 and len(set(times[8:])) == 1


def test_request_order_is_seeded_and_covers_items():
    order = request_order(5, 12, seed=3)
    assert order == request_order(5, 12, seed=3)
    assert order != request_order(5, 12, seed=4)
    assert sorted(order[:5]) == list(range(5)) and sorted(order[5:10]) == list(range(5))


def test_bad_spec_is_rejected():
    with pytest.raises(ValueError, match="pattern"):
        LoadSpec(pattern="zipf")
    with pytest.raises(ValueError, match="rate_rps"):
        LoadSpec(rate_rps=0.0)


def _requests(n=6, max_tokens=4):
    return [
        PreparedRequest(key=f"k{i}", workload="w", prompt_token_ids=(1, 2 + i), max_tokens=max_tokens)
        for i in range(n)
    ]


def _counting_stream(delay_s=0.0):
    def stream(request, cancel):
        for i in range(request.max_tokens):
            if delay_s:
                time.sleep(delay_s)
            yield (i,), f"t{i} "

    return stream


async def test_run_load_is_reproducible_from_its_seed():
    spec = LoadSpec(pattern="poisson", rate_rps=50.0, num_requests=8, max_duration_s=5.0, seed=11)
    target = ThreadedTarget("count", _counting_stream())
    first = await run_load(target, _requests(), spec)
    second = await run_load(target, _requests(), spec)
    assert [t.prompt_key for t in first.traces] == [t.prompt_key for t in second.traces]
    assert [t.sent_s for t in first.traces] == [t.sent_s for t in second.traces]
    assert all(t.ok and t.completion_tokens == 4 and t.text == "t0 t1 t2 t3 " for t in first.traces)
    other = await run_load(
        target,
        _requests(),
        LoadSpec(pattern="poisson", rate_rps=50.0, num_requests=8, max_duration_s=5.0, seed=12),
    )
    assert [t.sent_s for t in other.traces] != [t.sent_s for t in first.traces]
    m = first.metrics(SLO())
    assert m.num_requests == 8 and m.output_tokens == 32


async def test_unfinished_requests_are_cancelled_and_counted_as_failed():
    cancelled = threading.Event()

    def slow(request, cancel):
        try:
            for i in range(1000):
                if cancel.is_set():
                    return
                time.sleep(0.01)
                yield (i,), "x"
        finally:  # the worker stops pulling from (and closes) a cancelled request's generator
            cancelled.set()

    spec = LoadSpec(
        pattern="burst",
        rate_rps=100.0,
        burst_size=2,
        num_requests=2,
        max_duration_s=0.2,
        drain_timeout_s=0.1,
        seed=0,
    )
    target = ThreadedTarget("slow", slow, max_concurrency=2)
    result = await run_load(target, _requests(2), spec)
    m = result.metrics(SLO())
    assert m.num_failed == 2 and m.slo_attainment == 0.0
    assert all("time bound" in t.error for t in result.traces)
    for _ in range(100):
        if cancelled.is_set():
            break
        time.sleep(0.01)
    assert cancelled.is_set()
    target.close()


async def test_closed_loop_keeps_concurrency_and_count():
    spec = LoadSpec(pattern="closed", concurrency=3, num_requests=7, max_duration_s=10.0, seed=2)
    target = ThreadedTarget("count", _counting_stream(0.001), max_concurrency=3)
    result = await run_load(target, _requests(), spec)
    assert len(result.traces) == 7 and all(t.ok for t in result.traces)
    assert [int(t.request_id.rsplit("-", 1)[1]) for t in result.traces] == list(range(7))
    target.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from edge_rtgi.llm.weights import load_model
    from tests.tiny_models import make_tiny_hf_model

    return load_model(make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"), seed=5), "cpu", "fp32")


async def test_engine_and_plain_targets_give_the_same_greedy_text(tiny):
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig

    reqs = [
        PreparedRequest(
            key=f"k{i}", workload="w", max_tokens=6, prompt_token_ids=tuple(tiny.tokenizer.encode(text))
        )
        for i, text in enumerate(["Hello! How are", "The quick brown", "def add(a, b):"])
    ]
    spec = LoadSpec(pattern="burst", rate_rps=100.0, burst_size=3, num_requests=3, max_duration_s=30.0)
    engine = LLMEngine.from_loaded(tiny, EngineConfig(dtype="fp32", num_kv_blocks=64, block_size=4))
    try:
        batched = await run_load(EngineTarget(engine), reqs, spec)
    finally:
        engine.shutdown()
    plain = await run_load(ThreadedTarget("plain", plain_stream_fn(tiny)), reqs, spec)
    by_key = {t.prompt_key: t.token_ids for t in plain.traces}
    assert all(t.ok for t in batched.traces + plain.traces)
    assert {t.prompt_key: t.token_ids for t in batched.traces} == by_key
    assert batched.kv_blocks_total == 64 and batched.kv_blocks_peak is not None


async def test_a_warm_start_has_the_shared_prompt_prefix_cached_before_the_first_request(tiny):
    """``start_load_run`` with ``warm``: the run's first request already finds the prefix its
    prompts share in the prefix cache, as on a daemon after start-up; cold, it finds nothing."""
    from edge_rtgi.bench.suite import shared_prompt_prefix, start_load_run
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig

    system = tiny.tokenizer.encode("You are a helpful voice assistant. Answer in one short sentence.")
    reqs = [
        PreparedRequest(
            key=f"k{i}", workload="w", max_tokens=4, prompt_token_ids=tuple(system + tiny.tokenizer.encode(q))
        )
        for i, q in enumerate([" what time is it", " how far is the moon"])
    ]
    assert shared_prompt_prefix(reqs) == tuple(system)
    spec = LoadSpec(pattern="poisson", rate_rps=1.0, num_requests=1, max_duration_s=30.0)
    engine = LLMEngine.from_loaded(tiny, EngineConfig(dtype="fp32", num_kv_blocks=64, block_size=4))
    try:
        cached = {}
        for warm in (True, False):
            assert start_load_run(engine, reqs, warm) == (len(system) if warm else 0)
            result = await run_load(EngineTarget(engine), reqs, spec)
            cached[warm] = result.traces[0].cached_tokens
    finally:
        engine.shutdown()
    assert cached == {True: len(system) // 4 * 4, False: 0}
