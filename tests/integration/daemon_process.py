"""``edge-rtgi serve`` in a child process, from this checkout or another one.

The benchmarks compare two checkouts of the daemon in one sitting (``--against PATH``): each
runs as its own process with its own ``PYTHONPATH``, on the same models and the same venv, and
the benchmark plays the same client traffic to both, interleaved.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class DaemonProcess:
    """A daemon child process; ``port`` is known once it prints its serving line."""

    def __init__(
        self,
        checkout: Path,
        pipelines: list[str],
        default_pipeline: str,
        label: str,
        server_settings: str = "",
    ):
        self.checkout, self.label = Path(checkout).resolve(), label
        self._dir = tempfile.TemporaryDirectory(prefix=f"edge-rtgi-{label}-")
        cfg = Path(self._dir.name) / "daemon.yaml"
        files = ", ".join(str(ROOT / "pipelines" / f"{p}.yaml") for p in pipelines)
        # server_settings: more "key: value" pairs, e.g. "max_messages_per_s: 1000000.0"
        server = ", ".join(x for x in ("port: 0", server_settings) if x)
        cfg.write_text(f"pipelines: [{files}]\ndefault_pipeline: {default_pipeline}\nserver: {{{server}}}\n")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_rtgi.cli", "serve", "--config", str(cfg)],
            cwd=self.checkout,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(self.checkout)},
        )
        self.port = 0

    def wait_ready(self) -> int:
        """Block until the daemon serves (models loaded); its port."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if m := re.search(r":(\d+)/v1/native", line):
                self.port = int(m.group(1))
                return self.port
        raise RuntimeError(f"the {self.label} daemon ({self.checkout}) exited before serving")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._dir.cleanup()
