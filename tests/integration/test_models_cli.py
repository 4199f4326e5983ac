"""``edge-rtgi models ...`` end to end, as a user runs it (a subprocess, a temporary cache)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SILERO_SHA256 = "4cbf549b8326f60f80f2536d9eefeb450a9abe83365a098031c89719f1be17d2"


def run_cli(*args: str, cache: Path, catalog: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run the real console entry point in a child process, as a user would."""
    full_env = {**os.environ, "EDGE_RTGI_MODEL_DIR": str(cache), **env}
    full_env.pop("EDGE_RTGI_CATALOG", None)
    if catalog is not None:
        full_env["EDGE_RTGI_CATALOG"] = str(catalog)
    return subprocess.run(
        [sys.executable, "-m", "edge_rtgi.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
    )


@pytest.fixture
def cli(monkeypatch, capsys):
    """The same entry point in-process (child processes pay the whole CLI's import time each call)."""

    def run(*args: str, cache: Path, catalog: Path | None = None) -> subprocess.CompletedProcess:
        from edge_rtgi.cli import main

        monkeypatch.setenv("EDGE_RTGI_MODEL_DIR", str(cache))
        if catalog is None:
            monkeypatch.delenv("EDGE_RTGI_CATALOG", raising=False)
        else:
            monkeypatch.setenv("EDGE_RTGI_CATALOG", str(catalog))
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


@pytest.fixture
def vad_catalog(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        version: 1
        models:
          - name: vad-test
            role: vad
            default: true
            sources:
              - kind: python-package
                package: faster_whisper
                path: silero.onnx
                files:
                  - {{name: silero.onnx, member: assets/silero_vad_v6.onnx, sha256: {SILERO_SHA256}}}
        """)
    )
    return path


def assert_one_line_error(proc: subprocess.CompletedProcess, text: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("edge-rtgi: error:") and text in errors[0], proc.stderr


def test_list_shows_the_catalogue(cli, tmp_path):
    proc = cli("models", "list", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split() == ["NAME", "ROLE", "SIZE", "INSTALLED", "DEFAULT", "SOURCES"]
    smollm = next(r for r in rows if r.startswith("smollm2-135m-instruct "))
    assert smollm.split()[1:] == ["llm", "93.8", "MiB", "no", "default", "pypi,hub"]
    proc = cli("models", "list", "--role", "tts", cache=tmp_path)
    assert "piper-en_US-joe-medium" in proc.stdout and "whisper" not in proc.stdout


def test_pull_defaults_path_and_verify(cli, tmp_path, vad_catalog):
    cache = tmp_path / "cache"
    proc = cli("models", "pull", "--defaults", cache=cache, catalog=vad_catalog)
    assert proc.returncode == 0, proc.stderr
    assert "vad-test: verified" in proc.stderr
    proc = cli("models", "pull", "--defaults", cache=cache, catalog=vad_catalog)
    assert "vad-test: already installed" in proc.stderr
    proc = cli("models", "path", "vad-test", cache=cache, catalog=vad_catalog)
    assert proc.stdout.strip() == str(cache / "vad-test" / "silero.onnx")
    proc = cli("models", "verify", cache=cache, catalog=vad_catalog)
    assert proc.returncode == 0 and "vad-test: ok (1/1 files)" in proc.stdout
    info = cli("models", "info", "vad-test", cache=cache, catalog=vad_catalog).stdout
    assert f"installed: {cache / 'vad-test' / 'silero.onnx'}" in info
    assert f"silero.onnx  ?  sha256 {SILERO_SHA256}" in info and "python-package faster_whisper" in info
    assert cli("models", "remove", "vad-test", cache=cache, catalog=vad_catalog).returncode == 0
    assert not (cache / "vad-test").exists()
    assert (
        "vad-test: not installed"
        in cli("models", "remove", "vad-test", cache=cache, catalog=vad_catalog).stderr
    )


def test_verify_detects_a_corrupted_cached_file(cli, tmp_path, vad_catalog):
    cache = tmp_path / "cache"
    assert cli("models", "pull", "vad-test", cache=cache, catalog=vad_catalog).returncode == 0
    model = cache / "vad-test" / "silero.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    proc = cli("models", "verify", "vad-test", cache=cache, catalog=vad_catalog)
    assert proc.returncode == 1
    assert "vad-test/silero.onnx: MISMATCH" in proc.stdout and "vad-test: FAILED" in proc.stdout
    assert "models pull --force" in proc.stderr
    assert cli("models", "pull", "--force", "vad-test", cache=cache, catalog=vad_catalog).returncode == 0
    assert cli("models", "verify", "vad-test", cache=cache, catalog=vad_catalog).returncode == 0


def test_bad_input_is_one_line(tmp_path):
    assert_one_line_error(run_cli("models", "path", "smollm3", cache=tmp_path), "unknown model 'smollm3'")
    assert_one_line_error(run_cli("models", "path", "whisper-small", cache=tmp_path), "not in the cache")
    assert_one_line_error(run_cli("models", "pull", cache=tmp_path), "name at least one model")
    assert_one_line_error(run_cli("models", "verify", "whisper-small", cache=tmp_path), "not in the cache")


@pytest.mark.timeout(120)
def test_hub_only_model_offline_fails_fast_with_alternatives(tmp_path):
    proc = run_cli(
        "models", "pull", "qwen2.5-0.5b-instruct", cache=tmp_path, HF_ENDPOINT="https://hub.invalid"
    )
    assert_one_line_error(proc, "cannot reach the model hub at https://hub.invalid")
    assert "smollm2-135m-instruct" in proc.stderr and "local path" in proc.stderr


@pytest.mark.slow
def test_catalogue_round_trip_of_the_default_model(tmp_path):
    """`models pull` of the default LLM with no model hub: registry package -> verified cache."""
    proc = run_cli(
        "models",
        "pull",
        "smollm2-135m-instruct",
        "--quiet",
        cache=tmp_path,
        HF_ENDPOINT="https://hub.invalid",
    )
    assert proc.returncode == 0, proc.stderr
    gguf = tmp_path / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert f"smollm2-135m-instruct: verified, {gguf}" in proc.stderr
    proc = run_cli("models", "verify", "--files", cache=tmp_path)
    assert proc.returncode == 0
    assert "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf: ok" in proc.stdout
    listing = run_cli("models", "list", "--role", "llm", cache=tmp_path).stdout
    assert next(r for r in listing.splitlines() if r.startswith("smollm2")).split()[4] == "yes"
