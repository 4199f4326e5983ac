"""Semantic end-of-turn detection: pipecat's smart-turn v3.2 ONNX model on the ASR worker.

A fixed silence timer must choose between cutting people off at a pause ("add milk, | eggs
and two lemons") and making every turn wait. In ``semantic`` mode the VAD's timer is set to
``max_silence_ms`` (the cap), and once ``min_silence_ms`` of silence has passed the
transcriber asks the model whether the utterance is finished: at or above ``threshold`` the
turn ends there, otherwise it waits for the cap. ``silence`` mode is the plain timer.

The words check (``text_check``): a verdict of "finished" is only taken once the speculative
final of the same pause (decoded meanwhile) does not end as an unfinished sentence: a trailing
comma or dash, a conjunction, filler, article or preposition ("add milk, and", "set a timer
for um"), or a fronted clause or phrase with no main clause yet ("if it rains tomorrow",
"after the meeting"). The model alone called such pauses finished on rendered speech
(docs/speech.md, "Measured"); the final needs that decode anyway, so the check moves the
moment the turn is declared over, not the reply. The rules are English; in other languages
only the punctuation rule can fire.

The model reads the last 8 s of 16 kHz audio as Whisper log-mel features, ``[batch, 80,
800]``, shorter audio zero-padded at the *front* (the end of the turn is what matters, and
it stays at the right edge), the waveform normalised to zero mean and unit variance over
the whole padded window before the spectrogram. Its ``logits`` output is already a
probability (the graph ends in a sigmoid). This mirrors pipecat's own inference path; the
features come from faster-whisper's ``FeatureExtractor``, which computes the same Whisper
log-mel as the transformers extractor pipecat vendors.

Backchannels: during a reply, a short "mm-hm" or "yes" is the user listening, not taking
the turn. ``is_backchannel`` tells them apart by their words; the ASR stage uses it, with
``barge_in_min_speech_ms``, to decide when speech over a reply cuts it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from edge_rtgi.errors import ModelFileError

log = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 16000
WINDOW_S = 8
WINDOW_SAMPLES = WINDOW_S * SAMPLE_RATE_HZ
N_MELS = 80
N_FRAMES = 800
_NORM_EPS = 1e-7  # as in the Whisper feature extractor's waveform normalisation
MODES = ("semantic", "silence")
DEFAULT_MODEL = "smart-turn-v3.2"
# semantic mode without explicit times: ask the model early, and cap the wait well above the
# length of an ordinary pause inside a sentence
DEFAULT_SEMANTIC_MIN_SILENCE_MS = 150
DEFAULT_SEMANTIC_MAX_SILENCE_MS = 1200

# Words a listener says to show they are following, not to take the turn. Compared after
# lower-casing and removing punctuation and hyphens ("Mm-hmm." -> "mmhmm"); murmurs ("mmhmm",
# "uh", "oh") are matched by ``_MURMUR`` below, in any length.
BACKCHANNEL_WORDS = frozenset(
    {
        "yeah",
        "yes",
        "yep",
        "yup",
        "ok",
        "okay",
        "right",
        "sure",
        "alright",
        "all",  # whisper writes "alright" as "All right."
        "i",
        "see",
        "got",
        "it",
        "true",
        "exactly",
        "cool",
        "nice",
        "wow",
    }
)
_BACKCHANNEL_MAX_WORDS = 3
# A murmur of any length: whisper writes the same hum as "Mmmm", "Hmmmm" or "Uhhh", and no list
# of spellings is complete ("mm-hm" read as "Mmmm" cut a reply in the benchmark's set).
_MURMUR = re.compile(r"h*m+(?:h+m+)*h*|u+h+(?:u+h+)*|u+m+|a+h+|o+h+")

# Words after which an English sentence is not over: conjunctions, fillers, articles,
# possessives and the determiners "which"/"whose" ("which | planet is closest", cut at the
# stop before "planet"), and prepositions that take an object. A question mark overrides them
# ("what is it for?", "Which?"); a stranded preposition in a statement is rare in a request.
UNFINISHED_LAST_WORDS = frozenset(
    {
        "and",
        "or",
        "but",
        "nor",
        "because",
        "um",
        "umm",
        "uh",
        "uhm",
        "er",
        "erm",
        "the",
        "a",
        "an",
        "my",
        "your",
        "our",
        "their",
        "which",
        "whose",
        "to",
        "of",
        "for",
        "with",
        "by",
        "at",
        "from",
        "into",
        "about",
    }
)
# Words that open a fronted clause or phrase, which a main clause must follow ("if it rains
# tomorrow, ...", "on Saturday morning, ..."); an auxiliary next makes it a question ("when
# does the sun set").
CLAUSE_OPENERS = frozenset(
    {
        "if",
        "when",
        "whenever",
        "before",
        "after",
        "once",
        "while",
        "unless",
        "until",
        "although",
        "though",
        "since",
        "on",
        "in",
        "at",
        "during",
    }
)
_AUXILIARIES = frozenset(
    {
        "is",
        "are",
        "was",
        "were",
        "do",
        "does",
        "did",
        "can",
        "could",
        "will",
        "would",
        "should",
        "shall",
        "has",
        "have",
        "had",
        "may",
        "might",
        "must",
        "what",
        "which",
        "whom",
        "whose",
    }
)
_UNFINISHED_ENDINGS = (",", ";", ":", "-", "\u2013", "\u2014", "...", "\u2026")
# A request of this many words or fewer ("Add milk.", "Tell me.", "Can you?") is more often
# the first piece of a longer one than a whole turn; see ``TurnDetectionConfig.fragment_hold_ms``.
FRAGMENT_MAX_WORDS = 2
DEFAULT_FRAGMENT_HOLD_MS = 600
# A statement or command can go on after a short pause ("Remind me about the dentist, | the
# bank, ..."); see ``TurnDetectionConfig.continuation_hold_ms``.
DEFAULT_CONTINUATION_HOLD_MS = 400
# An "unfinished" verdict on words that read as a question is asked about again this much later;
# see ``TurnDetectionConfig.question_recheck_ms`` and docs/benchmarks.md, "A recheck for questions".
DEFAULT_QUESTION_RECHECK_MS = 500
# Whisper's prompt for speech over a reply: the commonest backchannels, so that whisper writes a
# murmur or a short "yeah" as one instead of as other words ("Hmm." as "them."); see
# ``TurnDetectionConfig.talkover_prompt`` and docs/speech.md, "Backchannels".
DEFAULT_TALKOVER_PROMPT = "Mm-hmm. Uh-huh. Yeah. Okay. Right. Hmm."
_TALKOVER_PROMPT_MAX_CHARS = 400  # whisper keeps at most 223 prompt tokens anyway


def _words(text: str) -> list[str]:
    """Lower-cased words without punctuation; digits are words ("at 6 30" ends in "30")."""
    return [w for w in (re.sub(r"[^a-z0-9']", "", w.lower()) for w in text.split()) if w]


def is_question(text: str) -> bool:
    """True when the transcript ends in a question mark (whisper's reading of the syntax)."""
    return text.strip().endswith("?")


def is_fragment(text: str) -> bool:
    """True for a transcript of at most ``FRAGMENT_MAX_WORDS`` words (and at least one)."""
    return 0 < len(_words(text)) <= FRAGMENT_MAX_WORDS


def is_backchannel(text: str) -> bool:
    """True for a short listener response ("Mm-hmm.", "Yeah, right.", "I see"): at most
    ``_BACKCHANNEL_MAX_WORDS`` different words, all a listener's, however often said. People
    repeat them ("Okay, yeah. Okay, yeah."), and whisper now and then writes a short one twice
    or loops on it ("Yup. Yup. Yup. Yep.")."""
    words = [w for w in (re.sub(r"[^a-z]", "", w.lower()) for w in text.split()) if w]
    return 0 < len(set(words)) <= _BACKCHANNEL_MAX_WORDS and all(
        w in BACKCHANNEL_WORDS or _MURMUR.fullmatch(w) for w in words
    )


def talkover_speech_samples(talkover_start: int, now: int, silence_start: int | None) -> int:
    """The speech heard over a reply since ``talkover_start`` (sample indices): up to the pause in
    progress (``silence_start``), not through it. In semantic mode the VAD stays "in speech"
    through a pause until the cap, so counting to ``now`` would make every backchannel that waits
    for the model or the fragment hold ("Yes." + 600 ms) as long as a real barge-in."""
    end = now if silence_start is None else min(silence_start, now)
    return max(0, end - talkover_start)


@dataclass
class TalkoverMeter:
    """The speech heard over a reply since it began at ``start_index`` (a sample index): from its
    first word to now, less the pauses inside it, the ended ones and the one in progress. A
    two-part backchannel ("Yes, | yes.") is two short bursts; counting its pause would make it as
    long as a real barge-in. Fed on every chunk by the ASR stage's worker."""

    start_index: int
    paused_samples: int = 0
    pause_start: int | None = None  # the pause in progress, as the VAD reports it

    def heard_samples(self, now: int, silence_start: int | None) -> int:
        """The speech so far at sample ``now``, with the VAD's ``silence_start_index``."""
        if silence_start is not None and silence_start >= self.start_index:
            self.pause_start = silence_start
        elif silence_start is None and self.pause_start is not None:  # speech resumed
            self.paused_samples += max(0, now - self.pause_start)
            self.pause_start = None
        return max(0, talkover_speech_samples(self.start_index, now, silence_start) - self.paused_samples)


def talkover_cuts(
    heard_ms: int,
    text: str,
    words_pending: bool,
    min_ms: int,
    max_ms: int,
    pause_words: str | None = None,
) -> bool:
    """Whether speech over a reply, ``heard_ms`` long so far (``TalkoverMeter``), cuts
    the reply now, before its final: once it is ``min_ms`` long, unless the words heard so far
    (``text``) are a backchannel's or are still being decoded (``words_pending``: a decode of a
    pause inside it, "Yes, | yes."); at ``max_ms``, whatever the words. Two-part backchannels
    ("Okay, yeah.", "Right, right.") run past ``min_ms`` from first word to last.

    ``pause_words``: the words decoded up to the pause in progress (None: no pause, or their
    decode is not in yet). When they are words and not a backchannel's, the speech cuts now,
    however short: a short request ("Stop.", "Wait, what?") never reaches ``min_ms``, and its
    final would wait for the end of its turn."""
    if pause_words is not None and pause_words.strip() and not is_backchannel(pause_words):
        return True
    if heard_ms < min_ms:
        return False
    if heard_ms >= max_ms:
        return True
    return not words_pending and not is_backchannel(text)


def transcript_unfinished(text: str) -> bool:
    """True when ``text`` (a speculative final) reads as a sentence cut off at a pause: it ends
    in a comma, dash or ellipsis, or (unless it is a question) in a conjunction, filler, article
    or preposition, or it is only a fronted clause or phrase ("If it rains tomorrow.")."""
    t = text.strip()
    if not t:
        return False
    if t.endswith(_UNFINISHED_ENDINGS):
        return True
    if t.endswith("?"):
        return False
    words = _words(t)
    if not words:
        return False
    if words[-1] in UNFINISHED_LAST_WORDS:
        return True
    fronted = words[0] in CLAUSE_OPENERS and (len(words) < 2 or words[1] not in _AUXILIARIES)
    # a fronted phrase followed by a sentence of its own ("On Saturday morning. Wake me up.")
    # has its main clause: whisper wrote a full stop where the speaker paused
    one_sentence = re.search(r"[.!?]\s", t) is None
    return fronted and one_sentence and "," not in t


@dataclass(frozen=True)
class TurnDetectionConfig:
    """``asr.turn_detection`` in a pipeline (and ``turn_detection`` in ``session.update``).

    ``mode`` "silence": the turn ends after ``min_silence_ms`` of silence (unset: the VAD's own
    ``min_silence_ms``). "semantic": after ``min_silence_ms`` (unset: 150) the model scores the
    turn; it ends if the probability is at least ``threshold``, else at ``max_silence_ms``
    (unset: 1200). ``text_check``: a "finished" verdict also needs the speculative final not to
    read as cut off (``transcript_unfinished``), and when the final is a fragment of at most two
    words ("Add milk.", "Tell me."), ``fragment_hold_ms`` of silence (0: no hold), at which the
    model is asked again; any other final that is not a question waits ``continuation_hold_ms``
    (0: no hold) the same way. ``recheck_ms``: after the model calls a pause unfinished, it is
    asked again each time this much more silence has passed (0: never; the turn waits for the
    cap). ``question_recheck_ms``: the same, only where the pause's words read as a question (0:
    off; ``recheck_ms`` wins when both are set). ``barge_in_min_speech_ms``: in semantic mode,
    speech over a reply cuts it once it has lasted this long unless its words so far are a
    backchannel's (then at ``barge_in_max_speech_ms``), or when its words turn out not to be a
    backchannel (``talkover_cuts``). ``talkover_prompt``: in semantic mode, speech that begins
    over a reply is decoded with this as whisper's prompt, in English only ("": none), so that a
    backchannel is written as one. ``preemptive_reply``: in either mode, once a pause's words (its
    speculative final) are decoded and do not read as cut off, the reply to them starts, held from
    the client until the final confirms the words (dropped unseen if speech goes on or they
    differ), while a hold, a recheck, the cap or the silence timer waits.
    """

    mode: str = "silence"
    min_silence_ms: int | None = None
    max_silence_ms: int | None = None
    threshold: float = 0.5
    model: str = DEFAULT_MODEL
    barge_in_min_speech_ms: int = 700
    barge_in_max_speech_ms: int = 1500
    text_check: bool = True
    fragment_hold_ms: int = DEFAULT_FRAGMENT_HOLD_MS
    continuation_hold_ms: int = DEFAULT_CONTINUATION_HOLD_MS
    recheck_ms: int = 0
    question_recheck_ms: int = DEFAULT_QUESTION_RECHECK_MS
    talkover_prompt: str = DEFAULT_TALKOVER_PROMPT
    preemptive_reply: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'semantic' or 'silence', got {self.mode!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        for name in ("min_silence_ms", "max_silence_ms"):
            ms = getattr(self, name)
            if ms is not None and not 32 <= ms <= 10_000:
                raise ValueError(f"{name} must be in [32, 10000] ms, got {ms}")
        for name in ("fragment_hold_ms", "continuation_hold_ms"):
            ms = getattr(self, name)
            if not 0 <= ms <= 10_000:
                raise ValueError(f"{name} must be in [0, 10000] ms, got {ms}")
        # at most one model run per 32 ms of audio, as for the check time
        for name in ("recheck_ms", "question_recheck_ms"):
            ms = getattr(self, name)
            if ms != 0 and not 32 <= ms <= 10_000:
                raise ValueError(f"{name} must be 0 (off) or in [32, 10000] ms, got {ms}")
        if not 0 <= self.barge_in_min_speech_ms <= 10_000:
            raise ValueError(
                f"barge_in_min_speech_ms must be in [0, 10000] ms, got {self.barge_in_min_speech_ms}"
            )
        if not self.barge_in_min_speech_ms <= self.barge_in_max_speech_ms <= 10_000:
            raise ValueError(
                f"barge_in_max_speech_ms must be in [barge_in_min_speech_ms "
                f"({self.barge_in_min_speech_ms}), 10000] ms, got {self.barge_in_max_speech_ms}"
            )
        if "<|" in self.talkover_prompt:  # whisper would read it as its own control tokens
            raise ValueError("talkover_prompt must be plain text, without '<|...|>' tokens")
        if len(self.talkover_prompt) > _TALKOVER_PROMPT_MAX_CHARS:
            raise ValueError(
                f"talkover_prompt must be at most {_TALKOVER_PROMPT_MAX_CHARS} characters, "
                f"got {len(self.talkover_prompt)}"
            )
        if self.mode == "semantic" and self.semantic_max_ms < self.semantic_min_ms:
            raise ValueError(
                f"max_silence_ms ({self.semantic_max_ms}) must not be below "
                f"min_silence_ms ({self.semantic_min_ms})"
            )

    @property
    def semantic_min_ms(self) -> int:
        return self.min_silence_ms if self.min_silence_ms is not None else DEFAULT_SEMANTIC_MIN_SILENCE_MS

    @property
    def semantic_max_ms(self) -> int:
        return self.max_silence_ms if self.max_silence_ms is not None else DEFAULT_SEMANTIC_MAX_SILENCE_MS

    def with_overrides(
        self,
        mode: str | None = None,
        min_silence_ms: int | None = None,
        max_silence_ms: int | None = None,
        threshold: float | None = None,
        text_check: bool | None = None,
        recheck_ms: int | None = None,
        talkover_prompt: str | None = None,
        preemptive_reply: bool | None = None,
        question_recheck_ms: int | None = None,
    ) -> TurnDetectionConfig:
        """This config with a session's settings on top (None keeps the pipeline's); ValueError
        names the key when the result is inconsistent. A switch to the other mode drops the
        pipeline's times: they were set for its own mode (semantic's 100 ms check would
        otherwise become silence mode's timer)."""
        other_mode = mode is not None and mode != self.mode
        base_min = None if other_mode else self.min_silence_ms
        base_max = None if other_mode else self.max_silence_ms
        return dataclasses.replace(
            self,
            mode=self.mode if mode is None else mode,
            min_silence_ms=base_min if min_silence_ms is None else min_silence_ms,
            max_silence_ms=base_max if max_silence_ms is None else max_silence_ms,
            threshold=self.threshold if threshold is None else threshold,
            text_check=self.text_check if text_check is None else text_check,
            recheck_ms=self.recheck_ms if recheck_ms is None else recheck_ms,
            talkover_prompt=self.talkover_prompt if talkover_prompt is None else talkover_prompt,
            preemptive_reply=self.preemptive_reply if preemptive_reply is None else preemptive_reply,
            question_recheck_ms=(
                self.question_recheck_ms if question_recheck_ms is None else question_recheck_ms
            ),
        )

    def silence_ms(self, vad_min_silence_ms: int) -> int:
        """Silence after which the turn ends without asking the model (the VAD's timer)."""
        if self.mode == "semantic":
            return self.semantic_max_ms
        return self.min_silence_ms if self.min_silence_ms is not None else vad_min_silence_ms


@dataclass(frozen=True)
class TurnDetectionUpdate:
    """``turn_detection`` as an object in a native ``session.update``: any of the keys, the rest
    unchanged. Checked here so an error names ``turn_detection.<key>``."""

    mode: str | None = None
    min_silence_ms: int | None = None
    max_silence_ms: int | None = None
    threshold: float | None = None
    text_check: bool | None = None
    recheck_ms: int | None = None
    talkover_prompt: str | None = None
    preemptive_reply: bool | None = None
    question_recheck_ms: int | None = None

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode must be 'semantic' or 'silence', got {self.mode!r}")
        # the keys given, checked alone and against each other; the session checks them again
        # on top of its pipeline's own settings
        TurnDetectionConfig(
            min_silence_ms=self.min_silence_ms,
            max_silence_ms=self.max_silence_ms,
            threshold=0.5 if self.threshold is None else self.threshold,
            recheck_ms=self.recheck_ms or 0,
            talkover_prompt=self.talkover_prompt or "",
            question_recheck_ms=self.question_recheck_ms or 0,
        )
        if self.max_silence_ms is not None and self.min_silence_ms is not None:
            if self.max_silence_ms < self.min_silence_ms:
                raise ValueError(
                    f"max_silence_ms ({self.max_silence_ms}) must not be below "
                    f"min_silence_ms ({self.min_silence_ms})"
                )


class TurnScorer(Protocol):
    """Anything that says how likely the audio ends a finished turn (the model, or a test double)."""

    def probability(self, audio: np.ndarray) -> float: ...


def turn_features(audio: np.ndarray, extractor: object | None = None) -> np.ndarray:
    """``[1, 80, 800]`` float32 Whisper log-mel of the last 8 s of 16 kHz ``audio``."""
    from faster_whisper.feature_extractor import FeatureExtractor

    fe = extractor if isinstance(extractor, FeatureExtractor) else FeatureExtractor(chunk_length=WINDOW_S)
    x = np.asarray(audio, dtype=np.float32).reshape(-1)[-WINDOW_SAMPLES:]
    if len(x) < WINDOW_SAMPLES:  # the model was trained with silence before short turns
        x = np.concatenate([np.zeros(WINDOW_SAMPLES - len(x), np.float32), x])
    x = (x - x.mean()) / np.sqrt(x.var() + _NORM_EPS)
    mel = np.asarray(fe(x, padding=0), dtype=np.float32)[:, :N_FRAMES]
    return mel[None, :, :]


class SmartTurnModel:
    """The smart-turn ONNX model on onnxruntime (CPU). ``probability`` blocks: call it from the
    ASR worker thread, never the event loop. One instance may serve every session (an
    onnxruntime session accepts concurrent ``run`` calls)."""

    def __init__(self, path: str | Path, threads: int = 1):
        import onnxruntime
        from faster_whisper.feature_extractor import FeatureExtractor

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(
                f"turn detection model not found: {self.path}",
                hint="run `edge-rtgi models pull smart-turn-v3.2`",
            )
        opts = onnxruntime.SessionOptions()
        # It runs beside the whisper decode of the same turn, which has the other cores.
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 4
        try:
            self._session = onnxruntime.InferenceSession(
                str(self.path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
            inputs = {i.name: i.shape for i in self._session.get_inputs()}
            shape = inputs.get("input_features")
            if shape is None or list(shape[1:]) != [N_MELS, N_FRAMES]:
                raise ValueError(f"expected input_features [batch, 80, 800], found {inputs}")
            self._extractor = FeatureExtractor(chunk_length=WINDOW_S)
            self._lock = threading.Lock()  # the extractor's buffers are per instance
            self.probability(np.zeros(SAMPLE_RATE_HZ, np.float32))  # a broken graph fails here, not mid-turn
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise ModelFileError(
                f"cannot load turn detection model {self.path}: {exc}",
                hint="re-pull it with `edge-rtgi models pull smart-turn-v3.2 --force`",
            ) from None

    def probability(self, audio: np.ndarray) -> float:
        """Probability that ``audio`` (16 kHz float32, newest last) ends a finished turn."""
        with self._lock:
            features = turn_features(audio, self._extractor)
        (out,) = self._session.run(["logits"], {"input_features": features})
        return float(np.asarray(out).reshape(-1)[0])


def load_turn_model(name_or_path: str) -> SmartTurnModel:
    """A catalogue name (pulled if missing) or an .onnx path; ``ModelFileError`` when unusable."""
    from edge_rtgi.catalog import resolve_model

    path = resolve_model(name_or_path, role="turn")
    if path.is_dir():
        found = sorted(path.glob("*.onnx"))
        if not found:
            raise ModelFileError(
                f"no .onnx file in {path}", hint="run `edge-rtgi models pull smart-turn-v3.2`"
            )
        path = found[0]
    return SmartTurnModel(path)


@dataclass(frozen=True)
class TurnStatus:
    """How a session's pauses end turns, as set up: ``mode`` is what runs, ``requested`` what
    was asked for; they differ when the model could not be loaded (``fallback`` says why)."""

    mode: str
    requested: str
    silence_ms: int  # the silence that ends a turn without the model (semantic: the cap)
    check_ms: int | None = None  # semantic: the silence after which the model is asked
    threshold: float | None = None
    model: str | None = None
    text_check: bool | None = None
    fragment_hold_ms: int | None = None
    continuation_hold_ms: int | None = None
    recheck_ms: int | None = None
    fallback: str | None = None

    def to_wire(self) -> dict[str, object]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class TurnModelLoad:
    """A loaded model, or (``model`` None) why it could not be loaded."""

    model: SmartTurnModel | None
    error: str | None


@dataclass(frozen=True)
class TurnDecision:
    """What the model said about one pause: ``probability`` None when scoring failed;
    ``unfinished_text`` True when the words check overruled a "finished" verdict."""

    silence_start_index: int
    probability: float | None
    complete: bool
    model_ms: float
    decided_t_s: float  # time.monotonic() when the decision was made
    unfinished_text: bool = False
    # ask again once the silence reaches this many samples: the words' hold (a fragment, or
    # words that are not a question) is longer than the pause so far, or the model said
    # unfinished and rechecks are on
    retry_silence_samples: int | None = None
    held: bool = False  # the model said finished; the words wait out their hold (retry above)


class SemanticEndpointer:
    """The decision at one pause: score the audio, compare with the threshold.

    A model that fails at run time (it loaded, so this is rare) is logged once and the turn
    falls back to the silence cap; the session goes on.
    """

    def __init__(
        self,
        scorer: TurnScorer,
        threshold: float,
        check_ms: int,
        text_check: bool = True,
        fragment_hold_ms: int = 0,
        continuation_hold_ms: int = 0,
        recheck_ms: int = 0,
        question_recheck_ms: int = 0,
    ):
        self.scorer = scorer
        self.threshold = threshold
        self.text_check = text_check
        self.check_samples = check_ms * SAMPLE_RATE_HZ // 1000
        self.fragment_hold_samples = fragment_hold_ms * SAMPLE_RATE_HZ // 1000
        self.continuation_hold_samples = continuation_hold_ms * SAMPLE_RATE_HZ // 1000
        self.recheck_samples = recheck_ms * SAMPLE_RATE_HZ // 1000
        self.question_recheck_samples = question_recheck_ms * SAMPLE_RATE_HZ // 1000
        self._warned = False

    @classmethod
    def from_config(cls, scorer: TurnScorer, turn: TurnDetectionConfig) -> SemanticEndpointer:
        """The endpointer ``turn`` (a semantic-mode config) describes, scoring with ``scorer``."""
        return cls(
            scorer,
            turn.threshold,
            turn.semantic_min_ms,
            turn.text_check,
            turn.fragment_hold_ms,
            turn.continuation_hold_ms,
            turn.recheck_ms,
            turn.question_recheck_ms,
        )

    def hold_samples(self, text: str) -> int:
        """The silence a "finished" verdict on ``text`` must wait for before it ends the turn: the
        fragment hold for one or two words, the continuation hold for any other words that are
        not a question (a question's syntax is closed; a statement can go on after a comma's
        pause), else none."""
        hold = self.fragment_hold_samples if is_fragment(text) else 0
        if not is_question(text):
            hold = max(hold, self.continuation_hold_samples)
        return hold

    def decide(self, audio: np.ndarray, silence_start_index: int, silence_samples: int = 0) -> TurnDecision:
        """The model's verdict on ``audio``, which ends ``silence_samples`` into the pause that
        began at ``silence_start_index``. An "unfinished" verdict is asked about again after
        ``recheck_ms`` more silence (when set): the model often calls a finished request
        unfinished at 100 ms of silence and finished a few hundred ms later."""
        t0 = time.perf_counter()
        try:
            p: float | None = self.scorer.probability(audio)
        except Exception as exc:  # noqa: BLE001 - a failed score must not end the session
            if not self._warned:
                log.warning("turn detection model failed (%s); waiting for the silence cap", exc)
                self._warned = True
            p = None
        model_ms = (time.perf_counter() - t0) * 1000.0
        complete = p is not None and p >= self.threshold
        retry = (
            silence_samples + self.recheck_samples
            if p is not None and not complete and self.recheck_samples
            else None
        )
        return TurnDecision(
            silence_start_index, p, complete, model_ms, time.monotonic(), retry_silence_samples=retry
        )

    def recheck_question(self, decision: TurnDecision, text: str, silence_samples: int = 0) -> TurnDecision:
        """An "unfinished" verdict on a pause whose words (``text``) read as a question is asked
        about again after ``question_recheck_ms`` more silence: a question's syntax is closed,
        and the model often calls one unfinished at 100 ms and finished at 500."""
        if (
            decision.complete
            or decision.probability is None
            or decision.retry_silence_samples is not None
            or not self.question_recheck_samples
            or not is_question(text)
        ):
            return decision
        retry = silence_samples + self.question_recheck_samples
        return dataclasses.replace(decision, retry_silence_samples=retry)

    def check_words(self, decision: TurnDecision, text: str, silence_samples: int = 0) -> TurnDecision:
        """A "finished" verdict held against the pause's speculative final (``text_check``):
        words that read as cut off wait for the cap; words that are not a question (and a
        fragment, "Add milk.", longer) wait until ``silence_samples`` reaches their hold
        (``hold_samples``), and are then asked about again."""
        unfinished = decision.complete and transcript_unfinished(text)
        retry = None
        if decision.complete and not unfinished:
            hold = self.hold_samples(text)
            retry = hold if silence_samples < hold else None
        return dataclasses.replace(
            decision,
            complete=decision.complete and not unfinished and retry is None,
            unfinished_text=unfinished,
            retry_silence_samples=retry,
            held=retry is not None,
            decided_t_s=time.monotonic(),
        )
