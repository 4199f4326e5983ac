"""Checks on the text handed to a synthesiser (shared by every engine and the async wrapper)."""

from __future__ import annotations

from edge_rtgi.errors import EdgeRtgiError


class EmptyTextError(EdgeRtgiError):
    """There is nothing to say."""


def check_text(text: str) -> str:
    """The text itself, or ``EmptyTextError`` if it has nothing speakable."""
    if not text or not any(ch.isalnum() for ch in text):
        raise EmptyTextError(
            "nothing to speak: the text is empty or has no words",
            hint='give some text, e.g. edge-rtgi speak "Hello there"',
        )
    return text
