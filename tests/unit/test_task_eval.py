"""Task retention on a tiny seeded model: the same computation reads exactly 1; the full model's
outputs are cached per model file, prompt and budget, and a stale entry is never used."""

from __future__ import annotations

import dataclasses

import pytest

from edge_rtgi.bench.task_eval import (
    FullOutputCache,
    TaskOutputs,
    run_full_model,
    run_on_engine,
    select_items,
    task_retention,
)
from edge_rtgi.bench.tasks import load_task_set
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from edge_rtgi.llm.weights import load_model

    folder = make_tiny_hf_model(
        "llama", tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=4096
    )
    return load_model(folder, "cpu", "fp32")


@pytest.fixture(scope="module")
def engine(tiny):
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig

    eng = LLMEngine.from_loaded(tiny, EngineConfig(dtype="fp32", quant="none", num_threads=1))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("name", ["voice", "dialogue", "code", "translation"])
def test_the_same_computation_reads_exactly_one(tiny, engine, tmp_path, name):
    task_set = load_task_set(name)
    full = run_full_model(tiny, task_set, limit=4, cache=FullOutputCache(tmp_path))
    optimised = run_on_engine(engine, task_set, limit=4)
    assert optimised.texts == full.texts  # fp32 engine and plain path: identical greedy text
    result = task_retention(task_set, optimised, full)
    assert result.retention == 1.0 and (result.interval.low, result.interval.high) == (1.0, 1.0)
    assert result.fidelity_chrf == pytest.approx(100.0) and result.interval.n == 4
    if name == "dialogue":
        assert [d.distance_turns for d in result.per_distance] == [1, 4, 12, 30]


def test_a_worse_configuration_reads_below_one():
    task_set = load_task_set("voice")
    items = select_items(task_set, 10)
    ids = tuple(i.id for i in items)
    right = tuple(i.answers[0] for i in items)  # every reply names an accepted answer
    half = right[:5] + ("I do not know.",) * 5
    full = TaskOutputs("voice", ids, right, (3,) * 10)
    worse = TaskOutputs("voice", ids, half, (3,) * 10)
    result = task_retention(task_set, worse, full)
    assert result.interval.full_score == 1.0 and result.interval.optimised_score == 0.5
    assert result.retention == pytest.approx(0.5) and result.interval.low < 0.5 < result.interval.high
    with pytest.raises(ValueError, match="different items"):
        task_retention(task_set, dataclasses.replace(worse, item_ids=ids[::-1]), full)


def test_full_outputs_are_cached_and_a_changed_model_file_is_recomputed(tiny, tmp_path, monkeypatch):
    task_set = load_task_set("code")
    cache = FullOutputCache(tmp_path)
    from edge_rtgi.llm import generate as gen_module

    generated = []
    real_generate = gen_module.generate

    def counting_generate(*args, **kwargs):
        generated.append(1)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(gen_module, "generate", counting_generate)
    first = run_full_model(tiny, task_set, limit=3, cache=cache)
    assert len(generated) == 3
    again = run_full_model(tiny, task_set, limit=3, cache=cache)
    assert again == first and len(generated) == 3  # served from the cache
    weights = next(tiny.source.glob("*.safetensors"))
    weights.touch()  # the file changed (mtime): its entries no longer match
    run_full_model(tiny, task_set, limit=3, cache=cache)
    assert len(generated) == 6


def test_item_selection_spreads_over_the_set():
    task_set = load_task_set("dialogue")
    chosen = select_items(task_set, 8)
    assert len(chosen) == 8 and len({item.distance_turns for item in chosen}) == 4
    assert select_items(task_set, None) == task_set.items
    with pytest.raises(ValueError, match=">= 1"):
        select_items(task_set, 0)
