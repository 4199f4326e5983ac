"""A headless Chromium driven over the DevTools protocol, with the ``websockets`` client.

Debian's Chromium (``/usr/bin/chromium``), started with a fake microphone that plays a WAV file;
no browser download and no driver package. Only what the browser-client test needs:
navigate, evaluate JavaScript (as a user gesture when asked), wait for a condition, screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The system Chromium, or None."""
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


class Browser:
    """One headless Chromium process and a DevTools session on its first page."""

    def __init__(self, proc: subprocess.Popen, ws: ClientConnection):
        self.proc, self.ws = proc, ws
        self._ids = itertools.count(1)
        self.console: list[str] = []

    @classmethod
    async def launch(cls, profile_dir: Path, mic_wav: Path, size: tuple[int, int] = (1000, 700)) -> Browser:
        exe = find_chromium()
        if exe is None:
            raise RuntimeError("no Chromium found (apt-get install chromium)")
        args = [
            exe,
            "--headless=new",
            "--no-sandbox",  # root in CI containers; the page is our own, on loopback
            "--disable-gpu",
            "--no-first-run",
            "--mute-audio",  # playback still runs (and its clock advances); nothing reaches a speaker
            "--autoplay-policy=no-user-gesture-required",
            "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={mic_wav}%noloop",
            f"--user-data-dir={profile_dir}",
            f"--window-size={size[0]},{size[1]}",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        assert proc.stderr is not None
        url = await asyncio.to_thread(_devtools_url, proc)
        port = int(re.search(r":(\d+)/", url).group(1))  # type: ignore[union-attr]
        targets = await asyncio.to_thread(_json_list, port)
        page = next(t for t in targets if t["type"] == "page")
        ws = await connect(page["webSocketDebuggerUrl"], max_size=64 << 20)
        browser = cls(proc, ws)
        await browser.send("Page.enable")
        await browser.send("Runtime.enable")
        return browser

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile: console lines kept)."""
        msg_id = next(self._ids)
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            if msg.get("method") == "Runtime.consoleAPICalled":
                args = msg["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:500])

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", timeout_s=30)

    async def eval(self, expression: str, user_gesture: bool = False) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        result = await self.send(
            "Runtime.evaluate",
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
            userGesture=user_gesture,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float, poll_s: float = 0.2) -> Any:
        """Poll until the expression is truthy; its value. A timeout names the expression."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {expression}")
            await asyncio.sleep(poll_s)

    async def screenshot(self, path: Path) -> Path:
        data = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    async def close(self) -> None:
        try:
            await self.ws.close()
        finally:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _devtools_url(proc: subprocess.Popen) -> str:
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"DevTools listening on (ws://\S+)", line):
            # keep reading stderr in the background so that the browser never blocks on it
            import threading

            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return m.group(1)
    raise RuntimeError("Chromium exited before DevTools started:\n" + "".join(lines[-20:]))


def _json_list(port: int) -> list[dict[str, Any]]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
        return json.loads(resp.read())


def environment_ok() -> bool:
    """Chromium present, and not told to stay off (EDGE_RTGI_NO_BROWSER=1)."""
    return find_chromium() is not None and os.environ.get("EDGE_RTGI_NO_BROWSER") != "1"
