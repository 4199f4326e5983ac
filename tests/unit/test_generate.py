"""Plain generation on a tiny model: stops, limits, seeds, streaming, and chat history trimming."""

from __future__ import annotations

import pytest

from edge_rtgi.commands.llm import Backend, chat_turn, fit_history
from edge_rtgi.errors import RequestError
from edge_rtgi.llm.generate import generate, generate_stream
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("gen"), seed=2)
    return load_model(folder, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def prompt(tiny):
    return tiny.tokenizer.encode("Hello! How are you today?")


def test_max_tokens_and_length_finish(tiny, prompt):
    result = generate(tiny, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


def test_stream_deltas_join_to_the_result(tiny, prompt):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    deltas = list(generate_stream(tiny, prompt, params))
    assert [d.finish_reason for d in deltas] == [None] * 19 + ["length"]
    assert "".join(d.text for d in deltas) == generate(tiny, prompt, params).text
    assert [t for d in deltas for t in d.token_ids] == generate(tiny, prompt, params).token_ids


def test_stop_token_ends_generation_and_is_not_in_text(tiny, prompt):
    free = generate(tiny, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    stop_id = free.token_ids[6]
    first = free.token_ids.index(stop_id)
    result = generate(tiny, prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)))
    assert result.finish_reason == "stop"
    assert result.token_ids == free.token_ids[: first + 1]
    assert result.text == tiny.tokenizer.decode(free.token_ids[:first])


def test_stop_string_cuts_text_before_it(tiny, prompt):
    free = generate(tiny, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    visible = free.text.replace("\ufffd", "")
    assert len(visible) >= 6, free.text
    stop = visible[len(visible) // 2 : len(visible) // 2 + 2]
    result = generate(tiny, prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.index(stop)]


def test_seeded_sampling_is_reproducible(tiny, prompt):
    params = SamplingParams(max_tokens=16, temperature=1.5, top_k=50, top_p=0.95, seed=7, ignore_eos=True)
    a, b = generate(tiny, prompt, params), generate(tiny, prompt, params)
    other = generate(tiny, prompt, SamplingParams(max_tokens=16, temperature=1.5, seed=8, ignore_eos=True))
    assert a.token_ids == b.token_ids
    assert a.token_ids != other.token_ids


def test_prompt_longer_than_context_names_both_lengths(tiny):
    ids = [5] * (tiny.config.max_position_embeddings + 3)
    with pytest.raises(RequestError, match=r"259 tokens.*256 tokens"):
        generate(tiny, ids, SamplingParams(max_tokens=4))


def test_generation_stops_at_the_context_window(tiny):
    ids = [5] * (tiny.config.max_position_embeddings - 3)
    result = generate(tiny, ids, SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


def test_max_tokens_zero_is_refused():
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_chat_history_keeps_system_and_drops_oldest_turns(tiny):
    tok = tiny.tokenizer
    history = []
    for i in range(6):
        history += [
            {"role": "user", "content": f"question {i} " * 8},
            {"role": "assistant", "content": "answer " * 8},
        ]
    history.append({"role": "user", "content": "last question"})
    full = len(tok.encode_chat([{"role": "system", "content": "SYS"}, *history]))
    ids, dropped = fit_history(tok, "SYS", history, context_tokens=full - 40, reserve_tokens=0)
    assert dropped > 0 and dropped % 2 == 0
    assert len(ids) <= full - 40
    assert ids == tok.encode_chat([{"role": "system", "content": "SYS"}, *history[dropped:]])
    with pytest.raises(RequestError, match="context window"):
        fit_history(tok, "SYS", history, context_tokens=10, reserve_tokens=0)


def test_chat_turn_streams_and_trims(tiny):
    backend = Backend(
        tokenizer=tiny.tokenizer,
        context_tokens=tiny.config.max_position_embeddings,
        stream=lambda ids, params: generate_stream(tiny, ids, params),
    )
    history = [{"role": "user", "content": "Hello!"}]
    written: list[str] = []
    reply = chat_turn(backend, "Be brief.", history, SamplingParams(max_tokens=6), write=written.append)
    assert "".join(written) == reply + "\n"
