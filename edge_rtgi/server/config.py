"""Daemon configuration (``config/edge-rtgi.yaml``), loaded strictly.

Safe by default: the daemon binds 127.0.0.1; binding anything else without a token is
refused at start-up; browser connections (those that send an ``Origin`` header) are
accepted only from ``allowed_origins``; messages and per-session queues are bounded.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from edge_rtgi.config import load_config
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.engine_config import EngineConfig

MIN_TOKEN_CHARS = 16  # a guessable token is no protection off loopback
DEFAULT_ORIGINS = ("http://localhost", "http://127.0.0.1", "https://localhost", "https://127.0.0.1")


@dataclass(frozen=True)
class ServerConfig:
    """Network and safety limits. ``allowed_origins`` entries match with or without a port."""

    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    token_file: str | None = None
    allowed_origins: tuple[str, ...] = DEFAULT_ORIGINS
    max_message_bytes: int = 1 << 20
    max_sessions: int = 16
    stage_queue_frames: int = 64
    outbox_events: int = 256
    auth_failures_per_min: int = 10  # wrong tokens from one address before it gets 429s
    history_turns: int = 64
    # overload (docs/daemon.md, "Overload"): text API requests answered at once (more get a
    # 503 "busy" at once, so voice sessions keep the engine), client messages per second per
    # connection, and how much faster than real time a client may send audio
    max_text_requests: int = 4
    max_messages_per_s: float = 400.0
    max_audio_speed: float = 4.0
    drain_timeout_s: float = 10.0
    # how often freed C heap memory goes back to the OS while the daemon is in use; 0: never
    heap_trim_interval_s: float = 0.0
    # how often Python's cyclic garbage is collected while the daemon is in use (server/memory.py,
    # CycleCollector); 0 leaves it to the collector's own schedule
    gc_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < 4096:
            raise ValueError("max_message_bytes must be >= 4096")
        if self.max_sessions < 1 or self.stage_queue_frames < 4 or self.outbox_events < 16:
            raise ValueError(
                "max_sessions >= 1, stage_queue_frames >= 4 and outbox_events >= 16 are required"
            )
        if self.auth_failures_per_min < 1:
            raise ValueError("auth_failures_per_min must be >= 1")
        if self.max_text_requests < 1 or self.max_messages_per_s < 10 or self.max_audio_speed < 1:
            raise ValueError("max_text_requests >= 1, max_messages_per_s >= 10, max_audio_speed >= 1")
        if self.history_turns < 2:
            raise ValueError("history_turns must be >= 2")
        if self.heap_trim_interval_s < 0:
            raise ValueError("heap_trim_interval_s must be >= 0 (0 turns heap trimming off)")
        if self.gc_interval_s < 0:
            raise ValueError(
                "gc_interval_s must be >= 0 (0 leaves garbage collection to Python's own schedule)"
            )
        if self.token is not None and len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"token must be at least {MIN_TOKEN_CHARS} characters")

    def resolved_token(self) -> str | None:
        """The token from ``token``, ``token_file`` or ``$EDGE_RTGI_TOKEN``."""
        if self.token:
            return self.token
        if self.token_file:
            try:
                token = Path(self.token_file).expanduser().read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read token_file {self.token_file}: {exc.strerror}") from None
            if len(token) < MIN_TOKEN_CHARS:
                raise ConfigError(f"token in {self.token_file} must be at least {MIN_TOKEN_CHARS} characters")
            return token
        env = (os.environ.get("EDGE_RTGI_TOKEN") or "").strip()
        if env and len(env) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"$EDGE_RTGI_TOKEN must be at least {MIN_TOKEN_CHARS} characters (it has {len(env)})",
                hint="generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'",
            )
        return env or None

    def check_bind(self) -> str | None:
        """Refuse a non-loopback bind without a token; returns the token to require, if any."""
        token = self.resolved_token()
        if not is_loopback(self.host) and not token:
            raise ConfigError(
                f"refusing to listen on {self.host}: a non-loopback address needs a token",
                hint="set server.token_file (or $EDGE_RTGI_TOKEN), or bind 127.0.0.1",
            )
        return token


@dataclass(frozen=True)
class WyomingConfig:
    """The Wyoming server for Home Assistant (docs/wyoming.md); off unless ``uri`` is set.

    ``uri``: ``tcp://HOST:PORT`` or ``unix:///path``. Wyoming has no authentication, so a
    non-loopback host also needs ``allow_remote: true`` (put Home Assistant and the daemon on
    a network you trust). ``pipeline`` supplies the models (wake word, ASR, assistant, voice);
    None: the daemon's default pipeline. Each connection's events are bounded: a header line
    plus its data at most ``max_event_bytes``, a payload at most ``max_payload_bytes``, and one
    request's audio at most ``max_audio_s``; an event's data and payload must arrive within
    ``frame_timeout_s`` of its header line, and inside an open request (``transcribe`` or
    ``detect`` to ``audio-stop``, ``synthesize-start`` to ``synthesize-stop``) the next event
    within ``request_idle_s`` (a client that stops sending is answered with an error and closed,
    so it cannot hold a connection slot or a session). Between requests a connection may stay idle.
    """

    uri: str | None = None
    pipeline: str | None = None
    allow_remote: bool = False
    max_event_bytes: int = 64 * 1024
    max_payload_bytes: int = 1 << 20
    max_audio_s: float = 60.0
    frame_timeout_s: float = 10.0
    request_idle_s: float = 30.0

    def __post_init__(self) -> None:
        # 64 KiB: asyncio's stream reader reads no longer line (the wyoming server's default)
        if not 1024 <= self.max_event_bytes <= 64 * 1024 or self.max_payload_bytes < 4096:
            raise ValueError("max_event_bytes must be in [1024, 65536] and max_payload_bytes >= 4096")
        if self.max_audio_s <= 0:
            raise ValueError("max_audio_s must be > 0")
        if self.frame_timeout_s <= 0 or self.request_idle_s <= 0:
            raise ValueError("frame_timeout_s and request_idle_s must be > 0")
        if self.uri is not None:
            self.address()  # fails early on a malformed URI

    def address(self) -> tuple[str, str, int]:
        """(scheme, host or socket path, port) of ``uri``; ValueError when it is malformed."""
        if self.uri is None:
            raise ValueError("wyoming.uri is not set")
        parts = urlsplit(self.uri)
        if parts.scheme == "unix" and parts.path:
            return "unix", parts.path, 0
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "tcp" or not parts.hostname or port is None:
            raise ValueError(f"wyoming uri must be tcp://HOST:PORT or unix:///PATH, got {self.uri!r}")
        return "tcp", parts.hostname, port

    def check_bind(self) -> None:
        """Refuse a non-loopback TCP bind unless ``allow_remote`` says it is meant."""
        scheme, host, _ = self.address()
        if scheme == "tcp" and not is_loopback(host) and not self.allow_remote:
            raise ConfigError(
                f"refusing to serve Wyoming on {host}: the protocol has no authentication",
                hint="bind 127.0.0.1, or set wyoming.allow_remote: true on a network you trust",
            )


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; False for wildcards and other addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: may resolve anywhere


@dataclass(frozen=True)
class DaemonEngineConfig(EngineConfig):
    """The daemon's shared engine: ``EngineConfig`` with speculative decoding ``auto`` by default.
    The policy drafts only where its measured step costs say drafts pay, which on the CPU here
    was at every batch size measured (docs/engine.md, "Speculative decoding"); the library's own
    default stays ``off``, the plain path its comparisons start from."""

    speculative: str | bool | dict[str, str | int] = "auto"


@dataclass(frozen=True)
class DaemonConfig:
    """The whole daemon: server, pipelines (files or folders), engine."""

    server: ServerConfig = field(default_factory=ServerConfig)
    pipelines: tuple[str, ...] = ()  # empty: the shipped pipelines/ folder
    default_pipeline: str = "voice-assistant"
    preload: bool = True  # load every pipeline's models at start-up, not on first use
    engine: EngineConfig = field(default_factory=DaemonEngineConfig)  # the shared LLM engine
    wyoming: WyomingConfig = field(default_factory=WyomingConfig)  # Home Assistant's protocol


def load_daemon_config(path: str | Path | None) -> DaemonConfig:
    """Load ``path`` strictly (None: all defaults). Relative pipeline paths are from the file."""
    if path is None:
        return DaemonConfig()
    cfg = load_config(DaemonConfig, path)
    base = Path(path).resolve().parent
    pipes = tuple(str((base / p) if not Path(p).is_absolute() else Path(p)) for p in cfg.pipelines)
    return DaemonConfig(
        server=cfg.server,
        pipelines=pipes,
        default_pipeline=cfg.default_pipeline,
        preload=cfg.preload,
        engine=cfg.engine,
        wyoming=cfg.wyoming,
    )
