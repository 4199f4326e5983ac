"""Measuring streaming ASR: WER, a simulated-clock feeder, and the partial-stability check.

Shared by the tests and ``scripts/bench_speech.py`` so both measure the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from edge_rtgi.asr.agreement import normalize_word
from edge_rtgi.asr.events import AsrEvent, FinalTranscript, PartialTranscript, SpeechEnded
from edge_rtgi.asr.streaming import SAMPLE_RATE_HZ, StreamingTranscriber


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus WER with jiwer's standard English normalisation (case, punctuation, spaces)."""
    import jiwer

    transform = jiwer.Compose(
        [
            jiwer.ToLowerCase(),
            jiwer.RemovePunctuation(),
            jiwer.RemoveMultipleSpaces(),
            jiwer.Strip(),
            jiwer.ReduceToListOfListOfWords(),
        ]
    )
    return float(
        jiwer.wer(
            list(references), list(hypotheses), reference_transform=transform, hypothesis_transform=transform
        )
    )


def stream_samples(
    transcriber: StreamingTranscriber,
    samples: np.ndarray,
    chunk_ms: Iterable[int] = (20, 30, 40),
    tail_silence_ms: int = 1000,
) -> list[AsrEvent]:
    """Feed audio in the order and sizes a microphone would, on a simulated clock.

    After each chunk ``process_iter`` runs, exactly as a real-time loop whose decodes finish
    before the next chunk arrives; nothing sleeps, so a test runs faster than real time.
    ``tail_silence_ms`` of silence follows the audio so the endpoint can fire.
    """
    audio = np.concatenate(
        [samples.astype(np.float32), np.zeros(SAMPLE_RATE_HZ * tail_silence_ms // 1000, np.float32)]
    )
    events: list[AsrEvent] = []
    pos = 0
    for ms in itertools.cycle(tuple(chunk_ms)):
        if pos >= len(audio):
            break
        step = SAMPLE_RATE_HZ * ms // 1000
        transcriber.insert_audio(audio[pos : pos + step])
        pos += step
        events.extend(transcriber.process_iter())
    events.extend(transcriber.finish())
    return events


def final_text(events: Iterable[AsrEvent]) -> str:
    """All final transcripts of a stream, joined."""
    return " ".join(e.text for e in events if isinstance(e, FinalTranscript)).strip()


def stability_problems(events: Sequence[AsrEvent]) -> list[str]:
    """Ways in which partials and finals disagree; empty when the stream is stable.

    Per utterance: the committed words of each partial must extend the previous ones
    unchanged, and the final must start with the last committed words, so that no word is
    dropped or repeated between partials and final. Across a forced split (``max_length``),
    the next final must not begin with the words the previous one ended on (a word heard
    on both sides of the cut).
    """
    problems = []
    by_utt: dict[int, list[PartialTranscript | FinalTranscript]] = {}
    for e in events:
        if isinstance(e, (PartialTranscript, FinalTranscript)):
            by_utt.setdefault(e.utterance_id, []).append(e)
    for utt, evs in by_utt.items():
        committed: list[str] = []
        for e in evs:
            words = (e.committed_text if isinstance(e, PartialTranscript) else e.text).split()
            if words[: len(committed)] != committed:
                problems.append(
                    f"utterance {utt}: {' '.join(committed)!r} is not a prefix of {' '.join(words)!r}"
                )
            if isinstance(e, PartialTranscript):
                committed = words
        finals = [e for e in evs if isinstance(e, FinalTranscript)]
        if len(finals) > 1:
            problems.append(f"utterance {utt}: {len(finals)} finals")
        if finals:
            norm = [normalize_word(w) for w in finals[0].text.split()]
            for n in range(2, 5):  # the same 2-4 words twice in a row, right at the commit point
                k = len(committed)
                if k >= n and norm[k - n : k] == norm[k : k + n]:
                    problems.append(
                        f"utterance {utt}: words repeated at the commit point: {finals[0].text!r}"
                    )
    return problems + _repeats_across_splits(events)


def _repeats_across_splits(events: Sequence[AsrEvent]) -> list[str]:
    split_ids = {e.utterance_id for e in events if isinstance(e, SpeechEnded) and e.reason == "max_length"}
    finals = [e for e in events if isinstance(e, FinalTranscript)]
    problems = []
    for before, after in zip(finals, finals[1:], strict=False):
        if before.utterance_id not in split_ids or after.utterance_id != before.utterance_id + 1:
            continue
        end = [normalize_word(w) for w in before.text.split()]
        start = [normalize_word(w) for w in after.text.split()]
        for n in range(1, 5):
            if len(end) >= n and end[-n:] == start[:n]:
                problems.append(
                    f"utterances {before.utterance_id}/{after.utterance_id}: {' '.join(start[:n])!r} "
                    f"on both sides of a forced split: {before.text!r} | {after.text!r}"
                )
                break
    return problems
