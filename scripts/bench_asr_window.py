#!/usr/bin/env python
"""Whisper's short encoder window (``AsrConfig.encoder_window_s``) against its own 30 s window.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_asr_window.py --windows 30,10,15 --out w.json

Clips: the project sentences (tests/data/sentences_en.txt), the voice questions, the turn-taking
set's complete requests (both sets) and ten runs of 2-4 sentences (9-16 s), each spoken by Piper
(prosody noise off) and by espeak-ng, with 0.3 s of silence either side. Every clip is decoded
once per window setting as a final (beam 5, timestamps) and as a partial (greedy, no
timestamps) through ``WhisperAsr.transcribe``, short-window guard and fallback included.
Prints per setting the corpus WER, its paired difference from the 30 s window with a 95 %
bootstrap interval (clips resampled), the clips whose words changed, the median cost per
decode and how often a doubtful short-window result went to the 30 s decode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_voice import load_questions, load_turn_set, say_16k, turn_voices  # noqa: E402

from edge_rtgi.asr import AsrConfig, WhisperAsr  # noqa: E402
from edge_rtgi.scoring.retention import bootstrap_mean_interval  # noqa: E402


class CountingAsr(WhisperAsr):
    """The real model, counting the decodes that went to whisper's own 30 s window."""

    whole_calls = 0

    def transcribe_whole(self, *args, **kwargs):
        self.whole_calls += 1
        return super().transcribe_whole(*args, **kwargs)


def corpus() -> tuple[list[str], list[np.ndarray]]:
    sentences = [
        s.strip() for s in (ROOT / "tests/data/sentences_en.txt").read_text().splitlines() if s.strip()
    ]
    turns = load_turn_set()
    texts = list(
        dict.fromkeys(sentences + load_questions(64) + turns["complete"] + turns["heldout_complete"])
    )
    runs = [
        " ".join(sentences[i : i + k])
        for i, k in zip(range(0, 20, 2), (2, 3, 4, 2, 3, 4, 2, 3, 4, 3), strict=True)
    ]
    refs, clips = [], []
    pad = np.zeros(4800, np.float32)
    for voice in turn_voices():
        for text in texts + runs:
            audio = say_16k(voice, text)
            if len(audio) <= 28 * 16000:
                refs.append(text)
                clips.append(np.concatenate([pad, audio, pad]))
    return refs, clips


def word_errors(ref: str, hyp: str) -> tuple[int, int]:
    """(errors, reference words) under jiwer's standard English normalisation."""
    import jiwer

    t = jiwer.Compose(
        [
            jiwer.ToLowerCase(),
            jiwer.RemovePunctuation(),
            jiwer.RemoveMultipleSpaces(),
            jiwer.Strip(),
            jiwer.ReduceToListOfListOfWords(),
        ]
    )
    out = jiwer.process_words(ref, hyp, reference_transform=t, hypothesis_transform=t)
    return out.substitutions + out.deletions + out.insertions, len(t(ref)[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", default="30,10", help="encoder_window_s settings; the first is the baseline")
    ap.add_argument("--out", help="write the hypotheses and the summary as JSON here")
    args = ap.parse_args()
    windows = [float(w) for w in args.windows.split(",")]
    refs, clips = corpus()
    seconds = [len(c) / 16000 for c in clips]
    print(
        f"{len(clips)} clips, {statistics.median(seconds):.1f} s median, {max(seconds):.1f} s longest, "
        f"{sum(s > 9 for s in seconds)} over 9 s",
        flush=True,
    )
    result: dict = {"clips": len(clips), "rows": []}
    for kind, beam, timestamps in (("final", 5, True), ("partial", 1, False)):
        base: list[tuple[int, int]] | None = None
        base_hyps: list[str] = []
        for window in windows:
            asr = CountingAsr(AsrConfig(model="whisper-tiny.en", encoder_window_s=window))
            hyps, costs = [], []
            for clip in clips:
                t0 = time.perf_counter()
                hyps.append(asr.transcribe(clip, timestamps=timestamps, beam_size=beam).text)
                costs.append((time.perf_counter() - t0) * 1000.0)
            errs = [word_errors(r, h) for r, h in zip(refs, hyps, strict=True)]
            words = sum(n for _, n in errs)
            wer = sum(e for e, _ in errs) / words
            row = {
                "kind": kind,
                "encoder_window_s": window,
                "wer": wer,
                "cost_ms_p50": statistics.median(costs),
                "to_30_s": asr.whole_calls,
                "hypotheses": hyps,
            }
            line = (
                f"{kind:7s} window {window:4.0f} s: WER {100 * wer:5.2f} %, {row['cost_ms_p50']:4.0f} ms per "
                f"decode (p50), {asr.whole_calls} by whisper's own decode"
            )
            if base is None:
                base, base_hyps = errs, hyps
            else:
                diff = [e - b for (e, _), (b, _) in zip(errs, base, strict=True)]
                low, high = bootstrap_mean_interval(diff, [n for _, n in errs])
                row.update(diff_points=100 * sum(diff) / words, low=100 * low, high=100 * high)
                row["changed"] = sum(1 for h, b in zip(hyps, base_hyps, strict=True) if h != b)
                line += (
                    f"; {row['diff_points']:+.2f} points [95 % {100 * low:+.2f}, {100 * high:+.2f}], "
                    f"text of {row['changed']} clips changed (case and punctuation count)"
                )
            result["rows"].append(row)
            print(line, flush=True)
    result["references"] = refs
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
