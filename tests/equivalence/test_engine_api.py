"""Engine API behaviour: async streaming, abort, consumers that stop reading, failures that stay local."""

from __future__ import annotations

import asyncio
import gc

import pytest

import edge_rtgi.llm.runner as runner_module
from edge_rtgi.errors import RequestError
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model

LONG = SamplingParams(max_tokens=150, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(make_tiny_hf_model("llama", tmp_path_factory.mktemp("api"), seed=2), "cpu", "fp64")


@pytest.fixture
def engine(loaded):
    eng = LLMEngine.from_loaded(
        loaded, EngineConfig(block_size=4, num_kv_blocks=48, max_num_batched_tokens=32)
    )
    yield eng
    eng.shutdown()


async def wait_until(cond, timeout_s=20.0):
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def pool_full(engine):
    return lambda: engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.scheduler.has_unfinished()


async def test_stream_delivers_text_tokens_and_usage(engine, loaded):
    prompt = "The quick brown fox"
    want = generate(loaded, loaded.tokenizer.encode(prompt), SamplingParams(max_tokens=12, ignore_eos=True))
    deltas = [d async for d in engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert "".join(d.text for d in deltas) == want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    last = deltas[-1]
    assert last.finish_reason == "length" and all(d.usage is None for d in deltas[:-1])
    u = last.usage
    assert u.prompt_tokens == len(loaded.tokenizer.encode(prompt)) and u.completion_tokens == 12
    assert u.ttft_ms == u.token_times_ms[0] and len(u.token_times_ms) == 12
    assert list(u.token_times_ms) == sorted(u.token_times_ms)


async def test_abort_releases_all_blocks(engine):
    stream = engine.add_request("Hello! How are you today?", LONG, request_id="victim")
    first = await stream.__anext__()
    assert first.finish_reason is None
    engine.abort("victim")
    rest = [d async for d in stream]
    assert rest[-1].finish_reason == "abort"
    await wait_until(pool_full(engine))


async def test_consumer_that_stops_reading_releases_blocks(engine):
    stream = engine.add_request("Hello! How are you today?", LONG)
    async for _ in stream:
        break
    del stream
    gc.collect()
    await wait_until(pool_full(engine))


async def test_cancelled_consumer_task_releases_blocks(engine):
    got = []

    async def consume():
        async for d in engine.add_request("What is the capital of France?", LONG):
            got.append(d)

    task = asyncio.create_task(consume())
    await wait_until(lambda: len(got) >= 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(pool_full(engine))


async def test_closed_stream_releases_blocks(engine):
    async with engine.add_request("Numbers like 12", LONG) as stream:
        await stream.__anext__()
    await wait_until(pool_full(engine))


async def test_bad_requests_fail_alone(engine, loaded, monkeypatch):
    real_sample = runner_module.sample_token

    def flaky_sample(logits, params, generator=None):
        if params.seed == 666:  # fault injection: this request's sampler fails, as on NaN logits
            raise RequestError("sampling failed: logits contain NaN or inf")
        return real_sample(logits, params, generator)

    monkeypatch.setattr(runner_module, "sample_token", flaky_sample)
    good_params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompt = "The quick brown fox"
    streams = {
        "good": engine.add_request(prompt, good_params),
        "too_long": engine.add_request(list(range(5)) * 60, good_params),
        "bad_stop": engine.add_request(prompt, {"max_tokens": 5, "stop": [""]}),
        "bad_param": engine.add_request(prompt, {"max_tokens": 5, "temprature": 1.0}),
        "sampling": engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=666)),
        "too_big": engine.add_request(prompt, SamplingParams(max_tokens=600, ignore_eos=True)),
    }
    results = {}
    for name, stream in streams.items():
        results[name] = [d async for d in stream]
    for name in ("too_long", "bad_stop", "bad_param", "sampling", "too_big"):
        last = results[name][-1]
        assert last.finish_reason == "error" and last.error, name
    assert "context window is 256 tokens" in results["too_long"][-1].error
    assert "stop strings" in results["bad_stop"][-1].error
    assert "temprature" in results["bad_param"][-1].error
    assert "NaN" in results["sampling"][-1].error
    assert "48 blocks" in results["too_big"][-1].error and "blocks of 4" in results["too_big"][-1].error
    good = results["good"]
    want = generate(loaded, loaded.tokenizer.encode(prompt), good_params)
    assert [t for d in good for t in d.token_ids] == want.token_ids and good[-1].finish_reason == "length"
    await wait_until(pool_full(engine))


async def test_requests_join_while_others_run(engine):
    a = engine.add_request("Hello!", SamplingParams(max_tokens=30, ignore_eos=True))
    await a.__anext__()
    b = engine.add_request("def add(a, b):", SamplingParams(max_tokens=5, ignore_eos=True))
    b_deltas = [d async for d in b]
    a_deltas = [d async for d in a]
    assert b_deltas[-1].finish_reason == "length" and a_deltas[-1].finish_reason == "length"
    stats = engine.stats()
    assert stats.num_steps > 0 and stats.requests_per_step > 1.0
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_total == 48


async def test_requests_after_shutdown_fail_with_an_error(loaded):
    eng = LLMEngine.from_loaded(loaded, EngineConfig(block_size=4, num_kv_blocks=16))
    eng.shutdown()
    deltas = [d async for d in eng.add_request("Hello!", SamplingParams(max_tokens=3))]
    assert len(deltas) == 1 and deltas[0].finish_reason == "error" and "shut down" in deltas[0].error
