"""Settings of the LLM backends a text stage streams from, and of the router between them.

A backend is the daemon's own engine (``backend: local``) or any server that speaks OpenAI's
streaming chat-completions API (``backend: openai``: vLLM, SGLang, TensorRT-LLM, llama.cpp's
server, another edge-rtgi daemon). A router (``router:``) picks one of two or more backends per
turn. Loading is strict, as for every pipeline setting (``edge_rtgi.pipeline.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

BACKEND_KINDS = ("local", "openai")
ROUTER_RULES = ("confidence", "features", "fallback")


@dataclass(frozen=True)
class RemoteConfig:
    """Timeouts and retries of a remote backend.

    ``first_token_timeout_s`` bounds the whole wait for the first token, retries included;
    ``idle_timeout_s`` the gap between two chunks after it. Retries (at most ``max_retries``,
    ``retry_backoff_ms`` doubling) happen only before the first token: once text has been
    spoken, a turn is never restarted. ``context_tokens`` is the remote model's window, used
    to trim the conversation; without the remote's tokenizer, prompt sizes are estimated
    generously (one token per 3 bytes of UTF-8).
    """

    connect_timeout_s: float = 3.0
    first_token_timeout_s: float = 10.0
    idle_timeout_s: float = 10.0
    max_retries: int = 2
    retry_backoff_ms: int = 250
    context_tokens: int = 4096

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "first_token_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.max_retries <= 10:
            raise ValueError(f"max_retries must be in [0, 10], got {self.max_retries}")
        if self.retry_backoff_ms < 0:
            raise ValueError(f"retry_backoff_ms must be >= 0, got {self.retry_backoff_ms}")
        if self.context_tokens < 64:
            raise ValueError(f"context_tokens must be >= 64, got {self.context_tokens}")


def check_base_url(base_url: str) -> str | None:
    """None if ``base_url`` is an http(s) URL with a host; otherwise what is wrong with it."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"base_url must be an http:// or https:// URL with a host, got {base_url!r}"
    return None


@dataclass(frozen=True)
class LlmBackendConfig:
    """One LLM backend. ``model`` is a catalogue name or path (local) or the name the remote
    server serves (openai); ``api_key_env`` names the environment variable holding the remote's
    key (sent as a bearer token); ``label`` overrides the name in logs and /metrics."""

    backend: str = "local"
    model: str = "smollm2-135m-instruct"
    base_url: str | None = None
    api_key_env: str | None = None
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    label: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_KINDS:
            raise ValueError(f"backend must be one of {', '.join(BACKEND_KINDS)}, got {self.backend!r}")
        if self.backend == "openai":
            if not self.base_url:
                raise ValueError("backend: openai needs a base_url (e.g. http://gpu-host:8000/v1)")
            problem = check_base_url(self.base_url)
            if problem:
                raise ValueError(problem)
        elif self.base_url or self.api_key_env:
            raise ValueError("base_url and api_key_env belong to backend: openai")
        if not self.model:
            raise ValueError("a backend needs a model")

    @property
    def name(self) -> str:
        """The backend's label: ``local:<model>``, or ``openai:<model>@<host>[:port]``."""
        if self.label:
            return self.label
        if self.backend == "local":
            return f"local:{self.model}"
        return f"openai:{self.model}@{urlsplit(self.base_url or '').netloc}"


@dataclass(frozen=True)
class RouterConfig:
    """Per-turn choice between ``backends`` (cheapest first).

    ``rule: confidence`` cascades: each backend but the last starts the reply, and its first
    ``probe_tokens`` tokens are judged by their mean entropy; above ``max_mean_entropy_nats``
    the attempt is dropped (nothing of it was spoken) and the next backend starts afresh. A
    backend that fails before its first token also hands the turn on. Only local engines
    report entropies, so every backend but the last must be local.

    ``rule: features`` decides before generating, from the turn itself: the last backend when
    the user's turn has at least ``escalate_min_words`` words or contains one of
    ``escalate_keywords`` (whole words, any case), the first otherwise.

    ``rule: fallback`` takes the first backend that answers: the next one is tried only when
    one fails before its first token (down, timed out, refused), e.g. a remote first and the
    local engine behind it, so a turn is not lost while the remote is away.
    """

    backends: tuple[LlmBackendConfig, ...] = ()
    rule: str = "confidence"
    probe_tokens: int = 8
    max_mean_entropy_nats: float = 1.5
    escalate_min_words: int | None = None
    escalate_keywords: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.rule not in ROUTER_RULES:
            raise ValueError(f"rule must be one of {', '.join(ROUTER_RULES)}, got {self.rule!r}")
        if len(self.backends) < 2:
            raise ValueError("a router needs at least two backends (cheapest first)")
        if self.probe_tokens < 1:
            raise ValueError(f"probe_tokens must be >= 1, got {self.probe_tokens}")
        if not self.max_mean_entropy_nats > 0:
            raise ValueError(f"max_mean_entropy_nats must be > 0, got {self.max_mean_entropy_nats}")
        if self.rule == "confidence":
            remote = [b.name for b in self.backends[:-1] if b.backend != "local"]
            if remote:
                raise ValueError(
                    f"rule: confidence reads each tried model's entropy, which only local engines "
                    f"report; {', '.join(remote)} is remote (put remote backends last, or use rule: features)"
                )
        elif self.rule == "features":
            if len(self.backends) != 2:
                raise ValueError("rule: features picks between exactly two backends")
            if self.escalate_min_words is None and not self.escalate_keywords:
                raise ValueError("rule: features needs escalate_min_words or escalate_keywords")
        if self.escalate_min_words is not None and self.escalate_min_words < 1:
            raise ValueError(f"escalate_min_words must be >= 1, got {self.escalate_min_words}")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"router backends must differ, got {names}")
