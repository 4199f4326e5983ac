"""``edge-rtgi serve``, ``edge-rtgi translate`` and ``edge-rtgi voice``.

``serve`` runs the daemon until SIGTERM/SIGINT, then drains: it stops accepting, lets
responses in flight finish (``server.drain_timeout_s``), and closes every session. Under
systemd (``Type=notify``) it reports ``READY=1`` once the models are loaded and the port
is open, and ``STOPPING=1`` when the drain starts, through ``$NOTIFY_SOCKET``; with
``WatchdogSec=`` it pings ``WATCHDOG=1`` from the event loop while healthy
(``edge_rtgi.server.systemd``).

``translate`` and ``voice`` stream the microphone (``--mic``) or a WAV file (``--input``)
through a pipeline in-process, or through a running daemon with ``--connect ws://...``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_rtgi.errors import AudioError, ConfigError
from edge_rtgi.server.systemd import Watchdog, sd_notify, watchdog_interval_s

if TYPE_CHECKING:
    from edge_rtgi.server.client import Transport

log = logging.getLogger(__name__)

__all__ = ["sd_notify"]  # kept importable from here


# --------------------------------------------------------------------------- serve


def _load(args: argparse.Namespace) -> tuple[Any, dict]:
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines
    from edge_rtgi.server.config import load_daemon_config

    config = load_daemon_config(args.config)
    if getattr(args, "wyoming", None):
        import dataclasses

        from edge_rtgi.config import from_dict
        from edge_rtgi.server.config import WyomingConfig

        fields = {**dataclasses.asdict(config.wyoming), "uri": args.wyoming}
        config = dataclasses.replace(config, wyoming=from_dict(WyomingConfig, fields, "--wyoming"))
    server = config.server
    if getattr(args, "host", None) or getattr(args, "port", None) is not None:
        import dataclasses

        server = dataclasses.replace(
            server, **{k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        )
        config = dataclasses.replace(config, server=server)
    pipelines = load_pipelines(list(config.pipelines) or [builtin_pipelines_dir()])
    return config, pipelines


async def _serve(config: Any, pipelines: dict) -> int:
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon, start_worker_pool
    from edge_rtgi.server.memory import install_heap_snapshots

    config.server.check_bind()  # refuse an unsafe bind before spending time on models
    start_worker_pool(asyncio.get_running_loop())
    if config.wyoming.uri is not None:
        config.wyoming.check_bind()
    resources = Resources(config.engine)
    daemon = Daemon(config, pipelines, resources)
    if config.preload:
        for pipeline in daemon.pipelines.values():
            log.info("loading models for pipeline %s", pipeline.name)
            await resources.prepare(pipeline)
    await daemon.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    srv = config.server
    print(
        f"edge-rtgi: serving {', '.join(daemon.pipelines)} on ws://{srv.host}:{daemon.port}/v1/native "
        f"(browser: http://{srv.host}:{daemon.port}/, OpenAI API: http://{srv.host}:{daemon.port}/v1, "
        f"health: http://{srv.host}:{daemon.port}/healthz)",
        flush=True,
    )
    if daemon.wyoming is not None:
        print(f"edge-rtgi: Wyoming (Home Assistant) on {daemon.wyoming.uri}", flush=True)
    install_heap_snapshots(loop)  # after the models: their loading is not what a long run grows
    sd_notify(f"READY=1\nSTATUS=serving on {srv.host}:{daemon.port}")
    interval_s = watchdog_interval_s()
    watchdog = Watchdog(interval_s, daemon.health_problems) if interval_s else None
    if watchdog is not None:
        watchdog.start()
    await stop.wait()
    sd_notify("STOPPING=1")
    if watchdog is not None:
        await watchdog.stop()
    print("edge-rtgi: draining sessions", flush=True)
    await daemon.drain()
    await asyncio.to_thread(resources.close)
    print("edge-rtgi: stopped", flush=True)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from edge_rtgi.server.memory import reexec_with_jemalloc

    try:
        # Before the models load: the re-exec starts the process over with jemalloc preloaded.
        allocator = reexec_with_jemalloc(["edge_rtgi.cli", *sys.argv[1:]])
    except ValueError as exc:
        raise ConfigError(str(exc), hint="unset it, or set auto, jemalloc or system") from None
    log.info("memory allocator: %s", allocator)
    config, pipelines = _load(args)
    return asyncio.run(_serve(config, pipelines))


# --------------------------------------------------------------------------- translate / voice


# PortAudio's input stream (through ALSA's pulse plugin, for one) captures nothing until its
# first callback, which can come seconds after ``start()`` on a loaded machine (docs/daemon.md).
# Whatever is said before that is lost, so "listening" may only be announced once the first block is in.
MIC_FIRST_BLOCK_TIMEOUT_S = 20.0


async def _mic_chunks(duration_s: float | None, device: str | None, on_live: Any = None) -> Any:
    """PCM16 chunks from the microphone. ``on_live()`` runs when audio really flows, and
    ``duration_s`` counts from that moment."""
    from edge_rtgi.audio.devices import MicrophoneSource

    mic = MicrophoneSource(sample_rate_hz=16000, chunk_ms=20, device=device)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, mic.stop)
    it = mic.__aiter__()
    try:
        try:
            first = await asyncio.wait_for(it.__anext__(), MIC_FIRST_BLOCK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise AudioError(
                f"the microphone delivered no audio within {MIC_FIRST_BLOCK_TIMEOUT_S:.0f} s",
                hint="check the input device (--mic-device) and that the sound server runs",
            ) from None
        except StopAsyncIteration:
            return
        if on_live is not None:
            on_live()
        deadline = loop.time() + duration_s if duration_s else None
        yield _pcm16(first)
        while True:
            # the deadline is enforced here: a stalled input stream must not hold the command
            timeout = None if deadline is None else deadline - loop.time()
            if timeout is not None and timeout <= 0:
                break
            try:
                chunk = await asyncio.wait_for(it.__anext__(), timeout)
            except (StopAsyncIteration, asyncio.TimeoutError):
                break
            yield _pcm16(chunk)
    finally:
        mic.stop()
        loop.remove_signal_handler(signal.SIGINT)
        await it.aclose()  # closes the PortAudio stream now, not at interpreter exit
        if mic.dropped_chunks:  # processing fell behind real time for longer than the mic queue
            print(
                f"edge-rtgi: warning: dropped {mic.dropped_chunks * mic.chunk_ms / 1000:.1f} s of microphone "
                "audio because processing fell behind",
                file=sys.stderr,
                flush=True,
            )


def _announce_listening() -> None:
    # scripts (and the mic tests) start talking when they read this line
    print("edge-rtgi: listening (Ctrl-C to stop)", file=sys.stderr, flush=True)


async def _file_chunks(path: str, realtime: bool) -> Any:
    from edge_rtgi.audio.wav import WavSource

    async for chunk in WavSource(path, chunk_ms=20, realtime=realtime, sample_rate_hz=16000):
        yield _pcm16(chunk)


def _pcm16(samples: np.ndarray) -> np.ndarray:
    if samples.dtype == np.int16:
        return samples
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype(np.int16)


async def _open_transport(args: argparse.Namespace, pipeline: str) -> Transport:
    from edge_rtgi.server.client import InProcessTransport, WebSocketTransport

    if args.connect:
        return await WebSocketTransport.connect(
            args.connect, args.token or os.environ.get("EDGE_RTGI_TOKEN"), pipeline
        )
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.pipeline.session import Session, SessionSettings

    config, pipelines = _load(args)
    if pipeline not in pipelines:
        raise ConfigError(
            f"no pipeline named {pipeline!r}",
            hint=f"available: {', '.join(pipelines)}; add pipelines/{pipeline}.yaml",
        )
    print(f"edge-rtgi: loading models for {pipeline}...", file=sys.stderr, flush=True)
    session = await Session.open(pipelines, Resources(config.engine), SessionSettings(pipeline=pipeline))
    return InProcessTransport(session)


async def _live(args: argparse.Namespace, mode: str, pipeline: str) -> int:
    from edge_rtgi.audio.wav import write_wav
    from edge_rtgi.server.client import LiveOutput, run_live

    if not args.mic and not args.input:
        raise ConfigError(f"edge-rtgi {mode} needs --mic or --input FILE.wav")
    if args.input and not Path(args.input).is_file():
        raise AudioError(f"input file not found: {args.input}")
    transport = await _open_transport(args, pipeline)
    speaker = None
    output = LiveOutput(mode=mode)
    try:
        async for message in transport.messages():  # session.created tells the output rate
            if message.head["type"] == "session.created":
                output.sample_rate_hz = message.head["audio"]["output_sample_rate_hz"]
                break
        if getattr(args, "no_barge_in", False):
            await transport.send({"type": "session.update", "session": {"barge_in": False}})
        if not args.no_speak and output.sample_rate_hz:
            from edge_rtgi.audio.devices import SpeakerSink

            speaker = SpeakerSink(output.sample_rate_hz, device=args.speaker_device)
            output.speaker = speaker
            if args.mic and not getattr(args, "no_aec", False):
                # the speaker's audio is the echo reference: barge-in hears the user, not the reply
                from edge_rtgi.audio.aec import PlayoutReference

                await transport.send({"type": "session.update", "session": {"echo_reference": True}})
                output.playout = PlayoutReference(16000)
        source = (
            _mic_chunks(args.duration, args.mic_device, on_live=_announce_listening)
            if args.mic
            else _file_chunks(args.input, realtime=args.realtime)
        )
        await run_live(transport, source, output)
        if speaker is not None:  # let the last reply play out (estimated: real time since its first chunk)
            remaining_s = output.playback_end_s - time.monotonic() if output.playback_end_s else 0.0
            await asyncio.sleep(min(max(remaining_s, 0.0) + 0.3, 120.0))
    finally:
        if speaker is not None:
            # PortAudio can stall after an underrun; never let closing it hang the command
            closer = threading.Thread(target=speaker.close, daemon=True)
            closer.start()
            closer.join(5)
        await transport.close()
    if args.out:
        pcm = output.audio_pcm()
        write_wav(args.out, pcm, output.sample_rate_hz or 22050)
        print(
            f"edge-rtgi: wrote {len(pcm) / (output.sample_rate_hz or 22050):.1f} s of audio to {args.out}",
            file=sys.stderr,
        )
    return 1 if output.errors and not output.responses else 0


def cmd_translate(args: argparse.Namespace) -> int:
    pipeline = args.pipeline or f"translate-{args.source_language}-{args.target_language}"
    return asyncio.run(_live(args, "translate", pipeline))


def cmd_voice(args: argparse.Namespace) -> int:
    return asyncio.run(_live(args, "voice", args.pipeline or "voice-assistant"))


# --------------------------------------------------------------------------- parsers


def _live_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--mic", action="store_true", help="listen on the microphone")
    src.add_argument("--input", metavar="FILE.wav", help="stream a WAV file instead of the microphone")
    p.add_argument(
        "--realtime", action="store_true", help="pace --input at real time (default: as fast as it goes)"
    )
    p.add_argument("--duration", type=float, metavar="S", help="stop listening after S seconds (--mic)")
    p.add_argument("--no-speak", action="store_true", help="do not play the audio")
    p.add_argument("--out", metavar="FILE.wav", help="also write the returned audio to this WAV file")
    p.add_argument("--connect", metavar="ws://HOST:PORT/v1/native", help="use a running daemon")
    p.add_argument("--token", help="the daemon's token (default: $EDGE_RTGI_TOKEN)")
    p.add_argument("--pipeline", help="pipeline name (overrides the default)")
    p.add_argument("--config", help="daemon config file, for in-process runs (pipelines, engine)")
    p.add_argument("--mic-device", help="input device name or index (default: the system default)")
    p.add_argument("--speaker-device", help="output device name or index")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run the daemon (WebSockets, OpenAI-compatible API, browser client, metrics)"
    )
    p.add_argument("--config", help="daemon config file (see config/edge-rtgi.yaml)")
    p.add_argument("--host", help="bind address (default 127.0.0.1; others need a token)")
    p.add_argument("--port", type=int, help="port (default 8765; 0 picks a free one)")
    p.add_argument(
        "--wyoming",
        metavar="tcp://127.0.0.1:10300",
        help="also serve Home Assistant's Wyoming protocol here (or unix:///PATH); docs/wyoming.md",
    )
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("translate", help="live speech translation with captions")
    p.add_argument("--from", dest="source_language", default="en", help="spoken language (default en)")
    p.add_argument("--to", dest="target_language", default="es", help="target language (default es)")
    _live_args(p)
    p.set_defaults(func=cmd_translate)

    p = subparsers.add_parser("voice", help="talk to the voice assistant")
    _live_args(p)
    p.add_argument(
        "--no-barge-in",
        action="store_true",
        help="do not cut replies when you speak (for a speaker without echo cancellation)",
    )
    p.add_argument(
        "--no-aec",
        action="store_true",
        help="no echo cancellation of the played reply on the microphone (on by default with --mic)",
    )
    p.set_defaults(func=cmd_voice)
