"""Streaming transcription: VAD-gated utterances, LocalAgreement partials, exact finals.

``StreamingTranscriber`` is synchronous and single-threaded, with whisper_streaming's three
verbs: ``insert_audio`` (cheap: ring buffer + VAD), ``process_iter`` (may decode; call it
from a worker thread) and ``finish``. ``AsrSession`` is its asyncio front: feed chunks from
the event loop, read ``AsrEvent``s; all model work happens on one worker thread per session.

Invariants:
- whisper never sees audio the VAD did not call speech (plus ``speech_pad_ms`` before it and
  ``end_pad_ms`` after it);
- committed words only grow; the final of an utterance is ``committed + tail`` where the
  tail comes from one decode of the whole utterance with the committed words forced as its
  prefix, so a word is never dropped or emitted twice between partials and final;
- each utterance is finalised once, and its audio is forgotten after (no tail repeated);
- speech longer than ``max_utterance_s`` is cut at a word boundary *after* the committed
  words (word timestamps of one decode), so the words promised in partials all lie before
  the cut and the next utterance, which starts at the cut, cannot hear them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from edge_rtgi.asr.agreement import LocalAgreement, normalize_word, split_words, tail_after
from edge_rtgi.asr.batch import PartialSkipped
from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.asr.events import (
    AsrEvent,
    FinalTranscript,
    PartialTranscript,
    SpeechEnded,
    SpeechStarted,
    TranscriptSegment,
    TurnLikelyEnded,
    TurnResumed,
)
from edge_rtgi.asr.split import choose_split
from edge_rtgi.asr.turn import WINDOW_SAMPLES, SemanticEndpointer, TurnDecision, transcript_unfinished
from edge_rtgi.asr.vad import SileroVad, VadEvent
from edge_rtgi.asr.whisper import DecodeTiming, Hypothesis, Transcriber, text_loops
from edge_rtgi.audio.pcm import Resampler
from edge_rtgi.audio.ring import RingBuffer
from edge_rtgi.errors import AudioError

log = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16000
_LANGUAGE_LOCK_SAMPLES = 2 * SAMPLE_RATE_HZ  # language detection on less audio is unreliable
_MIN_DECODE_SAMPLES = SAMPLE_RATE_HZ // 10
# Audio kept beyond max_utterance_s: what may pile up while a stalled decode keeps the cut
# (or final) of the utterance in progress waiting; callers insert a whole backlog at once.
_BACKLOG_S = 30.0


@dataclass(frozen=True)
class _SpeculativeFinal:
    """A decode of ``[start, silence_start_index + pad)`` made during trailing silence; it is reused
    as the final when the endpoint confirms that same silence with the same committed words."""

    silence_start_index: int
    num_committed_words: int
    hypothesis: Hypothesis
    timing: DecodeTiming | None = None  # semantic mode: when its decode began, after any queue

    def matches(self, end_index: int, num_committed_words: int) -> bool:
        return self.silence_start_index == end_index and self.num_committed_words == num_committed_words


@dataclass(frozen=True)
class _PendingSpeculation:
    """A speculative decode running on the decode thread while the worker scores the turn."""

    silence_start_index: int
    end_index: int
    num_committed_words: int
    future: Future[tuple[Hypothesis, DecodeTiming | None]]


@dataclass(frozen=True)
class _SplitFinal:
    """Long speech cut at its quietest gap: the final's words, the decode they came from, its cost."""

    words: list[str]
    hypothesis: Hypothesis
    decode_ms: float


@dataclass
class _Utterance:
    id: int
    start_index: int  # first sample given to whisper (speech start minus pad)
    speech_start_index: int
    agreement: LocalAgreement
    last_decode_end: int = 0
    language: str | None = None
    end_index: int | None = None  # first silent sample after the speech
    endpoint_index: int | None = None
    reason: str = "silence"
    speculative: _SpeculativeFinal | None = None
    pending: _PendingSpeculation | None = None  # semantic mode: a speculative decode in flight
    decision: TurnDecision | None = None  # semantic mode: the model's verdict on the latest pause
    split: _SplitFinal | None = None  # set when long speech was cut
    partial_key: tuple[str, str] = field(default=("", ""))
    likely_end_at: int | None = None  # the pause a TurnLikelyEnded was sent for (its silence start)


class StreamingTranscriber:
    """Turns a 16 kHz float32 stream into ``AsrEvent``s (see module docstring)."""

    def __init__(
        self,
        asr: Transcriber,
        config: AsrConfig | None = None,
        vad: SileroVad | None = None,
        endpointer: SemanticEndpointer | None = None,
        likely_ends: bool = False,
    ):
        """``endpointer``: semantic turn detection (the ``vad`` then carries the silence cap as its
        ``min_silence_ms``); None: the VAD's silence timer alone ends turns. ``likely_ends``:
        announce a pause's words before the turn ends (``TurnLikelyEnded``, for a reply started
        early: the ASR stage's ``preemptive_reply``)."""
        self.asr = asr
        self.endpointer = endpointer
        self.likely_ends = likely_ends
        # Semantic mode decodes the likely final on its own thread, so that the model's verdict
        # on the pause and the final's decode overlap instead of queueing on the worker.
        self._decode_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="asr-final") if endpointer is not None else None
        )
        self.config = config or asr.config
        self.vad = vad or SileroVad(self.config.vad)
        self.vad.reset()  # the VAD's sample indices must match the ring's
        self._pad = self.config.vad.speech_pad_ms * SAMPLE_RATE_HZ // 1000  # before speech
        self._end_pad = self.config.vad.trailing_pad_ms * SAMPLE_RATE_HZ // 1000  # after it
        # silence mode announces a pause's words only once half its timer has passed: shorter
        # dips inside speech are common, and each announcement starts a reply
        self._likely_end_silence = self.vad.config.min_silence_ms * SAMPLE_RATE_HZ // 2000
        self._min_chunk = self.config.min_chunk_ms * SAMPLE_RATE_HZ // 1000
        # New audio needed before the next partial decode; a real-time driver may raise it
        # when decodes are slow (see AsrSession), never below min_chunk_ms.
        self.partial_interval_samples = self._min_chunk
        self.last_partial_decode_s = 0.0  # wall time the last partial decode took
        self._max_len = int(self.config.max_utterance_s * SAMPLE_RATE_HZ)
        self._ring = RingBuffer(int((self.config.max_utterance_s + _BACKLOG_S) * SAMPLE_RATE_HZ))
        self._events: list[AsrEvent] = []
        self._active: _Utterance | None = None
        self._ended: list[_Utterance] = []
        self._next_id = 0
        # utterance id -> whisper prompt for its decodes; set from the event loop's thread
        # (``prompt_utterance``), read here: single dict operations, atomic under the GIL
        self._prompts: dict[int, str] = {}

    def close(self) -> None:
        """Stop the decode thread of semantic mode (a decode in flight finishes on its own)."""
        if self._decode_pool is not None:
            self._decode_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def audio_s(self) -> float:
        """Seconds of audio received so far."""
        return self._ring.total_written / SAMPLE_RATE_HZ

    @property
    def split_due(self) -> bool:
        """The utterance in progress is longer than ``max_utterance_s``; ``process_iter`` will cut it."""
        return (
            self._active is not None and self._ring.total_written - self._active.start_index > self._max_len
        )

    @property
    def heard_text(self) -> str:
        """The utterance in progress as last decoded (its latest partial, or the speculative final
        of a pause inside it); "" before its first decode and between utterances."""
        utt = self._active
        return " ".join(t for t in utt.partial_key if t) if utt is not None else ""

    @property
    def pause_words(self) -> str | None:
        """Semantic mode: the words of the utterance in progress as decoded up to the pause in
        progress (its speculative final); None when there is no pause, or that decode is not in."""
        utt, silence_start = self._active, self.vad.silence_start_index
        if utt is None or silence_start is None:
            return None
        return self._speculative_words(utt, max(silence_start, utt.start_index))

    @property
    def active_utterance_id(self) -> int | None:
        """The id of the utterance in progress (None between utterances)."""
        utt = self._active
        return utt.id if utt is not None else None

    def prompt_utterance(self, utterance_id: int, prompt: str) -> None:
        """Decode utterance ``utterance_id`` from now on with ``prompt`` as whisper's prompt ("":
        none). Safe to call from another thread than the one that decodes."""
        self._prompts[utterance_id] = prompt

    @property
    def decode_pending(self) -> bool:
        """Semantic mode: a decode of the utterance in progress, up to a pause inside it, has been
        started and its words are not in ``heard_text`` yet."""
        return self._active is not None and self._active.pending is not None

    def insert_audio(self, samples: np.ndarray) -> None:
        """Append mono float32 16 kHz samples. Cheap (VAD only); never decodes.

        Call ``process_iter`` after every chunk or few: it also cuts speech that has grown
        past ``max_utterance_s`` (which takes a decode), and only 30 s more than that is kept.
        An utterance whose end the VAD finds within audio inserted since the last
        ``process_iter`` may run past the limit by up to that much audio.
        """
        samples = np.asarray(samples)
        if samples.ndim != 1:
            raise AudioError(
                f"insert_audio takes mono [N] samples, got shape {samples.shape}",
                hint="down-mix with edge_rtgi.audio.downmix",
            )
        if samples.dtype == np.int16:
            samples = samples.astype(np.float32) / 32768.0
        self._ring.write(samples)
        for event in self.vad.process(samples):
            self._on_vad(event)

    def _on_vad(self, event: VadEvent) -> None:
        if event.kind == "start":
            self._start_utterance(
                event.sample_index, max(self._ring.oldest_index, event.sample_index - self._pad)
            )
        elif self._active is not None:
            self._end_active(event.sample_index, "silence")

    def _start_utterance(self, speech_start: int, start: int) -> None:
        cfg = self.config
        agreement = LocalAgreement(cfg.agreement_n, cfg.holdback_words)
        language = cfg.language if self.asr.multilingual else "en"
        self._active = _Utterance(
            self._next_id, start, speech_start, agreement, last_decode_end=start, language=language
        )
        # prompts set after their utterance was finalised (the loop ran late) go with the next one
        oldest = min([u.id for u in self._ended] + [self._next_id])
        for stale in [u for u in list(self._prompts) if u < oldest]:
            self._prompts.pop(stale, None)
        self._next_id += 1
        self._events.append(SpeechStarted(self._active.id, round(1000 * speech_start / SAMPLE_RATE_HZ)))

    def _end_active(self, end_index: int, reason: str) -> None:
        utt, self._active = self._active, None
        if utt is None:
            return
        end_index = max(end_index, utt.start_index)  # silence can predate a forced split
        utt.end_index, utt.endpoint_index, utt.reason = end_index, self._ring.total_written, reason
        self._ended.append(utt)

    def commit(self) -> None:
        """End the current utterance now (the client says the turn is over)."""
        event = self.vad.force_end()
        if event is not None and self._active is not None:
            self._end_active(min(event.sample_index, self._ring.total_written), "commit")

    def process_iter(self) -> list[AsrEvent]:
        """Decode what is due and return the events since the last call. Blocking."""
        self._finalize_ended()
        if self.split_due:
            self._split_long_utterance()
        utt = self._active
        if utt is not None:
            now = self._ring.total_written
            silence_start = self.vad.silence_start_index
            if silence_start is not None:
                # After a forced split the silence may have begun before this utterance did.
                silence_start = max(silence_start, utt.start_index)
                if self.endpointer is not None:
                    self._semantic_pause(utt, silence_start, now)
                else:
                    # Speech may be over: no partial decode now (it would delay the final); once
                    # the pad has arrived, decode the likely final while the endpoint timer runs.
                    fresh = utt.speculative is None or utt.speculative.silence_start_index != silence_start
                    if self.config.speculative_final and fresh and now - silence_start >= self._end_pad:
                        self._speculate(utt, silence_start)
                    if now - silence_start >= self._likely_end_silence:
                        self._announce_likely_end(utt, silence_start)
            else:
                if utt.likely_end_at is not None:  # the words of that pause were not the end
                    utt.likely_end_at = None
                    self._events.append(TurnResumed(utt.id))
                self._collect_pending(utt, wait=True)  # speech resumed: that decode is stale
                if now - utt.last_decode_end >= max(self._min_chunk, self.partial_interval_samples):
                    self._partial(utt, now)
        self._finalize_ended()
        events, self._events = self._events, []
        return events

    def _finalize_ended(self) -> None:
        for ended in self._ended:
            self._events.extend(self._finalize(ended))
        self._ended.clear()

    # -- semantic end of turn -------------------------------------------------------------

    def _semantic_pause(self, utt: _Utterance, silence_start: int, now: int) -> None:
        """A pause in semantic mode: start the likely final's decode once the end pad is in (on
        the decode thread), and when ``min_silence_ms`` has passed, ask the model on this thread
        whether the turn is over; if so, end it here instead of at the VAD's silence cap."""
        endpointer = self.endpointer
        if endpointer is None:
            return
        self._collect_pending(utt, wait=False)
        fresh = utt.speculative is None or utt.speculative.silence_start_index != silence_start
        pending_here = utt.pending is not None and utt.pending.silence_start_index == silence_start
        pad_in = now - silence_start >= self._end_pad
        if self.config.speculative_final and fresh and not pending_here and pad_in:
            self._collect_pending(utt, wait=True)  # at most one decode in flight
            self._speculate_async(utt, silence_start)
        earlier = utt.decision if utt.decision and utt.decision.silence_start_index == silence_start else None
        if earlier is not None:  # decided at this pause: asked again only after a hold or recheck time
            # Not before the model's first look: on a busy CPU a reply would slow that look, which
            # ends most questions; after it, the reply runs while a hold or the cap waits.
            self._announce_likely_end(utt, silence_start)
            retry = earlier.retry_silence_samples
            if retry is None or now - silence_start < retry:
                return
        elif now - silence_start < endpointer.check_samples:
            return
        audio = self._ring.read(max(self._ring.oldest_index, utt.start_index, now - WINDOW_SAMPLES), now)
        utt.decision = endpointer.decide(audio, silence_start, now - silence_start)
        question_recheck = endpointer.question_recheck_samples and utt.decision.retry_silence_samples is None
        if not utt.decision.complete and question_recheck and endpointer.text_check:
            words = self._words_to_pause(utt, silence_start)
            if words is not None:
                utt.decision = endpointer.recheck_question(utt.decision, words, now - silence_start)
        if utt.decision.complete and endpointer.text_check:
            # Hold the verdict against this pause's speculative final: the final needs that
            # decode anyway, so waiting for it here delays the declared end, not the reply.
            words = self._words_to_pause(utt, silence_start)
            if words is not None:
                utt.decision = endpointer.check_words(utt.decision, words, now - silence_start)
        if utt.decision.complete:
            self.vad.force_end()
            self._end_active(silence_start, "semantic")
        else:  # the words may have been waited for just now
            self._announce_likely_end(utt, silence_start)

    def _announce_likely_end(self, utt: _Utterance, silence_start: int) -> None:
        """``TurnLikelyEnded`` for the pause that began at ``silence_start``, once its words (its
        speculative final) are decoded and do not read as cut off: a timer (the silence timer, a
        hold, the cap) or the model's next look ends most such pauses with these words, so a
        reply can start now and be held until the final confirms them. Once per pause. In
        semantic mode after the model's first look at the pause, whatever it said: a turn it
        calls unfinished ends with these words at the cap too."""
        if not self.likely_ends or utt.likely_end_at == silence_start:
            return
        words = self._speculative_words(utt, silence_start)
        if not words or transcript_unfinished(words):
            return
        # words the final would drop (too little audio after a split; a stock phrase whisper
        # was unsure of) could never be confirmed
        heard = min(silence_start + self._end_pad, self._ring.total_written) - utt.start_index
        hyp = utt.speculative.hypothesis if utt.speculative is not None else None
        unsure = hyp is not None and not utt.agreement.committed and self._is_hallucination(words, hyp)
        if heard < _MIN_DECODE_SAMPLES or unsure:
            return
        utt.likely_end_at = silence_start
        self._events.append(TurnLikelyEnded(utt.id, words))

    def _words_to_pause(self, utt: _Utterance, silence_start: int) -> str | None:
        """The words up to the pause that began at ``silence_start`` (its speculative final,
        waited for); None when that pause has none."""
        self._collect_pending(utt, wait=True)
        return self._speculative_words(utt, silence_start)

    @staticmethod
    def _speculative_words(utt: _Utterance, silence_start: int) -> str | None:
        """The utterance's words as its speculative final for the pause at ``silence_start`` has
        them (committed + tail); None when its speculative final is for another pause, or none."""
        spec = utt.speculative
        if spec is None or spec.silence_start_index != silence_start:
            return None
        return " ".join(utt.agreement.final_words(split_words(spec.hypothesis.text)))

    def _speculate_async(self, utt: _Utterance, silence_start: int) -> None:
        if self._decode_pool is None:
            return
        end = min(silence_start + self._end_pad, self._ring.total_written)
        audio = self._ring.read(utt.start_index, end)
        prefix, language = utt.agreement.committed_text or None, utt.language
        future = self._decode_pool.submit(
            self._timed_transcribe,
            utt.id,
            audio,
            prefix=prefix,
            language=language,
            timestamps=True,
            beam_size=self.config.final_beam_size,
        )
        utt.pending = _PendingSpeculation(silence_start, end, len(utt.agreement.committed), future)

    def _timed_transcribe(
        self, utterance_id: int, audio: np.ndarray, **kwargs
    ) -> tuple[Hypothesis, DecodeTiming | None]:
        hyp = self._transcribe(utterance_id, audio, **kwargs)
        return hyp, self.asr.last_timing()

    def _transcribe(self, utterance_id: int, audio: np.ndarray, **kwargs) -> Hypothesis:
        """``asr.transcribe`` with the utterance's prompt (``prompt_utterance``). A prompted decode
        that repeats itself ("Okay. Okay. Okay. ...": a prompt makes whisper loop more readily)
        is decoded again without the prompt."""
        prompt = self._prompts.get(utterance_id) or None
        hyp = self.asr.transcribe(audio, prompt=prompt, **kwargs)
        if prompt is not None and (
            text_loops(hyp.text)
            or any(s.compression_ratio > self.config.compression_ratio_threshold for s in hyp.segments)
        ):
            log.info("a prompted decode repeated itself; decoding it again without the prompt")
            hyp = self.asr.transcribe(audio, **kwargs)
        return hyp

    def _collect_pending(self, utt: _Utterance, wait: bool) -> None:
        """Take a finished (or, with ``wait``, the) speculative decode into the utterance."""
        pending = utt.pending
        if pending is None or not (wait or pending.future.done()):
            return
        utt.pending = None
        try:
            hyp, timing = pending.future.result()
        except Exception as exc:  # noqa: BLE001 - the final decodes again in _finalize
            log.warning("speculative final decode failed: %s", exc)
            return
        if pending.num_committed_words != len(utt.agreement.committed):
            return
        heard = pending.end_index - utt.start_index
        if utt.language is None and hyp.language and heard >= _LANGUAGE_LOCK_SAMPLES:
            utt.language = hyp.language
        utt.speculative = _SpeculativeFinal(
            pending.silence_start_index, pending.num_committed_words, hyp, timing
        )
        utt.last_decode_end = max(utt.last_decode_end, pending.end_index)
        if utt.end_index is None:  # still open: show the likely tail as a partial
            tail = utt.agreement.final_words(split_words(hyp.text))[len(utt.agreement.committed) :]
            self._emit_partial(utt, " ".join(tail), pending.end_index)

    def finish(self) -> list[AsrEvent]:
        """End of stream: finalise the utterance in progress and return all remaining events."""
        if self._active is not None:
            event = self.vad.force_end()
            end = event.sample_index if event else self._ring.total_written
            self._end_active(min(end, self._ring.total_written), "finish")
        return self.process_iter()

    # -- long speech ----------------------------------------------------------------------

    def _split_long_utterance(self) -> None:
        """End the utterance in progress, which is past ``max_utterance_s``, and go on with a new one.

        The committed words have been shown in partials, so they must end this utterance's
        final; and whatever audio they came from must not be heard again by the next
        utterance, or they are repeated (what happened when the cut was simply the quietest
        recent frame: it could fall before the last committed words). So the cut is made at
        a word boundary after the committed words, from one decode with word timestamps,
        and this utterance's final is exactly the words before it (``edge_rtgi.asr.split``).
        """
        utt = self._active
        if utt is None:
            return
        now = self._ring.total_written
        silence_start = self.vad.silence_start_index
        next_start: int | None = None
        if (
            silence_start is not None
            and silence_start - utt.start_index <= self._max_len
            and now - max(silence_start, utt.start_index) >= self._end_pad
        ):
            # Already in a pause that began within the limit (the VAD's silence timer has not
            # fired yet): end there as it soon would. Whoever speaks next opens a new utterance.
            self.vad.force_end()
            self._end_active(silence_start, "max_length")
        else:
            end = min(now, utt.start_index + self._max_len)
            t0 = time.perf_counter()
            hyp = self._decode(
                utt, end, timestamps=True, beam_size=self.config.final_beam_size, word_timestamps=True
            )
            split = choose_split(utt.agreement.committed, hyp, utt.start_index, end, self.vad.quietest_frame)
            if split.boundary is None:
                log.warning("no word times to split long speech at; cutting at the end of the decoded audio")
            utt.split = _SplitFinal(split.words, hyp, (time.perf_counter() - t0) * 1000.0)
            next_start = split.cut_index
            self._end_active(next_start, "max_length")
        self._events.extend(self._finalize(self._ended.pop()))
        if next_start is not None:
            self._start_utterance(next_start, next_start)

    # -- decoding -------------------------------------------------------------------------

    def _decode(
        self,
        utt: _Utterance,
        end: int,
        timestamps: bool,
        beam_size: int | None = None,
        word_timestamps: bool = False,
    ) -> Hypothesis:
        audio = self._ring.read(utt.start_index, end)
        hyp = self._transcribe(
            utt.id,
            audio,
            prefix=utt.agreement.committed_text or None,
            language=utt.language,
            timestamps=timestamps,
            beam_size=beam_size,
            word_timestamps=word_timestamps,
        )
        if utt.language is None and hyp.language and end - utt.start_index >= _LANGUAGE_LOCK_SAMPLES:
            utt.language = hyp.language  # detected once on enough audio, then fixed so hypotheses agree
        return hyp

    def _emit_partial(self, utt: _Utterance, tentative: str, end: int) -> None:
        key = (utt.agreement.committed_text, tentative)
        if key != utt.partial_key:
            utt.partial_key = key
            self._events.append(PartialTranscript(utt.id, key[0], key[1], end / SAMPLE_RATE_HZ))

    def _partial(self, utt: _Utterance, end: int) -> None:
        t0 = time.perf_counter()
        try:
            hyp = self._decode(utt, end, timestamps=False)
        except PartialSkipped:  # the shared engine is behind on finals: try again next step
            self.last_partial_decode_s = time.perf_counter() - t0
            return
        self.last_partial_decode_s = time.perf_counter() - t0
        utt.last_decode_end = end
        utt.agreement.update(split_words(hyp.text))
        self._emit_partial(utt, utt.agreement.tentative_text, end)

    def _speculate(self, utt: _Utterance, silence_start: int) -> None:
        end = silence_start + self._end_pad
        hyp = self._decode(utt, end, timestamps=True, beam_size=self.config.final_beam_size)
        utt.speculative = _SpeculativeFinal(silence_start, len(utt.agreement.committed), hyp)
        utt.last_decode_end = end
        tail = utt.agreement.final_words(split_words(hyp.text))[len(utt.agreement.committed) :]
        self._emit_partial(utt, " ".join(tail), end)

    def _finalize(self, utt: _Utterance) -> list[AsrEvent]:
        if utt.end_index is None or utt.endpoint_index is None:  # _end_active sets both
            raise RuntimeError(f"utterance {utt.id} is finalised before it ended")
        end_index, endpoint_index = utt.end_index, utt.endpoint_index
        try:
            return self._finalize_words(utt, end_index, endpoint_index)
        finally:
            self._prompts.pop(utt.id, None)

    def _finalize_words(self, utt: _Utterance, end_index: int, endpoint_index: int) -> list[AsrEvent]:
        queue_ms = 0.0  # of the time after the endpoint, waiting for a shared engine's step
        if utt.split is not None:
            # Cut off long speech: the words were chosen with the cut; no pad after it, that
            # audio belongs to the next utterance.
            words, hyp, decode_ms = utt.split.words, utt.split.hypothesis, utt.split.decode_ms
            end = end_index
        else:
            end = min(end_index + self._end_pad, self._ring.total_written)
            if end - utt.start_index < _MIN_DECODE_SAMPLES:  # nothing left to hear (e.g. after a split)
                return [
                    SpeechEnded(
                        utt.id, end_index / SAMPLE_RATE_HZ, endpoint_index / SAMPLE_RATE_HZ, utt.reason
                    )
                ]
            t0, endpoint_s = time.perf_counter(), time.monotonic()
            self._collect_pending(utt, wait=True)
            spec = utt.speculative
            if spec is not None and spec.matches(end_index, len(utt.agreement.committed)):
                hyp, reused = spec.hypothesis, True
                if spec.timing is not None:  # a speculative decode still queued at the endpoint
                    queue_ms = max(0.0, (min(spec.timing.started_s, time.monotonic()) - endpoint_s) * 1000.0)
            else:
                hyp, reused = (
                    self._decode(utt, end, timestamps=True, beam_size=self.config.final_beam_size),
                    False,
                )
                timing = self.asr.last_timing()
                queue_ms = timing.queue_wait_ms if timing is not None else 0.0
            words, final_hyp = self._final_words(utt, hyp, end)
            decode_ms = 0.0 if reused and final_hyp is hyp else (time.perf_counter() - t0) * 1000.0
            decode_ms = max(0.0, decode_ms - queue_ms)
            hyp = final_hyp
        text = " ".join(words)
        start_s, speech_end_s = utt.start_index / SAMPLE_RATE_HZ, end_index / SAMPLE_RATE_HZ
        endpoint_s, end_s = endpoint_index / SAMPLE_RATE_HZ, end / SAMPLE_RATE_HZ
        decision = utt.decision if utt.reason == "semantic" else None
        decided_t_s = decision.decided_t_s if decision else None
        turn_decision_ms = utt.decision.model_ms if utt.decision is not None else None
        events: list[AsrEvent] = [
            SpeechEnded(utt.id, speech_end_s, endpoint_s, utt.reason, decided_t_s, turn_decision_ms)
        ]
        if not text or (not utt.agreement.committed and self._is_hallucination(text, hyp)):
            if text:
                log.info("dropped a likely hallucination (%d characters)", len(text))
                log.debug("the dropped text: %r", text)
            return events
        if split_words(hyp.text) == words:
            segments = tuple(
                TranscriptSegment(s.text, start_s + s.start_s, start_s + min(s.end_s, end_s - start_s))
                for s in hyp.segments
                if s.text
            )
        else:
            segments = (TranscriptSegment(text, start_s, end_s),)
        events.append(
            FinalTranscript(
                utt.id,
                text,
                segments,
                start_s,
                speech_end_s,
                endpoint_s,
                utt.language or hyp.language,
                decode_ms,
                decided_t_s,
                turn_decision_ms,
                final_queue_ms=round(queue_ms, 1),
            )
        )
        return events

    def _final_words(self, utt: _Utterance, hyp: Hypothesis, end: int) -> tuple[list[str], Hypothesis]:
        """``committed + tail``, guarding against whisper ending a forced-prefix decode early.

        Given a prefix that ends a sentence, whisper sometimes predicts the end of text even
        though more speech follows (seen on a forced split: "...leave the house." and nothing
        for "My sister bought a"). When the tail is empty although the last hypothesis had
        words, or the decode's timestamps leave over a second of speech unexplained, decode
        once more without the prefix and take its words after the committed ones.
        """
        agreement = utt.agreement
        words = agreement.final_words(split_words(hyp.text))
        tail_len = len(words) - len(agreement.committed)
        heard_s = max((s.end_s for s in hyp.segments), default=0.0)
        unexplained_s = (end - utt.start_index) / SAMPLE_RATE_HZ - heard_s
        if not agreement.committed or not ((tail_len == 0 and agreement.tentative) or unexplained_s > 1.0):
            return words, hyp
        free = self._transcribe(
            utt.id,
            self._ring.read(utt.start_index, end),
            language=utt.language,
            timestamps=True,
            beam_size=self.config.final_beam_size,
        )
        tail = tail_after(agreement.committed, split_words(free.text))
        if tail is None:
            tail = list(agreement.tentative)
        if len(tail) > tail_len:
            log.info("final decode stopped early; tail recovered without the prefix")
            log.debug("the recovered tail: %r", " ".join(tail))
            return agreement.committed + tail, free
        return words, hyp

    def _is_hallucination(self, text: str, hyp: Hypothesis) -> bool:
        """Last-resort filter: the whole utterance is a stock phrase and whisper was unsure."""

        def norm(phrase: str) -> str:
            return " ".join(filter(None, (normalize_word(w) for w in phrase.split())))

        if not hyp.segments or norm(text) not in {norm(p) for p in self.config.hallucination_blocklist}:
            return False
        unsure = (
            min(s.avg_logprob for s in hyp.segments) < -0.5
            or max(s.no_speech_prob for s in hyp.segments) > 0.2
        )
        return unsure


class AsrSession:
    """Asyncio front of a ``StreamingTranscriber``.

    ``feed`` (non-blocking, from the event loop) queues audio; a background task inserts all
    queued audio and runs ``process_iter`` on a worker thread, so while one decode runs the
    next chunks simply accumulate. Read events with ``async for event in session``; the
    iteration ends after ``close()`` has finalised the last utterance.
    """

    def __init__(
        self,
        asr: Transcriber,
        config: AsrConfig | None = None,
        vad: SileroVad | None = None,
        executor: ThreadPoolExecutor | None = None,
    ):
        self.transcriber = StreamingTranscriber(asr, config, vad)
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="asr")
        self._pending: list[np.ndarray] = []
        self._resampler: Resampler | None = None
        self._commit = False
        self._closing = False
        self._wake = asyncio.Event()
        self._events: asyncio.Queue[AsrEvent | BaseException | None] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="asr-session")

    def feed(self, samples: np.ndarray, sample_rate_hz: int = SAMPLE_RATE_HZ) -> None:
        """Queue mono float32 (or int16) audio; resampled to 16 kHz if needed."""
        if self._closing:
            raise AudioError("feed() after close() on an ASR session")
        if samples.dtype == np.int16:
            samples = samples.astype(np.float32) / 32768.0
        if sample_rate_hz != SAMPLE_RATE_HZ:
            if self._resampler is None or self._resampler.src_rate_hz != sample_rate_hz:
                self._resampler = Resampler(sample_rate_hz, SAMPLE_RATE_HZ)
            samples = self._resampler.process(samples)
        self._pending.append(np.asarray(samples, dtype=np.float32))
        self._wake.set()

    def commit(self) -> None:
        """End the current utterance now instead of waiting for the VAD."""
        self._commit = True
        self._wake.set()

    async def close(self) -> None:
        """Finalise the last utterance; the event iteration ends after its events."""
        self._closing = True
        self._wake.set()
        await asyncio.shield(self._task)
        if self._own_executor:
            self._executor.shutdown(wait=False)

    def _step(self, chunks: list[np.ndarray], commit: bool, closing: bool) -> list[AsrEvent]:
        tr = self.transcriber
        events: list[AsrEvent] = []
        for chunk in chunks:
            tr.insert_audio(chunk)
            if tr.split_due:  # after a stall: cut long speech before the ring forgets where it began
                events.extend(tr.process_iter())
        if commit:
            tr.commit()
        events.extend(tr.finish() if closing else tr.process_iter())
        # On a slow or shared CPU, back-to-back partial decodes would keep the worker busy when
        # speech ends, and the final would queue behind a stale partial. Space partials so
        # decoding takes at most 1/factor of real time; the final is never delayed by this.
        factor = tr.config.partial_interval_factor
        tr.partial_interval_samples = int(factor * tr.last_partial_decode_s * SAMPLE_RATE_HZ)
        return events

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                chunks, self._pending = self._pending, []
                commit, self._commit, closing = self._commit, False, self._closing
                events = await loop.run_in_executor(self._executor, self._step, chunks, commit, closing)
                for event in events:
                    self._events.put_nowait(event)
                if closing:
                    break
        except BaseException as exc:  # surfaced to the reader, not lost in a task
            self._events.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self._events.put_nowait(None)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            item = await self._events.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
