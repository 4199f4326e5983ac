"""Load a model from an HF folder (safetensors), a GGUF file, or a catalogue name.

Both formats are first mapped onto HF's tensor names and shapes (GGUF tensors are
dequantised to fp32 and llama.cpp's Q/K row permutation is undone), then assembled into
our fused layout: q/k/v weights and biases concatenated into ``qkv_proj``, gate and up into
``gate_up_proj``. Every tensor's shape is checked against the config before it is used, so
a wrong or damaged file fails with a message naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from edge_rtgi.device import resolve_device, resolve_dtype
from edge_rtgi.errors import ModelFileError, ModelNotFoundError
from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.gguf_file import GGUFFile, dequantize, q4k_grid, read_gguf
from edge_rtgi.llm.model import ModelConfig, Transformer
from edge_rtgi.llm.rope import RotaryEmbedding
from edge_rtgi.llm.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# HF tensors some checkpoints carry that our model recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors' own names for the dtypes, so source formats read the same for both file kinds.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass
class LoadedModel:
    """A model ready to run: weights on their device, its tokenizer, and where it came from."""

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    source: Path


def load_model(
    source: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"
) -> LoadedModel:
    """Load an HF folder, a ``.gguf`` file, or a catalogue model name.

    ``device``/``dtype`` are config values ("auto", "cpu", "cuda", "fp32", "bf16", ...)
    resolved by ``edge_rtgi.device`` (or already-resolved torch objects). Raises ModelFileError
    for a missing, corrupt or unsupported file and ModelNotFoundError for an unknown name.
    """
    path = resolve_source(source)
    torch_device = device if isinstance(device, torch.device) else resolve_device(device)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, torch_device)
    formats: dict[str, str] = {}  # HF tensor name -> storage format in the file, filled by fetch
    grids: dict[str, tuple[Tensor, Tensor]] = {}  # HF tensor name -> the file's 4-bit grid
    if path.is_dir():
        cfg, fetch, tokenizer, rope_factors = _open_hf_folder(path, formats)
    else:
        cfg, fetch, tokenizer, rope_factors = _open_gguf(path, formats, grids)
    state = assemble_state_dict(cfg, fetch, path, torch_dtype)
    model = _build_model(cfg, state, torch_device, torch_dtype, rope_factors)
    model.source_weight_formats = source_formats(cfg, formats)
    model.source_grids = {
        ours: grids[parts[0][0]]
        for ours, parts in _slots(cfg).items()
        if len(parts) == 1 and parts[0][0] in grids
    }
    cpu_ops.prepare(torch_device)
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, source=path)


def source_formats(cfg: ModelConfig, formats: Mapping[str, str]) -> dict[str, str]:
    """Our parameter name -> how the file stored it (GGUF type such as "Q4_1", or a
    safetensors dtype such as "BF16"); "mixed" when the fused parts were stored differently.

    The engine's ``quant: auto`` uses it to keep 4-bit source blocks in a kernel format that
    reproduces them (``edge_rtgi.llm.quant.policy.source_aligned_scheme``)."""
    out = {}
    for ours, parts in _slots(cfg).items():
        kinds = {formats.get(hf_name, "unknown") for hf_name, _ in parts}
        out[ours] = kinds.pop() if len(kinds) == 1 else "mixed"
    return out


def resolve_source(source: str | Path) -> Path:
    """A path that exists, or the path the catalogue resolves a model name to."""
    path = Path(source).expanduser()
    if path.exists():
        return _pick_file_in_folder(path)
    text = str(source)
    if os.sep in text or text.endswith((".gguf", ".safetensors", ".json")):
        raise ModelFileError(
            f"model path {text} does not exist", hint="check the path, or pass a catalogue name"
        )
    try:
        from edge_rtgi.catalog import resolve_model
    except ImportError:
        raise ModelNotFoundError(
            f"unknown model {text!r}: not a path, and the model catalogue is unavailable",
            hint="pass the path of an HF folder or a .gguf file",
        ) from None
    return _pick_file_in_folder(Path(resolve_model(text, role="llm")))


def _pick_file_in_folder(path: Path) -> Path:
    # A catalogue entry or a user may point at a folder that holds just one GGUF file.
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelFileError(
            f"{path} has no config.json" + (f" and {len(ggufs)} .gguf files" if ggufs else ""),
            hint="point at an HF model folder or at one .gguf file",
        )
    return path


# --- HF safetensors folders --------------------------------------------------------------------


def _open_hf_folder(folder: Path, formats: dict[str, str]):
    from safetensors import safe_open

    config_path = folder / "config.json"
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
        cfg = ModelConfig.from_hf(hf_config)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelFileError(f"cannot read model config {config_path}: {exc!r}") from None
    except ValueError as exc:
        raise ModelFileError(f"{config_path}: {exc}") from None

    files = _safetensors_files(folder)
    where: dict[str, Any] = {}  # tensor name -> open safetensors handle
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():
                where[name] = (handle, file)
        except Exception as exc:  # noqa: BLE001 - safetensors raises SafetensorError (not exported stably)
            raise ModelFileError(
                f"{file} is truncated or corrupt: {exc}", hint="re-download the model"
            ) from None

    # Gemma's RMSNorm multiplies by 1 + weight; our RMSNorm keeps 1 + weight (as GGUF files do).
    shift_norms = cfg.arch == "gemma3"

    def fetch(name: str) -> tuple[Tensor, Path] | None:
        if name not in where:
            return None
        handle, file = where[name]
        try:
            tensor = handle.get_tensor(name)
            formats[name] = _SAFETENSORS_DTYPES.get(tensor.dtype, str(tensor.dtype))
            if shift_norms and name.endswith("norm.weight"):
                tensor = tensor.float() + 1.0
            return tensor, file
        except Exception as exc:  # noqa: BLE001 - safetensors raises SafetensorError (not exported stably)
            raise ModelFileError(
                f"{file}: cannot read tensor {name}: {exc}", hint="re-download the model"
            ) from None

    eos = list(cfg.eos_token_ids)
    gen_config = folder / "generation_config.json"
    if gen_config.is_file():  # instruct models often list extra end-of-turn ids only here
        try:
            gen_eos = json.loads(gen_config.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFileError(f"cannot read {gen_config}: {exc}") from None
        eos += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    tokenizer = load_hf_tokenizer(folder, eos_token_ids=tuple(dict.fromkeys(eos)))
    return cfg, fetch, tokenizer, None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelFileError(f"cannot read shard index {index}: {exc!r}") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelFileError(
                    f"shard {file} listed in {index.name} is missing", hint="re-download the model"
                )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(
            f"{folder} has no *.safetensors weights",
            hint="convert .bin/.pt checkpoints to safetensors, or use a GGUF file",
        )
    return files


# --- GGUF files --------------------------------------------------------------------------------


def _read_gguf(path: Path) -> tuple[GGUFFile, dict[str, Any]]:
    """The file's header and its metadata, arrays as ``gguf_file`` leaves them (lazy strings)."""
    gguf = read_gguf(path)
    return gguf, gguf.metadata


def gguf_config(meta: Mapping[str, Any], tensor_names: set[str], path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata (llama, mistral, qwen2 and gemma3 architectures)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(
            f"{path}: unsupported architecture {arch!r}",
            hint=f"supported GGUF architectures: {', '.join(sorted(GGUF_ARCHITECTURES))}",
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    try:
        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        hf: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "vocab_size": int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv") or heads),
            "head_dim": int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
            "max_position_embeddings": int(get("context_length", 4096)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        }
    except (TypeError, KeyError) as exc:
        raise ModelFileError(f"{path}: required metadata is missing or malformed ({exc!r})") from None
    window = get("attention.sliding_window")
    hf["use_sliding_window"] = bool(window)
    hf["sliding_window"] = int(window) if window else None
    if arch == "gemma3":
        # The layer pattern (every sixth layer global) and the local RoPE base (10,000) are not in
        # the file; llama.cpp and transformers assume Gemma 3's, as ModelConfig.from_hf does.
        # Scores are scaled by head_dim ** -0.5 as llama.cpp does for every size but 27B.
        hf.update(
            model_type="gemma3_text", query_pre_attn_scalar=hf["head_dim"], rope_local_base_freq=10_000.0
        )
    scaling, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor:
        hf["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
        if get("rope.scaling.original_context_length"):
            hf["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length")
            )
    return ModelConfig.from_hf(hf)


# GGUF block tensor -> HF tensor name (per layer).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# Gemma 3: norms after attention and MLP too, and ffn_norm is the norm *before* the MLP.
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    stem, _, suffix = name.rpartition(".")
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    names = _GGUF_GEMMA_LAYER_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    return None


def _unpermute_rows(w: Tensor, num_heads: int) -> Tensor:
    # llama.cpp's converter reorders Q/K rows of each head from HF's "rotate half" layout
    # (first half, second half) to interleaved pairs; this puts them back.
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _open_gguf(path: Path, formats: dict[str, str], grids: dict[str, tuple[Tensor, Tensor]]):
    gguf, meta = _read_gguf(path)
    tensors = gguf.tensors
    cfg = gguf_config(meta, set(tensors), path)
    tokenizer = load_gguf_tokenizer(meta, path)
    by_hf_name = {
        hf: t for name, t in tensors.items() if (hf := _gguf_to_hf_name(name, cfg.arch)) is not None
    }
    unpermute = cfg.arch in ("llama", "mistral")

    def fetch(name: str) -> tuple[Tensor, Path] | None:
        tensor = by_hf_name.get(name)
        if tensor is None:
            return None
        try:
            weights = torch.from_numpy(np.array(dequantize(tensor), dtype=np.float32, copy=True))
        except (NotImplementedError, ValueError) as exc:
            raise ModelFileError(
                f"{path}: cannot dequantise {tensor.name} ({tensor.type_name}): {exc}"
            ) from None
        formats[name] = tensor.type_name
        if tensor.type_name == "Q4_K" and not unpermute:
            # The kernels' int4 form is w = (code - 8) * scale + zero per 32 weights: Q4_K's own
            # grid, so ``quant: auto`` can keep the file's codes (quant.policy).
            scale, minimum = (torch.from_numpy(np.array(a)) for a in q4k_grid(tensor))
            grids[name] = (scale, 8 * scale - minimum)
        if unpermute and ".self_attn.q_proj." in name:
            weights = _unpermute_rows(weights, cfg.num_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            weights = _unpermute_rows(weights, cfg.num_kv_heads)
        return weights, path

    rope_factors = None
    if "rope_freqs.weight" in tensors:  # llama 3.x stores its rope scaling as per-frequency divisors
        rope_factors = torch.from_numpy(
            np.array(dequantize(tensors["rope_freqs.weight"]), copy=True)
        ).flatten()
    return cfg, fetch, tokenizer, rope_factors


# --- Assembling our fused layout ---------------------------------------------------------------


def _slots(cfg: ModelConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Our parameter name -> the HF tensors (name, expected shape) concatenated along dim 0 to make it."""
    h, q, kv, inter = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    slots: dict[str, list[tuple[str, tuple[int, ...]]]] = {
        "embed_tokens.weight": [("model.embed_tokens.weight", (cfg.vocab_size, h))],
        "norm.weight": [("model.norm.weight", (h,))],
    }
    if not cfg.tie_word_embeddings:
        slots["lm_head.weight"] = [("lm_head.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        slots[ours + "self_attn.qkv_proj.weight"] = [
            (attn + "q_proj.weight", (q, h)),
            (attn + "k_proj.weight", (kv, h)),
            (attn + "v_proj.weight", (kv, h)),
        ]
        if cfg.attention_bias:
            slots[ours + "self_attn.qkv_proj.bias"] = [
                (attn + "q_proj.bias", (q,)),
                (attn + "k_proj.bias", (kv,)),
                (attn + "v_proj.bias", (kv,)),
            ]
        slots[ours + "self_attn.o_proj.weight"] = [(attn + "o_proj.weight", (h, q))]
        slots[ours + "mlp.gate_up_proj.weight"] = [
            (hf + "mlp.gate_proj.weight", (inter, h)),
            (hf + "mlp.up_proj.weight", (inter, h)),
        ]
        slots[ours + "mlp.down_proj.weight"] = [(hf + "mlp.down_proj.weight", (h, inter))]
        slots[ours + "input_layernorm.weight"] = [(hf + "input_layernorm.weight", (h,))]
        slots[ours + "post_attention_layernorm.weight"] = [(hf + "post_attention_layernorm.weight", (h,))]
        if cfg.arch == "gemma3":
            d = cfg.head_dim
            slots[ours + "self_attn.q_norm.weight"] = [(attn + "q_norm.weight", (d,))]
            slots[ours + "self_attn.k_norm.weight"] = [(attn + "k_norm.weight", (d,))]
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                slots[ours + f"{norm}.weight"] = [(hf + f"{norm}.weight", (h,))]
    return slots


def assemble_state_dict(
    cfg: ModelConfig,
    fetch: Callable[[str], tuple[Tensor, Path] | None],
    source: Path,
    dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """Our state dict (fused layout), from a name -> (tensor, file) lookup over HF tensor names.

    Each tensor is cast to ``dtype`` as soon as it is read, so a dequantised GGUF never sits
    in memory in fp32 as a whole when the model runs in bf16.
    """
    state: dict[str, Tensor] = {}
    for ours, parts in _slots(cfg).items():
        pieces = []
        for hf_name, shape in parts:
            found = fetch(hf_name)
            if found is None:
                raise ModelFileError(
                    f"{source}: tensor {hf_name} is missing",
                    hint="the file does not match its config; re-download or re-convert it",
                )
            tensor, file = found
            if tuple(tensor.shape) != shape:
                raise ModelFileError(
                    f"{file}: tensor {hf_name} has shape {tuple(tensor.shape)}, the config implies {shape}",
                    hint="the weights do not match config.json",
                )
            pieces.append(tensor if dtype is None else tensor.to(dtype))
        state[ours] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
    return state


def _build_model(
    cfg: ModelConfig,
    state: dict[str, Tensor],
    device: torch.device,
    dtype: torch.dtype,
    rope_factors: Tensor | None,
) -> Transformer:
    # Build on the meta device so no memory or time goes into random init that is overwritten anyway.
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        embed = model.embed_tokens
        if not isinstance(embed, nn.Embedding):  # a bug: a model just built has a float table
            raise RuntimeError(f"embed_tokens is a {type(embed).__name__}, not an nn.Embedding")
        model.lm_head.weight = embed.weight
    model.rotary = RotaryEmbedding(cfg.rope()).to(device)
    local = cfg.local_rope()
    model.rotary_local = RotaryEmbedding(local).to(device) if local is not None else None
    if rope_factors is not None:
        if rope_factors.numel() != model.rotary.inv_freq.numel():
            raise ModelFileError(
                f"rope_freqs has {rope_factors.numel()} entries, expected {model.rotary.inv_freq.numel()}"
            )
        model.rotary.inv_freq = model.rotary.inv_freq / rope_factors.to(device)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:  # a bug in _slots, not a user error
        raise RuntimeError(f"parameters left uninitialised: {missing[:5]}")
    return model.eval().requires_grad_(False)
