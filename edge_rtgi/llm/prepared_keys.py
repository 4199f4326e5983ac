"""What identifies a prepared copy of a model's weights (``llm.prepared``); imports no torch."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENV_SWITCH = "EDGE_RTGI_PREPARED"  # "0" / "off": never read or write prepared copies
# The modules whose code decides what a prepared copy holds; editing any of them rebuilds it.
_CODE_FILES = (
    "model.py",
    "weights.py",
    "gguf_file.py",
    "tokenizer.py",
    "rope.py",
    "prepared.py",
    "prepared_keys.py",
    "quant/__init__.py",
    "quant/kernels.py",
    "quant/plan.py",
    "quant/policy.py",
    "quant/schemes.py",
)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").lower() not in ("0", "off", "false", "no")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Digest of the weight-building code and of the torch version it runs on."""
    root = Path(__file__).parent
    digest = hashlib.sha256(importlib.metadata.version("torch").encode())
    for name in _CODE_FILES:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()[:16]


def prepared_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<model cache>/.prepared`` (``catalog.cache_dir`` decides the model cache)."""
    from edge_rtgi.catalog import cache_dir as model_cache_dir

    return model_cache_dir(cache_dir) / ".prepared"


def source_sha256(path: Path, root: Path) -> str:
    """The file's sha256, remembered in ``root/source-hashes.json`` by path, size, mtime and inode."""
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    memo_file = root / "source-hashes.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    entry = memo.get(str(path.resolve()))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and entry.get("sha256"):
        return str(entry["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    memo[str(path.resolve())] = {**stamp, "sha256": digest.hexdigest()}
    try:
        root.mkdir(parents=True, exist_ok=True)
        atomic_write(memo_file, json.dumps(memo, indent=1))
    except OSError as exc:
        log.debug("cannot remember the hash of %s: %s", path, exc)
    return digest.hexdigest()


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def tokenizer_file(root: Path, source_sha: str) -> Path:
    """Where the tokenizer of a source file is kept (shared by all its prepared copies)."""
    return root / "tokenizers" / f"{source_sha[:24]}-{code_version()}.json"
