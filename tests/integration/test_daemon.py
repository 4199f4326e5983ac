"""``edge-rtgi serve`` as a process: systemd readiness, SIGTERM drain, start-up refusals,
and the systemd unit itself."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from tests.integration.native_client import NativeClient

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "edge_rtgi.cli"]


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies():
    unit = ROOT / "systemd" / "edge-rtgi.service"
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = unit.read_text()
    for line in (
        "Type=notify",
        "Restart=on-failure",
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "ProtectHome=yes",
        "--config /etc/edge-rtgi/edge-rtgi.yaml",
    ):
        assert line in text


def test_non_loopback_bind_without_token_refuses_to_start():
    out = run_cli("serve", "--host", "0.0.0.0", "--port", "0", env={"EDGE_RTGI_TOKEN": ""})
    assert out.returncode == 2
    assert "refusing to listen on 0.0.0.0" in out.stderr and "Traceback" not in out.stderr


def test_pipeline_typo_fails_at_start_with_the_line(tmp_path):
    pipes = tmp_path / "pipelines"
    pipes.mkdir()
    (pipes / "mine.yaml").write_text(
        "name: mine\nstages:\n  - asr:\n      model: whisper-tiny.en\n      lenguage: en\n"
    )
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("pipelines: [pipelines]\ndefault_pipeline: mine\n")
    out = run_cli("serve", "--config", str(cfg), "--port", "0")
    assert out.returncode == 2
    assert f"{pipes / 'mine.yaml'}:5: unknown key 'lenguage'" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.asyncio
async def test_serve_notifies_systemd_and_drains_on_sigterm(tmp_path):
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.setblocking(False)
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(
        f"pipelines: [{ROOT / 'pipelines' / 'translate-en-es.yaml'}]\n"
        "default_pipeline: translate-en-es\nserver: {port: 0, drain_timeout_s: 20}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "serve",
        "--config",
        str(cfg),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
    )
    loop = asyncio.get_running_loop()
    try:
        ready = await asyncio.wait_for(loop.sock_recv(notify, 4096), 240)
        assert ready.decode().startswith("READY=1")
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
        port = int(re.search(r":(\d+)/v1/native", line).group(1))
        c = await NativeClient.open(port)
        await c.wait_type("session.created")
        await c.send(type="text.input", text="The weather is nice today and I am going to the beach.")
        await c.wait_type("response.created")
        proc.send_signal(signal.SIGTERM)
        stopping = await asyncio.wait_for(loop.sock_recv(notify, 4096), 30)
        assert stopping.decode() == "STOPPING=1"
        # the response in flight finishes before the connection is closed
        done = await c.wait_type("response.done", timeout=60)
        assert done["status"] == "completed" and done["text"]
        await asyncio.wait_for(c.ws.wait_closed(), 30)
        assert c.ws.close_code == 1001
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        # new connections are refused once it is gone
        with pytest.raises(OSError):
            async with connect(f"ws://127.0.0.1:{port}/v1/native", open_timeout=5):
                pass
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        notify.close()


def test_onnxruntime_keeps_no_device_id_and_queues_no_telemetry(tmp_path):
    """Found by the soak: the first ONNX model load opened a telemetry event database (three
    descriptors) and wrote a device id under ~/.cache/Microsoft; onnxruntime's Linux builds
    upload those events. Importing edge_rtgi opts out before onnxruntime starts."""
    from edge_rtgi.catalog.cache import cache_dir

    env = {k: v for k, v in os.environ.items() if k not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    env.update(HOME=str(tmp_path), EDGE_RTGI_MODEL_DIR=str(cache_dir()))
    load = "from edge_rtgi.asr.vad import SileroVad; SileroVad().reset(); print('loaded')"
    out = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr
    assert not (tmp_path / ".cache" / "Microsoft").exists()
