#!/usr/bin/env python
"""WebSocket message throughput of the daemon's native protocol: pings and their pongs.

Each message goes the whole way a client event and a session event go: the server's WebSocket
reader, the protocol codec, the session's control lane, its writer and the codec again; no model
runs. Two figures per round, on one fresh connection each:

- round trips per second: one ``ping`` in flight at a time (latency-bound);
- pipelined pongs per second: ``--window`` pings in flight (throughput-bound);
- the daemon process's CPU time per message (user + system, from /proc), over both phases: on a
  shared machine the wall-clock rates swing with other jobs, its CPU cost much less.

With ``--against PATH`` a second daemon runs from another checkout (for example the commit
before a change, from ``git worktree add /tmp/base <commit>``), and rounds alternate between the
two in ABBA order; the report gives each one's medians and the ratio this / other, with the
load average. The daemons run as child processes (``edge-rtgi serve``, transcription pipeline).

    .venv/bin/python scripts/bench_ws.py --rounds 7 --against /tmp/base-http
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import connect  # noqa: E402

from tests.integration.daemon_process import DaemonProcess  # noqa: E402


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _recv(ws, timeout_s: float = 30.0) -> str:
    """The next message, or a clear error instead of waiting for ever on a dropped reply."""
    try:
        return await asyncio.wait_for(ws.recv(), timeout_s)
    except TimeoutError:
        raise SystemExit(
            f"no reply within {timeout_s:.0f} s: the daemon dropped messages (a checkout with a "
            "per-connection message-rate limit needs server.max_messages_per_s raised)"
        ) from None


async def one_round(port: int, pid: int, round_trips: int, pipelined: int, window: int) -> dict[str, float]:
    async with connect(f"ws://127.0.0.1:{port}/v1/native", max_size=1 << 22) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        cpu0 = cpu_s(pid)
        t0 = time.perf_counter()
        for i in range(round_trips):
            await ws.send(json.dumps({"type": "ping", "id": i}))
            while json.loads(await _recv(ws)).get("type") != "pong":
                pass
        rt_s = time.perf_counter() - t0

        async def reader() -> None:
            seen = 0
            while seen < pipelined:
                if json.loads(await _recv(ws)).get("type") == "pong":
                    seen += 1
                    credit.release()

        credit = asyncio.Semaphore(window)
        t1 = time.perf_counter()
        task = asyncio.create_task(reader())
        for i in range(pipelined):
            await credit.acquire()
            await ws.send(json.dumps({"type": "ping", "id": i}))
        await task
        pipe_s = time.perf_counter() - t1
        cpu = cpu_s(pid) - cpu0
    return {
        "round_trips_per_s": round_trips / rt_s,
        "pipelined_per_s": pipelined / pipe_s,
        "server_cpu_us_per_message": 1e6 * cpu / (round_trips + pipelined),
    }


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="rounds per daemon (default 7)")
    ap.add_argument("--round-trips", type=int, default=2000, help="sequential pings per round")
    ap.add_argument("--pipelined", type=int, default=5000, help="pipelined pings per round")
    ap.add_argument("--window", type=int, default=64, help="pings in flight when pipelined")
    ap.add_argument("--against", metavar="PATH", help="another checkout to compare with, in the same run")
    ap.add_argument("--out", help="write the rows and medians as JSON here")
    args = ap.parse_args()
    # this checkout's per-connection message-rate limit (issue 18) would drop the pipelined pings;
    # a checkout from before that limit knows no such key, so only this one gets it raised
    daemons = [DaemonProcess(ROOT, ["transcribe"], "transcribe", "this", "max_messages_per_s: 1000000000.0")]
    if args.against:
        daemons.append(DaemonProcess(Path(args.against), ["transcribe"], "transcribe", "other"))
    loads = [os.getloadavg()[0]]
    try:
        for d in daemons:
            await asyncio.to_thread(d.wait_ready)
        for d in daemons:  # warm-up round each, not counted
            await one_round(d.port, d.proc.pid, 200, 500, args.window)
        rows: dict[str, list[dict[str, float]]] = {d.label: [] for d in daemons}
        for r in range(args.rounds):
            order = daemons if r % 2 == 0 else daemons[::-1]  # ABBA: neither always goes first
            for d in order:
                row = await one_round(d.port, d.proc.pid, args.round_trips, args.pipelined, args.window)
                rows[d.label].append(row)
                loads.append(os.getloadavg()[0])
    finally:
        for d in daemons:
            d.stop()
    med = {label: summary(r) for label, r in rows.items()}
    print(f"bench_ws: {args.rounds} rounds per daemon, load average {min(loads):.1f}-{max(loads):.1f}")
    for label, m in med.items():
        rt, pipe, cpu = m["round_trips_per_s"], m["pipelined_per_s"], m["server_cpu_us_per_message"]
        print(f"  {label:5s}  round trips {rt:8.0f}/s  pipelined {pipe:8.0f}/s  server CPU {cpu:6.1f} us/msg")
    if "other" in med:
        for k in ("round_trips_per_s", "pipelined_per_s", "server_cpu_us_per_message"):
            ratios = [a[k] / b[k] for a, b in zip(rows["this"], rows["other"], strict=True)]
            print(
                f"  {k}: this / other = {med['this'][k] / med['other'][k]:.3f} (medians); "
                f"per round {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "medians": med, "load_average": loads}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
