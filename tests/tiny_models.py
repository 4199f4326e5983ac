"""Tiny seeded random Llama-family models, written as real HF folders.

``make_tiny_hf_model("llama", tmp_path)`` writes config.json, safetensors weights and a real
byte-level BPE tokenizer (trained in a few milliseconds on a fixed text, with ChatML special
tokens and a chat template) that both transformers and ``edge_rtgi.llm.weights.load_model``
read. The engine and quantisation tests reuse these factories.

Weights are drawn with a larger spread than HF's default init so the next-token distribution
is peaked: with near-uniform logits, greedy decoding would hinge on float rounding and the
equivalence tests would test noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 384

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model on a small device answers questions about the weather, the time and the news.",
    "Real-time speech translation turns what you say into another language while you are still talking.",
    "Numbers like 12, 345 and 6789 appear in text, as do dates such as 2024-05-17.",
    "Caf\u00e9, na\u00efve, \u00fcber, se\u00f1or, \u65e5\u672c\u8a9e, \u4e2d\u6587 "
    "and emoji \U0001f600\U0001f680 are text too.",
    "def add(a, b):\n    return a + b\n",
    "Hello! How are you today? I am fine, thank you. What is the capital of France? Paris.",
]

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=True,
        attention_bias=False,
        rope_theta=10000.0,
        # llama3 scaling with a short original context, so the scaled band covers most frequencies
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        use_sliding_window=False,
    ),
    "mistral": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        tie_word_embeddings=False,
        rope_theta=10000.0,
        sliding_window=8,
    ),
    # Local, global, local layers; a window of 8 and linear RoPE scaling on the global layer (as
    # Gemma 3 4B+ has); a query scalar that differs from head_dim. Untied: with random weights, a
    # tied head over sqrt(hidden)-scaled embeddings keeps predicting the input token.
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        tie_word_embeddings=False,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
        query_pre_attn_scalar=32,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        hidden_activation="gelu_pytorch_tanh",
    ),
}


def make_tiny_tokenizer(folder: Path, split_regex: str | None = None):
    """Train a byte-level BPE on a fixed corpus and save tokenizer.json + tokenizer_config.json.

    ``split_regex`` replaces GPT-2's pre-tokenizer split rule (Qwen2's tokenizer class in
    transformers 5 imposes its own rule, so a tiny Qwen2 tokenizer must be trained with it).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_regex:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok


def make_tiny_hf_model(
    arch: str,
    tmp_path: Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    init_std: float = 0.25,
    **overrides: Any,
) -> Path:
    """Write a seeded random ``arch`` model ("llama", "qwen2", "mistral", "gemma3") under ``tmp_path``;
    return the folder.

    ``overrides`` replace config.json fields (e.g. ``num_hidden_layers=3``). ``max_shard_size``
    (e.g. "100KB") writes a sharded checkpoint with an index.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from edge_rtgi.llm.tokenizer import _QWEN2_SPLIT

    folder = Path(tmp_path) / f"tiny-{arch}-{seed}"
    tok = make_tiny_tokenizer(folder, split_regex=_QWEN2_SPLIT if arch == "qwen2" else None)
    spec: dict[str, Any] = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=tok.token_to_id("<|im_start|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        initializer_range=init_std,
    )
    spec.update(ARCH_DEFAULTS[arch])
    spec.update(overrides)
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # RMSNorm weights start at 1; vary them so a mix-up of norms would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn_like(param))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def _permute_for_llama_cpp(w, num_heads: int):
    # What llama.cpp's converter does to Q/K rows of llama-arch models (rotate-half -> interleaved).
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tokenizer_metadata(writer, hf_folder: Path, arch: str) -> None:
    """The byte-level BPE of tokenizer.json as llama.cpp's tokenizer.ggml.* metadata."""
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    tok_config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])


def write_tiny_gguf(hf_folder: Path, out_path: Path, qtype: str = "F32") -> Path:
    """Convert a ``make_tiny_hf_model`` folder to GGUF the way llama.cpp's converter does.

    Writes llama.cpp's tensor names, permutes Q/K rows for llama/mistral, stores llama3 rope
    scaling as a ``rope_freqs`` tensor, and carries the byte-level BPE tokenizer and chat
    template in metadata. ``qtype`` ("F32", "F16", "Q8_0", "Q4_1"...) applies to 2-D weights.
    """
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.torch import load_file

    from edge_rtgi.llm.model import ModelConfig
    from edge_rtgi.llm.rope import rope_inverse_frequencies

    hf_folder, out_path = Path(hf_folder), Path(out_path)
    hf = json.loads((hf_folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(hf_folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    arch = cfg.arch
    writer = GGUFWriter(str(out_path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.sliding_window:
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)

    _write_tokenizer_metadata(writer, hf_folder, arch)

    gguf_type = GGMLQuantizationType[qtype]

    def put(name: str, tensor: torch.Tensor, quantize: bool = True) -> None:
        array = tensor.float().numpy()
        if array.ndim == 2 and quantize and gguf_type != GGMLQuantizationType.F32:
            data = quants.quantize(array, gguf_type)
            writer.add_tensor(name, data, raw_dtype=gguf_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", state["lm_head.weight"])
    if cfg.rope_scaling:  # llama.cpp keeps llama3 scaling as per-frequency divisors
        base = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        )
        scaled, _ = rope_inverse_frequencies(cfg.rope())
        put("rope_freqs.weight", (base.float() / scaled), quantize=False)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    permute = arch in ("llama", "mistral")
    for i in range(cfg.num_layers):
        for hf_name, gguf_name in names.items():
            for suffix in ("weight", "bias"):
                tensor = state.get(f"model.layers.{i}.{hf_name}.{suffix}")
                if tensor is None:
                    continue
                if permute and gguf_name in ("attn_q", "attn_k"):
                    heads = cfg.num_heads if gguf_name == "attn_q" else cfg.num_kv_heads
                    tensor = _permute_for_llama_cpp(tensor, heads)
                put(f"blk.{i}.{gguf_name}.{suffix}", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
