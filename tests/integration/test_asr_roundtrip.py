"""TTS -> streaming ASR round trip on the project's sentences, plus silence and noise.

The Piper voice speaks tests/data/sentences_en.txt (synthesised once per module into a tmp
folder); whisper tiny.en transcribes each file through the streaming path, fed in 20/30/40 ms
chunks on a simulated clock (see ``stream_samples``), and once more in one shot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_rtgi.asr import (
    AsrConfig,
    FinalTranscript,
    PartialTranscript,
    SileroVad,
    SpeechEnded,
    SpeechStarted,
    StreamingTranscriber,
    WhisperAsr,
)
from edge_rtgi.asr.evaluation import final_text, stability_problems, stream_samples, word_error_rate
from edge_rtgi.audio import read_wav_mono, resample, write_wav
from edge_rtgi.tts import make_tts
from tests.integration.native_client import steady_voice

pytestmark = pytest.mark.slow

SENTENCES = [
    s.strip()
    for s in (Path(__file__).parents[1] / "data" / "sentences_en.txt").read_text().splitlines()
    if s.strip()
]
LEAD_IN = np.zeros(8000, np.float32)  # 0.5 s of silence before speech, as a speaker would leave


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[tuple[str, np.ndarray]]:
    voice = steady_voice(make_tts("piper-en_US-joe-medium"))  # the same audio every run
    folder = tmp_path_factory.mktemp("piper_corpus")
    out = []
    for i, text in enumerate(SENTENCES):
        pcm = np.concatenate(list(voice.synthesize_stream(text)))
        path = folder / f"s{i:02d}.wav"
        write_wav(path, pcm, voice.sample_rate_hz)
        out.append((text, read_wav_mono(path)))  # through the WAV reader and resampler, like a user file
    return out


@pytest.fixture(scope="module")
def asr() -> WhisperAsr:
    return WhisperAsr(AsrConfig(model="whisper-tiny.en", cpu_threads=2))


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    return SileroVad()


@pytest.fixture(scope="module")
def streamed(corpus, asr, vad) -> list[list]:
    return [
        stream_samples(StreamingTranscriber(asr, vad=vad), np.concatenate([LEAD_IN, x])) for _, x in corpus
    ]


def test_corpus_is_about_twenty_sentences():
    assert 18 <= len(SENTENCES) <= 25


def test_streaming_wer_is_low_and_not_worse_than_one_shot(corpus, asr, streamed):
    refs = [t for t, _ in corpus]
    stream_hyps = [final_text(ev) for ev in streamed]
    # Baseline: one decode of each whole file with faster-whisper's default beam (5), the same
    # beam our final decode uses.
    one_shot_hyps = [asr.transcribe(x, beam_size=5).text for _, x in corpus]
    wer_stream, wer_one_shot = word_error_rate(refs, stream_hyps), word_error_rate(refs, one_shot_hyps)
    print(f"\nWER streaming {wer_stream:.2%}, one-shot {wer_one_shot:.2%} over {len(refs)} files")
    for ref, hyp in zip(refs, stream_hyps, strict=True):
        if word_error_rate([ref], [hyp]) > 0:
            print(f"  ref: {ref}\n  hyp: {hyp}")
    assert wer_stream <= 0.05
    # Tolerance: 3 points (about 7 of the ~220 words). The two paths decode differently (greedy
    # partials commit words; the one-shot is beam 5 over the whole file). The corpus is now
    # rendered without Piper's noise (the same audio every run: streaming 2.71 %, one-shot
    # 2.26 %); the tolerance was set on random renderings, where streaming minus one-shot was -1.8,
    # -0.9, -0.5, +0.5, +0.5, +0.5 and +2.3 points (the last: 4.07 % against an unusually good
    # 1.81 %, all misheard words such as "seat" for "sea", none dropped or repeated), so the
    # mean difference is about zero. A systematic loss (dropped tails, repeated words across
    # utterances) costs more than that, and is also checked file by file in the tests below.
    assert wer_stream <= wer_one_shot + 0.03 + 1e-9


def test_short_end_pad_speculates_the_final_without_losing_words(corpus, asr, streamed):
    """``end_pad_ms: 64`` (the voice assistant's setting): the final is decoded once two VAD frames
    of silence are in, 236 ms before the 300 ms endpoint, and reused; it has at most two more
    word errors than the default (200 ms pad) stream on the same audio (30 questions at
    100/64/32/0 ms end pad gave identical words in a same-audio comparison, docs/daemon.md)."""
    from edge_rtgi.asr.config import VadConfig

    config = AsrConfig(
        model="whisper-tiny.en",
        cpu_threads=2,
        vad=VadConfig(min_silence_ms=300, speech_pad_ms=100, end_pad_ms=64),
    )
    files = corpus[:6]
    events = [
        stream_samples(
            StreamingTranscriber(asr, config, vad=SileroVad(config.vad)), np.concatenate([LEAD_IN, x])
        )
        for _, x in files
    ]
    finals = [e for ev in events for e in ev if isinstance(e, FinalTranscript)]
    assert len(finals) == len(files)
    for final in finals:
        assert final.final_decode_ms == 0.0, "the speculative final was not reused"
        assert final.segments[-1].end_audio_s <= final.speech_end_audio_s + 0.064 + 1e-6
    refs = [t for t, _ in files]
    wer_short = word_error_rate(refs, [final_text(ev) for ev in events])
    wer_default = word_error_rate(refs, [final_text(ev) for ev in streamed[: len(files)]])
    words = sum(len(t.split()) for t in refs)
    assert wer_short <= wer_default + 2 / words + 1e-9, (wer_short, wer_default)


def test_partials_are_stable_on_every_file(streamed):
    for events in streamed:
        assert stability_problems(events) == []
        kinds = [type(e) for e in events]
        assert kinds[0] is SpeechStarted and kinds[-1] is FinalTranscript and kinds[-2] is SpeechEnded
        assert kinds.count(FinalTranscript) == 1, "one sentence is one utterance"
        partials = [e for e in events if isinstance(e, PartialTranscript)]
        assert partials, "partials must appear while the sentence is spoken"
    # Words get committed while the speaker is still talking, on most files (a 3 s sentence
    # gets only 2-3 decodes, so two of them may disagree to the end on a few files).
    committing = sum(
        any(isinstance(e, PartialTranscript) and e.committed_text for e in events) for events in streamed
    )
    assert committing >= len(streamed) // 2


def test_final_carries_timestamps_within_the_audio(corpus, streamed):
    for (_, x), events in zip(corpus, streamed, strict=True):
        final = next(e for e in events if isinstance(e, FinalTranscript))
        duration_s = (len(LEAD_IN) + len(x)) / 16000
        assert 0.0 <= final.start_audio_s < final.speech_end_audio_s <= duration_s + 0.05
        assert final.endpoint_audio_s >= final.speech_end_audio_s
        assert final.segments and all(s.start_audio_s <= s.end_audio_s for s in final.segments)
        assert " ".join(s.text for s in final.segments) == final.text


@pytest.mark.parametrize("kind", ["silence", "white_noise"])
def test_silence_and_noise_give_no_transcript(asr, vad, kind):
    rng = np.random.default_rng(7)
    audio = (
        np.zeros(160000, np.float32)
        if kind == "silence"
        else (rng.standard_normal(160000) * 0.05).astype(np.float32)
    )
    events = stream_samples(StreamingTranscriber(asr, vad=vad), audio)
    assert [e for e in events if isinstance(e, (PartialTranscript, FinalTranscript))] == []


def _trim(x: np.ndarray, floor: float = 0.01) -> np.ndarray:
    loud = np.nonzero(np.abs(x) > floor)[0]
    return x[loud[0] : loud[-1] + 1]


@pytest.mark.parametrize(
    ("first", "chunk_ms"),
    [(1, (20, 30, 40)), (1, (2000,)), (9, (20, 30, 40))],
    ids=["live", "backlog", "live-2"],
)
def test_long_speech_is_split_without_losing_words(corpus, asr, vad, first, chunk_ms):
    """Three sentences without pauses (about 9-10 s) exceed max_utterance_s (5 s) and get split.

    Until the cut was tied to the committed words it could fall before the last of them,
    and the next utterance repeated them: over 38 renderings, 18 had WER above 10 % (1 in 20
    for sentences 2-4, 6 of 6 for sentences 10-12). "backlog" inserts 2 s at a time, as a
    real-time loop does after a stalled decode: the limit is passed by up to 2 s before the
    cut can be made."""
    config = AsrConfig(model="whisper-tiny.en", max_utterance_s=5.0)
    texts = [t for t, _ in corpus[first : first + 3]]
    audio = np.concatenate([LEAD_IN] + [_trim(x) for _, x in corpus[first : first + 3]])
    events = stream_samples(StreamingTranscriber(asr, config=config, vad=vad), audio, chunk_ms=chunk_ms)
    ends = [e for e in events if isinstance(e, SpeechEnded)]
    finals = [e for e in events if isinstance(e, FinalTranscript)]
    assert stability_problems(events) == []
    assert any(e.reason == "max_length" for e in ends)
    # The limit is checked when process_iter runs, i.e. after each inserted chunk; the VAD
    # may end an utterance inside a chunk that crossed it.
    assert all(f.speech_end_audio_s - f.start_audio_s <= 5.0 + max(chunk_ms) / 1000 + 0.1 for f in finals)
    # The cut falls at a word boundary after the committed words: stability_problems above
    # also checks that no word ends one final and starts the next.
    assert word_error_rate([" ".join(texts)], [final_text(events)]) <= 0.10


def test_unsupported_rate_and_channels_are_converted(tmp_path, corpus, asr, vad, streamed):
    """A 48 kHz stereo file is down-mixed and resampled; recognition is as good as at 16 kHz mono."""
    text, x = corpus[1]
    stereo_48k = resample(x, 16000, 48000)
    stereo_48k = np.stack([stereo_48k, stereo_48k * 0.5], axis=1)
    path = tmp_path / "stereo48k.wav"
    write_wav(path, stereo_48k, 48000)
    events = stream_samples(
        StreamingTranscriber(asr, vad=vad), np.concatenate([LEAD_IN, read_wav_mono(path)])
    )
    mono_wer = word_error_rate([text], [final_text(streamed[1])])
    assert word_error_rate([text], [final_text(events)]) <= mono_wer + 1.0 / len(text.split()) + 1e-9


async def test_async_session_in_real_time(tmp_path, corpus, asr):
    """The daemon's path: WavSource paced by the wall clock -> AsrSession -> events."""
    from edge_rtgi.asr import AsrSession
    from edge_rtgi.audio import WavSource

    text, x = corpus[4]
    path = tmp_path / "one.wav"
    write_wav(path, np.concatenate([LEAD_IN, x]), 16000)
    session = AsrSession(asr)

    async def feed() -> None:
        async for chunk in WavSource(path, chunk_ms=30, realtime=True, tail_silence_ms=1200):
            session.feed(chunk)
        await session.close()

    import asyncio

    feeder = asyncio.create_task(feed())
    events = [event async for event in session]
    await feeder
    assert stability_problems(events) == []
    finals = [e for e in events if isinstance(e, FinalTranscript)]
    assert len(finals) == 1 and word_error_rate([text], [finals[0].text]) <= 0.1
    # Events were produced while audio was still arriving, not all at the end.
    started = next(e for e in events if isinstance(e, SpeechStarted))
    assert started.t_s < finals[0].t_s


def test_blocklist_drops_only_unsure_stock_phrases(asr, vad):
    """The last-resort filter: a whole-utterance stock phrase that whisper was unsure of."""
    from edge_rtgi.asr.whisper import DecodedSegment, Hypothesis

    def hyp(text: str, avg_logprob: float, no_speech_prob: float) -> Hypothesis:
        return Hypothesis(
            text, (DecodedSegment(text, 0.0, 1.0, avg_logprob, no_speech_prob, 1.2),), "en", 1.0
        )

    tr = StreamingTranscriber(asr, vad=vad)
    assert tr._is_hallucination("Thanks for watching!", hyp("Thanks for watching!", -0.9, 0.05))
    assert tr._is_hallucination("Subtitles by the Amara.org community", hyp("x", -0.2, 0.5))
    assert not tr._is_hallucination(
        "Thanks for watching!", hyp("Thanks for watching!", -0.1, 0.01)
    )  # sure: kept
    assert not tr._is_hallucination("Thanks for the tea.", hyp("Thanks for the tea.", -0.9, 0.05))
