"""``edge-rtgi transcribe`` and ``edge-rtgi speak``: streaming ASR and TTS from the terminal."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time

import numpy as np

from edge_rtgi.errors import EdgeRtgiError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "transcribe",
        help="streaming speech recognition of a WAV file or the microphone",
        description="Live partial transcripts on one line, each final on its own line.",
    )
    p.add_argument("file", nargs="?", help="WAV file (any rate, channels, 8-32 bit or float)")
    p.add_argument("--mic", action="store_true", help="listen to the microphone instead of a file")
    p.add_argument("--input-device", default=None, help="PortAudio input device name or index (with --mic)")
    p.add_argument(
        "--seconds", type=float, default=None, help="stop listening after this many seconds (with --mic)"
    )
    p.add_argument(
        "--model",
        default="whisper-tiny.en",
        help="catalogue name or CTranslate2 folder (default whisper-tiny.en)",
    )
    p.add_argument(
        "--language", default=None, help="spoken language, e.g. es (multilingual models; default: detect)"
    )
    p.add_argument(
        "--task",
        choices=("transcribe", "translate"),
        default="transcribe",
        help="translate: output English text (multilingual models)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per event on stdout")
    p.add_argument(
        "--fast", action="store_true", help="feed the file as fast as possible instead of in real time"
    )
    p.add_argument("--chunk-ms", type=int, default=20, help="audio chunk size (default 20)")
    p.add_argument(
        "--min-silence-ms", type=int, default=None, help="silence that ends an utterance (default 500)"
    )
    p.add_argument("--device", default="auto", help="compute device: auto, cpu, cuda")
    p.add_argument("--cpu-threads", type=int, default=2, help="CPU threads for whisper (default 2)")
    p.set_defaults(func=_transcribe)

    s = subparsers.add_parser(
        "speak",
        help="speak text with a Piper voice or espeak-ng",
        description="Plays on the speaker, or writes a WAV file with --out.",
    )
    s.add_argument("text", help="text to speak ('-' reads standard input)")
    s.add_argument(
        "--voice",
        default="piper-en_US-joe-medium",
        help="catalogue name, path to VOICE.onnx, or espeak:LANG (e.g. espeak:es)",
    )
    s.add_argument("--out", default=None, help="write a 16-bit WAV file instead of playing")
    s.set_defaults(func=_speak)


# --------------------------------------------------------------------------- transcribe


def _asr_config(args: argparse.Namespace):
    from edge_rtgi.asr import AsrConfig, VadConfig
    from edge_rtgi.config import from_dict

    vad = {} if args.min_silence_ms is None else {"min_silence_ms": args.min_silence_ms}
    cfg = {
        "model": args.model,
        "language": args.language,
        "task": args.task,
        "device": args.device,
        "cpu_threads": args.cpu_threads,
    }
    config = from_dict(AsrConfig, cfg, "transcribe options")
    return dataclasses.replace(config, vad=from_dict(VadConfig, vad, "transcribe options"))


def _event_json(event) -> str:
    name = type(event).__name__
    kind = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    data = dataclasses.asdict(event)
    data.pop("t_s", None)
    if hasattr(event, "text") and "text" not in data:
        data["text"] = event.text
    return json.dumps({"type": kind, **data}, ensure_ascii=False)


class _Printer:
    """Partials overwrite one terminal line; finals get their own lines."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.tty = sys.stdout.isatty()
        self._line_open = False

    def __call__(self, event) -> None:
        from edge_rtgi.asr import FinalTranscript, PartialTranscript

        if self.as_json:
            print(_event_json(event), flush=True)
            return
        if isinstance(event, PartialTranscript) and self.tty:
            sys.stdout.write("\r\033[K" + event.text[-(200):])
            sys.stdout.flush()
            self._line_open = True
        elif isinstance(event, FinalTranscript):
            prefix = "\r\033[K" if self._line_open else ""
            sys.stdout.write(prefix + event.text + "\n")
            sys.stdout.flush()
            self._line_open = False


async def _pump(source, session, seconds: float | None, announce: bool) -> None:
    deadline = None if seconds is None else time.monotonic() + seconds
    chunks = source.__aiter__()
    try:
        async for chunk in chunks:
            if announce:
                # Said once audio really flows, so scripts can start talking at this point.
                print("edge-rtgi: listening (Ctrl-C to stop)", file=sys.stderr, flush=True)
                announce = False
                deadline = None if seconds is None else time.monotonic() + seconds
            session.feed(chunk)
            if deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        await chunks.aclose()  # closes the PortAudio stream now, not at interpreter exit
    await session.close()


async def _transcribe_async(args: argparse.Namespace, source, asr) -> None:
    from edge_rtgi.asr import AsrSession

    session = AsrSession(asr)
    printer = _Printer(args.json)
    feeder = asyncio.create_task(_pump(source, session, args.seconds, announce=args.mic))
    try:
        async for event in session:
            printer(event)
    except BaseException:
        feeder.cancel()
        raise
    await feeder  # re-raises a source error (e.g. the microphone failed)


def _transcribe(args: argparse.Namespace) -> int:
    from edge_rtgi.asr import WhisperAsr
    from edge_rtgi.audio import MicrophoneSource, WavSource

    if args.mic == bool(args.file):
        raise EdgeRtgiError("give either a WAV file or --mic", hint="edge-rtgi transcribe talk.wav | --mic")
    if args.chunk_ms <= 0:
        raise EdgeRtgiError(f"--chunk-ms must be positive, got {args.chunk_ms}")
    config = _asr_config(args)
    source: WavSource | MicrophoneSource
    if args.file:
        # Tail silence lets the VAD endpoint fire after the last word, as with a live speaker.
        tail_ms = config.vad.min_silence_ms + config.vad.speech_pad_ms + 300
        source = WavSource(args.file, chunk_ms=args.chunk_ms, realtime=not args.fast, tail_silence_ms=tail_ms)
    else:
        source = MicrophoneSource(chunk_ms=args.chunk_ms, device=args.input_device)
    asr = WhisperAsr(config)
    try:
        asyncio.run(_transcribe_async(args, source, asr))
    except KeyboardInterrupt:
        return 130
    return 0


# --------------------------------------------------------------------------- speak


async def _play(engine, text: str) -> None:
    from edge_rtgi.audio import SpeakerSink
    from edge_rtgi.tts import synthesize_async

    sink = SpeakerSink(engine.sample_rate_hz)
    try:
        async for chunk in synthesize_async(engine, text):
            sink.write(chunk)
        await sink.drain()
    finally:
        sink.close()


def _speak(args: argparse.Namespace) -> int:
    from edge_rtgi.audio import has_output_device, write_wav
    from edge_rtgi.errors import AudioError
    from edge_rtgi.tts import check_text, make_tts

    text = sys.stdin.read() if args.text == "-" else args.text
    check_text(text)
    if args.out is None and not has_output_device():
        raise AudioError(
            "no audio output device: nothing to play the speech on",
            hint="write it to a file with --out speech.wav",
        )
    engine = make_tts(args.voice)
    if args.out is not None:
        chunks = list(engine.synthesize_stream(text))
        write_wav(args.out, np.concatenate(chunks), engine.sample_rate_hz)
        seconds = sum(len(c) for c in chunks) / engine.sample_rate_hz
        print(f"wrote {args.out} ({seconds:.2f} s at {engine.sample_rate_hz} Hz)", file=sys.stderr)
        return 0
    asyncio.run(_play(engine, text))
    return 0
