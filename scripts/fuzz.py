"""Fuzz both WebSocket protocols of a real daemon on loopback (issue #18).

Starts the light test daemon (whisper tiny.en, a tiny seeded LLM, espeak-ng) in its own
process, then sends hypothesis-generated batches of hostile frames (``tests/fuzz/strategies.py``)
over ``/v1/native`` and ``/v1/realtime`` until each protocol has had ``--frames`` frames. After
each batch the protocol's marker must be answered (or the connection closed cleanly). Reports,
per protocol: frames, batches, error events, clean closes, bad closes, hung sessions; and for the
daemon: whether it is still alive and healthy, the tracebacks and ERROR lines in its log, and
whether a valid request still works afterwards.

    PYTHONPATH=. python scripts/fuzz.py --frames 10000 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.fuzz.harness import FuzzClient, Outcome  # noqa: E402
from tests.fuzz.strategies import native_frames, realtime_frames  # noqa: E402


def start_daemon(folder: Path, log_path: Path, pipeline: str) -> tuple[subprocess.Popen, int]:
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fuzz.harness", str(folder), pipeline],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        raise SystemExit(f"the daemon did not start; see {log_path}")
    return proc, int(line.split()[1])


def fuzz(port: int, protocol: str, target_frames: int) -> Outcome:
    client = FuzzClient(port, protocol)
    outcome = Outcome()
    strategy = native_frames if protocol == "native" else realtime_frames
    findings: list[object] = []

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(frames=strategy)
    def batch(frames):
        before = (len(outcome.bad_closes), outcome.hung)
        client.send_batch(frames, outcome)
        if (len(outcome.bad_closes), outcome.hung) != before:
            findings.append(frames)

    while outcome.frames < target_frames:
        batch()
        print(f"  {protocol}: {outcome.frames} frames, {outcome.batches} batches", flush=True)
    client.close()
    outcome.turn_ok = FuzzClient(port, protocol).turn_works()  # type: ignore[attr-defined]
    outcome.findings = [repr(f)[:300] for f in findings[:10]]  # type: ignore[attr-defined]
    return outcome


def healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            return resp.status
    except Exception:  # noqa: BLE001 - a dead daemon is a finding, not a script error
        return 0


def main() -> int:
    warnings.filterwarnings("ignore", module="hypothesis")  # huge examples' reprs, not findings
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=10_000, help="frames per protocol")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument(
        "--pipeline",
        default="tiny-chat",
        choices=["tiny-chat", "tiny-voice"],
        help="the sessions' default pipeline (tiny-chat: no TTS, more frames a minute)",
    )
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fuzz-"))
    log_path = folder / "daemon.log"
    t0 = time.monotonic()
    proc, port = start_daemon(folder, log_path, args.pipeline)
    report: dict[str, object] = {"frames_per_protocol": args.frames, "pipeline": args.pipeline}
    try:
        for protocol in ("native", "realtime"):
            o = fuzz(port, protocol, args.frames)
            report[protocol] = {
                "frames": o.frames,
                "batches": o.batches,
                "error_events": o.error_events,
                "clean_closes": o.clean_closes,
                "bad_closes": len(o.bad_closes),
                "hung_sessions": o.hung,
                "valid_request_after": o.turn_ok,  # type: ignore[attr-defined]
                "findings": o.findings,  # type: ignore[attr-defined]
            }
        report["daemon_alive"] = proc.poll() is None
        report["healthz"] = healthz(port)
    finally:
        proc.terminate()
        proc.wait(30)
    text = log_path.read_text()
    lines = text.splitlines()
    report["log_tracebacks"] = text.count("Traceback (most recent call last)")
    report["log_errors"] = sum(1 for line in lines if " ERROR " in line or " CRITICAL " in line)
    report["log_file"] = str(log_path)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["loadavg"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = (
        report["daemon_alive"]
        and report["healthz"] == 200
        and report["log_tracebacks"] == 0
        and report["log_errors"] == 0
        and all(
            r["bad_closes"] == 0 and r["hung_sessions"] == 0 and r["valid_request_after"]  # type: ignore[index]
            for r in (report["native"], report["realtime"])
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
