"""Pipeline files: ``pipelines/*.yaml`` -> a validated, frozen ``PipelineConfig``.

A pipeline is a chain of stages, each written as a one-key mapping whose key is the stage
kind::

    version: 1
    name: voice-assistant
    input_sample_rate_hz: 16000
    stages:
      - wake: {model: okay_nabu}          # optional: a wake-word gate in front of ASR
      - asr: {model: whisper-tiny.en, language: en, vad: {min_silence_ms: 300}}
      - assistant: {model: smollm2-135m-instruct, max_reply_tokens: 60}
      - tts: {voice: piper-en_US-joe-medium}

The ``asr`` stage takes ``edge_rtgi.asr.config.AsrConfig``'s keys. Loading is strict: an
unknown stage kind, an unknown key, a model the catalogue does not know (and that is not a
path), or a chain in the wrong order is a ``ConfigError`` that names the file, the line and
the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.config import from_dict, load_yaml, parse_yaml, where
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.request import DEFAULT_SLOS, RequestClass, RequestSLO
from edge_rtgi.llm.speculative import parse_speculative
from edge_rtgi.pipeline.backends.config import (
    BACKEND_KINDS,
    ROUTER_RULES,
    LlmBackendConfig,
    RemoteConfig,
    RouterConfig,
    check_base_url,
)

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful voice assistant. Your replies are spoken aloud, so answer in one or two "
    "short, plain sentences without lists, markdown or emojis."
)


@dataclass(frozen=True)
class WakeStageConfig:
    """A wake-word gate in front of ASR (``edge_rtgi.pipeline.stages.wake``).

    ``model`` is one of the wake words bundled in ``pymicro-wakeword`` (``okay_nabu``,
    ``hey_jarvis``, ``alexa``, ``hey_mycroft``). After a detection the audio goes to ASR until
    the user's utterance ends, or until ``listen_timeout_ms`` of audio passed without speech;
    then the gate closes again. ``probability_cutoff`` replaces the model's own (null: keep it).
    """

    model: str = "okay_nabu"
    listen_timeout_ms: int = 8000
    refractory_ms: int = 2000
    probability_cutoff: float | None = None

    def __post_init__(self) -> None:
        if self.listen_timeout_ms < 500:
            raise ValueError("listen_timeout_ms must be >= 500")
        if self.refractory_ms < 0:
            raise ValueError("refractory_ms must be >= 0")
        if self.probability_cutoff is not None and not 0.0 < self.probability_cutoff < 1.0:
            raise ValueError(f"probability_cutoff must be in (0, 1), got {self.probability_cutoff}")


def check_budget_settings(token_budget: str, reply_deadline_ms: int | None) -> None:
    if token_budget not in ("off", "predicted"):
        raise ValueError(f"token_budget must be 'off' or 'predicted', got {token_budget!r}")
    if reply_deadline_ms is not None and reply_deadline_ms < 1:
        raise ValueError(f"reply_deadline_ms must be >= 1 ms, got {reply_deadline_ms}")


@dataclass(frozen=True)
class SloConfig:
    """A text stage's requests to the engine: their class (``voice``, ``translation``,
    ``dialogue``, ``bulk``) and latency objective; ``ttft_ms``/``itl_ms`` left out take the
    class's defaults (``llm.request.DEFAULT_SLOS``). Read by the engine's ``slo`` scheduling."""

    request_class: str = "voice"
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def __post_init__(self) -> None:
        try:
            RequestClass.parse(self.request_class)
        except ValueError as e:
            raise ValueError(f"request_class: {e}") from None
        self.objective()  # validates the numbers, naming ttft_ms or itl_ms

    @property
    def klass(self) -> RequestClass:
        return RequestClass.parse(self.request_class)

    def objective(self) -> RequestSLO:
        default = DEFAULT_SLOS[self.klass]
        return RequestSLO(
            ttft_ms=default.ttft_ms if self.ttft_ms is None else self.ttft_ms,
            itl_ms=default.itl_ms if self.itl_ms is None else self.itl_ms,
        )


def speculative_setting(value: str | bool | dict[str, str | int] | None) -> str | None:
    """A stage's ``speculative`` as ``SamplingParams.speculative`` takes it (ValueError naming
    ``speculative`` or its sub-key when bad)."""
    return None if value is None else parse_speculative(value).as_setting()


@dataclass(frozen=True)
class AssistantStageConfig:
    """A multi-turn assistant: on the shared LLM engine (``backend: local``), on a remote
    OpenAI-compatible server (``backend: openai`` with ``base_url``, ``api_key_env`` and
    ``remote`` timeouts), or on whichever of several backends a ``router`` picks per turn."""

    model: str = "smollm2-135m-instruct"
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_reply_tokens: int = 60
    temperature: float = 0.0
    top_p: float = 1.0
    context_tokens: int | None = None  # None: the backend's own context length
    # > 0: exchanges dropped to fit context_tokens leave a note of this many words of what the
    # user said in them (pipeline.stages.text.summary_line); 0: they go without a trace
    history_summary_words: int = 0
    priority: int = 0
    slo: SloConfig = field(default_factory=SloConfig)
    # "predicted": a soft budget per reply from the length predictor (llm.budget); past it, or
    # past reply_deadline_ms after the request, the reply ends at the next clause (local engine)
    token_budget: Literal["off", "predicted"] = "off"
    reply_deadline_ms: int | None = None
    # speculative decoding of its replies on a local engine whose own setting is not off:
    # auto | off | {draft: ngram, k: 1..16}; null follows the engine (llm.speculative)
    speculative: str | bool | dict[str, str | int] | None = None
    backend: str = "local"
    base_url: str | None = None
    api_key_env: str | None = None
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    router: RouterConfig | None = None

    def __post_init__(self) -> None:
        if self.max_reply_tokens < 1:
            raise ValueError("max_reply_tokens must be >= 1")
        speculative_setting(self.speculative)
        check_budget_settings(self.token_budget, self.reply_deadline_ms)
        if self.history_summary_words < 0:
            raise ValueError(f"history_summary_words must be >= 0, got {self.history_summary_words}")
        if self.context_tokens is not None and self.context_tokens < 64:
            raise ValueError("context_tokens must be >= 64")
        if self.router is None:
            self.backend_config()  # validates backend, base_url and api_key_env

    def backend_config(self) -> LlmBackendConfig:
        """The one backend (when there is no router)."""
        return LlmBackendConfig(self.backend, self.model, self.base_url, self.api_key_env, self.remote)

    @property
    def backends(self) -> tuple[LlmBackendConfig, ...]:
        """Every backend this stage may use."""
        return self.router.backends if self.router else (self.backend_config(),)


TRANSLATE_BACKENDS = ("apertium", "llm", "openai")


@dataclass(frozen=True)
class TranslateStageConfig:
    """Translation of each final utterance: by Apertium, by an LLM on the shared engine
    (``backend: llm``), by an LLM on a remote OpenAI-compatible server (``backend: openai``),
    or by the LLM a ``router`` picks (``backend: llm`` with ``router``)."""

    source_language: str = "en"
    target_language: str = "es"
    backend: str = "apertium"
    model: str | None = None  # the LLM for backend: llm and backend: openai
    apertium_pair: str | None = None  # default "<source>-<target>"
    budget_ratio: float = 2.0  # output tokens allowed per source token (LLM backends)
    min_budget_tokens: int = 16
    timeout_s: float = 10.0
    base_url: str | None = None
    api_key_env: str | None = None
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    router: RouterConfig | None = None
    # LLM backends. "chat": an instruction in the model's chat template (instruct models);
    # "few-shot": raw text with example pairs, cut at the end of the line (base models, Gemma 3 270M).
    prompt: Literal["chat", "few-shot"] = "chat"
    slo: SloConfig = field(default_factory=lambda: SloConfig("translation"))
    # "predicted": a soft budget from the source length and the pair's ratio (llm.budget)
    token_budget: Literal["off", "predicted"] = "off"
    # as AssistantStageConfig.speculative
    speculative: str | bool | dict[str, str | int] | None = None

    def __post_init__(self) -> None:
        check_budget_settings(self.token_budget, None)
        speculative_setting(self.speculative)
        if self.prompt not in ("chat", "few-shot"):
            raise ValueError(f"prompt must be 'chat' or 'few-shot', got {self.prompt!r}")
        if self.backend not in TRANSLATE_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(TRANSLATE_BACKENDS)}, got {self.backend!r}")
        if self.router is not None and self.backend != "llm":
            raise ValueError("a router picks between LLMs: use it with backend: llm")
        if self.backend in ("llm", "openai") and not self.model and self.router is None:
            raise ValueError(f"backend: {self.backend} needs a model")
        if self.backend != "apertium" and self.router is None:
            self.backend_config()
        if self.budget_ratio <= 0:
            raise ValueError("budget_ratio must be > 0")
        if self.min_budget_tokens < 1:
            raise ValueError(f"min_budget_tokens must be >= 1 token, got {self.min_budget_tokens}")

    def backend_config(self) -> LlmBackendConfig:
        """The one LLM backend (backend: llm or openai, without a router)."""
        kind = "openai" if self.backend == "openai" else "local"
        return LlmBackendConfig(kind, self.model or "", self.base_url, self.api_key_env, self.remote)

    @property
    def backends(self) -> tuple[LlmBackendConfig, ...]:
        """Every LLM backend this stage may use (none for Apertium)."""
        if self.router is not None:
            return self.router.backends
        return () if self.backend == "apertium" else (self.backend_config(),)


@dataclass(frozen=True)
class TtsStageConfig:
    """Clause segmentation and streaming speech synthesis.

    ``voice`` is a catalogue name (a Piper voice), a Piper ``.onnx`` path, or
    ``espeak:<language>`` (the espeak-ng program, e.g. ``espeak:es``).

    The first chunk of a reply is spoken early: at a clause mark once it has
    ``first_clause_min_words`` words, or before a conjunction ("and", "because", ...) once
    it has ``first_break_after_words`` words (None: only at marks). Later chunks are whole
    sentences. The break words are English; text in other languages breaks at marks only.
    See ``edge_rtgi.tts.segmenter``.
    """

    voice: str = "piper-en_US-joe-medium"
    first_clause_min_words: int = 3
    first_break_after_words: int | None = 3

    def __post_init__(self) -> None:
        if self.first_clause_min_words < 1:
            raise ValueError("first_clause_min_words must be >= 1")
        if self.first_break_after_words is not None and self.first_break_after_words < 1:
            raise ValueError("first_break_after_words must be >= 1 (or null: only at marks)")


STAGE_KINDS: dict[str, type] = {
    "wake": WakeStageConfig,
    "asr": AsrConfig,
    "assistant": AssistantStageConfig,
    "translate": TranslateStageConfig,
    "tts": TtsStageConfig,
}
StageConfig = WakeStageConfig | AsrConfig | AssistantStageConfig | TranslateStageConfig | TtsStageConfig


@dataclass(frozen=True)
class PipelineConfig:
    """A validated chain: optionally ``wake``, ``asr``, optionally ``assistant``/``translate``,
    optionally ``tts``."""

    name: str
    stages: tuple[StageConfig, ...]
    description: str = ""
    version: int = 1
    input_sample_rate_hz: int = 16000
    source: str = "<string>"

    def stage(self, cls: type) -> Any | None:
        """The stage config of type ``cls``, or None when the chain has none."""
        return next((s for s in self.stages if isinstance(s, cls)), None)

    @property
    def text_stage(self) -> AssistantStageConfig | TranslateStageConfig | None:
        return self.stage(AssistantStageConfig) or self.stage(TranslateStageConfig)


_TOP_KEYS = ("version", "name", "description", "input_sample_rate_hz", "stages")


def _parse_stage(item: Any, source: str, index: int, parent: Any) -> StageConfig:
    loc = where(parent, "stages")
    if not isinstance(item, dict) or len(item) != 1:
        raise ConfigError(
            f"{loc}: stage #{index + 1} must be a one-key mapping like '- asr: {{...}}'",
            hint=f"stage kinds: {', '.join(STAGE_KINDS)}",
        )
    ((kind, body),) = item.items()
    if kind not in STAGE_KINDS:
        raise ConfigError(
            f"{where(item, kind)}: unknown stage {kind!r}", hint=f"stage kinds: {', '.join(STAGE_KINDS)}"
        )
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError(f"{where(item, kind)}: stage {kind!r} must be a mapping of settings")
    if kind in ("assistant", "translate"):
        _check_backend_keys(kind, body)
    stage: StageConfig = from_dict(STAGE_KINDS[kind], body, f"stage {kind!r}")
    _check_models(stage, body)
    return stage


def _check_one_backend(mapping: Any, allowed: tuple[str, ...], default: str, ctx: str) -> None:
    """A backend's name and base URL, checked where they are written (file:line)."""
    kind = mapping.get("backend", default)
    if kind not in allowed:
        raise ConfigError(
            f"{where(mapping, 'backend')}: unknown backend {kind!r} in {ctx}",
            hint=f"backends: {', '.join(allowed)}",
        )
    url = mapping.get("base_url")
    for key in ("base_url", "api_key_env"):
        if key in mapping and kind != "openai":
            raise ConfigError(
                f"{where(mapping, key)}: {key} is for backend: openai, not {kind!r} ({ctx})",
                hint="set backend: openai to use a remote OpenAI-compatible server",
            )
    if kind == "openai":
        if not url:
            raise ConfigError(
                f"{where(mapping, 'backend')}: backend: openai needs a base_url ({ctx})",
                hint="e.g. base_url: http://gpu-host:8000/v1",
            )
        problem = check_base_url(str(url))
        if problem:
            raise ConfigError(f"{where(mapping, 'base_url')}: {problem} ({ctx})")


def _check_backend_keys(kind: str, body: Any) -> None:
    """Backend names, base URLs and router rules, with the line they are on."""
    ctx = f"stage {kind!r}"
    router = body.get("router")
    if router is None:
        if kind == "assistant" or body.get("backend") != "apertium":
            allowed = TRANSLATE_BACKENDS if kind == "translate" else BACKEND_KINDS
            _check_one_backend(body, allowed, "apertium" if kind == "translate" else "local", ctx)
        return
    if not isinstance(router, dict):
        raise ConfigError(f"{where(body, 'router')}: router must be a mapping with a 'backends' list")
    flat = ("backend", "model", "base_url", "api_key_env", "remote") if kind == "assistant" else ()
    for key in (*flat, *(("model", "base_url", "api_key_env", "remote") if kind == "translate" else ())):
        if key in body:
            raise ConfigError(
                f"{where(body, key)}: {key!r} is set beside a router in {ctx}",
                hint="with a router, name each backend under router.backends",
            )
    rule = router.get("rule", "confidence")
    if rule not in ROUTER_RULES:
        raise ConfigError(
            f"{where(router, 'rule')}: unknown router rule {rule!r}", hint=f"rules: {', '.join(ROUTER_RULES)}"
        )
    entries = router.get("backends")
    if not isinstance(entries, list) or len(entries) < 2:
        raise ConfigError(
            f"{where(router, 'backends') if 'backends' in router else where(body, 'router')}: "
            "router.backends must list at least two backends, cheapest first"
        )
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where(router, 'backends')}: router backend #{i + 1} must be a mapping")
        _check_one_backend(entry, BACKEND_KINDS, "local", f"router backend #{i + 1}")


def _check_order(stages: list[StageConfig], data: Any) -> None:
    kinds = [next(k for k, c in STAGE_KINDS.items() if isinstance(s, c)) for s in stages]
    if kinds[:1] == ["wake"]:  # the gate may stand in front of any chain
        kinds = kinds[1:]
    allowed = (
        ["asr"],
        ["asr", "assistant"],
        ["asr", "translate"],
        ["asr", "assistant", "tts"],
        ["asr", "translate", "tts"],
    )
    if kinds not in [list(a) for a in allowed]:
        raise ConfigError(
            f"{where(data, 'stages')}: stages {kinds} are not a valid chain",
            hint="use optionally wake, then asr, then optionally assistant or translate, then optionally tts",
        )


def _model_known(name: str, role: str) -> str | None:
    """None if ``name`` is a path or a catalogue model of ``role``; otherwise why not."""
    if Path(name).expanduser().exists():
        return None
    from edge_rtgi.catalog import get_entry
    from edge_rtgi.errors import ModelNotFoundError

    try:
        entry = get_entry(name)
    except ModelNotFoundError as exc:
        return exc.hint or "`edge-rtgi models list` shows the catalogue"
    if entry.role != role:
        return f"{name!r} is a {entry.role} model, not a {role} model"
    return None


def _check_models(stage: StageConfig, body: Any) -> None:
    """Every model a stage names must be a path or a catalogue entry of the right role."""

    def check(name: str | None, role: str, mapping: Any, key: str) -> None:
        if name is None:
            return
        problem = _model_known(name, role)
        if problem:
            raise ConfigError(
                f"{where(mapping, key)}: unknown {role} model {name!r} for key {key!r}", hint=problem
            )

    if isinstance(stage, WakeStageConfig):
        from edge_rtgi.asr.wakeword import check_wake_word

        try:
            check_wake_word(stage.model)
        except ConfigError as exc:
            raise ConfigError(f"{where(body, 'model')}: {exc.message}", hint=exc.hint) from None
    elif isinstance(stage, AsrConfig):
        check(stage.model, "asr", body, "model")
        check(stage.vad.model, "vad", body.get("vad", body), "model" if "vad" in body else "vad")
    elif isinstance(stage, (AssistantStageConfig, TranslateStageConfig)):
        if stage.router is not None:
            for spec, entry in zip(stage.router.backends, body["router"]["backends"], strict=True):
                if spec.backend == "local":
                    check(spec.model, "llm", entry, "model")
        elif stage.backends and stage.backends[0].backend == "local":
            check(stage.backends[0].model, "llm", body, "model")  # a remote names its own models
    elif isinstance(stage, TtsStageConfig) and not stage.voice.startswith("espeak"):
        check(stage.voice, "tts", body, "voice")


def pipeline_from_data(data: Any, source: str, default_name: str = "pipeline") -> PipelineConfig:
    """Validate parsed YAML ``data`` (from ``edge_rtgi.config``) into a PipelineConfig."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a pipeline file must be a mapping with a 'stages' list")
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(
                f"{where(data, key)}: unknown key {key!r} in pipeline",
                hint=f"allowed keys: {', '.join(_TOP_KEYS)}",
            )
    if data.get("version", 1) != 1:
        raise ConfigError(
            f"{where(data, 'version')}: unsupported pipeline version {data['version']!r}",
            hint="this edge-rtgi reads version: 1",
        )
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise ConfigError(f"{where(data, 'stages')}: 'stages' must be a non-empty list")
    stages = [_parse_stage(item, source, i, data) for i, item in enumerate(raw_stages)]
    _check_order(stages, data)
    rate = data.get("input_sample_rate_hz", 16000)
    if not isinstance(rate, int) or isinstance(rate, bool) or not 8000 <= rate <= 48000:
        raise ConfigError(
            f"{where(data, 'input_sample_rate_hz')}: input_sample_rate_hz must be an "
            f"integer in [8000, 48000], got {rate!r}"
        )
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where(data, 'name')}: name must be a non-empty string")
    return PipelineConfig(
        name=name,
        stages=tuple(stages),
        description=str(data.get("description", "")),
        input_sample_rate_hz=rate,
        source=source,
    )


def load_pipeline(path: str | Path) -> PipelineConfig:
    """Load and validate one pipeline file; errors name the file, line and key."""
    path = Path(path)
    return pipeline_from_data(load_yaml(path), str(path), default_name=path.stem)


def parse_pipeline(text: str, source: str = "<string>") -> PipelineConfig:
    """Like ``load_pipeline`` for YAML text (tests, inline configs)."""
    return pipeline_from_data(parse_yaml(text, source), source)


def builtin_pipelines_dir() -> Path:
    """The ``pipelines/`` folder shipped with the source tree."""
    return Path(__file__).resolve().parents[2] / "pipelines"


def load_pipelines(paths: list[str | Path]) -> dict[str, PipelineConfig]:
    """Load pipeline files and folders of ``*.yaml``; names must be unique."""
    out: dict[str, PipelineConfig] = {}
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
        if p.is_dir() and not files:
            raise ConfigError(f"no *.yaml pipeline files in {p}")
        for f in files:
            cfg = load_pipeline(f)
            if cfg.name in out:
                raise ConfigError(f"{f}: pipeline name {cfg.name!r} is also used by {out[cfg.name].source}")
            out[cfg.name] = cfg
    return out
