"""The hub source end to end against a loopback server that speaks the hub's HTTP API.

This machine cannot reach the real hub, so a small local server answers the four requests the
hub client makes (model info, paths-info, HEAD and GET of a file) with the real response
shapes. What is under test is our side: revision -> commit, the hub's published hashes (LFS
sha256, git blob id) checked against the downloaded bytes, files moved into place, refusals.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote

import pytest

from edge_rtgi import catalog
from edge_rtgi.catalog.cache import PinMismatchError
from edge_rtgi.catalog.hub import git_blob_sha1
from edge_rtgi.errors import DownloadError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-voice"


class FakeRepo:
    """Files as the hub publishes them, plus the bytes it actually serves (which a test may corrupt)."""

    def __init__(self, files: dict[str, bytes], lfs: set[str]):
        self.published = dict(files)
        self.served = dict(files)
        self.lfs = lfs
        self.gated = False  # True: metadata is public, downloads answer 403 GatedRepo (as the hub does)

    def path_info(self, path: str) -> dict:
        data = self.published[path]
        info = {
            "type": "file",
            "path": path,
            "size": len(data),
            "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
        }
        if path in self.lfs:
            info["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return info


def make_handler(repo: FakeRepo):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _send(self, code: int, body: bytes, headers: dict | None = None, head: bool = False):
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _file(self, head: bool):
            m = re.match(rf"^/{REPO}/resolve/([^/]+)/(.+)$", unquote(self.path))
            if not m or m.group(2) not in repo.served:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
            path = m.group(2)
            if repo.gated:
                return self._send(
                    403,
                    b"",
                    {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted."},
                    head,
                )
            data = repo.served[path]
            etag = repo.path_info(path).get("lfs", {}).get("oid") or repo.path_info(path)["oid"]
            self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}, head)

        def do_HEAD(self):
            self._file(head=True)

        def do_GET(self):
            if self.path.startswith(f"/api/models/{REPO}/revision/"):
                body = json.dumps({"id": REPO, "sha": COMMIT, "siblings": []}).encode()
                return self._send(200, body, {"Content-Type": "application/json"})
            self._file(head=False)

        def do_POST(self):
            if not self.path.startswith(f"/api/models/{REPO}/paths-info/{COMMIT}"):
                return self._send(404, b"")
            form = self.rfile.read(int(self.headers["Content-Length"])).decode()
            ctype = self.headers.get("Content-Type", "")
            paths = json.loads(form)["paths"] if "json" in ctype else parse_qs(form)["paths"]
            body = json.dumps([repo.path_info(p) for p in paths if p in repo.published]).encode()
            self._send(200, body, {"Content-Type": "application/json"})

    return Handler


@pytest.fixture
def hub(monkeypatch):
    onnx = bytes(range(256)) * 64
    repo = FakeRepo(
        {"voices/x.onnx": onnx, "voices/x.onnx.json": b'{"audio": {"sample_rate": 22050}}\n'},
        lfs={"voices/x.onnx"},
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(repo))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield repo
    server.shutdown()
    server.server_close()


def hub_catalog(tmp_path: Path, json_pin: str | None = None) -> Path:
    pin = f", sha256: '{json_pin}'" if json_pin else ""
    path = tmp_path / "catalog.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        version: 1
        models:
          - name: voice-x
            role: tts
            sources:
              - kind: hub
                repo: {REPO}
                revision: main
                files:
                  - {{name: x.onnx, member: voices/x.onnx}}
                  - {{name: x.onnx.json, member: voices/x.onnx.json{pin}}}
        """)
    )
    return path


def test_git_blob_sha1_matches_git(tmp_path):
    f = tmp_path / "f.json"
    f.write_bytes(b'{"a": 1}\n\x00binary\xff')
    git = subprocess.run(["git", "hash-object", str(f)], capture_output=True, text=True, check=True)
    assert git_blob_sha1(f) == git.stdout.strip()


@pytest.mark.timeout(120)
def test_hub_pull_checks_published_hashes_and_records_the_commit(tmp_path, hub):
    cat, cache = hub_catalog(tmp_path), tmp_path / "cache"
    folder = catalog.pull("voice-x", cache_dir=cache, catalog=cat, progress=False)
    assert folder == cache / "voice-x"
    assert (folder / "x.onnx").read_bytes() == hub.published["voices/x.onnx"]
    assert (folder / "x.onnx.json").read_bytes() == hub.published["voices/x.onnx.json"]
    manifest = json.loads((folder / ".edge-rtgi-manifest.json").read_text())
    assert manifest["source"] == f"hub {REPO}@{COMMIT}"
    assert catalog.verify("voice-x", cache_dir=cache, catalog=cat) == [
        ("x.onnx", True),
        ("x.onnx.json", True),
    ]
    assert sorted(p.name for p in cache.iterdir()) == [".locks", "voice-x"]  # no staging left over


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "path, what",
    [("voices/x.onnx", "vs the hub's sha256"), ("voices/x.onnx.json", "vs the hub's git blob id")],
)
def test_bytes_that_differ_from_the_hubs_hashes_are_refused(tmp_path, hub, path, what):
    served = bytearray(hub.served[path])
    served[3] ^= 0x20  # same size, different bytes
    hub.served[path] = bytes(served)
    cat, cache = hub_catalog(tmp_path), tmp_path / "cache"
    with pytest.raises(PinMismatchError, match=re.escape(what)):
        catalog.pull("voice-x", cache_dir=cache, catalog=cat, progress=False)
    assert not (cache / "voice-x").exists()


@pytest.mark.timeout(120)
def test_a_catalogue_pin_on_a_hub_file_is_checked_too(tmp_path, hub):
    cat = hub_catalog(tmp_path, json_pin="a" * 64)
    with pytest.raises(PinMismatchError, match="pinned a{64}; file refused"):
        catalog.pull("voice-x", cache_dir=tmp_path / "cache", catalog=cat, progress=False)


@pytest.mark.timeout(120)
def test_a_file_missing_on_the_hub_is_named(tmp_path, hub):
    del hub.published["voices/x.onnx.json"]
    with pytest.raises(DownloadError, match=rf"{REPO}@{COMMIT[:12]} has no file 'voices/x.onnx.json'"):
        catalog.pull("voice-x", cache_dir=tmp_path / "cache", catalog=hub_catalog(tmp_path), progress=False)


@pytest.mark.timeout(120)
def test_a_gated_repo_says_how_to_get_access(tmp_path, hub):
    hub.gated = True
    with pytest.raises(DownloadError, match=f"{REPO} is gated on the hub") as info:
        catalog.pull("voice-x", cache_dir=tmp_path / "cache", catalog=hub_catalog(tmp_path), progress=False)
    assert "accept its licence" in str(info.value) and "HF_TOKEN" in str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_hub_source_in_the_catalogue_exists_on_the_real_hub(monkeypatch):
    """Where the real hub is reachable, each hub source's repo, revision and files exist (metadata only)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError

    from edge_rtgi.catalog.hub import probe_hub

    for var in ("HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    try:
        probe_hub()
    except DownloadError:
        pytest.skip("the model hub is not reachable from this machine")
    api = HfApi()
    for entry in catalog.list_entries():
        for source in (s for s in entry.sources if s.kind == "hub"):
            members = [f.member or f.name for f in source.files]
            try:
                found = {p.path for p in api.get_paths_info(source.repo, members, revision=source.revision)}
            except GatedRepoError:
                assert source.gated, f"{entry.name}: {source.repo} is gated but not marked gated"
                continue
            assert found == set(members), f"{entry.name}: missing on the hub: {set(members) - found}"
