"""Bad input to `edge-rtgi generate` gives one clear line on stderr and a non-zero exit, never a traceback.

The CLI runs in a subprocess, as a user would run it. A few loader failures that need no
process are checked in-process too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_rtgi.errors import ModelFileError, ModelNotFoundError
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("bad"), seed=4)


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_rtgi.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("edge-rtgi: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_safetensors(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = run_cli("generate", "--model", str(folder), "--dtype", "fp32", "hello")
    assert_clean_error(proc, "model.safetensors", "truncated or corrupt")


def unsupported_gguf(path: Path) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_unsupported_architecture(tmp_path):
    path = unsupported_gguf(tmp_path / "gpt2.gguf")
    proc = run_cli("generate", "--model", str(path), "hello")
    assert_clean_error(
        proc,
        "gpt2.gguf",
        "unsupported architecture 'gpt2'",
        "supported GGUF architectures: gemma3, llama, mistral, qwen2",
    )


def test_prompt_longer_than_context(tiny_folder):
    from edge_rtgi.llm.tokenizer import load_hf_tokenizer

    prompt = "fox " * 400
    prompt_tokens = len(load_hf_tokenizer(tiny_folder).encode(prompt, add_special_tokens=True))
    proc = run_cli("generate", "--model", str(tiny_folder), "--dtype", "fp32", "-", stdin=prompt)
    assert_clean_error(proc, f"the prompt is {prompt_tokens} tokens", "context window is 256 tokens")


def test_max_tokens_zero(tiny_folder):
    proc = run_cli("generate", "--model", str(tiny_folder), "--max-tokens", "0", "hello")
    assert_clean_error(proc, "max_tokens")


def test_unknown_model_name():
    proc = run_cli("generate", "--model", "no-such-model-xyz", "hello")
    assert_clean_error(proc, "no-such-model-xyz")


def test_generate_works_on_a_good_model(tiny_folder):
    proc = run_cli("generate", "--model", str(tiny_folder), "--dtype", "fp32", "--max-tokens", "4", "hello")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


# --- in-process loader failures --------------------------------------------------------------


def test_shape_mismatch_names_file_and_tensor(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelFileError,
        match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.gate_proj\.weight "
        r"has shape \(128, 64\), the config implies \(96, 64\)",
    ):
        load_model(folder, device="cpu", dtype="fp32")


def test_missing_tensor(tiny_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(tiny_folder, tmp_path / "model")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight is missing"):
        load_model(folder, device="cpu", dtype="fp32")


def test_truncated_gguf(tiny_folder, tmp_path):
    path = write_tiny_gguf(tiny_folder, tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(ModelFileError, match=r"tiny\.gguf is truncated or corrupt"):
        load_model(path, device="cpu", dtype="fp32")


def test_not_a_model_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(ModelFileError, match=r"notes\.gguf is neither a GGUF file"):
        load_model(path)


def test_missing_path():
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model("/nonexistent/model.gguf")


def test_unknown_name_in_process():
    with pytest.raises(ModelNotFoundError):
        load_model("no-such-model-xyz")


@pytest.mark.parametrize("backend", [[], ["--plain"]])
def test_chat_repl_runs_turns_from_stdin(tiny_folder, backend):
    proc = run_cli(
        "chat",
        "--model",
        str(tiny_folder),
        "--dtype",
        "fp32",
        "--max-tokens",
        "4",
        "--system",
        "Be brief.",
        *backend,
        stdin="Hello!\n/reset\nWhat is the capital of France?\n/quit\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") >= 2  # a reply per message, each ended
