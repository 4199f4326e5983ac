"""Workload data loads from the package, tokenises with a real tokenizer, and sets budgets and SLOs."""

import pytest

from edge_rtgi.bench.workloads import (
    WORKLOAD_NAMES,
    code_prefixes,
    get_workload,
    get_workloads,
    prepare,
    translation_budget_tokens,
)
from edge_rtgi.errors import ConfigError


def test_all_four_workloads_with_their_data():
    workloads = get_workloads()
    assert [w.name for w in workloads] == list(WORKLOAD_NAMES)
    sizes = {w.name: len(w.items) for w in workloads}
    assert sizes == {"dialogue": 24, "code": 30, "translation": 30, "voice": 30}
    translation = get_workload("translation")
    assert all(i.reference and i.source_text for i in translation.items)
    assert get_workload("code").slo.ttft_ms < get_workload("voice").slo.ttft_ms
    # multi-turn: the last turn of a dialogue carries the earlier turns and the shared system prompt
    dialogue = get_workload("dialogue").items
    assert dialogue[3].messages[:6] == dialogue[2].messages and len(dialogue[3].messages) == 8
    assert dialogue[0].messages[0] == dialogue[5].messages[0]
    assert len(code_prefixes()) == 30 and all(p.strip() for p in code_prefixes())


def test_unknown_workload_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown workload 'chat'.*dialogue"):
        get_workload("chat")


def test_translation_budget_scales_with_source():
    assert translation_budget_tokens(10, cap=64) == 23
    assert translation_budget_tokens(100, cap=64) == 64


def test_overrides():
    w = get_workload("voice").with_overrides(num_requests=3, rate_rps=2.0, max_tokens=5, seed=9)
    assert (w.load.num_requests, w.load.rate_rps, w.max_tokens, w.load.seed) == (3, 2.0, 5, 9)


def test_prepare_with_a_real_tokenizer(tmp_path):
    from edge_rtgi.llm.tokenizer import load_hf_tokenizer
    from tests.tiny_models import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    for w in get_workloads():
        reqs = prepare(w, tok)
        assert len(reqs) == len(w.items)
        assert all(r.prompt_token_ids and 1 <= r.max_tokens <= w.max_tokens for r in reqs)
    chat = prepare(get_workload("voice"), tok)[0]
    assert tok.decode(chat.prompt_token_ids, skip_special_tokens=False).startswith("<|im_start|>system")
