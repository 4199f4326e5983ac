"""OpenAI chat/completion request parsing (no model, no server) and the browser tickets."""

from __future__ import annotations

import json

import pytest

from edge_rtgi.server.http.openai_requests import ApiError, ChatMessage, parse_request
from edge_rtgi.server.http.tickets import Tickets

MODELS = ["tiny", "smollm2-135m-instruct"]


def chat(**fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse_request("chat", json.dumps(body).encode(), MODELS)


def refused(kind, body) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as err:
        parse_request(kind, raw, MODELS)
    assert err.value.status == 400 and err.value.body()["error"]["type"] == "invalid_request_error"
    return err.value


def test_defaults_follow_openai():
    req = chat()
    assert req.temperature == 1.0 and req.top_p == 1.0 and req.max_tokens is None
    assert req.stop == () and req.seed is None and not req.stream and not req.include_usage
    assert req.messages == (ChatMessage("user", "Hi"),) and req.prompt is None


def test_fields_are_read():
    req = chat(
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        seed=3,
        stop="\n",
        stream=True,
        stream_options={"include_usage": True},
    )
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stop) == (7, 0.0, 0.5, 3, ("\n",))
    assert req.stream and req.include_usage
    assert chat(max_completion_tokens=9).max_tokens == 9
    assert chat(frequency_penalty=0, logprobs=False, user="me", n=1).max_tokens is None


def test_messages_roles_and_text_parts():
    req = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        ]
    )
    assert req.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "Hello"))


def test_completion_prompts():
    def prompt(value):
        return parse_request(
            "completion", json.dumps({"model": "tiny", "prompt": value}).encode(), MODELS
        ).prompt

    assert prompt("Once upon") == "Once upon"
    assert prompt(["Once upon"]) == "Once upon"
    assert prompt([1, 2, 3]) == (1, 2, 3)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        ({"model": "tiny"}, "messages", "'messages' is required"),
        ({"model": "tiny", "messages": []}, "messages", "non-empty"),
        (
            {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
            "model",
            "unknown model 'gpt-4o'",
        ),
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "'model' is required"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({"model": "tiny", "messages": [{"role": "user"}]}, "messages[0].content", "required"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "text only",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_token": 5},
            "max_token",
            "unrecognized",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
            "at least 1",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 3},
            "temperature",
            "[0, 2]",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p", "(0, 1]"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "n=1"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5},
            "stop",
            "at most 4",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
            "logprobs",
            "not supported",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
            "stream_options",
            "only allowed",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed", "integer"),
    ],
)
def test_bad_chat_requests_name_the_reason(body, param, words):
    err = refused("chat", body)
    assert err.param == param and words in err.message, err.message


def test_bad_completion_requests():
    assert refused("completion", {"model": "tiny"}).param == "prompt"
    assert "one prompt per request" in refused("completion", {"model": "tiny", "prompt": ["a", "b"]}).message
    assert refused("completion", {"model": "tiny", "prompt": "x", "messages": []}).param == "messages"
    assert refused(
        "chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}
    ).param


def test_no_model_served_says_so():
    with pytest.raises(ApiError, match="no pipeline of this daemon uses an LLM"):
        parse_request("chat", b'{"model": "x", "messages": [{"role": "user", "content": "hi"}]}', [])


def test_tickets_are_single_use_and_expire(monkeypatch):
    tickets = Tickets(ttl_s=30.0)
    t = tickets.issue()
    assert tickets.redeem(t) and not tickets.redeem(t), "a ticket works once"
    assert not tickets.redeem("made-up")
    clock = [1000.0]
    monkeypatch.setattr("edge_rtgi.server.http.tickets.time.monotonic", lambda: clock[0])
    late = tickets.issue()
    clock[0] += 31.0
    assert not tickets.redeem(late), "an expired ticket is refused"
    many = [tickets.issue() for _ in range(300)]
    assert not tickets.redeem(many[0]) and tickets.redeem(many[-1]), "the table is bounded, oldest dropped"
