"""scripts/bench_voice.py: the summary and the Markdown report (pure logic, no models)."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_voice")


def _row(v2v: float, load: float, tts: float | None = 100.0) -> dict:
    return {
        "client_voice_to_voice_ms": v2v,
        "endpointing_ms": 300.0,
        "asr_final_ms": 200.0,
        "llm_ttft_ms": 80.0,
        "first_clause_ms": 250.0,
        "tts_first_chunk_ms": tts,
        "voice_to_voice_ms": v2v + 10,
        "load_average_1m": load,
    }


def test_summary_has_median_p95_and_counts(bench):
    rows = [_row(900, 0.5), _row(1100, 0.7), _row(1000, 0.6, tts=None)]
    base = [{"asr_ms": 400.0, "llm_ms": 2000.0, "tts_ms": 300.0, "endpointing_ms": 300.0}] * 3
    s = bench.summarize(rows, base, load_start=0.4)
    v2v = s["parts"]["client_voice_to_voice_ms"]
    assert (v2v["median"], v2v["n"]) == (1000, 3)
    assert v2v["p95"] == pytest.approx(1090.0)  # linear interpolation between 1000 and 1100
    assert s["parts"]["tts_first_chunk_ms"]["n"] == 2  # a missing part is not counted as zero
    assert s["load_average_1m"] == {"start": 0.4, "median": 0.55, "max": 0.7}
    assert s["baseline"]["total_ms"]["median"] == 3000.0


def test_markdown_report_states_conditions_and_every_part(bench):
    s = bench.summarize([_row(900, 3.0), _row(1100, 5.0)], [], load_start=2.0)
    md = bench.markdown_report(s)
    assert "--utterances 2" in md and "median 3.0, max 5.0" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(bench.PARTS) + 1  # header, the client total, the server parts
    assert "| 1000 | 1090 | 2 |" in md
    assert "non-streaming" not in md  # no baseline row without a baseline


def _run(part: str, rows: list[dict]) -> dict:
    meta = {"items": "all", "started": "t", "commit": "c", "load_average_1m": {"start": 0.5, "max": 0.6}}
    return {"part": part, **meta, "rows": rows}


def test_speech_over_a_reply_is_summarised_per_mode_with_when_it_cut(bench):
    """Through the daemon: interruptions among the items played over a reply, and how soon after
    the speech began the reply was cut; a reply that ended before the speech did is not counted."""
    rows = [
        {"mode": "semantic", "over_reply": True, "interrupted": True, "cut_after_start_ms": 900},
        {"mode": "semantic", "over_reply": True, "interrupted": True, "cut_after_start_ms": 1100},
        {"mode": "semantic", "over_reply": False, "interrupted": False, "cut_after_start_ms": None},
        {"mode": "no-talkover-prompt", "over_reply": True, "interrupted": False, "cut_after_start_ms": None},
    ]
    s = bench.summarize_turns([_run("interruption", rows)])["interruption"]
    assert (s["semantic"]["n"], s["semantic"]["over_reply"], s["semantic"]["interrupted"]) == (3, 2, 2)
    assert s["semantic"]["cut_after_start_ms"]["p50"] == 1000
    assert s["no-talkover-prompt"]["interrupted"] == 0 and "cut_after_start_ms" not in s["no-talkover-prompt"]


def test_speech_over_a_reply_on_the_audio_clock_counts_finals_that_would_cut(bench):
    rows = [
        {"mode": "semantic", "item": 0, "interrupted": False, "decisions": [], "final_decode_ms": [90.0]},
        {"mode": "semantic", "item": 1, "interrupted": True, "decisions": [], "final_decode_ms": [110.0]},
    ]
    s = bench.summarize_offline([_run("heldout_backchannel", rows)])["heldout_backchannel"]["semantic"]
    assert (s["n"], s["interrupted"], s["cut_items"]) == (2, 1, [1])
