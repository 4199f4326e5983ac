"""Pipeline YAML loading: the shipped files load, and every mistake names file, line and key."""

from pathlib import Path

import pytest

from edge_rtgi.asr.config import AsrConfig
from edge_rtgi.errors import ConfigError
from edge_rtgi.pipeline.config import (
    AssistantStageConfig,
    TranslateStageConfig,
    TtsStageConfig,
    builtin_pipelines_dir,
    load_pipeline,
    load_pipelines,
    parse_pipeline,
)


def test_shipped_pipelines_load():
    pipes = load_pipelines([builtin_pipelines_dir()])
    assert set(pipes) >= {"voice-assistant", "translate-en-es", "transcribe"}
    va = pipes["voice-assistant"]
    assert [type(s) for s in va.stages] == [AsrConfig, AssistantStageConfig, TtsStageConfig]
    assert va.stage(AsrConfig).vad.min_silence_ms == 300
    tr = pipes["translate-en-es"]
    assert isinstance(tr.text_stage, TranslateStageConfig)
    assert tr.text_stage.backend == "apertium" and tr.text_stage.target_language == "es"
    assert tr.stage(TtsStageConfig).voice == "espeak:es"
    assert pipes["transcribe"].text_stage is None


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_typo_in_stage_key_names_file_line_and_key(tmp_path):
    path = _write(
        tmp_path,
        "name: x\nstages:\n  - asr:\n      model: whisper-tiny.en\n"
        "  - assistant:\n      max_reply_tokns: 20\n",
    )
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    msg = str(err.value)
    assert f"{path}:6" in msg and "max_reply_tokns" in msg and "max_reply_tokens" in msg


def test_unknown_stage_kind(tmp_path):
    path = _write(tmp_path, "stages:\n  - asr: {}\n  - assistent: {}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml:3: unknown stage 'assistent'"):
        load_pipeline(path)


def test_unknown_model_names_line(tmp_path):
    path = _write(tmp_path, "stages:\n  - asr:\n      model: whisper-tinyy.en\n")
    with pytest.raises(ConfigError, match=r"p\.yaml:3: unknown asr model 'whisper-tinyy.en'"):
        load_pipeline(path)


def test_model_of_wrong_role(tmp_path):
    path = _write(tmp_path, "stages:\n  - asr: {}\n  - assistant: {model: whisper-tiny.en}\n")
    with pytest.raises(ConfigError, match="is a asr model, not a llm model"):
        load_pipeline(path)


def test_nested_vad_key_typo(tmp_path):
    path = _write(tmp_path, "stages:\n  - asr:\n      vad:\n        min_silense_ms: 300\n")
    with pytest.raises(ConfigError, match=r"p\.yaml:4: unknown key 'min_silense_ms'"):
        load_pipeline(path)


@pytest.mark.parametrize(
    "stages, why",
    [
        ("  - tts: {}\n", "not a valid chain"),
        ("  - asr: {}\n  - tts: {}\n", "not a valid chain"),
        ("  - asr: {}\n  - assistant: {}\n  - translate: {}\n", "not a valid chain"),
        ("  - asr\n", "one-key mapping"),
    ],
)
def test_bad_chains(stages, why):
    with pytest.raises(ConfigError, match=why):
        parse_pipeline("stages:\n" + stages, "c.yaml")


def test_bad_values_and_top_level_keys():
    with pytest.raises(ConfigError, match="c.yaml:1: unknown key 'stage'"):
        parse_pipeline("stage: []\n", "c.yaml")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: unknown backend 'google' in stage 'translate'"):
        parse_pipeline("stages:\n  - asr: {}\n  - translate: {backend: google}\n", "c.yaml")
    with pytest.raises(ConfigError, match="needs a model"):
        parse_pipeline("stages:\n  - asr: {}\n  - translate: {backend: llm}\n", "c.yaml")
    with pytest.raises(ConfigError, match="expected int"):
        parse_pipeline("stages:\n  - asr: {}\n  - assistant: {max_reply_tokens: many}\n", "c.yaml")
    with pytest.raises(ConfigError, match="input_sample_rate_hz"):
        parse_pipeline("input_sample_rate_hz: 3\nstages:\n  - asr: {}\n", "c.yaml")
    with pytest.raises(ConfigError, match=r"encoder_window_s must be in \[5, 30\]"):
        parse_pipeline("stages:\n  - asr: {encoder_window_s: 2}\n", "c.yaml")
    with pytest.raises(ConfigError, match="first_break_after_words must be >= 1"):
        parse_pipeline(
            "stages:\n  - asr: {}\n  - assistant: {}\n  - tts: {first_break_after_words: 0}\n", "c.yaml"
        )


def test_first_chunk_settings_reach_the_tts_stage():
    pipe = parse_pipeline(
        "stages:\n  - asr: {}\n  - assistant: {}\n"
        "  - tts: {first_clause_min_words: 2, first_break_after_words: null}\n",
        "c.yaml",
    )
    tts = pipe.stage(TtsStageConfig)
    assert (tts.first_clause_min_words, tts.first_break_after_words) == (2, None)


def test_duplicate_pipeline_names(tmp_path):
    (tmp_path / "a.yaml").write_text("name: same\nstages:\n  - asr: {}\n")
    (tmp_path / "b.yaml").write_text("name: same\nstages:\n  - asr: {}\n")
    with pytest.raises(ConfigError, match="also used by"):
        load_pipelines([tmp_path])


def test_wake_gate_in_front_of_the_chain():
    from edge_rtgi.pipeline.config import WakeStageConfig

    pipe = load_pipelines([builtin_pipelines_dir()])["voice-assistant-wake"]
    assert [type(s) for s in pipe.stages] == [
        WakeStageConfig,
        AsrConfig,
        AssistantStageConfig,
        TtsStageConfig,
    ]
    assert pipe.stage(WakeStageConfig).model == "okay_nabu"
    with pytest.raises(ConfigError, match="not a valid chain"):
        parse_pipeline("stages:\n  - asr: {}\n  - wake: {}\n", "c.yaml")
    with pytest.raises(ConfigError, match="listen_timeout_ms must be >= 500"):
        parse_pipeline("stages:\n  - wake: {listen_timeout_ms: 10}\n  - asr: {}\n", "c.yaml")


def test_unknown_wake_word_lists_the_available_ones(tmp_path):
    path = _write(tmp_path, "stages:\n  - wake:\n      model: hey_nabu\n  - asr: {}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml:3: unknown wake word 'hey_nabu'") as info:
        load_pipeline(path)
    assert info.value.hint is not None
    for name in ("okay_nabu", "hey_jarvis", "alexa", "hey_mycroft"):
        assert name in info.value.hint


def _assistant(body: str) -> str:
    return "stages:\n  - asr: {}\n  - assistant:\n" + body


def test_remote_backends_load_and_mistakes_name_their_line():
    pipe = parse_pipeline(
        _assistant(
            "      backend: openai\n      base_url: http://gpu:8000/v1\n      model: qwen\n"
            "      api_key_env: KEY\n      remote: {first_token_timeout_s: 4, max_retries: 1}\n"
        ),
        "r.yaml",
    )
    spec = pipe.text_stage.backends[0]
    assert spec.name == "openai:qwen@gpu:8000" and spec.remote.first_token_timeout_s == 4
    assert spec.api_key_env == "KEY" and spec.remote.max_retries == 1
    with pytest.raises(ConfigError, match=r"r\.yaml:5: unknown backend 'vllm' in stage 'assistant'"):
        parse_pipeline(_assistant("      model: m\n      backend: vllm\n"), "r.yaml")
    with pytest.raises(ConfigError, match=r"r\.yaml:6: base_url must be an http:// or https:// URL"):
        parse_pipeline(
            _assistant("      backend: openai\n      model: m\n      base_url: gpu:8000\n"), "r.yaml"
        )
    with pytest.raises(ConfigError, match=r"r\.yaml:4: backend: openai needs a base_url"):
        parse_pipeline(_assistant("      backend: openai\n      model: m\n"), "r.yaml")
    with pytest.raises(ConfigError, match=r"r\.yaml:5: base_url is for backend: openai, not 'local'"):
        parse_pipeline(
            _assistant("      model: smollm2-135m-instruct\n      base_url: http://x/v1\n"), "r.yaml"
        )
    with pytest.raises(ConfigError, match="unknown key 'timeout_s'"):
        parse_pipeline(
            _assistant(
                "      backend: openai\n      base_url: http://x/v1\n      model: m\n"
                "      remote: {timeout_s: 1}\n"
            ),
            "r.yaml",
        )
    tr = parse_pipeline(
        "stages:\n  - asr: {}\n  - translate: {backend: openai, base_url: 'http://x/v1', model: m}\n",
        "t.yaml",
    )
    assert tr.text_stage.backends[0].name == "openai:m@x"


def _router_yaml(models, rule: str, first: str | None = None) -> str:
    small, big = models
    first = first or f"{{backend: local, model: {small}}}"
    return (
        "stages:\n  - asr: {}\n  - assistant:\n      router:\n"
        f"        rule: {rule}\n        backends:\n"
        f"          - {first}\n          - {{backend: local, model: {big}}}\n"
    )


def test_router_settings_are_checked():
    models = ("smollm2-135m-instruct", "smollm2-135m-instruct")
    with pytest.raises(ConfigError, match="router backends must differ"):
        parse_pipeline(_router_yaml(models, "confidence"), "r.yaml")
    with pytest.raises(ConfigError, match=r"r\.yaml:5: unknown router rule 'magic'"):
        parse_pipeline(_router_yaml(("a", "b"), "magic"), "r.yaml")
    remote_first = "{backend: openai, base_url: 'http://x/v1', model: m}"
    with pytest.raises(ConfigError, match="only local engines report"):
        parse_pipeline(
            _router_yaml(("a", "smollm2-135m-instruct"), "confidence", first=remote_first), "r.yaml"
        )
    with pytest.raises(ConfigError, match="set beside a router"):
        parse_pipeline(
            _router_yaml(models, "fallback").replace("      router:", "      model: x\n      router:"),
            "r.yaml",
        )


def test_few_shot_translation_prompt_for_base_models():
    from edge_rtgi.pipeline.translate import FEW_SHOT_EXAMPLES, translation_few_shot_prompt

    prompt = translation_few_shot_prompt("  Where is   the station? ", "en", "es")
    lines = prompt.split("\n")
    assert lines[0] == "Translate English into Spanish." and lines[-2:] == [
        "English: Where is the station?",
        "Spanish:",
    ]
    examples = FEW_SHOT_EXAMPLES[("en", "es")]
    assert all(f"English: {en}\nSpanish: {es}\n" in prompt for en, es in examples)
    # the examples are not in the benchmark's sentences they would otherwise give away
    import json
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "edge_rtgi/bench/data"
    sources = {row["en"] for row in json.loads((data / "translation_en_es.json").read_text())}
    graded = (data / "tasks/translation.jsonl").read_text().splitlines()
    sources |= {json.loads(line)["source"] for line in graded if line.strip()}
    assert not {en for en, _ in examples} & sources
    assert TranslateStageConfig(backend="llm", model="gemma-3-270m", prompt="few-shot").prompt == "few-shot"
    with pytest.raises(ValueError, match="prompt must be"):
        TranslateStageConfig(backend="llm", model="x", prompt="zero-shot")  # type: ignore[arg-type]
