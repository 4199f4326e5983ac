"""Where to cut speech that has grown past ``max_utterance_s``.

Whisper sees at most 30 s, so ``StreamingTranscriber`` ends a long utterance and goes on
with a new one that starts at the cut. Two things must hold at the cut:

- every committed word (already shown in partials) is in the ending utterance's final,
  so the cut may not fall before the end of the last committed word; if it did, the next
  utterance would hear that word's audio again and the word would appear twice (issue 4:
  cutting at the quietest recent VAD frame, wherever it was, did exactly that);
- no word is cut in half: the cut goes to a boundary between two words.

Word boundaries come from one decode of the utterance with word timestamps (the committed
words forced as its prefix, so they come first). The cut lands on the least speech-like
VAD frame in the gap between two words after the committed words; the quietest boundary
wins, so a pause between sentences is preferred to a join inside a phrase. The ending
utterance's final is exactly the words before that boundary; the next utterance hears
only audio after the cut, so no word can be heard by both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from edge_rtgi.asr.agreement import common_prefix_len, split_words, strip_prefix_words
from edge_rtgi.asr.vad import FRAME_SAMPLES
from edge_rtgi.asr.whisper import Hypothesis

SAMPLE_RATE_HZ = 16000
MIN_SPLIT_SAMPLES = SAMPLE_RATE_HZ  # no utterance cut off long speech is shorter than this
# A last word ending this close to the end of the decoded audio may be cut off mid-word.
OPEN_WORD_SAMPLES = SAMPLE_RATE_HZ // 4

QuietestFrame = Callable[[int, int], tuple[int, float]]


@dataclass(frozen=True)
class SplitPoint:
    """``words``: the final of the utterance being ended; ``cut_index``: the absolute sample
    where it ends and the next utterance begins; ``boundary``: how many words of the
    hypothesis lie before the cut (None when the hypothesis had no usable word times)."""

    words: list[str]
    cut_index: int
    boundary: int | None


def choose_split(
    committed: list[str], hyp: Hypothesis, start_index: int, end_index: int, quietest_frame: QuietestFrame
) -> SplitPoint:
    """Cut ``[start_index, end_index)``, decoded as ``hyp`` (word timestamps, ``committed``
    forced as prefix), at a word boundary after the committed words.

    ``quietest_frame(lo, hi)`` gives the least speech-like VAD frame starting in ``[lo, hi)``
    as ``(sample_index, speech_probability)`` (``SileroVad.quietest_frame``).

    Candidates are the boundaries between words after the last committed word, and the end
    of the last word unless it runs up to the end of the audio (it may be cut off there);
    never the end of the audio itself past the last word, since whisper may stop before
    speech does and what it did not hear must go to the next utterance. All lie at least
    ``MIN_SPLIT_SAMPLES`` into the utterance. The cut stays inside the gap whisper's word
    times leave between the two words (at least one VAD frame wide), on its least
    speech-like frame. (Letting it look into the neighbouring words put it inside them,
    e.g. "market" heard as "get" after the cut, and raised the WER: docs/speech.md.)
    """
    timed = list(hyp.words)
    texts = [w.text for w in timed]
    if texts != split_words(hyp.text) or common_prefix_len(committed, texts) < len(committed):
        # No usable word times (or the decode left the prefix): keep everything decoded
        # here; the next utterance starts after it.
        return SplitPoint(
            list(committed) + strip_prefix_words(committed, split_words(hyp.text)), end_index, None
        )

    def at(t_s: float) -> int:
        return start_index + round(t_s * SAMPLE_RATE_HZ)

    earliest = start_index + MIN_SPLIT_SAMPLES
    closed = bool(timed) and at(timed[-1].end_s) < end_index - OPEN_WORD_SAMPLES
    last = len(timed) if closed else len(timed) - 1
    options = []
    for i in range(max(len(committed), 1), last + 1):
        lo = max(earliest, at(timed[i - 1].end_s))
        gap_end = at(timed[i].start_s) if i < len(timed) else lo
        hi = min(end_index, max(gap_end, lo + FRAME_SAMPLES))
        if lo < hi:
            index, probability = quietest_frame(lo, hi)
            options.append((probability, -i, index, i))  # ties: the later boundary
    if not options:  # no words, or none ending after the first second: keep it all
        return SplitPoint(list(committed) + texts[len(committed) :], end_index, len(timed))
    _, _, cut, i = min(options)
    return SplitPoint(list(committed) + texts[len(committed) : i], cut, i)
