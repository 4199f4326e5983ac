"""Strict JSON for client messages, shared by every WebSocket protocol of the daemon.

A text frame of a few hundred bytes must never cost more than an error event. Python's
``json.loads`` on its own lets through, or raises outside ``JSONDecodeError``:

- deep nesting (``RecursionError``) and integers longer than Python's digit limit
  (``ValueError``);
- ``NaN``, ``Infinity`` and numbers that overflow a float (``1e999``), none of which JSON has;
- ``\\ud800`` escapes that decode to a lone surrogate: a ``str`` that cannot be encoded as
  UTF-8, which later breaks every tokenizer call on a history that holds it.

``parse_client_json`` refuses all of these with ``WireJsonError``, whose message says what was
wrong; each protocol turns it into its own ``error`` event.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32  # far deeper than any event of either protocol (session.update nests 5 levels)
MAX_INT_DIGITS = 64


class WireJsonError(Exception):
    """A client text frame that is not acceptable JSON; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _no_constants(name: str) -> Any:
    raise WireJsonError(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise WireJsonError(f"the number {text[:40]} does not fit a 64-bit float")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise WireJsonError(f"an integer of {digits} digits is too long (at most {MAX_INT_DIGITS})")
    return int(text)


def _depth_ok(text: str) -> bool:
    """Nesting depth of ``text`` at most ``MAX_DEPTH`` (brackets inside strings are skipped)."""
    depth, in_string, escaped = 0, False, False
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return True  # cannot be deeper than the number of openers
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _check_strings(value: Any) -> None:
    """Raise when a string (key or value) holds a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise WireJsonError(
                    f"a string holds a lone UTF-16 surrogate (\\u{ord(item[exc.start]):04x}); "
                    "send valid Unicode text"
                ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_client_json(message: str | bytes) -> Any:
    """Parse one client text frame strictly; ``WireJsonError`` names what is wrong."""
    if isinstance(message, (bytes, bytearray, memoryview)):
        try:
            message = bytes(message).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireJsonError(
                f"the message is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
    if not _depth_ok(message):
        raise WireJsonError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(
            message, parse_constant=_no_constants, parse_float=_finite_float, parse_int=_bounded_int
        )
    except json.JSONDecodeError as exc:
        raise WireJsonError(f"{exc.msg} at char {exc.pos}") from None
    except (ValueError, RecursionError) as exc:  # the depth check makes RecursionError unlikely
        raise WireJsonError(str(exc)[:200]) from None
    if "\\u" in message or "\\U" in message:  # only an escape can produce a lone surrogate
        _check_strings(value)
    return value
