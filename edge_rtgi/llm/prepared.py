"""Prepared weights: the model as the engine runs it, kept in the model cache and memory-mapped.

Loading a GGUF file means parsing its metadata, building the tokenizer from its vocabulary,
dequantising every tensor, assembling our fused layout and then quantising again for the
kernels (``quant: auto``). The result depends only on the file, the code that did the work and
the settings, so it is kept: ``load_prepared`` writes the finished tensors (kernel layouts, the
dense copies for many-row inputs, the float norms) to one flat file next to the config and the
tokenizer, and the next start maps that file into memory and wraps views of it, copying
nothing.

Key: the source file's sha256 (remembered per path, size, mtime and inode, so an unchanged
file is hashed once), ``code_version()`` (a digest of the modules that build the weights and of
torch's version), and the device type, dtype and quantisation setting. A prepared copy whose
recorded key differs from the one expected is rebuilt, never used. Where no copy can be kept
(not a GGUF file, not the CPU, a quantisation plan or checkpoint file), the model loads as
before. ``EDGE_RTGI_PREPARED=0`` switches the cache off.

Layout of ``<model cache>/.prepared/<key>/``: ``meta.json`` (the key, the config, the
tokenizer's special tokens and template, the quantised layers, the tensor index) and
``weights.bin`` (tensors at 64-byte aligned offsets); the tokenizer, the same for every
setting, is ``.prepared/tokenizers/<source sha256>-<code version>.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from edge_rtgi.device import resolve_device, resolve_dtype
from edge_rtgi.llm import prepared_keys as keys
from edge_rtgi.llm.model import ModelConfig, Transformer
from edge_rtgi.llm.rope import RotaryEmbedding
from edge_rtgi.llm.tokenizer import Tokenizer
from edge_rtgi.llm.weights import LoadedModel, load_model, resolve_source

log = logging.getLogger(__name__)

FORMAT = "edge-rtgi-prepared/1"
_ALIGN = 64
_CACHEABLE_QUANT = (None, "", "none", "auto", "int8", "int4-g32", "int4-g64", "int4-g128")


@dataclass(frozen=True)
class PreparedModel:
    """A loaded model, what quantisation it got, and whether it came from a prepared copy."""

    loaded: LoadedModel
    quant: str | None  # apply_engine_quant's description (None: full precision)
    hit: bool
    cache_path: Path | None


def load_prepared(
    source: str | Path,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    quant: str | None = "auto",
    *,
    cache_dir: str | os.PathLike | None = None,
) -> PreparedModel:
    """``load_model`` + ``apply_engine_quant``, from a prepared copy when one matches."""
    from edge_rtgi.llm.quant import apply_engine_quant

    path = resolve_source(source)
    torch_device = device if isinstance(device, torch.device) else resolve_device(device)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, torch_device)
    cacheable = (
        path.is_file()
        and path.suffix == ".gguf"
        and torch_device.type == "cpu"
        and quant in _CACHEABLE_QUANT
        and keys.enabled()
    )
    if not cacheable:
        loaded = load_model(path, torch_device, torch_dtype)
        return PreparedModel(loaded, apply_engine_quant(loaded.model, quant, loaded.tokenizer), False, None)
    from edge_rtgi.llm import cpu_ops

    cpu_ops.prepare(torch_device)  # before the key, which reads which kernels loaded
    root = keys.prepared_root(cache_dir)
    key = _key(path, root, torch_dtype, quant)
    folder = root / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    found = _read(folder, key, keys.tokenizer_file(root, key["source_sha256"]))
    if found is not None:
        loaded, applied = found
        return PreparedModel(loaded, applied, True, folder)
    started = time.perf_counter()
    loaded = load_model(path, torch_device, torch_dtype)
    applied = apply_engine_quant(loaded.model, quant, loaded.tokenizer)
    try:
        _write(folder, key, loaded, applied, keys.tokenizer_file(root, key["source_sha256"]))
        log.info("prepared %s in %.1f s (%s)", path.name, time.perf_counter() - started, folder)
    except OSError as exc:  # a full or read-only cache costs the next start time, nothing else
        log.warning("could not keep prepared weights in %s: %s", folder, exc)
    return PreparedModel(loaded, applied, False, folder)


# --- the key -----------------------------------------------------------------------------------


def _key(path: Path, root: Path, dtype: torch.dtype, quant: str | None) -> dict[str, str]:
    from edge_rtgi.llm.quant.kernels import cpu_int4_layout
    from edge_rtgi.llm.quant.policy import auto_quant_kernel_max_rows, resolve_weight_quant

    return {
        "format": FORMAT,
        "source_sha256": keys.source_sha256(path, root),
        "code_version": keys.code_version(),
        "device": "cpu",
        "dtype": str(dtype),
        "quant": str(quant),
        # what "auto" resolves to depends on the CPU's kernels too (int8_activations_fast)
        "weights": str(resolve_weight_quant(quant, torch.device("cpu"), dtype)),
        # int4 weights are stored in ATen's pack, whose layout follows the CPU ATen runs its code for
        "int4_pack": str(layout.key if (layout := cpu_int4_layout()) is not None else None),
        # the layers store the row limit of quant "auto", which depends on the CPU's kernels
        # (AMX or not): a copy made where it differed must not be reused here
        "kernel_max_rows": str(auto_quant_kernel_max_rows()),
    }


# --- writing -----------------------------------------------------------------------------------


def _model_tensors(model: Transformer) -> dict[str, Tensor]:
    """Every parameter and buffer (non-persistent ones too, such as the dense copies), once per name."""
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out[name] = param.detach()
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer is not None:
            out[name] = buffer
    return out


def _quant_layers(model: Transformer) -> dict[str, dict[str, Any]]:
    from edge_rtgi.llm.quant.kernels import Int4Linear, QuantLinear

    layers = {}
    for path, module in model.named_modules():
        if isinstance(module, QuantLinear):
            layers[path] = {
                "kind": type(module).__name__,
                "in_features": module.in_features,
                "out_features": module.out_features,
                "scheme": module.scheme_name,
                "group_size": module.group_size if isinstance(module, Int4Linear) else None,
                "max_kernel_rows": module.max_kernel_rows,
            }
    return layers


def _write(
    folder: Path, key: dict[str, str], loaded: LoadedModel, applied: str | None, tokenizer_file: Path
) -> None:
    from edge_rtgi.llm.quant.kernels import TiedQuantEmbedding

    model, tok = loaded.model, loaded.tokenizer
    folder.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".building-"))
    try:
        index: dict[str, dict[str, Any]] = {}
        storage_names: dict[tuple[int, int, tuple[int, ...], str], str] = {}  # shared tensors once
        offset = 0
        with open(staged / "weights.bin", "wb") as f:
            for name, t in _model_tensors(model).items():
                t = t.contiguous()
                ident = (t.data_ptr(), t.numel(), tuple(t.shape), str(t.dtype))
                if ident in storage_names:
                    index[name] = {"alias": storage_names[ident]}
                    continue
                storage_names[ident] = name
                data = t.view(torch.uint8).reshape(-1) if t.numel() else torch.empty(0, dtype=torch.uint8)
                pad = -offset % _ALIGN
                f.write(b"\0" * pad)
                offset += pad
                f.write(data.numpy().data)
                index[name] = {"offset": offset, "dtype": str(t.dtype), "shape": list(t.shape)}
                offset += data.numel()
        if not tokenizer_file.is_file():
            tokenizer_file.parent.mkdir(parents=True, exist_ok=True)
            keys.atomic_write(tokenizer_file, tok.backend.to_str())
        meta = {
            **key,
            "config": dataclasses.asdict(loaded.config),
            "source": str(loaded.source),
            "applied_quant": applied,
            "tokenizer": {
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "eos_token_ids": list(tok.eos_token_ids),
                "chat_template": tok.chat_template,
                "special_tokens": tok.special_tokens,
            },
            "quant_layers": _quant_layers(model),
            "tied_quant_embedding": isinstance(model.embed_tokens, TiedQuantEmbedding),
            "source_weight_formats": model.source_weight_formats,
            "attention_scaling": {
                "rotary": model.rotary.attention_scaling,
                "rotary_local": model.rotary_local.attention_scaling if model.rotary_local else None,
            },
            "tensors": index,
            "weights_bytes": offset,
        }
        (staged / "meta.json").write_text(json.dumps(meta))
        if folder.exists():
            shutil.rmtree(folder)  # a stale or damaged copy under the same key
        os.replace(staged, folder)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)
    _prune(folder, str(loaded.source), key)


def _prune(kept: Path, source: str, key: dict[str, str]) -> None:
    """Remove copies of the same source file built from another file version or by other code
    (they would never be used again); copies for other settings (dtype, quant) stay."""
    for meta_file in kept.parent.glob("*/meta.json"):
        if meta_file.parent == kept:
            continue
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            continue
        same_settings = all(meta.get(k) == key[k] for k in ("device", "dtype", "quant"))
        if meta.get("source") == source and same_settings:
            shutil.rmtree(meta_file.parent, ignore_errors=True)


# --- reading -----------------------------------------------------------------------------------


def _read(folder: Path, key: dict[str, str], tokenizer_file: Path) -> tuple[LoadedModel, str | None] | None:
    """The prepared model in ``folder``, or None (absent, or recorded under another key: rebuilt)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("prepared weights in %s are unreadable (%s); rebuilding them", folder, exc)
        return None
    stale = [k for k, v in key.items() if meta.get(k) != v]
    if stale:
        log.warning("prepared weights in %s do not match (%s); rebuilding them", folder, ", ".join(stale))
        return None
    try:
        return _rebuild(folder, meta, tokenizer_file), meta.get("applied_quant")
    except Exception as exc:  # noqa: BLE001 - any damage (files, JSON, tokenizer parse): rebuild
        log.warning("prepared weights in %s cannot be used (%s); rebuilding them", folder, exc)
        tokenizer_file.unlink(missing_ok=True)  # it may be what was damaged
        return None


def _tensor_views(folder: Path, meta: dict[str, Any]) -> dict[str, Tensor]:
    size = int(meta["weights_bytes"])
    if (folder / "weights.bin").stat().st_size != size:
        raise ValueError(f"weights.bin is not {size} bytes")
    # Copy-on-write mapping (MAP_PRIVATE): pages come from the page cache on first touch, nothing
    # is read at start, and nothing the process does can change the file.
    raw = torch.from_numpy(np.memmap(folder / "weights.bin", dtype=np.uint8, mode="c", shape=(size,)))
    views: dict[str, Tensor] = {}
    entries = meta["tensors"]
    for name, e in entries.items():
        if "alias" in e:
            continue
        dtype = getattr(torch, e["dtype"].removeprefix("torch."))
        shape = tuple(e["shape"])
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        views[name] = raw[e["offset"] : e["offset"] + nbytes].view(dtype).view(shape)
    for name, e in entries.items():
        if "alias" in e:
            views[name] = views[e["alias"]]
    return views


def _config(meta: dict[str, Any]) -> ModelConfig:
    fields = dict(meta["config"])
    for name in ("eos_token_ids", "layer_types"):
        fields[name] = tuple(fields.get(name) or ())
    return ModelConfig(**fields)


def _rebuild(folder: Path, meta: dict[str, Any], tokenizer_file: Path) -> LoadedModel:
    from tokenizers import Tokenizer as BackendTokenizer

    model, cfg = _rebuild_model(folder, meta)
    t = meta["tokenizer"]
    # Parsing Gemma's 262k-token vocabulary and 515k merges holds the GIL, so a thread would not
    # hide it: the largest part of its start-up (docs/llm.md).
    tokenizer = Tokenizer(
        backend=BackendTokenizer.from_file(str(tokenizer_file)),
        bos_token=t["bos_token"],
        eos_token=t["eos_token"],
        eos_token_ids=tuple(t["eos_token_ids"]),
        chat_template=t["chat_template"],
        special_tokens=dict(t["special_tokens"]),
    )
    return LoadedModel(model, tokenizer, cfg, Path(meta["source"]))


def _rebuild_model(folder: Path, meta: dict[str, Any]) -> tuple[Transformer, ModelConfig]:
    from edge_rtgi.llm.quant.kernels import Int4Linear, Int8Linear, TiedQuantEmbedding

    cfg = _config(meta)
    tensors = _tensor_views(folder, meta)
    with torch.device("meta"):
        model = Transformer(cfg)
    kinds = {"Int8Linear": Int8Linear, "Int4Linear": Int4Linear}
    for path, info in meta["quant_layers"].items():
        cls = kinds[info["kind"]]
        buffers = {
            n: tensors[f"{path}.{n}"]
            for n in (*cls.kernel_buffers, "dense_weight")
            if f"{path}.{n}" in tensors
        }
        layer = cls.from_buffers(
            info["in_features"],
            info["out_features"],
            info["scheme"],
            buffers,
            tensors.get(f"{path}.bias"),
            info["group_size"],
            info["max_kernel_rows"],
        )
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, layer)
    if meta["tied_quant_embedding"]:
        head = model.get_submodule("lm_head")
        if not isinstance(head, (Int4Linear, Int8Linear)):
            raise ValueError("a tied quantised embedding without a quantised head")
        model.embed_tokens = TiedQuantEmbedding(head)
    quantised = tuple(f"{p}." for p in meta["quant_layers"])
    floats = {n: t for n, t in tensors.items() if not n.startswith(quantised) and "rotary" not in n}
    model.load_state_dict(floats, strict=False, assign=True)
    if (
        cfg.tie_word_embeddings
        and isinstance(model.embed_tokens, nn.Embedding)
        and isinstance(model.lm_head, nn.Linear)
    ):
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = RotaryEmbedding(cfg.rope())
    model.rotary.inv_freq = tensors["rotary.inv_freq"]
    local = cfg.local_rope()
    model.rotary_local = RotaryEmbedding(local) if local is not None else None
    if model.rotary_local is not None:
        model.rotary_local.inv_freq = tensors["rotary_local.inv_freq"]
    model.source_weight_formats = dict(meta["source_weight_formats"])
    missing = [
        n for n, p in (*model.named_parameters(), *model.named_buffers()) if p is not None and p.is_meta
    ]
    if missing:
        raise ValueError(f"prepared weights lack {missing[:3]}")
    return model.eval().requires_grad_(False), cfg
