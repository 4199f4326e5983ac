"""Soak the daemon (issue #18): concurrent clients streaming real speech for a bounded time.

Starts ``edge-rtgi serve`` as a child process on loopback (the shipped voice-assistant and
translate-en-es pipelines, or the light test pipelines with ``--light``) and runs ``--clients``
clients (default 8) until ``--minutes`` have passed or ``--max-utterances`` were sent:

- voice clients (native protocol, voice-assistant) and translation clients (native protocol,
  translate-en-es) stream Piper-rendered questions and sentences at real time;
- Realtime clients do the same over ``/v1/realtime`` (base64 PCM16 at 24 kHz);
- now and then a client barges in (starts its next utterance while the reply still plays),
  or disconnects mid-reply and reconnects.

Every utterance carries a sequence number; for each one the script counts final transcripts
and responses and checks there is exactly one of each: none lost, none doubled (an utterance
cut by the client's own disconnect is counted apart, as abandoned). Every ``--sample-s``
seconds it samples the daemon's RSS, open descriptors, threads (``/proc``), KV blocks in use and
engine queue depths (``/metrics``), and at the end it plots them against time.

The idle level that threads, descriptors, KV blocks and sessions must return to is taken after
a warm-up (every client speaks one utterance, all at once) and before the soak: what a daemon
creates once, on first use, and keeps (a model's ONNX session, a codec table) is then part of
it, and anything above it at the end was left behind by the clients. The exit status is 1 when
a turn was lost or doubled, the log holds a traceback, or a figure did not return to idle.

    PYTHONPATH=. flock /tmp/bench.lock python scripts/soak.py --minutes 30 --out docs/reliability
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402

from edge_rtgi.audio.pcm import float32_to_pcm16, pcm16_to_float32, resample  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Name a colour of the rainbow.",
    "What do bees make?",
    "Which planet is closest to the sun?",
    "What is two plus three?",
]
SENTENCES = [
    "The train leaves at nine in the morning.",
    "I would like a cup of coffee, please.",
    "The weather is nice today.",
    "Where is the nearest library?",
]
CHUNK_MS = 40
TRACED = {
    "speech.started",
    "speech.stopped",
    "transcript.final",
    "response.created",
    "response.done",
    "response.interrupted",
    "error",
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "conversation.item.input_audio_transcription.completed",
}
VOICE = "piper-en_US-joe-medium"  # the voice-assistant pipeline's own voice renders the input
EVENT_TIMEOUT_S = 120.0


@dataclass
class Ledger:
    """Per-utterance counts: sequence number -> [final transcripts, responses]."""

    counts: dict[str, list[int]] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)
    barge_ins: int = 0
    disconnects: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)
    # each connection's events and actions, to show what happened around a lost or doubled turn
    traces: dict[str, list[str]] = field(default_factory=dict)
    connection_of: dict[str, str] = field(default_factory=dict)

    def trace(self, connection: str, line: str) -> None:
        self.traces.setdefault(connection, []).append(f"{time.monotonic():.2f} {line}")

    def turn_traces(self, seqs: list[str], limit: int = 5) -> dict[str, list[str]]:
        """The event sequence of the connection that carried each of the first ``limit`` turns."""
        return {s: self.traces.get(self.connection_of.get(s, ""), [])[-200:] for s in seqs[:limit]}

    def summary(self) -> dict:
        judged = {k: v for k, v in self.counts.items() if k not in self.abandoned}
        return {
            "utterances": len(self.counts),
            "abandoned_by_client": len(self.abandoned),
            "judged": len(judged),
            "lost_transcripts": sum(1 for f, _ in judged.values() if f == 0),
            "doubled_transcripts": sum(1 for f, _ in judged.values() if f > 1),
            "lost_responses": sum(1 for _, r in judged.values() if r == 0),
            "doubled_responses": sum(1 for _, r in judged.values() if r > 1),
            "barge_ins": self.barge_ins,
            "disconnects_mid_reply": self.disconnects,
            "reconnects": self.reconnects,
            "lost": sorted(k for k, v in judged.items() if min(v) == 0)[:20],
            "doubled": sorted(k for k, v in judged.items() if max(v) > 1)[:20],
            "client_errors": self.errors[:20],
            "traces": self.turn_traces(sorted(k for k, v in judged.items() if min(v) == 0 or max(v) > 1)),
        }


def render(texts: list[str]) -> dict[str, np.ndarray]:
    """Each text spoken by the catalogue Piper voice, int16 PCM at 16 kHz with silence after."""
    from edge_rtgi.tts import make_tts

    voice = make_tts(VOICE)
    out = {}
    for text in texts:
        pcm = np.concatenate(list(voice.synthesize_stream(text)))
        audio = resample(pcm16_to_float32(pcm), voice.sample_rate_hz, 16000)
        audio = np.concatenate([np.zeros(4800, np.float32), audio, np.zeros(16000, np.float32)])
        out[text] = float32_to_pcm16(audio)
    return out


def _describe(event: dict) -> str:
    """One line for a traced server event: its type and the fields that tie it to a turn."""
    keys = ("turn_id", "response_id", "item_id", "status", "reason", "backchannel", "end_reason", "code")
    parts = [event["type"]] + [f"{k}={event[k]}" for k in keys if k in event]
    if isinstance(event.get("response"), dict):
        parts.append(f"response={event['response'].get('id')} status={event['response'].get('status')}")
    for k in ("text", "transcript", "message"):
        if k in event:
            parts.append(f"{k}={str(event[k])[:80]!r}")
    return " ".join(parts)


async def stream_pcm(send, pcm: np.ndarray, rate_hz: int) -> None:
    step = rate_hz * CHUNK_MS // 1000
    t0 = time.monotonic()
    for i in range(0, len(pcm), step):
        await send(pcm[i : i + step])
        delay = t0 + (i + step) / rate_hz - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


class NativeSoakClient:
    def __init__(self, name: str, port: int, pipeline: str, texts: list[str], speech, ledger: Ledger, rng):
        self.name, self.port, self.pipeline = name, port, pipeline
        self.texts, self.speech, self.ledger, self.rng = texts, speech, ledger, rng
        self.seq = 0
        self.connections = 0

    def _connection(self) -> str:
        self.connections += 1
        return f"{self.name}/c{self.connections}"

    async def run(self, deadline: float, budget: list[int]) -> None:
        while time.monotonic() < deadline and budget[0] > 0:
            try:
                await self._session(deadline, budget)
            except (ConnectionClosed, InvalidStatus, OSError, asyncio.TimeoutError) as exc:
                self.ledger.errors.append(f"{self.name}: {type(exc).__name__} {exc}"[:200])
            self.ledger.reconnects += 1

    async def _session(self, deadline: float, budget: list[int]) -> None:
        url = f"ws://127.0.0.1:{self.port}/v1/native?pipeline={self.pipeline}"
        conn = self._connection()
        log = self.ledger.trace
        async with connect(url, max_size=None) as ws:
            created = json.loads(await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S))
            assert created["type"] == "session.created", created
            turn_seq: dict[int, str] = {}  # the daemon's turn id -> our sequence number
            by_response: dict[str, str] = {}  # response id -> our sequence number
            pending: list[str] = []  # utterances sent, no final transcript yet
            sent: list[str] = []  # this connection's utterances, in order
            done = asyncio.Event()

            async def reader() -> None:
                async for message in ws:
                    if isinstance(message, bytes):
                        continue
                    e = json.loads(message)
                    kind = e["type"]
                    if kind in TRACED:
                        log(conn, _describe(e))
                    if kind == "transcript.final":
                        if pending:
                            seq = pending.pop(0)
                            turn_seq[e["turn_id"]] = seq
                            self.ledger.counts[seq][0] += 1
                        else:  # a final nobody asked for: count it against the last one
                            last = next(reversed(turn_seq.values()), None)
                            if last:
                                self.ledger.counts[last][0] += 1
                    elif kind == "response.created":
                        seq = turn_seq.get(e.get("turn_id") or -1)
                        if seq is not None:
                            by_response[e["response_id"]] = seq
                    elif kind == "response.done":
                        seq = by_response.get(e["response_id"])
                        if seq is not None:
                            self.ledger.counts[seq][1] += 1
                        done.set()

            read = asyncio.create_task(reader())
            try:
                while time.monotonic() < deadline and budget[0] > 0:
                    budget[0] -= 1
                    text = self.rng.choice(self.texts)
                    self.seq += 1
                    seq = f"{self.name}#{self.seq}"
                    self.ledger.counts[seq] = [0, 0]
                    self.ledger.connection_of[seq] = conn
                    pending.append(seq)
                    sent.append(seq)
                    done.clear()
                    log(conn, f"send {seq} {text!r}")

                    async def send(chunk):
                        await ws.send(chunk.astype("<i2").tobytes())

                    await stream_pcm(send, self.speech[text], 16000)
                    roll = self.rng.random()
                    if roll < 0.1:  # disconnect mid-reply
                        await self._disconnect_mid_reply(seq, sent, by_response)
                        log(conn, f"disconnect after {seq}")
                        return
                    if roll < 0.3:  # barge in: the next utterance starts while this one's reply plays
                        try:
                            await asyncio.wait_for(
                                self._until(lambda s=seq: s in by_response.values()), EVENT_TIMEOUT_S
                            )
                            self.ledger.barge_ins += 1
                            log(conn, f"barge in after {seq}")
                            continue
                        except asyncio.TimeoutError:
                            pass
                    await asyncio.wait_for(done.wait(), EVENT_TIMEOUT_S)
                await self._all_answered(sent)
            finally:
                read.cancel()

    async def _disconnect_mid_reply(self, seq: str, sent: list[str], by_response: dict[str, str]) -> None:
        """Before a disconnect mid-reply: the earlier turns are answered and ``seq``'s reply has
        started; only ``seq`` is then abandoned. (Waiting for "some reply playing" cut earlier
        turns too: a translation is not interrupted by the next utterance, so under load the
        previous turn's translation was often still in flight, and was counted lost.)"""
        counts = self.ledger.counts

        def ready() -> bool:
            return seq in by_response.values() and all(min(counts[s]) >= 1 for s in sent[:-1])

        try:
            await asyncio.wait_for(self._until(ready), EVENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass  # an earlier turn that never ends stays judged, and counts as lost
        self.ledger.abandoned.add(seq)
        self.ledger.disconnects += 1

    async def _all_answered(self, sent: list[str]) -> None:
        """Before a planned close: every utterance sent has its final transcript and its
        response is done. (Waiting for "no transcript pending and no reply playing" closed
        now and then in the moment between a final and its response.created, and the reply,
        cut by the close, was counted lost.) A turn that never ends times out: counted lost."""
        counts = self.ledger.counts
        await asyncio.wait_for(self._until(lambda: all(min(counts[s]) >= 1 for s in sent)), EVENT_TIMEOUT_S)
        await asyncio.sleep(1.0)  # a doubled transcript or response would arrive now

    @staticmethod
    async def _until(predicate) -> None:
        while not predicate():
            await asyncio.sleep(0.02)


class RealtimeSoakClient(NativeSoakClient):
    async def _session(self, deadline: float, budget: list[int]) -> None:
        url = f"ws://127.0.0.1:{self.port}/v1/realtime?model={self.pipeline}"
        conn = self._connection()
        log = self.ledger.trace
        async with connect(url, max_size=None) as ws:
            created = json.loads(await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S))
            assert created["type"] == "session.created", created
            pending: list[str] = []
            sent: list[str] = []
            awaiting: list[str] = []  # transcribed, no response yet (one auto response each, in order)
            by_response: dict[str, str] = {}
            done = asyncio.Event()

            async def reader() -> None:
                async for message in ws:
                    e = json.loads(message)
                    kind = e["type"]
                    if kind in TRACED:
                        log(conn, _describe(e))
                    if kind == "conversation.item.input_audio_transcription.completed":
                        if pending:
                            seq = pending.pop(0)
                            awaiting.append(seq)
                            self.ledger.counts[seq][0] += 1
                    elif kind == "response.created":
                        if awaiting:
                            by_response[e["response"]["id"]] = awaiting.pop(0)
                    elif kind == "response.done":
                        seq = by_response.get(e["response"]["id"])
                        if seq is not None:
                            self.ledger.counts[seq][1] += 1
                        done.set()

            read = asyncio.create_task(reader())
            try:
                while time.monotonic() < deadline and budget[0] > 0:
                    budget[0] -= 1
                    text = self.rng.choice(self.texts)
                    self.seq += 1
                    seq = f"{self.name}#{self.seq}"
                    self.ledger.counts[seq] = [0, 0]
                    self.ledger.connection_of[seq] = conn
                    pending.append(seq)
                    sent.append(seq)
                    done.clear()
                    log(conn, f"send {seq} {text!r}")
                    pcm24 = float32_to_pcm16(resample(pcm16_to_float32(self.speech[text]), 16000, 24000))

                    async def send(chunk):
                        audio = base64.b64encode(chunk.astype("<i2").tobytes()).decode()
                        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))

                    await stream_pcm(send, pcm24, 24000)
                    roll = self.rng.random()
                    if roll < 0.1:
                        await self._disconnect_mid_reply(seq, sent, by_response)
                        log(conn, f"disconnect after {seq}")
                        return
                    await asyncio.wait_for(done.wait(), EVENT_TIMEOUT_S)
                await self._all_answered(sent)
            finally:
                read.cancel()


# --------------------------------------------------------------------------- daemon and samples


def start_daemon(
    folder: Path, light: bool, trace_heap: bool = False, wrap: str = ""
) -> tuple[subprocess.Popen, int, int]:
    """Start the daemon (under ``wrap``, a profiler's command line, if given); the process, the
    daemon's port and the daemon's own pid (a wrapper's child, where there is a wrapper)."""
    # The caller's PYTHONPATH stays after ours (a diagnostic sitecustomize, for instance).
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    if trace_heap:
        env["EDGE_RTGI_TRACEMALLOC_DIR"] = str(folder / "heap")
    if light:
        cmd = [sys.executable, "-m", "tests.fuzz.harness", str(folder), "tiny-voice", "16"]
    else:
        config = folder / "soak.yaml"
        config.write_text("server:\n  port: 0\n  max_sessions: 16\n")
        cmd = [sys.executable, "-m", "edge_rtgi.cli", "serve", "--config", str(config)]
    cmd = shlex.split(wrap) + cmd
    log = open(folder / "daemon.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"PORT (\d+)|ws://[^:]+:(\d+)/v1/native", line)
        if m:
            return proc, int(m.group(1) or m.group(2)), _python_descendant(proc.pid) if wrap else proc.pid
    raise SystemExit(f"the daemon did not start; see {folder / 'daemon.log'}")


def _python_descendant(pid: int) -> int:
    """The first process under ``pid`` (breadth first) that runs this interpreter: the daemon
    itself when a wrapper such as heaptrack started it."""
    queue = [pid]
    while queue:
        cur = queue.pop(0)
        if cur != pid and Path(f"/proc/{cur}/exe").resolve() == Path(sys.executable).resolve():
            return cur
        children = Path(f"/proc/{cur}/task/{cur}/children")
        queue += [int(c) for c in children.read_text().split()] if children.exists() else []
    raise SystemExit(f"no Python process under the wrapper (pid {pid})")


def rss_trend_mb_per_min(samples: list[dict], t0: float) -> float:
    """The least-squares slope of RSS against time over ``samples``, in MB per minute."""
    if len(samples) < 2:
        return 0.0
    xs = [(s["t_s"] - t0) / 60 for s in samples]
    ys = [s["rss_mb"] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def rss_minute_medians(samples: list[dict], t0: float) -> list[float]:
    """RSS medians of each whole minute from ``t0`` on: jemalloc gives pages back in bursts, so
    single samples swing by 100 MB or more within a minute around a level that does not."""
    minutes: dict[int, list[float]] = {}
    for s in samples:
        minutes.setdefault(int((s["t_s"] - t0) // 60), []).append(s["rss_mb"])
    return [statistics.median(minutes[m]) for m in sorted(minutes)]


def sample(pid: int, port: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()

    def total(name: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    return {
        "t_s": time.monotonic(),
        "rss_mb": rss_kb / 1024,
        "threads": threads,
        "fds": fds,
        "kv_blocks_used": total("edge_rtgi_engine_kv_blocks_used"),
        "running": total("edge_rtgi_engine_running_requests"),
        "waiting": total("edge_rtgi_engine_waiting_requests"),
        "sessions": total("edge_rtgi_sessions_active"),
        "gc_collected": total("edge_rtgi_gc_collected_objects_total"),  # the daemon's collections
    }


async def sampler(pid: int, port: int, every_s: float, out: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        out.append(await asyncio.to_thread(sample, pid, port))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def settle(samples: list[dict], every_s: float, limit_s: float = 60.0) -> None:
    """Wait until the daemon is idle: no session open, no KV block in use, and two samples in a
    row with the same thread and descriptor counts (closed sessions end their threads after the
    close returns), or ``limit_s`` has passed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        await asyncio.sleep(every_s)
        last, before = samples[-1], samples[-2]
        if (
            last["sessions"] == 0
            and last["kv_blocks_used"] == 0
            and all(last[k] == before[k] for k in ("threads", "fds"))
        ):
            return


async def _heap_snapshot(pid: int, folder: Path, delay_s: float) -> Path | None:
    """Ask the daemon (started with ``--trace-heap``) for a tracemalloc snapshot; its path."""
    await asyncio.sleep(delay_s)
    heap = folder / "heap"
    before = set(heap.glob("*.tracemalloc"))
    os.kill(pid, signal.SIGUSR2)
    for _ in range(600):  # a snapshot of a large traced heap takes seconds
        await asyncio.sleep(0.5)
        new = set(heap.glob("*.tracemalloc")) - before
        if new:
            await asyncio.sleep(2.0)  # written in one dump() call; let it finish
            return new.pop()
    return None


def heap_diff(first: Path, last: Path, top: int = 15) -> dict:
    """What grew between two snapshots: total traced MB, and the largest growth by traceback."""
    import tracemalloc

    a, b = tracemalloc.Snapshot.load(str(first)), tracemalloc.Snapshot.load(str(last))
    stats = b.compare_to(a, "traceback")
    return {
        "traced_mb": [round(sum(s.size for s in x.statistics("filename")) / 2**20, 1) for x in (a, b)],
        "top": [
            {
                "size_diff_kb": round(s.size_diff / 1024, 1),
                "count_diff": s.count_diff,
                "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback[-4:]],
            }
            for s in stats[:top]
        ],
    }


def plot(samples: list[dict], path: Path, title: str, idle_t_s: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0]["t_s"]
    minutes = [(s["t_s"] - t0) / 60 for s in samples]
    keys = [
        ("rss_mb", "RSS (MB)"),
        ("fds", "open fds"),
        ("threads", "threads"),
        ("kv_blocks_used", "KV blocks in use"),
        ("waiting", "engine waiting"),
        ("sessions", "sessions"),
    ]
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2 * len(keys)), sharex=True)
    for ax, (key, label) in zip(axes, keys, strict=True):
        ax.plot(minutes, [s[key] for s in samples])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if idle_t_s is not None:  # the idle level: after the warm-up, before the soak
            ax.axvline((idle_t_s - t0) / 60, color="grey", linestyle="--", linewidth=1)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


async def soak(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    proc, port, pid = start_daemon(folder, args.light, args.trace_heap, args.wrap)
    voice_pipe, translate_pipe = (
        ("tiny-voice", "tiny-translate") if args.light else ("voice-assistant", "translate-en-es")
    )
    speech = await asyncio.to_thread(render, QUESTIONS + SENTENCES)
    ledger = Ledger()
    samples: list[dict] = []
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(pid, port, args.sample_s, samples, stop))
    await asyncio.sleep(args.sample_s * 2)  # samples of the daemon as started
    started = samples[-1]
    rng = random.Random(args.seed)
    clients = []
    kinds = args.kinds.split(",")
    for i in range(args.clients):
        kind = kinds[i % len(kinds)]
        if kind == "voice":
            clients.append(NativeSoakClient(f"voice{i}", port, voice_pipe, QUESTIONS, speech, ledger, rng))
        elif kind == "translate":
            clients.append(
                NativeSoakClient(f"translate{i}", port, translate_pipe, SENTENCES, speech, ledger, rng)
            )
        elif kind == "realtime":
            clients.append(
                RealtimeSoakClient(f"realtime{i}", port, voice_pipe, QUESTIONS, speech, ledger, rng)
            )
        else:
            raise SystemExit(f"--kinds: unknown client kind {kind!r} (voice, translate, realtime)")
    # warm-up: one utterance per client, all at once (its turns are judged with the rest)
    await asyncio.gather(*(c.run(time.monotonic() + 3 * EVENT_TIMEOUT_S, [1]) for c in clients))
    await settle(samples, args.sample_s)
    idle = samples[-1]
    warm_up_end = len(samples)
    deadline = time.monotonic() + args.minutes * 60
    budget = [args.max_utterances]
    t0 = time.monotonic()
    snapshot_at_5_min = (
        asyncio.create_task(_heap_snapshot(pid, folder, args.heap_first_s)) if args.trace_heap else None
    )
    await asyncio.gather(*(c.run(deadline, budget) for c in clients))
    ran_s = time.monotonic() - t0
    await settle(samples, args.sample_s)
    heap_growth = None
    if snapshot_at_5_min is not None:
        first = await snapshot_at_5_min
        last = await _heap_snapshot(pid, folder, delay_s=0.0)
        heap_growth = heap_diff(first, last) if first and last else None
    stop.set()
    await sampling
    end = samples[-1]
    soak_samples = samples[warm_up_end:]
    os.kill(pid, signal.SIGTERM)
    proc.wait(1800 if args.wrap else 60)  # a profiler may take minutes to write its data
    log_text = (folder / "daemon.log").read_text()
    after5 = [s for s in soak_samples if s["t_s"] - t0 >= 300] or soak_samples[len(soak_samples) // 2 :]
    idle_keys = ("threads", "fds", "kv_blocks_used", "sessions")
    report = {
        "minutes": round(ran_s / 60, 1),
        "clients": args.clients,
        "light": args.light,
        **ledger.summary(),
        "rss_idle_mb": round(idle["rss_mb"], 1),
        "rss_after_5_min_mb": round(after5[0]["rss_mb"], 1),
        "rss_end_mb": round(end["rss_mb"], 1),
        "rss_growth_after_5_min_pct": round(
            100 * (max(s["rss_mb"] for s in after5) / after5[0]["rss_mb"] - 1), 2
        ),
        # A least-squares slope besides the highest sample: an allocator that gives pages back
        # in bursts (jemalloc) swings above and below a level that does not rise.
        "rss_trend_after_5_min_mb_per_min": round(rss_trend_mb_per_min(after5, t0), 2),
        # the highest minute's median after minute 5 against minute 5's (the first after5 minute)
        "rss_growth_after_5_min_pct_minute_medians": round(
            100 * (max(medians) / medians[0] - 1) if (medians := rss_minute_medians(after5, t0)) else 0.0,
            2,
        ),
        "gc_collected_objects": end.get("gc_collected", 0.0),
        "started_idle_end": {k: (started[k], idle[k], end[k]) for k in idle_keys},
        "returned_to_idle": all(end[k] <= idle[k] for k in idle_keys),
        "log_tracebacks": log_text.count("Traceback (most recent call last)"),
        "loadavg_end": os.getloadavg(),
        "log": str(folder / "daemon.log"),
    }
    if heap_growth is not None:
        report["python_heap_growth_after_5_min"] = heap_growth
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps({"report": report, "samples": samples}, indent=1))
        title = f"soak: {args.clients} clients, {report['minutes']} min (dashed: idle level taken)"
        plot(samples, out / "soak.png", title, idle["t_s"])
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-utterances", type=int, default=100_000)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kinds",
        default="voice,translate,realtime",
        help="client kinds, assigned in turn: voice, translate (native protocol), realtime",
    )
    ap.add_argument(
        "--trace-heap",
        action="store_true",
        help="trace the daemon's Python allocations; report what grew after --heap-first-s",
    )
    ap.add_argument(
        "--heap-first-s", type=float, default=300.0, help="with --trace-heap: when the first snapshot is made"
    )
    ap.add_argument("--light", action="store_true", help="the light test pipelines (tiny models)")
    ap.add_argument(
        "--wrap",
        default="",
        help="run the daemon under this command, e.g. 'heaptrack -o DIR/daemon' (diagnosis only: "
        "a profiler slows the daemon, so its latencies and turn counts are not comparable)",
    )
    ap.add_argument("--out", help="folder for soak.json and soak.png")
    args = ap.parse_args()
    if args.trace_heap and args.light:
        ap.error("--trace-heap needs the real daemon (edge-rtgi serve), not --light")
    report = asyncio.run(soak(args))
    print(json.dumps(report, indent=2))
    bad = sum(
        report[k] for k in ("lost_transcripts", "doubled_transcripts", "lost_responses", "doubled_responses")
    )
    return 0 if bad == 0 and report["log_tracebacks"] == 0 and report["returned_to_idle"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
