"""The model cache on disk: location, hashing, per-model manifests, atomic installs, locking.

Layout: ``<cache>/<name>/`` holds a model's files plus ``.edge-rtgi-manifest.json``, which
records the source it came from and the sha256 and size of every file as verified at pull
time. A pull builds the folder under ``<cache>/.partial-<name>-<pid>/`` and renames it into
place only after every hash matched, so a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from edge_rtgi.errors import ModelFileError

MANIFEST_NAME = ".edge-rtgi-manifest.json"
_CHUNK_BYTES = 1 << 20


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where models live.

    In order: an explicit ``override`` (from the config or ``--cache-dir``),
    ``$EDGE_RTGI_MODEL_DIR``, ``$XDG_CACHE_HOME/edge-rtgi/models``, ``~/.cache/edge-rtgi/models``.
    """
    if override:
        return Path(override).expanduser()
    env = os.environ.get("EDGE_RTGI_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "edge-rtgi" / "models"


class PinMismatchError(ModelFileError):
    """A file's sha256 or size differs from its pin; the file is refused."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


class ByteReader(Protocol):
    """A binary stream to read from (a file, a zip member)."""

    def read(self, size: int, /) -> bytes: ...


class ByteWriter(Protocol):
    """A binary stream to write to (a file, or anything that passes the bytes on)."""

    def write(self, data: bytes, /) -> object: ...


class Progress(Protocol):
    """A progress bar (tqdm's ``update``)."""

    def update(self, n: int, /) -> object: ...


def copy_hashing(src: ByteReader, dst: ByteWriter, progress: Progress | None = None) -> tuple[str, int]:
    """Copy a stream, returning (sha256 hex, size in bytes); ``progress.update(n)`` per chunk."""
    h = hashlib.sha256()
    size = 0
    for chunk in iter(lambda: src.read(_CHUNK_BYTES), b""):
        h.update(chunk)
        dst.write(chunk)
        size += len(chunk)
        if progress is not None:
            progress.update(len(chunk))
    return h.hexdigest(), size


def tree_digest(file_hashes: dict[str, str]) -> str:
    """Digest of a folder: sha256 of ``"<sha256>  <relpath>\\n"`` lines sorted by relpath.

    The same as ``(cd DIR && find . -type f | sed 's|^./||' | LC_ALL=C sort | xargs sha256sum) | sha256sum``
    for names without spaces.
    """
    lines = "".join(f"{file_hashes[p]}  {p}\n" for p in sorted(file_hashes))
    return hashlib.sha256(lines.encode()).hexdigest()


def check_pin(
    what: str,
    expected_sha256: str | None,
    actual_sha256: str,
    expected_size: int | None = None,
    actual_size: int | None = None,
) -> None:
    """Raise PinMismatchError when a pinned hash or size differs."""
    if expected_size is not None and actual_size is not None and expected_size != actual_size:
        raise PinMismatchError(
            f"{what}: size {actual_size} bytes, pinned {expected_size}; file refused",
            hint="the source changed or the download was corrupted; retry with --force or another --source",
        )
    if expected_sha256 is not None and expected_sha256 != actual_sha256:
        raise PinMismatchError(
            f"{what}: sha256 {actual_sha256}, pinned {expected_sha256}; file refused",
            hint="the source changed or the download was corrupted; retry with --force or another --source",
        )


@dataclass(frozen=True)
class Manifest:
    """What a pull installed: the source, the entry path and every file's verified hash."""

    name: str
    source: str  # SourceSpec.describe(), plus the resolved commit for hub sources
    source_kind: str
    path: str  # what resolve_model returns, relative to the model folder
    files: dict[str, dict]  # relpath -> {"sha256": ..., "size_bytes": ...}
    pulled_at: float

    def write(self, folder: Path) -> None:
        data = dict(self.__dict__)
        (folder / MANIFEST_NAME).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")

    @classmethod
    def read(cls, folder: Path) -> Manifest | None:
        try:
            data = json.loads((folder / MANIFEST_NAME).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    def total_bytes(self) -> int:
        return sum(int(f["size_bytes"]) for f in self.files.values())

    def sizes_match(self, folder: Path) -> bool:
        """Cheap presence check: every file exists with its recorded size (no hashing)."""
        for rel, info in self.files.items():
            try:
                if (folder / rel).stat().st_size != int(info["size_bytes"]):
                    return False
            except OSError:
                return False
        return True


def new_manifest(
    name: str, source: str, source_kind: str, path: str, folder: Path, hashes: dict[str, str]
) -> Manifest:
    files = {rel: {"sha256": sha, "size_bytes": (folder / rel).stat().st_size} for rel, sha in hashes.items()}
    return Manifest(name, source, source_kind, path, files, time.time())


@contextlib.contextmanager
def model_lock(root: Path, name: str) -> Iterator[None]:
    """Serialise pulls of one model across processes (tests and daemons run side by side)."""
    locks = root / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging_dir(root: Path, name: str) -> Iterator[tuple[Path, Path]]:
    """(staging folder, scratch folder) next to the final one: same file system, so the
    rename into place is atomic. Call with the model's lock held: leftovers of this model from
    a pull that was killed are removed first, since no other pull of it can be running."""
    stale = re.compile(rf"^\.(partial|scratch|trash)-{re.escape(name)}-\d+$")
    for old in root.iterdir():
        if stale.match(old.name):
            shutil.rmtree(old, ignore_errors=True)
    staged, scratch = root / f".partial-{name}-{os.getpid()}", root / f".scratch-{name}-{os.getpid()}"
    staged.mkdir(parents=True)
    scratch.mkdir()
    try:
        yield staged, scratch
    finally:
        shutil.rmtree(staged, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def install(staged: Path, final: Path) -> None:
    """Move a verified staging folder into place, replacing an older copy if there is one."""
    trash = final.with_name(f".trash-{final.name}-{os.getpid()}")
    if final.exists():
        os.rename(final, trash)
    os.rename(staged, final)
    shutil.rmtree(trash, ignore_errors=True)
