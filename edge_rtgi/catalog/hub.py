"""The model hub (Hugging Face) source: the real download path on users' machines.

A hub source pins a repo and a revision. At download time the revision is resolved to a
commit, the hub's published hashes of each file are fetched (``lfs.sha256`` for LFS files, the
git blob id for small ones) and every downloaded byte is checked against them. A catalogue
sha256 pin, where one is given, is checked as well.

Offline, this must fail fast: before anything else the endpoint (or the HTTPS proxy) gets a
plain TCP connect with a short timeout, so a machine without the hub learns so in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from tqdm import tqdm

from edge_rtgi.catalog.cache import check_pin, sha256_file
from edge_rtgi.catalog.schema import SourceSpec
from edge_rtgi.errors import DownloadError

HUB_TIMEOUT_S = 3.0  # TCP connect probe: no DNS, no route or a dropped SYN shows up within this
HUB_API_TIMEOUT_S = 10.0  # each metadata request; a hub that accepts but never answers ends here
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubUnavailableError(DownloadError):
    """The hub cannot be reached (offline, blocked, HF_HUB_OFFLINE set)."""


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def probe_hub(endpoint: str | None = None, timeout_s: float = HUB_TIMEOUT_S) -> None:
    """Raise HubUnavailableError unless a TCP connection to the hub (or its proxy) opens in time."""
    endpoint = endpoint or hub_endpoint()
    if _truthy(os.environ.get("HF_HUB_OFFLINE")):
        raise HubUnavailableError(
            f"the model hub is disabled (HF_HUB_OFFLINE is set); cannot reach {endpoint}"
        )
    url = urlparse(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        purl = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        host, port = purl.hostname or host, purl.port or 8080
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise HubUnavailableError(
            f"cannot reach the model hub at {endpoint} ({host}:{port}: {exc})"
        ) from None


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file, which the hub publishes for files not stored in LFS."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # git's own blob id, not security
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _SilentTqdm(tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def _hub_errors(source: SourceSpec, endpoint: str, doing: str) -> Iterator[None]:
    """Turn the hub client's exceptions into one-line DownloadErrors that say what to do."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    repo = source.repo
    try:
        yield
    except GatedRepoError:
        raise DownloadError(
            f"{repo} is gated on the hub",
            hint=f"accept its licence at {endpoint}/{repo}, then log in with `hf auth login` or set HF_TOKEN",
        ) from None
    except RevisionNotFoundError:
        raise DownloadError(f"{repo} has no revision {source.revision!r} on {endpoint}") from None
    except RepositoryNotFoundError:
        raise DownloadError(f"{repo} is not on {endpoint} (or it is private: set HF_TOKEN)") from None
    except Exception as exc:  # noqa: BLE001 - network and HTTP errors of several libraries end up here
        raise DownloadError(f"{doing} failed: {exc}") from None


def _remote_metadata(source: SourceSpec, endpoint: str) -> tuple[str, dict]:
    """Resolve the revision to a commit and fetch the hub's record of each file."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint)
    repo = source.required_repo()
    doing = f"hub request for {repo}@{source.revision}"
    with _hub_errors(source, endpoint, doing):
        commit = api.model_info(repo, revision=source.revision, timeout=HUB_API_TIMEOUT_S).sha
    if commit is None:
        raise DownloadError(f"{doing}: the hub gave no commit")
    with _hub_errors(source, endpoint, doing):
        members = [f.member or f.name for f in source.files]
        infos = {p.path: p for p in api.get_paths_info(repo, members, revision=commit)}
    return commit, infos


def fetch_hub(
    source: SourceSpec, folder: Path, scratch: Path, progress: bool, timeout_s: float = HUB_TIMEOUT_S
) -> tuple[dict[str, str], str]:
    """Download a hub source's files into ``folder``; return ({relpath: sha256}, commit)."""
    endpoint = hub_endpoint()
    probe_hub(endpoint, timeout_s)
    from huggingface_hub import hf_hub_download

    commit, infos = _remote_metadata(source, endpoint)
    hashes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".hub-") as tmp:
        for f in source.files:
            member = f.member or f.name
            remote = infos.get(member)
            if remote is None:
                raise DownloadError(f"{source.repo}@{commit[:12]} has no file {member!r}")
            with _hub_errors(source, endpoint, f"downloading {source.repo}/{member}"):
                local = Path(
                    hf_hub_download(
                        source.required_repo(),
                        member,
                        revision=commit,
                        local_dir=tmp,
                        endpoint=endpoint,
                        etag_timeout=HUB_API_TIMEOUT_S,
                        tqdm_class=None if progress else _SilentTqdm,
                    )
                )
            sha = sha256_file(local)
            what = f"{f.name} (from {source.repo}@{commit[:12]}/{member})"
            if remote.lfs is not None:
                check_pin(
                    what + " vs the hub's sha256", remote.lfs.sha256, sha, remote.size, local.stat().st_size
                )
            else:
                check_pin(what + " vs the hub's git blob id", remote.blob_id, git_blob_sha1(local))
            check_pin(what, f.sha256, sha, f.size_bytes, local.stat().st_size)
            target = folder / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(local, target)
            hashes[f.name] = sha
    return hashes, commit
