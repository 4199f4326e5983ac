"""Daemon metrics in the Prometheus text format (version 0.0.4), without a dependency.

Counters and gauges live here; engine statistics are pulled from the engine when
``/metrics`` is scraped, so the numbers are always current.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels
    )
    return "{" + inner + "}"


class Metrics:
    """A tiny registry: ``inc``/``set`` by name and labels, ``render`` for /metrics."""

    def __init__(self) -> None:
        self._values: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._meta: dict[str, tuple[str, str]] = {}
        self._collectors: list[Callable[[Metrics], None]] = []

    def describe(self, name: str, kind: str, help_text: str) -> None:
        self._meta[name] = (kind, help_text)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self._values[name][key] = self._values[name].get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self._values[name][tuple(sorted(labels.items()))] = float(value)

    def get(self, name: str, **labels: str) -> float:
        return self._values.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def add_collector(self, fn: Callable[[Metrics], None]) -> None:
        """``fn(metrics)`` runs before each render (e.g. to copy engine stats)."""
        self._collectors.append(fn)

    def render(self) -> str:
        for fn in self._collectors:
            fn(self)
        lines = []
        for name in sorted(self._values):
            kind, help_text = self._meta.get(name, ("gauge", name))
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in sorted(self._values[name].items()):
                text = repr(float(value)) if value != int(value) else str(int(value))
                lines.append(f"{name}{_labels(labels)} {text}")
        return "\n".join(lines) + "\n"


def daemon_metrics() -> Metrics:
    """A registry with the daemon's own series described."""
    m = Metrics()
    for name, kind, text in [
        ("edge_rtgi_sessions_active", "gauge", "WebSocket sessions open now"),
        ("edge_rtgi_sessions_total", "counter", "Sessions opened since start"),
        ("edge_rtgi_connections_rejected_total", "counter", "Connections refused, by reason"),
        ("edge_rtgi_errors_total", "counter", "error events sent to clients, by code"),
        ("edge_rtgi_responses_total", "counter", "Responses finished, by status"),
        ("edge_rtgi_audio_in_seconds_total", "counter", "Seconds of user audio received"),
        ("edge_rtgi_audio_out_seconds_total", "counter", "Seconds of synthesised audio sent"),
        ("edge_rtgi_voice_to_voice_ms_sum", "counter", "Sum of end-of-speech to first-audio latencies"),
        ("edge_rtgi_voice_to_voice_ms_count", "counter", "Number of voice-to-voice latencies summed"),
        ("edge_rtgi_engine_steps_total", "counter", "LLM engine steps run"),
        (
            "edge_rtgi_engine_scheduled_requests_total",
            "counter",
            "Sum over engine steps of the requests each step ran (divide by steps: batch size)",
        ),
        ("edge_rtgi_engine_requests_per_step", "gauge", "Mean LLM requests scheduled per engine step"),
        ("edge_rtgi_engine_max_requests_per_step", "gauge", "Most LLM requests in one engine step"),
        ("edge_rtgi_engine_running_requests", "gauge", "LLM requests running now"),
        ("edge_rtgi_engine_kv_blocks_used", "gauge", "KV cache blocks in use"),
        ("edge_rtgi_engine_kv_blocks_total", "gauge", "KV cache blocks in the pool"),
        ("edge_rtgi_up", "gauge", "1 while the daemon serves"),
    ]:
        m.describe(name, kind, text)
    m.set("edge_rtgi_up", 1)
    return m
