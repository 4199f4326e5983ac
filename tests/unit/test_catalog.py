"""The model catalogue: parsing, strictness, resolution, cache layout, pins (no downloads here)."""

from __future__ import annotations

import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from edge_rtgi import catalog
from edge_rtgi.catalog.cache import MANIFEST_NAME, PinMismatchError, sha256_file, tree_digest
from edge_rtgi.catalog.hub import probe_hub
from edge_rtgi.config import from_dict
from edge_rtgi.errors import ConfigError, DownloadError, ModelFileError, ModelNotFoundError

SILERO_SHA256 = "4cbf549b8326f60f80f2536d9eefeb450a9abe83365a098031c89719f1be17d2"


def write_catalog(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text("version: 1\nmodels:\n" + textwrap.indent(textwrap.dedent(body), "  "))
    return path


def silero_entry(sha256: str = SILERO_SHA256, name: str = "vad-test", default: bool = True) -> str:
    return f"""
    - name: {name}
      role: vad
      default: {str(default).lower()}
      sources:
        - kind: python-package
          package: faster_whisper
          path: silero.onnx
          files:
            - {{name: silero.onnx, member: assets/silero_vad_v6.onnx, sha256: {sha256}}}
    """


HUB_ONLY = """
- name: hub-only-llm
  role: llm
  sources:
    - kind: hub
      repo: HuggingFaceTB/SmolLM2-135M-Instruct
      revision: main
      files: [{name: config.json}]
"""


# ---------------------------------------------------------------- the shipped catalogue


def test_shipped_catalogue_has_a_default_per_role_and_pins_every_registry_file():
    entries = catalog.list_entries()
    assert {catalog.default_model(r) for r in catalog.ROLES} == {
        "smollm2-135m-instruct",
        "whisper-tiny.en",
        "piper-en_US-joe-medium",
        "silero-vad",
        "smart-turn-v3.2",
        "smollm2-135m-instruct-eagle",
    }
    assert "whisper-base" in catalog.setup_models()
    for entry in entries:
        for source in entry.sources:
            if source.kind in ("pypi", "python-package"):
                assert source.pinned(), f"{entry.name}: {source.describe()} has an unpinned file"
            if source.kind == "hub":
                assert source.repo and source.revision
    base = catalog.get_entry("whisper-base").sources[0]
    model_bin = next(f for f in base.files if f.name == "model.bin")
    assert sum(p.size_bytes for p in model_bin.parts) == model_bin.size_bytes
    assert catalog.get_entry("llama-3.2-1b-instruct").sources[0].gated
    gemma = catalog.get_entry("gemma-3-270m")
    assert "gemma-3-270m" in catalog.setup_models() and gemma.license_file == "GEMMA_TERMS.html"
    gguf = gemma.sources[0].files[0]
    assert [p.member.rsplit(".", 1)[1] for p in gguf.parts] == ["part00", "part01", "part02", "part03"]
    assert sum(p.size_bytes for p in gguf.parts) == gguf.size_bytes


def _wheel(folder: Path, name: str, members: dict[str, bytes]) -> Path:
    import zipfile

    path = folder / f"{name}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    return path


def test_chunk_with_a_wrong_hash_is_refused_naming_the_file(tmp_path):
    """The assembly code of the Gemma entry, on two small chunk wheels: a wrong chunk is refused."""
    import hashlib

    from edge_rtgi.catalog.registry import _assemble_parts
    from edge_rtgi.catalog.schema import FileSpec, PartSpec

    chunks = [b"GGUF" + b"a" * 100, b"b" * 50]
    wheels = {
        f"m-part{i}": _wheel(tmp_path, f"m_part{i}", {f"m_part{i}/data/m.gguf.part0{i}": c})
        for i, c in enumerate(chunks)
    }
    sha = [hashlib.sha256(c).hexdigest() for c in chunks]
    whole = hashlib.sha256(b"".join(chunks)).hexdigest()

    def spec(part1_sha: str) -> FileSpec:
        parts = (
            PartSpec("m_part0/data/m.gguf.part00", sha[0], len(chunks[0]), "m-part0"),
            PartSpec("m_part1/data/m.gguf.part01", part1_sha, len(chunks[1]), "m-part1"),
        )
        return FileSpec("m.gguf", sha256=whole, size_bytes=len(chunks[0]) + len(chunks[1]), parts=parts)

    out = tmp_path / "model"
    assert _assemble_parts(wheels, "m-part0", spec(sha[1]), out, False) == whole
    assert (out / "m.gguf").read_bytes() == b"".join(chunks)
    with pytest.raises(
        PinMismatchError, match=r"m\.gguf part m_part1-1\.0\.0-py3-none-any\.whl:m_part1/data/m\.gguf\.part01"
    ):
        _assemble_parts(wheels, "m-part0", spec("0" * 64), tmp_path / "bad", False)


def test_entry_fields():
    e = catalog.get_entry("smollm2-135m-instruct")
    assert (e.role, e.default, e.license) == ("llm", True, "Apache-2.0")
    assert e.source_kinds() == ("pypi", "hub")
    assert e.files[0].name.endswith(".gguf") and e.extra["format"] == "gguf"
    assert catalog.get_entry("piper-en_US-joe-medium").extra["sample_rate_hz"] == 22050
    assert [x.name for x in catalog.list_entries("vad")] == ["silero-vad"]


# ---------------------------------------------------------------- strictness


@pytest.mark.parametrize(
    "body, expected",
    [
        ("- {name: a, role: llm, colour: red, sources: []}\n", "catalog.yaml:3: unknown key 'colour'"),
        ("- {name: a, role: painter, sources: []}\n", "unknown role 'painter'"),
        (
            "- name: a\n  role: vad\n  sources:\n    - kind: ftp\n      files: [{name: x}]\n",
            "unknown source kind 'ftp'",
        ),
        (
            "- name: a\n  role: vad\n  sources:\n    - kind: pypi\n"
            "      packages: [{name: p, version: '1'}]\n"
            "      files: [{name: x, member: p/x}]\n",
            "needs a sha256 pin",
        ),
        (
            "- name: a\n  role: vad\n  sources:\n    - kind: pypi\n"
            "      packages: [{name: p, version: '1'}]\n"
            "      files: [{name: x, member: p/x, sha256: abc}]\n",
            "64 lowercase hex",
        ),
        (
            "- name: a\n  role: vad\n  sources:\n    - kind: hub\n      repo: o/r\n"
            "      files: [{name: x}]\n",
            "needs repo and revision",
        ),
        (
            "- name: a\n  role: vad\n  sources:\n    - kind: hub\n      repo: o/r\n      revision: main\n"
            "      files: [{name: ../x}]\n",
            "relative path inside the model folder",
        ),
    ],
)
def test_bad_catalogue_is_a_config_error_naming_the_file(tmp_path, body, expected):
    path = write_catalog(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        catalog.list_entries(catalog=path)
    assert expected in str(info.value)
    assert str(path) in str(info.value)


def test_duplicate_names_and_two_defaults_are_rejected(tmp_path):
    path = write_catalog(tmp_path, silero_entry(name="a") + silero_entry(name="a", default=False))
    with pytest.raises(ConfigError, match="listed twice"):
        catalog.list_entries(catalog=path)
    path = write_catalog(tmp_path, silero_entry(name="a") + silero_entry(name="b"))
    with pytest.raises(ConfigError, match="two default vad models: a and b"):
        catalog.list_entries(catalog=path)


def test_missing_catalogue_file(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_RTGI_CATALOG", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="model catalogue not found"):
        catalog.list_entries()


# ---------------------------------------------------------------- resolution


def test_existing_paths_are_returned_as_is(tmp_path):
    f = tmp_path / "my.gguf"
    f.write_bytes(b"GGUF")
    assert catalog.resolve_model(str(f)) == f
    assert catalog.resolve_model(tmp_path, role="asr") == tmp_path


def test_missing_path_is_a_file_error(tmp_path):
    with pytest.raises(ModelFileError, match="model path does not exist"):
        catalog.resolve_model(str(tmp_path / "absent.gguf"))


def test_unknown_name_lists_close_names():
    with pytest.raises(ModelNotFoundError) as info:
        catalog.resolve_model("whisper-tiny")
    msg = str(info.value)
    assert "unknown model 'whisper-tiny'" in msg and "whisper-tiny.en" in msg
    assert "edge-rtgi models list" in msg


def test_role_mismatch_is_an_error():
    with pytest.raises(ConfigError, match="is a tts model, but a llm model is needed") as info:
        catalog.resolve_model("piper-en_US-joe-medium", role="llm", pull=False)
    assert "smollm2-135m-instruct" in str(info.value)


def test_not_installed_without_pull(tmp_path):
    cat = write_catalog(tmp_path, silero_entry())
    with pytest.raises(ModelFileError, match="not in the cache"):
        catalog.resolve_model("vad-test", pull=False, cache_dir=tmp_path / "c", catalog=cat)


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGE_RTGI_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "edge-rtgi" / "models"
    monkeypatch.setenv("EDGE_RTGI_MODEL_DIR", str(tmp_path / "env"))
    assert catalog.cache_dir() == tmp_path / "env"
    assert catalog.cache_dir(tmp_path / "cfg") == tmp_path / "cfg"
    monkeypatch.delenv("EDGE_RTGI_MODEL_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert catalog.cache_dir() == Path.home() / ".cache" / "edge-rtgi" / "models"


# ---------------------------------------------------------------- pulls that need no network


def test_python_package_pull_installs_verifies_and_is_a_noop_the_second_time(tmp_path):
    cat, cache = write_catalog(tmp_path, silero_entry()), tmp_path / "cache"
    path = catalog.resolve_model("vad-test", role="vad", cache_dir=cache, catalog=cat)
    assert path == cache / "vad-test" / "silero.onnx"
    assert sha256_file(path) == SILERO_SHA256
    assert (cache / "vad-test" / MANIFEST_NAME).is_file()
    assert catalog.verify("vad-test", cache_dir=cache, catalog=cat) == [("silero.onnx", True)]
    mtime = path.stat().st_mtime_ns
    assert catalog.pull("vad-test", cache_dir=cache, catalog=cat) == path
    assert path.stat().st_mtime_ns == mtime
    assert [p.name for p in cache.iterdir() if p.name.startswith(".partial")] == []


def test_wrong_pin_is_detected_and_the_file_refused(tmp_path):
    cat, cache = write_catalog(tmp_path, silero_entry(sha256="'" + "0" * 64 + "'")), tmp_path / "cache"
    with pytest.raises(PinMismatchError) as info:
        catalog.pull("vad-test", cache_dir=cache, catalog=cat, progress=False)
    assert f"sha256 {SILERO_SHA256}, pinned {'0' * 64}; file refused" in str(info.value)
    assert not (cache / "vad-test").exists()
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".locks")] == []


def test_verify_detects_a_corrupted_file(tmp_path):
    cat, cache = write_catalog(tmp_path, silero_entry()), tmp_path / "cache"
    path = catalog.pull("vad-test", cache_dir=cache, catalog=cat, progress=False)
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF  # same size, different bytes: only a re-hash notices
    path.write_bytes(bytes(data))
    assert catalog.verify("vad-test", cache_dir=cache, catalog=cat) == [("silero.onnx", False)]
    path.unlink()
    assert catalog.verify("vad-test", cache_dir=cache, catalog=cat) == [("silero.onnx", False)]
    assert not catalog.is_installed("vad-test", cache_dir=cache, catalog=cat)


def test_tree_digest_matches_the_documented_shell_pipeline(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for rel, text in {"b.txt": "bee", "a.txt": "a", "sub/c": "sea", "Z": "upper"}.items():
        (tmp_path / "d" / rel).write_text(text)
    hashes = {
        str(p.relative_to(tmp_path / "d")): sha256_file(p) for p in (tmp_path / "d").rglob("*") if p.is_file()
    }
    shell = subprocess.run(
        "(find . -type f | sed 's|^./||' | LC_ALL=C sort | xargs sha256sum) | sha256sum",
        shell=True,
        cwd=tmp_path / "d",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    assert tree_digest(hashes) == shell


# ---------------------------------------------------------------- the hub, offline


@pytest.mark.timeout(60)
def test_unreachable_hub_fails_fast_and_names_alternatives(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # .invalid never resolves (RFC 2606)
    cat = write_catalog(
        tmp_path, HUB_ONLY + textwrap.dedent(silero_entry()).replace("role: vad", "role: llm")
    )
    with pytest.raises(DownloadError) as info:
        catalog.pull("hub-only-llm", cache_dir=tmp_path / "c", catalog=cat, progress=False)
    msg = str(info.value)
    assert "cannot reach the model hub at https://hub.invalid" in msg
    assert "alternatives:" in msg and "vad-test" in msg and "local path" in msg


@pytest.mark.timeout(60)
def test_hub_that_accepts_but_never_answers_ends_in_a_clear_error(tmp_path, monkeypatch):
    from edge_rtgi.catalog import hub

    server = socket.create_server(("127.0.0.1", 0))  # listens, never reads or replies
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setattr(hub, "HUB_API_TIMEOUT_S", 1.0)
        cat = write_catalog(tmp_path, HUB_ONLY)
        start = time.monotonic()
        with pytest.raises(
            DownloadError, match="hub request for HuggingFaceTB/SmolLM2-135M-Instruct@main failed"
        ):
            catalog.pull("hub-only-llm", cache_dir=tmp_path / "c", catalog=cat, progress=False)
        assert time.monotonic() - start < 30  # generous: guards against a hang, not a timing claim
    finally:
        server.close()


def test_hub_offline_env_and_source_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError) as info:
        catalog.pull("smollm2-135m-instruct", source="hub", cache_dir=tmp_path, progress=False)
    assert "HF_HUB_OFFLINE" in str(info.value) and "`--source pypi`" in str(info.value)
    with pytest.raises(ConfigError, match="has no pypi source"):
        catalog.pull("qwen2.5-0.5b-instruct", source="pypi", cache_dir=tmp_path)


@pytest.mark.timeout(60)
def test_real_hub_endpoint_offline_here(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        probe_hub()
    except DownloadError:
        pass
    else:
        pytest.skip("the model hub is reachable from this machine")
    with pytest.raises(DownloadError, match="cannot reach the model hub at https://huggingface.co") as info:
        catalog.pull("whisper-small", cache_dir=tmp_path, progress=False)
    assert "whisper-tiny.en" in str(info.value)  # a registry-backed asr alternative


def test_configured_values_override_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_RTGI_MODEL_DIR", str(tmp_path / "env"))
    cat = write_catalog(tmp_path, silero_entry())
    cfg = from_dict(catalog.ModelsConfig, {"cache_dir": str(tmp_path / "cfg"), "catalog": str(cat)})
    catalog.configure(cfg)
    try:
        assert catalog.cache_dir() == tmp_path / "cfg"
        assert catalog.cache_dir(tmp_path / "arg") == tmp_path / "arg"
        assert catalog.resolve_model("vad-test") == tmp_path / "cfg" / "vad-test" / "silero.onnx"
    finally:
        catalog.configure(None)
    assert catalog.cache_dir() == tmp_path / "env"
    with pytest.raises(ConfigError, match="unknown key 'cache_path'"):
        from_dict(catalog.ModelsConfig, {"cache_path": "x"})


def test_concurrent_pulls_of_one_model_install_it_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cat, cache = write_catalog(tmp_path, silero_entry()), tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:
        paths = list(
            pool.map(lambda _: catalog.resolve_model("vad-test", cache_dir=cache, catalog=cat), range(4))
        )
    assert set(paths) == {cache / "vad-test" / "silero.onnx"}
    assert sorted(p.name for p in cache.iterdir()) == [".locks", "vad-test"]
    assert catalog.verify("vad-test", cache_dir=cache, catalog=cat) == [("silero.onnx", True)]


def test_leftovers_of_a_killed_pull_are_cleaned_up(tmp_path):
    cat, cache = write_catalog(tmp_path, silero_entry()), tmp_path / "cache"
    for leftover in (".partial-vad-test-999999", ".scratch-vad-test-999999", ".partial-vad-test-x-1"):
        (cache / leftover).mkdir(parents=True)
        (cache / leftover / "junk").write_bytes(b"x")
    catalog.pull("vad-test", cache_dir=cache, catalog=cat, progress=False)
    # another model's staging folder (vad-test-x) is not this pull's business
    assert sorted(p.name for p in cache.iterdir()) == [".locks", ".partial-vad-test-x-1", "vad-test"]


def test_an_unwritable_cache_is_a_clear_error(tmp_path):
    cat = write_catalog(tmp_path, silero_entry())
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ModelFileError, match="cannot write model vad-test into the cache") as info:
        catalog.pull("vad-test", cache_dir=tmp_path / "file" / "cache", catalog=cat, progress=False)
    assert "EDGE_RTGI_MODEL_DIR" in str(info.value)


def test_a_changed_catalogue_pin_makes_the_cached_copy_stale(tmp_path):
    cat, cache = write_catalog(tmp_path, silero_entry()), tmp_path / "cache"
    catalog.pull("vad-test", cache_dir=cache, catalog=cat, progress=False)
    assert catalog.is_installed("vad-test", cache_dir=cache, catalog=cat)
    (tmp_path / "v2").mkdir()
    other = write_catalog(tmp_path / "v2", silero_entry(sha256="'" + "1" * 64 + "'"))
    assert not catalog.is_installed("vad-test", cache_dir=cache, catalog=other)
    with pytest.raises(PinMismatchError):  # the new pin is fetched, not the old file served
        catalog.resolve_model("vad-test", cache_dir=cache, catalog=other)
    assert catalog.is_installed("vad-test", cache_dir=cache, catalog=cat)  # the old copy stays until replaced


def test_the_packaged_catalogue_is_the_repo_catalogue():
    from edge_rtgi.catalog import _PACKAGED_CATALOG, _REPO_CATALOG

    assert _PACKAGED_CATALOG.read_bytes() == _REPO_CATALOG.read_bytes()
