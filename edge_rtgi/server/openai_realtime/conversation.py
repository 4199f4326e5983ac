"""Conversation items as the Realtime protocol sees them: ids, order, content parts, truncation.

The pipeline keeps its own chat history for the LLM; this mirror exists so that item ids,
``previous_item_id``, ``conversation.item.retrieve`` and ``conversation.item.truncate`` behave
as clients expect. Truncating an assistant audio item at ``audio_end_ms`` keeps the words that
fit the heard share of its audio, measured in characters: the pipeline does not report which
text each audio chunk speaks (the LLM runs ahead of TTS), and speech time is close to
proportional to text length.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.openai_realtime.events import optional, require

_USER_PARTS = {"input_text": "text", "input_audio": "transcript", "text": "text"}
_ASSISTANT_PARTS = {
    "output_text": "text",
    "text": "text",
    "output_audio": "transcript",
    "audio": "transcript",
}


@dataclass
class Item:
    """One conversation item (a message). ``content`` holds GA content parts."""

    id: str
    role: str
    content: list[dict]
    status: str = "completed"
    audio_ms: float = 0.0  # assistant audio only: total audio sent
    # Where the session core keeps this message in its history: a turn of its own (``history_id``),
    # the user turn it transcribes (``turn_id``), or the response that spoke it (``response_id``).
    history_id: int | None = None
    turn_id: int | None = None
    response_id: str | None = None

    def text(self) -> str:
        """The plain text of the message (text parts and audio transcripts)."""
        parts = []
        for part in self.content:
            value = part.get("text") if part.get("text") is not None else part.get("transcript")
            if value:
                parts.append(value)
        return " ".join(parts)

    def to_wire(self) -> dict:
        content = [{k: v for k, v in part.items() if k != "audio"} for part in self.content]
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": content,
        }


def parse_message_item(item: object, new_id: str) -> Item:
    """A ``conversation.item.create`` item -> ``Item``; only text messages are accepted."""
    param = "item"
    if not isinstance(item, dict):
        raise RealtimeProtocolError("invalid_type", "item must be an object", param)
    kind = item.get("type", "message")
    if kind != "message":
        raise RealtimeProtocolError(
            "invalid_value",
            f"item type {kind!r} is not supported by edge-rtgi (no tools); only 'message'",
            "item.type",
        )
    role = require(item, "role", str, "item.role")
    if role == "system":  # the pipeline's LLM sees one system prompt: the session's instructions
        raise RealtimeProtocolError(
            "invalid_value",
            "system message items are not supported by edge-rtgi; "
            "set session.instructions with session.update instead",
            "item.role",
        )
    allowed = {"user": _USER_PARTS, "assistant": _ASSISTANT_PARTS}.get(role)
    if allowed is None:
        raise RealtimeProtocolError(
            "invalid_value", f"item.role must be user or assistant, got {role!r}", "item.role"
        )
    content = require(item, "content", list, "item.content")
    parts = []
    for i, part in enumerate(content):
        p = f"item.content[{i}]"
        if not isinstance(part, dict):
            raise RealtimeProtocolError("invalid_type", f"{p} must be an object", p)
        ptype = part.get("type")
        if not isinstance(ptype, str) or ptype not in allowed:
            raise RealtimeProtocolError(
                "invalid_value",
                f"{p}.type {ptype!r} is not supported for role {role!r}; use one of {sorted(allowed)}",
                f"{p}.type",
            )
        key = allowed[ptype]
        if ptype == "input_audio" and part.get("audio") and not part.get("transcript"):
            raise RealtimeProtocolError(
                "unsupported_audio_item",
                "audio inside conversation.item.create is not transcribed; "
                "stream it with input_audio_buffer.append and commit, or send input_text",
                f"{p}.audio",
            )
        text = optional(part, key, str, f"{p}.{key}", "")
        parts.append({"type": _ga_part_type(role, ptype), key: text})
    item_id = optional(item, "id", str, "item.id") or new_id
    return Item(id=item_id, role=role, content=parts)


def heard_prefix(text: str, heard_fraction: float) -> str:
    """The whole words of ``text`` within the first ``heard_fraction`` of its characters."""
    budget = len(text.strip()) * min(1.0, max(0.0, heard_fraction)) + 0.5
    kept: list[str] = []
    for word in text.split():
        if len(" ".join(kept + [word])) > budget:
            break
        kept.append(word)
    return " ".join(kept)


def _ga_part_type(role: str, ptype: str) -> str:
    if role == "assistant":
        return "output_audio" if ptype in ("audio", "output_audio") else "output_text"
    return ptype if ptype != "text" else "input_text"


class Conversation:
    """Ordered items of one session."""

    def __init__(self) -> None:
        self._items: dict[str, Item] = {}

    def __len__(self) -> int:
        return len(self._items)

    def last_id(self) -> str | None:
        return next(reversed(self._items), None)

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Append ``item`` (or insert it after ``previous_item_id``); returns its predecessor's id."""
        if item.id in self._items:
            raise RealtimeProtocolError(
                "invalid_value", f"an item with id {item.id!r} already exists", "item.id"
            )
        if previous_item_id is None or previous_item_id == self.last_id():
            prev = self.last_id()
            self._items[item.id] = item
            return prev
        if previous_item_id not in self._items and previous_item_id != "root":
            raise RealtimeProtocolError(
                "item_not_found", f"previous_item_id {previous_item_id!r} does not exist", "previous_item_id"
            )
        ordered = list(self._items.items())
        at = 0 if previous_item_id == "root" else [k for k, _ in ordered].index(previous_item_id) + 1
        ordered.insert(at, (item.id, item))
        self._items = dict(ordered)
        return None if previous_item_id == "root" else previous_item_id

    def get(self, item_id: object, param: str = "item_id") -> Item:
        if not isinstance(item_id, str) or item_id not in self._items:
            raise RealtimeProtocolError("item_not_found", f"no conversation item with id {item_id!r}", param)
        return self._items[item_id]

    def delete(self, item_id: object) -> None:
        del self._items[self.get(item_id).id]

    def items(self) -> list[Item]:
        return list(self._items.values())

    def snapshot(self, item_id: str) -> dict:
        return copy.deepcopy(self.get(item_id).to_wire())

    def truncate(self, item_id: object, content_index: object, audio_end_ms: object) -> Item:
        """Cut an assistant audio item at ``audio_end_ms``; its transcript keeps the words heard by then."""
        item = self.get(item_id)
        if item.role != "assistant" or not any(p["type"] == "output_audio" for p in item.content):
            raise RealtimeProtocolError(
                "invalid_value",
                f"item {item_id!r} is not an assistant audio message; only those can be truncated",
                "item_id",
            )
        if not isinstance(content_index, int) or not 0 <= content_index < len(item.content):
            raise RealtimeProtocolError(
                "invalid_value", f"content_index {content_index!r} is out of range", "content_index"
            )
        if not isinstance(audio_end_ms, int) or isinstance(audio_end_ms, bool) or audio_end_ms < 0:
            raise RealtimeProtocolError(
                "invalid_value", "audio_end_ms must be a non-negative integer", "audio_end_ms"
            )
        if audio_end_ms > item.audio_ms + 1:
            raise RealtimeProtocolError(
                "invalid_value",
                f"audio_end_ms {audio_end_ms} is past the end of the item's audio ({item.audio_ms:.0f} ms)",
                "audio_end_ms",
            )
        part = item.content[content_index]
        if item.audio_ms > 0:
            part["transcript"] = heard_prefix(part.get("transcript") or "", audio_end_ms / item.audio_ms)
        item.audio_ms = float(audio_end_ms)
        item.status = "incomplete"
        return item
