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
    "Caf\u00e9, na\u00efve, \u00fcber, se\u00f1or, \u65e5\u672c\u8a9e, \u4e2d\u6587 and emoji \U0001f600\U0001f680 are text too.",
    "def add(a, b):\n    return a + b\n",
    "Hello! How are you today? I am fine, thank you. What is the capital of France? Paris.",
]

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True, attention_bias=False,
        rope_theta=10000.0,
        # llama3 scaling with a short original context, so the scaled band covers most frequencies
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False,
                  rope_theta=1000000.0, use_sliding_window=False),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False,
                    rope_theta=10000.0, sliding_window=8),
}


def make_tiny_tokenizer(folder: Path):
    """Train a byte-level BPE on a fixed corpus and save tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 256, "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok


def make_tiny_hf_model(arch: str, tmp_path: Path, seed: int = 0, max_shard_size: str | None = None,
                       init_std: float = 0.25, **overrides: Any) -> Path:
    """Write a seeded random ``arch`` model ("llama", "qwen2", "mistral") under ``tmp_path``; return the folder.

    ``overrides`` replace config.json fields (e.g. ``num_hidden_layers=3``). ``max_shard_size``
    (e.g. "100KB") writes a sharded checkpoint with an index.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tmp_path) / f"tiny-{arch}-{seed}"
    tok = make_tiny_tokenizer(folder)
    spec: dict[str, Any] = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=tok.token_to_id("<|im_start|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"), initializer_range=init_std,
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
