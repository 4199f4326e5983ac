"""The Realtime ``session`` object: parsing ``session.update`` (GA and beta shapes) and echoing it.

``apply_session_update`` is all-or-nothing: it builds a new frozen ``RealtimeSessionConfig``
from the old one and the update, or raises ``RealtimeProtocolError`` naming the field, and
then the session keeps its previous settings. Fields we accept but do not act on (tools,
tracing, noise reduction...) are listed in ``IGNORED_FIELDS`` and in docs/openai-realtime.md;
anything else unknown is an error, so a typo never passes silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from edge_rtgi.server.openai_realtime.codecs import AudioFormat, parse_format
from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError
from edge_rtgi.server.openai_realtime.events import optional

MODALITIES = ("text", "audio")
# Accepted and echoed back, but they change nothing in a local pipeline.
IGNORED_FIELDS = frozenset(
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "tracing",
        "prompt",
        "reasoning",
        "include",
        "truncation",
        "model",
        "temperature",
        "client_secret",
        "input_audio_noise_reduction",
    }
)
IGNORED_AUDIO_INPUT_FIELDS = frozenset({"noise_reduction"})
IGNORED_AUDIO_OUTPUT_FIELDS = frozenset({"speed"})
EXTENSION_KEYS = frozenset({"pipeline"})


@dataclass(frozen=True)
class ServerVad:
    """``turn_detection: {"type": "server_vad", ...}``; ``None`` in its place means manual commits."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None

    def to_wire(self) -> dict:
        return {"type": "server_vad", **dataclasses.asdict(self)}


EAGERNESS = ("low", "medium", "high", "auto")


@dataclass(frozen=True)
class SemanticTurn:
    """Our turn detection settings for one ``semantic_vad`` eagerness (edge_rtgi.asr.turn)."""

    min_silence_ms: int  # silence before the model is asked
    max_silence_ms: int  # silence that ends the turn whatever the model says
    threshold: float  # probability of a finished turn that ends it


# "high" answers as soon as a pause looks final; "low" lets the user take their time (a higher
# bar for the model and a longer cap); "auto" is "medium", as in OpenAI's API.
SEMANTIC_EAGERNESS = {
    "high": SemanticTurn(min_silence_ms=100, max_silence_ms=800, threshold=0.3),
    "medium": SemanticTurn(min_silence_ms=150, max_silence_ms=1200, threshold=0.5),
    "auto": SemanticTurn(min_silence_ms=150, max_silence_ms=1200, threshold=0.5),
    "low": SemanticTurn(min_silence_ms=300, max_silence_ms=2500, threshold=0.7),
}


@dataclass(frozen=True)
class SemanticVad:
    """``turn_detection: {"type": "semantic_vad", "eagerness": ...}``: the smart-turn model
    decides whether a pause ends the turn (``SEMANTIC_EAGERNESS`` maps the levels)."""

    eagerness: str = "auto"
    create_response: bool = True
    interrupt_response: bool = True

    def to_wire(self) -> dict:
        return {"type": "semantic_vad", **dataclasses.asdict(self)}

    @property
    def turn(self) -> SemanticTurn:
        return SEMANTIC_EAGERNESS[self.eagerness]


TurnDetection = ServerVad | SemanticVad


@dataclass(frozen=True)
class InputTranscription:
    """``audio.input.transcription``: the ASR is always ours; ``model`` is only echoed."""

    model: str = "whisper-1"
    language: str | None = None
    prompt: str | None = None

    def to_wire(self) -> dict:
        return {"model": self.model, "language": self.language, "prompt": self.prompt}


@dataclass(frozen=True)
class RealtimeSessionConfig:
    """Everything a Realtime client can set on its session."""

    instructions: str | None = None  # None: the pipeline's own system prompt
    voice: str | None = None  # None: the pipeline's voice
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: AudioFormat = field(default_factory=AudioFormat)
    output_format: AudioFormat = field(default_factory=AudioFormat)
    turn_detection: TurnDetection | None = field(default_factory=ServerVad)
    transcription: InputTranscription | None = field(default_factory=InputTranscription)  # ours is free: on
    max_output_tokens: int | None = None  # None: "inf", the pipeline's own budget
    pipeline: str | None = None  # our extension: session.edge_rtgi.pipeline

    def to_wire(self, session_id: str, model: str) -> dict:
        """The GA session object sent in ``session.created`` / ``session.updated``."""
        session = {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions or "",
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
            "audio": {
                "input": {
                    "format": self.input_format.to_wire(),
                    "transcription": self.transcription.to_wire() if self.transcription else None,
                    "turn_detection": self.turn_detection.to_wire() if self.turn_detection else None,
                    "noise_reduction": None,
                },
                "output": {
                    "format": self.output_format.to_wire(),
                    "voice": self.voice or "default",
                    "speed": 1.0,
                },
            },
            "tools": [],
            "tool_choice": "auto",
            "edge_rtgi": {"pipeline": self.pipeline},
        }
        return session


def _parse_semantic_vad(value: dict, old: TurnDetection | None, param: str) -> SemanticVad:
    known = {f.name for f in dataclasses.fields(SemanticVad)} | {"type"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise RealtimeProtocolError(
            "unknown_parameter", f"unknown field {unknown[0]!r} in {param}", f"{param}.{unknown[0]}"
        )
    base = old if isinstance(old, SemanticVad) else SemanticVad()
    eagerness = optional(value, "eagerness", str, f"{param}.eagerness", base.eagerness)
    if eagerness not in EAGERNESS:
        raise RealtimeProtocolError(
            "invalid_value",
            f"{param}.eagerness must be one of {', '.join(EAGERNESS)}, got {eagerness!r}",
            f"{param}.eagerness",
        )
    return SemanticVad(
        eagerness=eagerness,
        create_response=optional(
            value, "create_response", bool, f"{param}.create_response", base.create_response
        ),
        interrupt_response=optional(
            value, "interrupt_response", bool, f"{param}.interrupt_response", base.interrupt_response
        ),
    )


def _parse_turn_detection(value: object, old: TurnDetection | None, param: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeProtocolError("invalid_type", f"{param} must be an object or null", param)
    kind = value.get("type", "server_vad")
    if kind == "semantic_vad":
        return _parse_semantic_vad(value, old, param)
    if kind != "server_vad":
        raise RealtimeProtocolError(
            "invalid_value",
            f"turn detection {kind!r} is not supported; use 'server_vad', 'semantic_vad' or null "
            "(manual input_audio_buffer.commit)",
            f"{param}.type",
        )
    old = old if isinstance(old, ServerVad) else None
    known = {f.name for f in dataclasses.fields(ServerVad)} | {"type"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise RealtimeProtocolError(
            "unknown_parameter", f"unknown field {unknown[0]!r} in {param}", f"{param}.{unknown[0]}"
        )
    base = old or ServerVad()
    threshold = optional(value, "threshold", (int, float), f"{param}.threshold", base.threshold)
    if not 0.0 < float(threshold) < 1.0:
        raise RealtimeProtocolError(
            "invalid_value",
            f"{param}.threshold must be between 0 and 1, got {threshold}",
            f"{param}.threshold",
        )
    padding = optional(value, "prefix_padding_ms", int, f"{param}.prefix_padding_ms", base.prefix_padding_ms)
    silence = optional(
        value, "silence_duration_ms", int, f"{param}.silence_duration_ms", base.silence_duration_ms
    )
    for name, ms, low in (("prefix_padding_ms", padding, 0), ("silence_duration_ms", silence, 50)):
        if not low <= ms <= 10_000:
            raise RealtimeProtocolError(
                "invalid_value", f"{param}.{name} must be in [{low}, 10000] ms, got {ms}", f"{param}.{name}"
            )
    return ServerVad(
        threshold=float(threshold),
        prefix_padding_ms=padding,
        silence_duration_ms=silence,
        create_response=optional(
            value, "create_response", bool, f"{param}.create_response", base.create_response
        ),
        interrupt_response=optional(
            value, "interrupt_response", bool, f"{param}.interrupt_response", base.interrupt_response
        ),
        idle_timeout_ms=optional(
            value, "idle_timeout_ms", int, f"{param}.idle_timeout_ms", base.idle_timeout_ms
        ),
    )


def _parse_transcription(value: object, param: str) -> InputTranscription | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeProtocolError("invalid_type", f"{param} must be an object or null", param)
    return InputTranscription(
        model=optional(value, "model", str, f"{param}.model", "whisper-1") or "whisper-1",
        language=optional(value, "language", str, f"{param}.language"),
        prompt=optional(value, "prompt", str, f"{param}.prompt"),
    )


def _parse_modalities(value: object, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or any(m not in MODALITIES for m in value):
        raise RealtimeProtocolError(
            "invalid_value", f"{param} must be a non-empty list of 'text' and 'audio'", param
        )
    return tuple(dict.fromkeys(value))


def _parse_max_tokens(value: object, param: str) -> int | None:
    if value == "inf" or value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096:
        return value
    raise RealtimeProtocolError("invalid_value", f"{param} must be an integer in [1, 4096] or 'inf'", param)


def _parse_voice(value: object, param: str) -> str | None:
    if isinstance(value, dict):  # GA allows {"id": "voice_..."}
        value = value.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RealtimeProtocolError("invalid_type", f"{param} must be a voice name", param)
    return value


def _check_keys(obj: dict, allowed: set[str] | frozenset[str], param: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        where = f"{param}.{unknown[0]}" if param else unknown[0]
        raise RealtimeProtocolError("unknown_parameter", f"unknown parameter {where!r}", where)


def _flatten_ga_audio(session: dict) -> dict:
    """GA nests audio settings under ``audio.input`` / ``audio.output``; map them to flat keys."""
    flat: dict = {}
    audio = session.get("audio")
    if audio is None:
        return flat
    if not isinstance(audio, dict):
        raise RealtimeProtocolError("invalid_type", "session.audio must be an object", "session.audio")
    _check_keys(audio, {"input", "output"}, "session.audio")
    inp = audio.get("input") or {}
    out = audio.get("output") or {}
    for part, name in ((inp, "input"), (out, "output")):
        if not isinstance(part, dict):
            param = f"session.audio.{name}"
            raise RealtimeProtocolError("invalid_type", f"{param} must be an object", param)
    _check_keys(
        inp, {"format", "transcription", "turn_detection"} | IGNORED_AUDIO_INPUT_FIELDS, "session.audio.input"
    )
    _check_keys(out, {"format", "voice"} | IGNORED_AUDIO_OUTPUT_FIELDS, "session.audio.output")
    for src, key, dst in (
        (inp, "format", "input_format"),
        (inp, "transcription", "transcription"),
        (inp, "turn_detection", "turn_detection"),
        (out, "format", "output_format"),
        (out, "voice", "voice"),
    ):
        if key in src:
            flat[dst] = (src[key], f"session.audio.{'input' if src is inp else 'output'}.{key}")
    return flat


_BETA_KEYS = {  # beta flat key -> (our field, param)
    "modalities": "output_modalities",
    "input_audio_format": "input_format",
    "output_audio_format": "output_format",
    "input_audio_transcription": "transcription",
    "turn_detection": "turn_detection",
    "voice": "voice",
    "max_response_output_tokens": "max_output_tokens",
}
_GA_KEYS = {
    "type",
    "audio",
    "instructions",
    "output_modalities",
    "max_output_tokens",
    "edge_rtgi",
    "id",
    "object",
}


def apply_session_update(config: RealtimeSessionConfig, session: object) -> RealtimeSessionConfig:
    """Return ``config`` with the fields of a ``session.update`` payload applied."""
    if not isinstance(session, dict):
        raise RealtimeProtocolError("invalid_type", "session must be an object", "session")
    kind = session.get("type", "realtime")
    if kind != "realtime":
        raise RealtimeProtocolError(
            "invalid_value", f"session type {kind!r} is not supported; use 'realtime'", "session.type"
        )
    _check_keys(session, _GA_KEYS | set(_BETA_KEYS) | IGNORED_FIELDS, "session")
    fields = _flatten_ga_audio(session)
    for beta_key, ours in _BETA_KEYS.items():
        if beta_key in session:
            fields[ours] = (session[beta_key], f"session.{beta_key}")
    for key in ("instructions", "output_modalities", "max_output_tokens"):
        if key in session:
            fields[key] = (session[key], f"session.{key}")
    changes: dict = {}
    for name, (value, param) in fields.items():
        if name == "input_format" or name == "output_format":
            changes[name] = parse_format(value, param) if value is not None else AudioFormat()
        elif name == "turn_detection":
            changes[name] = _parse_turn_detection(value, config.turn_detection, param)
        elif name == "transcription":
            changes[name] = _parse_transcription(value, param)
        elif name == "voice":
            changes[name] = _parse_voice(value, param)
        elif name == "output_modalities":
            changes[name] = _parse_modalities(value, param)
        elif name == "max_output_tokens":
            changes[name] = _parse_max_tokens(value, param)
        elif name == "instructions":
            if value is not None and not isinstance(value, str):
                raise RealtimeProtocolError("invalid_type", f"{param} must be a string", param)
            changes[name] = value or None
    if "edge_rtgi" in session:
        changes.update(_parse_extension(session["edge_rtgi"]))
    return dataclasses.replace(config, **changes)


def _parse_extension(value: object) -> dict:
    """``session.edge_rtgi``: our extension. ``pipeline`` picks a daemon pipeline by name."""
    param = "session.edge_rtgi"
    if value is None:
        return {"pipeline": None}
    if not isinstance(value, dict):
        raise RealtimeProtocolError(
            "invalid_type", f'{param} must be an object like {{"pipeline": "translate-en-es"}}', param
        )
    _check_keys(value, EXTENSION_KEYS, param)
    out = {}
    if "pipeline" in value:
        out["pipeline"] = optional(value, "pipeline", str, f"{param}.pipeline")
    return out
