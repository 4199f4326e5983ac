"""Book-keeping for one response in flight: its text, its audio, its latency marks.

A response stays *active* while it is being generated and, after that, while the client is
still playing its audio. The session cannot see the client's speaker, so it estimates
playback from the audio it has sent: playback starts with the first audio chunk and runs
at real time. Barge-in uses this to decide whether the user is talking over the reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_rtgi import frames as F


def _ms(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return round((b - a) * 1000.0, 1)


def _ms_after(a: float | None, b: float | None) -> float | None:
    """``_ms``, 0 when ``b`` came first (a reply started on a likely final can have its first
    words before the final that confirmed it)."""
    ms = _ms(a, b)
    return None if ms is None else max(0.0, ms)


@dataclass
class ResponseState:
    response_id: str
    turn_id: int
    kind: F.ResponseKind
    source_text: str
    timing: F.Transcript | None = None  # the final transcript that started it, if any
    created_t_s: float = field(default_factory=F.now_s)
    text: str = ""
    text_done: bool = False
    done: bool = False
    usage: dict | None = None
    llm: F.LlmCallStats | None = None
    marks: dict[str, float] = field(default_factory=dict)
    audio_sent_s: float = 0.0
    first_audio_sent_t_s: float | None = None
    playback_cut_t_s: float | None = None
    # started on a likely final (Session.on_likely_final): its events for the client, each with
    # whether it completes the response, until the final confirms it; None once it is the client's
    held: list[tuple[F.SessionEvent, bool]] | None = None
    releasing: bool = False  # the held events are on their way to the client (Session._release_held)
    held_after_entry: int = 0  # the history's last entry id when it started: its prompt's history

    @property
    def hidden(self) -> bool:
        """Held, and nothing of it sent yet: not the client's (no barge-in, no interrupt event)."""
        return self.held is not None and not self.releasing

    def observe(self, frame: object) -> None:
        """Update from a frame on its way to the client."""
        if isinstance(frame, F.TextDelta):
            self.text += frame.delta
            self.marks.setdefault("first_delta", frame.t_s)
        elif isinstance(frame, F.TextDone):
            self.text = frame.text
            self.text_done = True
            self.llm = frame.llm
            self.marks.setdefault("text_done", frame.t_s)

    def audio_sent(self, frame: F.AudioOut, now_s: float) -> None:
        if self.first_audio_sent_t_s is None:
            self.first_audio_sent_t_s = now_s
        self.audio_sent_s += frame.duration_s

    def playback_end_t_s(self) -> float | None:
        if self.first_audio_sent_t_s is None:
            return None
        return self.first_audio_sent_t_s + self.audio_sent_s

    def active(self, now_s: float | None = None) -> bool:
        """Generating, or (by the real-time estimate) still playing on the client."""
        if self.playback_cut_t_s is not None:
            return False
        if not self.done:
            return True
        end = self.playback_end_t_s()
        return end is not None and (now_s if now_s is not None else F.now_s()) < end

    @property
    def finished(self) -> bool:
        return self.done and not self.active()

    def played_ms(self, now_s: float) -> int:
        if self.first_audio_sent_t_s is None:
            return 0
        return int(1000 * min(self.audio_sent_s, max(0.0, now_s - self.first_audio_sent_t_s)))

    def stats(self) -> F.TurnStats:
        t = self.timing
        speech_end = t.speech_end_t_s if t else None
        endpoint = t.endpoint_t_s if t else None
        final = t.t_s if t else self.created_t_s
        m = self.marks
        tokens = (self.usage or {}).get("completion_tokens")
        llm = self.llm
        return F.TurnStats(
            endpointing_ms=_ms(speech_end, endpoint),
            turn_decision_ms=round(t.turn_decision_ms, 1) if t and t.turn_decision_ms is not None else None,
            asr_final_ms=_ms(endpoint, final if t else None),
            asr_queue_ms=t.asr_queue_ms if t else None,
            asr_decode_ms=t.asr_decode_ms if t else None,
            llm_ttft_ms=_ms_after(final, m.get("first_delta")),
            first_clause_ms=_ms(m.get("first_delta"), m.get("first_clause")),
            tts_first_chunk_ms=_ms(m.get("first_clause"), m.get("first_audio")),
            voice_to_voice_ms=_ms(speech_end, self.first_audio_sent_t_s),
            text_total_ms=_ms_after(final, m.get("text_done")),
            reply_head_start_ms=_ms(self.created_t_s, final) if t and self.created_t_s < final else None,
            completion_tokens=tokens,
            backend=llm.backend if llm else None,
            prompt_tokens=llm.prompt_tokens if llm else None,
            backend_connect_ms=llm.connect_ms if llm else None,
            backend_ttft_ms=llm.ttft_ms if llm else None,
            backend_total_ms=llm.total_ms if llm else None,
            backend_attempts=llm.attempts if llm else None,
            route_reason=llm.route_reason if llm else None,
            route_escalations=llm.escalations if llm and llm.route_reason else None,
            route_probe_ms=llm.probe_ms if llm else None,
        )
