"""Reading OpenAI's streamed answers: server-sent events, then one JSON chunk per event.

``SseDecoder`` follows the WHATWG event-stream rules that OpenAI-compatible servers use:
``data:`` lines (one space after the colon dropped) accumulate until a blank line ends the
event, ``:`` lines are comments (keep-alives), other fields are ignored. ``parse_chunk``
reads one event's data: ``[DONE]``, a chat-completion or text-completion chunk, a usage-only
chunk, or an ``error`` object. Anything else is a ``BackendError`` (``backend_error``) that
quotes the start of what was received.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from edge_rtgi.errors import BackendError

DONE = "[DONE]"
_QUOTE_CHARS = 80


class SseDecoder:
    """Event data from the lines of a ``text/event-stream`` body, fed one line at a time."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, line: str) -> str | None:
        """The data of the event a blank ``line`` ends; None while an event is still open."""
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None  # a comment: servers send them to keep idle connections open
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def close(self) -> str | None:
        """The data of an event left open when the body ended (no blank line after it)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


@dataclass(frozen=True)
class StreamChunk:
    """What one event said: new ``text``, a ``finish_reason``, token counts, or the end."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    done: bool = False


def _quote(data: str) -> str:
    return data if len(data) <= _QUOTE_CHARS else data[:_QUOTE_CHARS] + "..."


def _malformed(source: str, why: str, data: str) -> BackendError:
    return BackendError(
        f"{source} sent a malformed event stream: {why}: {_quote(data)!r}",
        hint="the server must speak OpenAI's streaming API (server-sent events of JSON chunks)",
    )


def _count(usage: dict[str, Any], key: str) -> int | None:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_chunk(data: str, chat: bool, source: str) -> StreamChunk:
    """Read one event of a chat (``chat``) or text completion stream from ``source``."""
    if data.strip() == DONE:
        return StreamChunk(done=True)
    try:
        obj = json.loads(data)
    except ValueError:
        raise _malformed(source, "an event is not JSON", data) from None
    if not isinstance(obj, dict):
        raise _malformed(source, "an event is not a JSON object", data)
    if "error" in obj:
        err = obj["error"]
        message = err.get("message") if isinstance(err, dict) else err
        raise BackendError(f"{source} reported an error mid-stream: {_quote(str(message))}")
    usage = obj.get("usage")
    prompt = completion = cached = None
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        prompt, completion = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
        cached = _count(details, "cached_tokens") if isinstance(details, dict) else None
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise _malformed(source, "a chunk has no 'choices' list", data)
    if not choices:
        return StreamChunk(
            "", None, prompt, completion, cached
        )  # the usage-only chunk of stream_options.include_usage
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _malformed(source, "a choice is not a JSON object", data)
    if chat:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            raise _malformed(source, "a chat chunk has no 'delta' object", data)
        text = delta.get("content")
    else:
        text = choice.get("text")
    if text is not None and not isinstance(text, str):
        raise _malformed(source, "a chunk's text is not a string", data)
    finish = choice.get("finish_reason")
    return StreamChunk(text or "", finish if isinstance(finish, str) else None, prompt, completion, cached)
