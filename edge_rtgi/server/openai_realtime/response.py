"""One Realtime response: the server events from ``response.created`` to ``response.done``.

A response has one assistant message item with one content part: ``output_audio`` (audio
plus its transcript) when ``audio`` is among the output modalities, else ``output_text``.
This class only formats events and keeps the counters; the adapter feeds it the pipeline's
text deltas and audio chunks. TTS audio arrives at the voice's rate and is resampled
(stateful, chunk by chunk) to the session's output format before base64 encoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from edge_rtgi.audio.pcm import Resampler, float32_to_pcm16, pcm16_to_float32
from edge_rtgi.server.openai_realtime.codecs import AudioFormat, encode_base64
from edge_rtgi.server.openai_realtime.conversation import Item

# Reasons the protocol knows for a response that did not complete.
CANCEL_REASONS = {
    "barge_in": "turn_detected",
    "client_cancel": "client_cancelled",
    "turn_detected": "turn_detected",
    "client_cancelled": "client_cancelled",
}


def usage_from_pipeline(usage: dict | None, output_text_tokens: int = 0) -> dict:
    """The Realtime ``usage`` object from the pipeline's token counts (unknown counts are 0)."""
    usage = usage or {}
    input_tokens = int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0)
    output_tokens = int(usage.get("completion_tokens", usage.get("output_tokens", output_text_tokens)) or 0)
    cached = int(usage.get("cached_tokens", usage.get("prefix_hit_tokens", 0)) or 0)
    return {
        "total_tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_token_details": {
            "text_tokens": input_tokens,
            "audio_tokens": 0,
            "cached_tokens": cached,
            "image_tokens": 0,
        },
        "output_token_details": {"text_tokens": output_tokens, "audio_tokens": 0},
    }


class ResponseStream:
    """Formats the events of one response and tracks its text, audio and status."""

    def __init__(
        self,
        *,
        response_id: str,
        item: Item,
        new_event_id: Callable[[str], str],
        modalities: tuple[str, ...],
        output_format: AudioFormat,
        voice: str | None,
        conversation_id: str,
        max_output_tokens: int | None,
    ):
        self.id = response_id
        self.item = item
        self._eid = new_event_id
        self.audio_out = "audio" in modalities
        self.modalities = ("audio",) if self.audio_out else ("text",)
        self.format = output_format
        self.voice = voice
        self.conversation_id = conversation_id
        self.max_output_tokens = max_output_tokens
        self.text = ""
        self.status = "in_progress"
        self._resampler: Resampler | None = None
        self._resampler_src_hz: int | None = None
        self.audio_samples = 0
        self.audio_chunks = 0
        part_type = "output_audio" if self.audio_out else "output_text"
        item.content = [{"type": part_type, "transcript" if self.audio_out else "text": ""}]
        item.status = "in_progress"

    # -------------------------------------------------------------- helpers
    def _ev(self, event_type: str, **fields) -> dict:
        return {"type": event_type, "event_id": self._eid("event"), **fields}

    def _where(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def _part(self) -> dict:
        if self.audio_out:
            return {"type": "audio", "transcript": self.text}
        return {"type": "text", "text": self.text}

    def to_wire(self, usage: dict | None = None, status_details: dict | None = None) -> dict:
        """The ``response`` object of ``response.created`` / ``response.done``."""
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": self.status,
            "status_details": status_details,
            "conversation_id": self.conversation_id,
            "output": [self.item.to_wire()] if self.status != "in_progress" else [],
            "output_modalities": list(self.modalities),
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
            "audio": {"output": {"format": self.format.to_wire(), "voice": self.voice or "default"}},
            "usage": usage,
        }

    # -------------------------------------------------------------- lifecycle
    def start(self, previous_item_id: str | None) -> list[dict]:
        """``response.created`` and the events that open its message item and content part."""
        item = self.item.to_wire()
        item["content"] = []
        return [
            self._ev("response.created", response=self.to_wire()),
            self._ev("response.output_item.added", response_id=self.id, output_index=0, item=item),
            self._ev("conversation.item.added", previous_item_id=previous_item_id, item=item),
            self._ev("response.content_part.added", **self._where(), part=self._part()),
        ]

    def text_delta(self, delta: str) -> list[dict]:
        """One piece of reply text: ``output_audio_transcript.delta`` or ``output_text.delta``."""
        if not delta:
            return []
        self.text += delta
        key = "transcript" if self.audio_out else "text"
        self.item.content[0][key] = self.text
        kind = "response.output_audio_transcript.delta" if self.audio_out else "response.output_text.delta"
        return [self._ev(kind, **self._where(), delta=delta)]

    def audio(self, pcm: np.ndarray, sample_rate_hz: int) -> list[dict]:
        """One TTS chunk (int16 at ``sample_rate_hz``) -> ``output_audio.delta`` at the session's rate."""
        if not self.audio_out or len(pcm) == 0:
            return []
        out = self._resample(pcm, sample_rate_hz)
        self.audio_samples += len(out)
        self.item.audio_ms = 1000.0 * self.audio_samples / self.format.sample_rate_hz
        if len(out) == 0:
            return []
        self.audio_chunks += 1
        return [
            self._ev("response.output_audio.delta", **self._where(), delta=encode_base64(out, self.format))
        ]

    def _resample(self, pcm: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        dst = self.format.sample_rate_hz
        if sample_rate_hz == dst:
            return np.asarray(pcm, dtype=np.int16)
        if self._resampler is None or self._resampler_src_hz != sample_rate_hz:
            self._resampler = Resampler(sample_rate_hz, dst)
            self._resampler_src_hz = sample_rate_hz
        return float32_to_pcm16(self._resampler.process(pcm16_to_float32(np.asarray(pcm, dtype=np.int16))))

    def _flush_audio(self) -> list[dict]:
        if self._resampler is None:
            return []
        tail = float32_to_pcm16(self._resampler.flush())
        self._resampler = None
        if len(tail) == 0 or self.status != "completed":
            return []
        self.audio_samples += len(tail)
        self.item.audio_ms = 1000.0 * self.audio_samples / self.format.sample_rate_hz
        return [
            self._ev("response.output_audio.delta", **self._where(), delta=encode_base64(tail, self.format))
        ]

    def finish(
        self,
        status: str,
        *,
        reason: str | None = None,
        usage: dict | None = None,
        text: str | None = None,
        error: dict | None = None,
    ) -> list[dict]:
        """The closing events, ending with ``response.done``
        (status completed/cancelled/failed/incomplete)."""
        self.status = status
        if text is not None and status == "completed" and text.strip() and not self.text.strip():
            self.text_delta(text)  # a pipeline that only reports the whole text at the end
        events = self._flush_audio()
        self.item.status = "completed" if status == "completed" else "incomplete"
        where = self._where()
        if self.audio_out:
            events.append(self._ev("response.output_audio.done", **where))
            events.append(self._ev("response.output_audio_transcript.done", **where, transcript=self.text))
        else:
            events.append(self._ev("response.output_text.done", **where, text=self.text))
        item = self.item.to_wire()
        events += [
            self._ev("response.content_part.done", **where, part=self._part()),
            self._ev("response.output_item.done", response_id=self.id, output_index=0, item=item),
            self._ev("conversation.item.done", item=item),
        ]
        details: dict[str, Any] | None = None
        if status != "completed":
            details = {"type": status, "reason": CANCEL_REASONS.get(reason or "", reason)}
            if error:
                details["error"] = error
        events.append(self._ev("response.done", response=self.to_wire(usage=usage, status_details=details)))
        return events
