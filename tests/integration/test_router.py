"""The routing cascade's decision mechanics on two local engines (tiny seeded models): the
router's reply is exactly the chosen backend's own greedy reply, the confidence rule judges
the mean entropy of the small model's first tokens (flipping at that very value), a dropped
probe is aborted in its engine, and every decision is logged and counted in /metrics."""

from __future__ import annotations

import logging
import socket
from contextlib import aclosing

import pytest

from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.pipeline.backends.base import BackendRequest, LlmBackend, Message
from edge_rtgi.pipeline.backends.router import RouterBackend
from edge_rtgi.pipeline.config import parse_pipeline
from edge_rtgi.pipeline.resources import Resources
from edge_rtgi.server.metrics import Metrics
from tests.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.asyncio(loop_scope="module")
ENGINE = EngineConfig(device="cpu", dtype="fp32", quant="none", kv_cache_memory_mb=16)
MESSAGES = (Message("system", "Be brief."), Message("user", "Hello! How are you today?"))
PROBE = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    return (
        str(make_tiny_hf_model("llama", root / "small", seed=3)),
        str(make_tiny_hf_model("llama", root / "big", seed=11)),
    )


@pytest.fixture(scope="module")
def resources(models):
    r = Resources(ENGINE)
    r.backend_observers.observers.append(Metrics())
    yield r
    r.close()


def router_yaml(models, rule: str, extra: str = "", first: str | None = None) -> str:
    small, big = models
    first = first or f"{{backend: local, model: {small}}}"
    return (
        "stages:\n  - asr: {}\n  - assistant:\n      router:\n"
        f"        rule: {rule}\n{extra}        backends:\n"
        f"          - {first}\n          - {{backend: local, model: {big}}}\n"
    )


def router(resources, models, rule: str, extra: str = "", first: str | None = None) -> RouterBackend:
    stage = parse_pipeline(router_yaml(models, rule, extra, first), "router.yaml").text_stage
    backend = resources.text_backend(stage)
    assert isinstance(backend, RouterBackend)
    return backend


async def run(backend: LlmBackend, rid: str, logprobs: bool = False, text: str = MESSAGES[-1].content):
    request = BackendRequest(rid, 24, messages=(MESSAGES[0], Message("user", text)), logprobs=logprobs)
    out, entropies, result = "", [], None
    async with aclosing(backend.stream(request)) as deltas:
        async for delta in deltas:
            out += delta.text
            entropies += delta.entropies_nats
            result = delta.result or result
    return out, entropies, result


def metrics(resources) -> str:
    return resources.backend_observers.observers[0].render().decode()


async def test_the_confidence_rule_escalates_exactly_above_its_threshold(resources, models, caplog):
    caplog.set_level(logging.INFO, logger="edge_rtgi.pipeline.backends.router")
    small, big = (resources.llm_backend(s) for s in router(resources, models, "confidence").config.backends)
    alone_small, entropies, _ = await run(small, "s", logprobs=True)
    alone_big, _, _ = await run(big, "b")
    assert alone_small != alone_big  # two different models, or the test could not tell them apart
    mean = sum(entropies[:PROBE]) / PROBE  # the router judges the first PROBE tokens

    keep = router(
        resources,
        models,
        "confidence",
        f"        probe_tokens: {PROBE}\n        max_mean_entropy_nats: {mean * 1.0001}\n",
    )
    text, _, result = await run(keep, "r1")
    assert text == alone_small and result.backend == small.name
    assert result.route.reason == "confident" and result.route.tried == ()
    assert result.route.mean_entropy_nats == pytest.approx(mean, rel=1e-3)

    escalate = router(
        resources,
        models,
        "confidence",
        f"        probe_tokens: {PROBE}\n        max_mean_entropy_nats: {mean * 0.9999}\n",
    )
    engine = resources.llm(models[0])
    text, _, result = await run(escalate, "r2")
    assert text == alone_big and result.backend == big.name  # restarted afresh on the big model
    assert result.route.reason == "low_confidence" and [t.backend for t in result.route.tried] == [small.name]
    assert result.route.tried[0].completion_tokens == PROBE and result.route.probe_ms > 0
    assert engine.stats().num_running == 0  # the dropped probe was aborted, its KV blocks freed
    said = [r.getMessage() for r in caplog.records]
    assert any("r1 ->" in m and "confident" in m for m in said)
    assert any("r2 ->" in m and "low_confidence" in m for m in said)
    text = metrics(resources)
    for backend, reason, name in (
        (small.name, "confident", keep.name),
        (big.name, "low_confidence", escalate.name),
    ):
        labels = f'backend="{backend}",reason="{reason}",router="{name}"'
        assert f"edge_rtgi_route_decisions_total{{{labels}}} 1.0" in text


async def test_the_features_rule_sends_long_or_keyword_turns_to_the_big_model(resources, models):
    r = router(
        resources, models, "features", "        escalate_min_words: 12\n        escalate_keywords: [code]\n"
    )
    small, big = r.backends
    _, _, plain = await run(r, "f1", text="Hello there")
    _, _, keyword = await run(r, "f2", text="Write some CODE please")
    _, _, long = await run(r, "f3", text=" ".join(["word"] * 12))
    assert (plain.backend, plain.route.reason) == (small.name, "plain_turn")
    assert (keyword.backend, keyword.route.reason) == (big.name, "keyword")
    assert (long.backend, long.route.reason) == (big.name, "long_turn")


async def test_the_fallback_rule_hands_a_turn_on_when_the_remote_is_down(resources, models):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = (
        f"{{backend: openai, base_url: 'http://127.0.0.1:{port}/v1', model: m,"
        " remote: {max_retries: 0, connect_timeout_s: 1}}"
    )
    r = router(resources, models, "fallback", first=first)
    alone_big, _, _ = await run(r.backends[1], "fb0")
    text, _, result = await run(r, "fb1")
    assert text == alone_big and result.route.reason == "failed"
    assert "cannot be reached" in result.route.detail and result.route.tried[0].finish_reason == "failed"
    await resources.aclose_backends()
    assert 'outcome="backend_unavailable"' in metrics(resources)
