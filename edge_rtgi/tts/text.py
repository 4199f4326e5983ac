"""Checks on the text handed to a synthesiser (shared by every engine and the async wrapper)."""

from __future__ import annotations

import unicodedata

from edge_rtgi.errors import EdgeRtgiError


class EmptyTextError(EdgeRtgiError):
    """There is nothing to say."""


def check_text(text: str) -> str:
    """The text with control characters made spaces, or ``EmptyTextError`` if it has nothing
    speakable. A NUL from a model's byte token or a client cannot go into espeak-ng's argv."""
    if not text or not any(ch.isalnum() for ch in text):
        raise EmptyTextError(
            "nothing to speak: the text is empty or has no words",
            hint='give some text, e.g. edge-rtgi speak "Hello there"',
        )
    if any(unicodedata.category(ch) == "Cc" for ch in text):
        text = "".join(" " if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch for ch in text)
    return text
