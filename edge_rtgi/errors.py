"""User-facing errors.

Every error a user can cause (bad file, bad config, bad request) is raised as an
``EdgeRtgiError`` subclass. The CLI prints it as one line and exits non-zero; the server
turns it into an ``error`` event. The message names what was wrong, and ``hint`` says
what to do about it.
"""

from __future__ import annotations


class EdgeRtgiError(Exception):
    """Base class for errors caused by input, files or configuration, not by bugs."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ConfigError(EdgeRtgiError):
    """A config or pipeline file is malformed, or names an unknown key."""


class ModelFileError(EdgeRtgiError):
    """A model file is missing, truncated, corrupt, or of an unsupported kind."""


class ModelNotFoundError(EdgeRtgiError):
    """A model name is not in the catalogue and is not a path."""


class DownloadError(EdgeRtgiError):
    """A model could not be fetched from any of its sources."""


class RequestError(EdgeRtgiError):
    """A generation request is invalid (prompt too long, bad sampling parameters...)."""


class BackendError(RequestError):
    """A remote LLM backend failed a turn. ``code`` is the client-facing error code:
    ``backend_unavailable`` (it could not be reached), ``backend_timeout`` (it sent no token, or
    stalled, within the configured time) or ``backend_error`` (it refused the request, or sent
    a stream that is not OpenAI's server-sent events)."""

    def __init__(self, message: str, hint: str | None = None, code: str = "backend_error"):
        super().__init__(message, hint)
        self.code = code


class EngineBusy(BackendError):
    """The local engine refused a request it could not serve within its SLO: more work of its
    class or above is queued than it finishes in that time (``scheduling: slo`` admission).
    ``retry_after_ms``: the estimated wait, a fair time to try again."""

    def __init__(self, message: str, retry_after_ms: float):
        super().__init__(message, f"retry in {retry_after_ms / 1e3:.1f} s", code="busy")
        self.retry_after_ms = retry_after_ms


class AudioError(EdgeRtgiError):
    """Audio input is malformed or in an unsupported format."""
