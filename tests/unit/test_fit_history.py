"""``fit_history`` (per-turn token counts, one or two template renders) against the plain path
it replaced: re-render the whole chat after each dropped exchange. Same messages for every
history and budget, and the token count is the template's own. It counts with the backend that
runs the turn: here the local engine's counting (``TokenizerCounter``, what ``LocalBackend``
uses) and the remote backend's estimate."""

from __future__ import annotations

import random

import pytest

from edge_rtgi.errors import RequestError
from edge_rtgi.frames import ChatTurn
from edge_rtgi.llm.tokenizer import load_hf_tokenizer
from edge_rtgi.pipeline.backends.base import Message
from edge_rtgi.pipeline.backends.config import LlmBackendConfig
from edge_rtgi.pipeline.backends.local import TokenizerCounter
from edge_rtgi.pipeline.backends.remote import OpenAIBackend
from edge_rtgi.pipeline.stages.text import TurnTokenCounts, fit_history
from tests.tiny_models import make_tiny_tokenizer

WORDS = "the sea is wide and blue a ship sails far over waves to the bright shore".split()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(folder)
    return load_hf_tokenizer(folder)


def plain_trim(counter, system, turns, budget_tokens):
    """The plain path: count everything, drop the oldest exchange, count again."""
    system_msg = (Message("system", system),)
    msgs = tuple(Message(t.role, t.text) for t in turns)
    while msgs:
        if counter.count_tokens(system_msg + msgs) <= budget_tokens:
            return system_msg + msgs
        msgs = msgs[1:]
        while msgs and msgs[0].role != "user":
            msgs = msgs[1:]
    raise RequestError("does not fit")


def history(rng: random.Random, n: int) -> list[ChatTurn]:
    turns = []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        turns.append(ChatTurn(i + 1, role, text))
    if rng.random() < 0.3:
        turns = turns[1:]  # a history may start with an assistant turn (Realtime items)
    return turns


def counters(tok):
    remote = OpenAIBackend(LlmBackendConfig("openai", "some-model", "http://127.0.0.1:9/v1"))
    return {"local": TokenizerCounter(tok), "remote": remote}  # remote: counting needs no server


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_same_messages_as_the_plain_path(tok, kind):
    counter = counters(tok)[kind]
    rng = random.Random(0)
    for _ in range(200):
        turns = history(rng, rng.randint(1, 24))
        if not any(t.role == "user" for t in turns):
            continue
        full = counter.count_tokens(
            (Message("system", "Be brief."),) + tuple(Message(t.role, t.text) for t in turns)
        )
        budget = rng.randint(5, full + 20)
        try:
            expected = plain_trim(counter, "Be brief.", turns, budget)
        except RequestError:
            with pytest.raises(RequestError, match="does not fit"):
                fit_history(counter, "Be brief.", turns, budget)
            continue
        got = fit_history(counter, "Be brief.", turns, budget, TurnTokenCounts(counter))
        assert got.messages == expected, (budget, full)
        assert got.prompt_tokens == counter.count_tokens(expected)


def test_each_turn_is_counted_once_and_counts_stay_bounded(tok):
    calls = []
    real = TokenizerCounter(tok)

    class Counting:
        """The real counter, noting each plain text it is asked to count."""

        def count_tokens(self, prompt):
            if isinstance(prompt, str):
                calls.append(prompt)
            return real.count_tokens(prompt)

    counting = Counting()
    counts = TurnTokenCounts(counting)
    turns = history(random.Random(1), 40)
    fit_history(counting, "Be brief.", turns, 10_000, counts)
    first = len(calls)
    fit_history(counting, "Be brief.", turns + [ChatTurn(99, "user", "and now?")], 10_000, counts)
    assert len(calls) - first == 1  # only the new turn
    fit_history(counting, "Be brief.", turns[-4:], 10_000, counts)
    assert len(counts._texts) <= 5  # the forgotten turns' counts are gone (system prompt too)


def test_dropped_exchanges_leave_a_one_line_note_of_what_the_user_said(tok):
    from edge_rtgi.pipeline.stages.text import summary_line

    turns = [
        ChatTurn(1, "user", "hello there"),
        ChatTurn(2, "assistant", "hi"),
        ChatTurn(3, "user", "my sister Alice lives in Lisbon and works at the harbour"),
        ChatTurn(4, "assistant", "nice"),
        ChatTurn(5, "user", "the weather is nice and the sea is wide and blue today"),
        ChatTurn(6, "assistant", "indeed"),
        ChatTurn(7, "user", "where does my sister live"),
    ]
    line = summary_line(turns[:6], max_words=12)
    # the turn with names comes first when words are short; the note keeps spoken order
    assert line.startswith("Earlier in this conversation the user said: my sister Alice lives in Lisbon")
    assert len(line.split(":", 1)[1].split()) <= 12
    assert summary_line([ChatTurn(1, "assistant", "only me")], 10) == ""
    counter = TokenizerCounter(tok)
    full = counter.count_tokens(
        (Message("system", "Be brief."),) + tuple(Message(t.role, t.text) for t in turns)
    )
    budget = full - 12
    plain = fit_history(counter, "Be brief.", turns, budget)
    noted = fit_history(counter, "Be brief.", turns, budget, summary_words=12)
    assert plain.messages[0].content == "Be brief." and noted.prompt_tokens <= budget
    assert noted.messages[0].content.startswith("Be brief.\nEarlier in this conversation the user said:")
    assert noted.messages[-1] == Message("user", "where does my sister live")
    assert fit_history(counter, "Be brief.", turns, full, summary_words=12).messages == plain_trim(
        counter, "Be brief.", turns, full
    )  # nothing dropped: no note
