"""One whisper decoder for every session of a daemon: the decodes that sessions ask for at the
same moment share batched CTranslate2 steps, finals first (issue 27).

Every session keeps its own streaming logic (VAD, LocalAgreement, the split of long speech:
``edge_rtgi.asr.streaming``); only the model calls are shared. Each session gets an
``AsrClient`` (``SharedWhisper.session()``) with the same ``transcribe`` as ``WhisperAsr``, so
a ``StreamingTranscriber`` takes either. ``transcribe`` queues a job and waits for it on the
calling (session worker) thread, never on the event loop. One engine thread takes the jobs in
deadline order, finals before partials, encodes each one's window (30 s, or a short one:
``encoder_window_s``), and runs one ``generate`` per beam size, window length, prompt length
and timestamp mode over the windows of the step, each with its own prompt and forced prefix.
Two cores then run one decode at a time at full width instead of N decodes that split them and
all finish late.

A step takes every window queued when it starts (up to ``batch_size``). On a CPU a 30 s encode
is compute-bound, so batching the encoder made steps slower; windows are encoded one by one
there and only the decoder is batched (beam-5 finals: 4 windows in one ``generate`` cost about
the time of two alone; docs/speech.md).

The words do not change: a batch item gets exactly the features, prompt and options that
``WhisperModel.transcribe`` would give it, and its result is post-processed as ``transcribe``
does for one window (segments split at timestamp pairs, the no-speech skip). A decode that
``transcribe`` would continue into a second window, one that needs word timestamps or language
detection, is run by ``transcribe`` itself on the engine thread: same words, no batching.

Partials are skipped, not queued, when the device is behind: one asked for while a final
waits, or one still queued when a final is taken, gets ``PartialSkipped`` at once (the session
shows its previous partial a little longer). Steps with a final are foreground work
(``edge_rtgi.cpu_priority``): the LLM engine's background steps yield to them as they yield
to a reply's first clause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import numpy as np

from edge_rtgi.asr.whisper import DecodeTiming, Hypothesis, PreparedWindow, WhisperAsr, WindowDecoder
from edge_rtgi.cpu_priority import FOREGROUND
from edge_rtgi.errors import AudioError, EdgeRtgiError

log = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16000
_WINDOW_SAMPLES = 30 * SAMPLE_RATE_HZ


class PartialSkipped(EdgeRtgiError):
    """A partial decode was dropped because finals were waiting (the device is behind)."""


class AsrEngineClosed(EdgeRtgiError):
    """The shared ASR engine was shut down, or the session detached, while a decode waited."""


@dataclass(frozen=True)
class StepStats:
    """One batched step of the shared engine (for /metrics)."""

    batch_size: int
    finals: int
    partials: int
    queue_wait_ms: tuple[float, ...]  # per job: submitted -> its step began
    job_finals: tuple[bool, ...]  # per job: a final (else a partial)
    step_ms: float


@dataclass(eq=False)  # compared by identity: queued jobs are found and removed as themselves
class DecodeJob:
    """One decode a session asked for; ``future`` gets its ``Hypothesis`` (or the exception)."""

    audio: np.ndarray
    prefix: str | None
    language: str | None
    timestamps: bool
    beam_size: int
    word_timestamps: bool
    final: bool
    deadline_s: float  # time.monotonic() by which the turn wants it; earlier first
    submitted_s: float
    prompt: str | None = None
    future: Future[Hypothesis] = field(default_factory=Future)
    queue_wait_ms: float = 0.0

    @property
    def batchable(self) -> bool:
        return not self.word_timestamps and self.language is not None and len(self.audio) <= _WINDOW_SAMPLES


# How long a job may wait for a step, beyond which finals count as late (the default deadline).
FINAL_BUDGET_S = 0.3
PARTIAL_BUDGET_S = 1.0


class SharedWhisper:
    """A ``WhisperAsr`` shared by every session, decoding their jobs in batched steps.

    ``max_batch`` bounds the windows of one step (memory, and the wait of the last job in it).
    A step takes every window queued when it starts, up to ``max_batch``; ``max_batch`` 1
    decodes one window at a time, finals first.
    """

    def __init__(self, asr: WhisperAsr, max_batch: int = 8):
        if max_batch < 1:
            raise ValueError(f"batch_size must be >= 1, got {max_batch}")
        self.asr = asr
        self.config = asr.config
        self.multilingual = asr.multilingual
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._queue: list[DecodeJob] = []
        self._closed = False
        self._listeners: list[Callable[[StepStats], None]] = []
        self._thread = threading.Thread(target=self._loop, name="asr-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """``listener(stats)`` after every step, on the engine thread (keep it cheap)."""
        self._listeners.append(listener)

    @property
    def queued(self) -> int:
        """Jobs waiting for a step now."""
        return len(self._queue)

    def submit(
        self,
        audio: np.ndarray,
        prefix: str | None = None,
        language: str | None = None,
        timestamps: bool = False,
        beam_size: int | None = None,
        word_timestamps: bool = False,
        deadline_s: float | None = None,
        prompt: str | None = None,
    ) -> DecodeJob:
        """Queue a decode and return its job at once (``job.future`` resolves to the hypothesis).

        Finals are the decodes with timestamps (the streaming transcriber's finals, speculative
        finals and splits); partials (no timestamps) are refused with ``PartialSkipped`` while
        a final waits."""
        cfg = self.config
        audio = np.asarray(audio)
        if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
            # caught here, in the caller's thread: a bad stream fails alone, never a shared step
            raise AudioError(
                f"ASR decodes mono float audio [N], got shape {audio.shape} of {audio.dtype}",
                hint="down-mix with edge_rtgi.audio.downmix and scale int16 by 1/32768",
            )
        final = timestamps or word_timestamps
        now = time.monotonic()
        lang = self.asr.language_for(language)
        job = DecodeJob(
            np.asarray(audio, dtype=np.float32),
            prefix or None,
            lang,
            timestamps,
            beam_size or cfg.beam_size,
            word_timestamps,
            final,
            deadline_s if deadline_s is not None else now + (FINAL_BUDGET_S if final else PARTIAL_BUDGET_S),
            now,
            prompt or None,
        )
        with self._cond:
            if self._closed:
                raise AsrEngineClosed("the shared ASR engine is shut down")
            if not final and any(j.final for j in self._queue):
                raise PartialSkipped("partial skipped: finals are waiting")
            self._queue.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: DecodeJob) -> bool:
        """Take a job that has not started out of the queue (its session closed), freeing its
        slot; its waiter gets ``AsrEngineClosed``. True if it was still queued."""
        with self._cond:
            if job not in self._queue:
                return False
            self._queue.remove(job)
        job.future.set_exception(AsrEngineClosed("the session closed while its decode was queued"))
        return True

    def session(self) -> AsrClient:
        """A handle for one session: the same ``transcribe``, plus ``detach`` when it closes."""
        return AsrClient(self)

    def close(self) -> None:
        """Stop the worker; queued jobs fail with ``AsrEngineClosed``."""
        with self._cond:
            self._closed = True
            for job in self._queue:
                job.future.set_exception(AsrEngineClosed("the shared ASR engine was shut down"))
            self._queue.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ engine thread

    def _next_job(self, block: bool) -> DecodeJob | None:
        """The most urgent queued job (finals first, then by deadline); None when closed, or when
        nothing is queued and ``block`` is false. While finals wait, queued partials are
        dropped with ``PartialSkipped``: they would be stale by the time the finals are done."""
        with self._cond:
            while block and not self._queue and not self._closed:
                self._cond.wait()
            if self._closed or not self._queue:
                return None
            job = min(self._queue, key=lambda j: (not j.final, j.deadline_s))
            self._queue.remove(job)
            skipped: list[DecodeJob] = []
            if job.final:
                skipped = [j for j in self._queue if not j.final]
                self._queue = [j for j in self._queue if j.final]
        for stale in skipped:
            stale.future.set_exception(PartialSkipped("partial skipped: finals were waiting"))
        return job

    def _loop(self) -> None:
        decoder = self.asr.window_decoder
        while True:
            job = self._next_job(block=True)
            if job is None:
                return
            t0 = time.monotonic()
            step: list[DecodeJob] = []
            ready: list[PreparedWindow[DecodeJob]] = []
            with ExitStack() as foreground:
                critical = False
                while job is not None:
                    job.queue_wait_ms = (time.monotonic() - job.submitted_s) * 1000.0
                    if job.final and not critical:
                        critical = True
                        foreground.enter_context(FOREGROUND.foreground())
                    if job.future.set_running_or_notify_cancel():
                        step.append(job)
                        prepared = self._prepare(decoder, job)
                        if prepared is not None:
                            ready.append(prepared)
                    if len(ready) >= self.max_batch:
                        break
                    job = self._next_job(block=False)
                self._generate(decoder, ready)
            if not step:
                continue
            stats = StepStats(
                len(step),
                sum(j.final for j in step),
                sum(not j.final for j in step),
                tuple(j.queue_wait_ms for j in step),
                tuple(j.final for j in step),
                (time.monotonic() - t0) * 1000.0,
            )
            log.debug(
                "ASR step: %d jobs (%d finals), waits %s ms, %.0f ms",
                stats.batch_size,
                stats.finals,
                [round(w) for w in stats.queue_wait_ms],
                stats.step_ms,
            )
            for listener in self._listeners:
                try:
                    listener(stats)
                except Exception:  # a metrics listener must not stop decoding
                    log.exception("ASR step listener failed")

    def _prepare(self, decoder: WindowDecoder, job: DecodeJob) -> PreparedWindow[DecodeJob] | None:
        """Encode a batchable job's window; decode any other job alone, now."""
        if job.batchable:
            try:
                return decoder.prepare(job)
            except Exception as exc:  # noqa: BLE001 - one bad job fails only its own session
                job.future.set_exception(exc)
                return None
        self._decode_alone(job)
        return None

    def _generate(self, decoder: WindowDecoder, ready: list[PreparedWindow[DecodeJob]]) -> None:
        if not ready:
            return
        t0 = time.perf_counter()
        try:
            results = decoder.generate(ready)
        except Exception as exc:  # noqa: BLE001 - the step failed: decode each alone to find the bad one
            log.warning("batched ASR step failed (%s); decoding its %d jobs one by one", exc, len(ready))
            for window in ready:
                self._decode_alone(window.job)
            return
        generate_ms = (time.perf_counter() - t0) * 1000.0
        # the step's finished results go out before any of its jobs is decoded again
        for window, hyp in zip(ready, results, strict=True):
            if hyp is not None:
                window.job.future.set_result(hyp)
        for window, hyp in zip(ready, results, strict=True):
            if hyp is None:  # whisper's own transcribe: a second window, or a doubtful short one
                self._decode_alone(window.job, spent_ms=window.encode_ms + generate_ms)

    def _decode_alone(self, job: DecodeJob, spent_ms: float = 0.0) -> None:
        """``job`` through whisper's own transcribe; ``spent_ms`` (a step's attempt at it) counts
        in its decode time."""
        try:
            hyp = self.asr.transcribe_whole(
                job.audio,
                prefix=job.prefix,
                language=job.language,
                timestamps=job.timestamps,
                beam_size=job.beam_size,
                word_timestamps=job.word_timestamps,
                prompt=job.prompt,
            )
        except Exception as exc:  # noqa: BLE001 - one bad job fails only its own session
            job.future.set_exception(exc)
        else:
            job.future.set_result(replace(hyp, decode_ms=hyp.decode_ms + spent_ms) if spent_ms else hyp)


class AsrClient:
    """One session's handle on a ``SharedWhisper`` (a ``Transcriber``).

    ``detach`` (the session is closing) drops the decode it has queued, so its slot goes to the
    next session at once, and refuses new ones; a decode already in a step finishes."""

    def __init__(self, engine: SharedWhisper):
        self.engine = engine
        self.config = engine.config
        self.multilingual = engine.multilingual
        self._lock = threading.Lock()
        self._jobs: set[DecodeJob] = set()
        self._detached = False
        self._local = threading.local()

    def transcribe(
        self,
        audio: np.ndarray,
        prefix: str | None = None,
        language: str | None = None,
        timestamps: bool = False,
        beam_size: int | None = None,
        word_timestamps: bool = False,
        prompt: str | None = None,
    ) -> Hypothesis:
        """``WhisperAsr.transcribe`` through the shared engine. Blocking: call from a worker thread."""
        with self._lock:
            if self._detached:
                raise AsrEngineClosed("the session closed; no more decodes")
            job = self.engine.submit(
                audio, prefix, language, timestamps, beam_size, word_timestamps, prompt=prompt
            )
            self._jobs.add(job)
        try:
            hyp = job.future.result()
        finally:
            with self._lock:
                self._jobs.discard(job)
        self._local.timing = DecodeTiming(
            job.queue_wait_ms, hyp.decode_ms, job.submitted_s + job.queue_wait_ms / 1000.0
        )
        return hyp

    def last_timing(self) -> DecodeTiming | None:
        """Queue wait and decode time of the calling thread's latest ``transcribe``."""
        return getattr(self._local, "timing", None)

    def detach(self) -> None:
        """The session is closing: free the slots of its queued decodes, refuse new ones."""
        with self._lock:
            self._detached = True
            jobs = list(self._jobs)
        for job in jobs:
            self.engine.cancel(job)
