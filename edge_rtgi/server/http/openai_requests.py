"""OpenAI chat and completion requests, parsed and checked before anything reaches an engine.

``parse_request`` turns a request body into a ``TextRequest`` or raises ``ApiError`` (HTTP
400, OpenAI's error shape) naming the field that is wrong and what to send instead. Unknown
fields are refused, as OpenAI's API does, so that a typo (``max_token``) is not silently
ignored; fields we accept but do not implement are refused unless they hold their neutral value.
The checks that need the model (the prompt's length against the context window, token ids
against the vocabulary) run after tokenizing, in ``openai_api``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

Kind = Literal["chat", "completion"]
ROLES = ("system", "developer", "user", "assistant")
MAX_STOP_STRINGS = 4
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request that names none samples

_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
}
# accepted only at their neutral value (what the API does when they are absent)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logprobs": (False,),
    "logit_bias": ({},),
    "top_logprobs": (0,),
}
_CHAT_ONLY = {"messages", "max_completion_tokens", "parallel_tool_calls", "store", "metadata"}
_CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
}
_COMPLETION_ONLY = {"prompt"}
_COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {"echo": (False,), "best_of": (1,), "suffix": ("",)}


class ApiError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type, the offending param, a code."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}`` as OpenAI's API and its client libraries expect it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatMessage:
    """One chat message, its content flattened to text."""

    role: str
    content: str


@dataclass(frozen=True)
class TextRequest:
    """A checked request. Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set;
    ``max_tokens`` None means "the rest of the context window"."""

    kind: Kind
    model: str
    messages: tuple[ChatMessage, ...] | None
    prompt: str | tuple[int, ...] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, low_open: bool) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"'{key}' must be a number, got {type(value).__name__}", key, "invalid_type")
    if not (low < value <= high if low_open else low <= value <= high):
        interval = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise ApiError(f"'{key}' must be in {interval}, got {value!r}", key, "invalid_value")
    return float(value)


def _int_or_none(body: dict[str, Any], key: str, minimum: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"'{key}' must be an integer, got {type(value).__name__}", key, "invalid_type")
    if minimum is not None and value < minimum:
        raise ApiError(f"'{key}' must be at least {minimum}, got {value}", key, "invalid_value")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only
        texts = []
        for i, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    f"{where}.content[{i}] must be a text part ({{'type': 'text', 'text': ...}}); "
                    "this model reads text only",
                    f"{where}.content",
                    "unsupported_content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(
        f"{where}.content must be a string or a list of text parts", f"{where}.content", "invalid_type"
    )


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if value is None:
        raise ApiError(
            "'messages' is required: a list of {'role': ..., 'content': ...}", "messages", "missing"
        )
    if not isinstance(value, list) or not value:
        raise ApiError("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object with 'role' and 'content'", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise ApiError(f"{where} has unsupported field {extra[0]!r}", f"{where}.{extra[0]}")
        if "content" not in m:
            raise ApiError(f"{where}.content is required", f"{where}.content", "missing")
        # "developer" is OpenAI's newer name for the system role
        out.append(ChatMessage("system" if role == "developer" else role, _content(m["content"], where)))
    return tuple(out)


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise ApiError("'prompt' is empty", "prompt", "invalid_value")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        if min(value) < 0:
            raise ApiError("'prompt' token ids must be >= 0", "prompt", "invalid_value")
        return tuple(value)
    if value is None:
        raise ApiError("'prompt' is required: a string (or a list of token ids)", "prompt", "missing")
    raise ApiError(
        "'prompt' must be one string or one list of token ids (one prompt per request)",
        "prompt",
        "invalid_type",
    )


def _check_fields(kind: Kind, body: dict[str, Any]) -> None:
    allowed = _COMMON | (_CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY)
    neutral = {**_NEUTRAL, **(_CHAT_NEUTRAL if kind == "chat" else _COMPLETION_NEUTRAL)}
    for key, value in body.items():
        if key in allowed or key in neutral and (value is None or value in neutral[key]):
            continue
        if key in neutral:
            raise ApiError(
                f"'{key}' is not supported by this server (got {value!r})", key, "unsupported_parameter"
            )
        raise ApiError(f"unrecognized request argument supplied: {key}", key, "unknown_parameter")
    if body.get("n") not in (None, 1):
        raise ApiError("only n=1 is supported", "n", "unsupported_parameter")


def parse_request(kind: Kind, raw: bytes, models: list[str]) -> TextRequest:
    """Parse and check a request body; ``models`` are the names this daemon serves."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", None, "invalid_json")
    _check_fields(kind, body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("'model' is required (GET /v1/models lists them)", "model", "missing")
    if model not in models:
        served = ", ".join(models) or "none: no pipeline of this daemon uses an LLM"
        raise ApiError(f"unknown model {model!r}; this daemon serves: {served}", "model", "model_not_found")
    messages = _messages(body.get("messages")) if kind == "chat" else None
    prompt = _prompt(body.get("prompt")) if kind == "completion" else None
    max_tokens = _int_or_none(body, "max_tokens", 1)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _int_or_none(body, "max_completion_tokens", 1)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be true or false", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError("'stream_options' takes only {'include_usage': bool}", "stream_options")
    if options and not stream:
        raise ApiError("'stream_options' is only allowed with 'stream': true", "stream_options")
    return TextRequest(
        kind=kind,
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0, low_open=False),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=_int_or_none(body, "seed", None),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )
