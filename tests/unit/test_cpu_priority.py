"""``CpuPriority``: background work waits while foreground work runs, within a bound; the
engine's step loop waits for it; the TTS stage marks a reply's first clause as foreground."""

from __future__ import annotations

import asyncio
import threading

from edge_rtgi.cpu_priority import FOREGROUND, CpuPriority
from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model


def _waiter(gate: CpuPriority, max_wait_s: float) -> tuple[threading.Thread, list[float]]:
    waited: list[float] = []
    thread = threading.Thread(target=lambda: waited.append(gate.wait_for_idle(max_wait_s)), daemon=True)
    thread.start()
    return thread, waited


def test_idle_gate_never_waits():
    assert CpuPriority().wait_for_idle(10.0) == 0.0


def test_background_waits_until_the_foreground_job_ends():
    gate = CpuPriority()
    with gate.foreground():
        with gate.foreground():  # overlapping jobs: wait for both
            thread, waited = _waiter(gate, 30.0)
            thread.join(0.2)
            assert thread.is_alive()
        thread.join(0.2)
        assert thread.is_alive() and gate.foreground_running == 1
    thread.join(5.0)
    assert not thread.is_alive() and waited and waited[0] < 30.0
    assert gate.foreground_running == 0


def test_wait_is_bounded_from_when_foreground_work_began():
    gate = CpuPriority()
    with gate.foreground():  # a job that outlives the bound (slow, or leaked)
        thread, waited = _waiter(gate, 0.05)
        thread.join(5.0)
        assert not thread.is_alive()
        # The bound counts from the start of the foreground work, not from each call: later
        # waits during the same busy spell return at once instead of 0.05 s each.
        thread, waited = _waiter(gate, 0.05)
        thread.join(5.0)
        assert not thread.is_alive() and waited[0] < 0.05


async def test_engine_holds_its_steps_while_foreground_work_runs(tmp_path):
    loaded = load_model(make_tiny_hf_model("llama", tmp_path, seed=3), "cpu", "fp32")
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(block_size=4, num_kv_blocks=32, yield_to_foreground_ms=60_000)
    )
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        with FOREGROUND.foreground():
            stream = engine.add_request("hello there", params)
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.3)
            assert not first.done(), "the engine stepped while foreground work ran"
            assert engine.stats().num_steps == 0
        await asyncio.wait_for(first, 30)
        rest = [d async for d in stream]
        assert sum(len(d.token_ids) for d in [first.result(), *rest]) == 4
        assert engine.stats().foreground_wait_s > 0
    finally:
        engine.shutdown()


async def test_engine_without_yield_ignores_foreground_work(tmp_path):
    loaded = load_model(make_tiny_hf_model("llama", tmp_path, seed=3), "cpu", "fp32")
    engine = LLMEngine.from_loaded(
        loaded, EngineConfig(block_size=4, num_kv_blocks=32, yield_to_foreground_ms=0)
    )
    try:
        with FOREGROUND.foreground():
            deltas = [
                d
                async for d in engine.add_request(
                    "hello there", SamplingParams(max_tokens=4, ignore_eos=True)
                )
            ]
        assert sum(len(d.token_ids) for d in deltas) == 4
    finally:
        engine.shutdown()


def test_freeze_heap_moves_live_objects_out_of_collections():
    import gc

    from edge_rtgi.cpu_priority import freeze_heap

    kept = [{"i": i} for i in range(1000)]  # long-lived containers, like a loaded tokenizer's
    before = gc.get_freeze_count()
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()  # leave the test process's collector as it was


def test_full_collections_keep_their_pace_after_freeze_heap():
    """Cyclic garbage that reached the oldest generation is freed on the collector's own
    schedule after a freeze (here after about 80,000 new long-lived objects), not only once a
    quarter of the frozen heap has been promoted anew (200,000 here; minutes of use in the
    daemon, while the garbage held its audio and tensors)."""
    import gc
    import weakref

    from edge_rtgi.cpu_priority import freeze_heap

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the cyclic collector frees it

    loaded = [[i] for i in range(800_000)]  # a loaded daemon's long-lived containers
    survivors: list[list[int]] = []
    try:
        freeze_heap()
        node = Node()
        gone = weakref.ref(node)
        for i in range(10_000):  # survivors, so collections run and promote the node
            survivors.append([i])
        del node
        for i in range(150_000):
            survivors.append([i])
            if gone() is None:
                break
        assert gone() is None, "no full collection ran after the freeze"
    finally:
        gc.unfreeze()  # leave the test process's collector as it was
        del loaded
