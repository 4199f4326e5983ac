"""The fuzzing harness: a light daemon on its own thread, and a synchronous client that sends a
batch of hostile frames, then a marker the protocol must answer, and judges the outcome.

After every batch the connection is either still usable (the marker is answered) or was closed
cleanly by the server (1000, 1001, 1008 policy or 1009 too big); anything else, a 1011, an
abnormal close, a marker never answered (a hung session) or an ERROR or traceback in the
daemon's log, is a finding. ``Outcome`` counts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.integration.light_daemon import light_daemon, tiny_model, tracebacks

CLEAN_CLOSE_CODES = {1000, 1001, 1008, 1009}
MARKER_TIMEOUT_S = 60.0


class LogRecorder(logging.Handler):
    """Keeps every record of the daemon's loggers (the fuzzers look for errors and tracebacks)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class ThreadedDaemon:
    """A light daemon served on a background event loop (the fuzz clients are synchronous)."""

    def __init__(self, folder: Path):
        self.log = LogRecorder()
        logging.getLogger("edge_rtgi").addHandler(self.log)
        logging.getLogger("edge_rtgi").setLevel(logging.INFO)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-daemon", daemon=True)
        self._thread.start()
        self.daemon = self.call(self._start(tiny_model(folder)), timeout_s=900)
        self.port = self.daemon.port

    async def _start(self, model: str):
        d = light_daemon(model, max_sessions=4)
        for pipeline in d.pipelines.values():
            await d.resources.prepare(pipeline)
        await d.start()
        return d

    def call(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def sessions(self) -> int:
        async def count() -> int:
            return len(self.daemon.sessions)

        return self.call(count())

    def errors(self) -> list[str]:
        return tracebacks(self.log.records)

    def close(self) -> None:
        self.call(self.daemon.drain(timeout_s=0.5))
        self.daemon.resources.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        logging.getLogger("edge_rtgi").removeHandler(self.log)


@dataclass
class Outcome:
    """Counts over a fuzzing run."""

    frames: int = 0
    batches: int = 0
    error_events: int = 0
    clean_closes: int = 0
    bad_closes: list[str] = field(default_factory=list)
    hung: int = 0

    def ok(self) -> bool:
        return not self.bad_closes and not self.hung


class FuzzClient:
    """One protocol's client: ``send_batch`` sends frames and a marker, and records what came back."""

    def __init__(self, port: int, protocol: str):
        self.port, self.protocol = port, protocol
        self.ws: ClientConnection | None = None
        self._n = 0

    def _connect(self) -> ClientConnection:
        path = "/v1/native" if self.protocol == "native" else "/v1/realtime"
        ws = connect(f"ws://127.0.0.1:{self.port}{path}", max_size=None, open_timeout=60)
        first = json.loads(ws.recv(timeout=MARKER_TIMEOUT_S))
        assert first["type"] == "session.created", first
        return ws

    def _marker(self) -> tuple[str, str]:
        self._n += 1
        mark = f"sync-{self._n}"
        if self.protocol == "native":
            return mark, json.dumps({"type": "ping", "id": mark})
        return mark, json.dumps({"type": "conversation.item.retrieve", "item_id": mark, "event_id": mark})

    def _answers(self, event: dict, mark: str) -> bool:
        if self.protocol == "native":
            return event.get("type") == "pong" and event.get("id") == mark
        return event.get("type") == "error" and (event.get("error") or {}).get("event_id") == mark

    def send_batch(self, frames: list[str | bytes], outcome: Outcome) -> None:
        if self.ws is None:
            self.ws = self._connect()
        ws = self.ws
        mark, marker = self._marker()
        outcome.batches += 1
        try:
            for frame in frames:
                ws.send(frame)
                outcome.frames += 1
            ws.send(marker)
            while True:
                message = ws.recv(timeout=MARKER_TIMEOUT_S)
                if isinstance(message, bytes):
                    continue  # response audio
                event = json.loads(message)
                if event.get("type") == "error":
                    outcome.error_events += 1
                if self._answers(event, mark):
                    return
        except TimeoutError:
            outcome.hung += 1
            self.close()
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            if code in CLEAN_CLOSE_CODES:
                outcome.clean_closes += 1
            else:
                outcome.bad_closes.append(f"close {code}: {exc.rcvd.reason if exc.rcvd else ''}")
            self.ws = None

    def turn_works(self) -> bool:
        """A valid request after the fuzzing: a typed question gets a completed reply."""
        self.close()
        ws = self.ws = self._connect()
        if self.protocol == "native":
            ws.send(json.dumps({"type": "session.update", "session": {"pipeline": "tiny-chat"}}))
            ws.send(json.dumps({"type": "text.input", "text": "Hello there."}))
            done = "response.done"
        else:
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello."}]}
            ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            ws.send(json.dumps({"type": "response.create"}))
            done = "response.done"
        while True:
            message = ws.recv(timeout=MARKER_TIMEOUT_S)
            if isinstance(message, bytes):
                continue
            event = json.loads(message)
            if event["type"] == done:
                status = event["status"] if self.protocol == "native" else event["response"]["status"]
                return status == "completed"

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None


async def _serve_forever(folder: Path, default_pipeline: str, max_sessions: int) -> None:
    from edge_rtgi.server.app import start_worker_pool

    start_worker_pool(asyncio.get_running_loop())  # as ``edge-rtgi serve`` does
    d = light_daemon(tiny_model(folder), default_pipeline=default_pipeline, max_sessions=max_sessions)
    for pipeline in d.pipelines.values():
        await d.resources.prepare(pipeline)
    await d.start()
    print(f"PORT {d.port}", flush=True)
    await asyncio.Event().wait()  # until the fuzzer kills the process


if (
    __name__ == "__main__"
):  # ``python -m tests.fuzz.harness FOLDER [PIPELINE [MAX_SESSIONS]]``: scripts/fuzz.py's daemon
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pipeline = sys.argv[2] if len(sys.argv) > 2 else "tiny-voice"
    max_sessions = int(sys.argv[3]) if len(sys.argv) > 3 else 4  # the fuzzer: a few sessions at most
    asyncio.run(_serve_forever(Path(sys.argv[1]), pipeline, max_sessions))
