"""The real SmolLM2-135M-Instruct GGUF: our loader + model vs transformers' own GGUF loading.

Both dequantise the same Q4_1 file to fp32, so greedy continuations must be identical, for
raw prompts and for chat-template prompts. The tokenizer and chat template built from the
GGUF metadata must agree with the ones transformers builds.
"""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
RAW_PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    "]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name two fruits that are yellow."},
    ],
]
TEXTS = [
    "Hello world! How are you today?",
    "  Leading spaces, tabs\tand\nnewlines\n\n",
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600\U0001f680",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "Numbers 12345 and 3.14159, dates 2024-05-17.",
    "def f(x):\n    return x ** 2  # square",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path():
    from edge_rtgi.catalog import resolve_model

    return resolve_model(MODEL, role="llm")


@pytest.fixture(scope="module")
def ours(gguf_path):
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_model(gguf_path, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


def hf_greedy(hf_model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def test_config_from_gguf_metadata(ours):
    cfg = ours.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert ours.tokenizer.eos_token_ids == (2,) and ours.tokenizer.eos_token == "<|im_end|>"


def test_tokenizer_matches_transformers(ours, hf_tokenizer):
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(
            ids, skip_special_tokens=False
        )


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_renders_identically(ours, hf_tokenizer, chat):
    expected = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(chat) == expected
    expected_ids = hf_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    expected_ids = expected_ids["input_ids"] if hasattr(expected_ids, "keys") else expected_ids
    assert ours.tokenizer.encode_chat(chat) == list(expected_ids)


@pytest.mark.parametrize("prompt", RAW_PROMPTS)
def test_raw_prompt_greedy_matches_transformers(ours, hf_model, prompt):
    ids = ours.tokenizer.encode(prompt, add_special_tokens=True)
    result = generate(ours, ids, SamplingParams(max_tokens=NEW_TOKENS))
    assert result.token_ids == hf_greedy(hf_model, ids)
    assert len(result.token_ids) == NEW_TOKENS


@pytest.mark.parametrize("chat", CHATS)
def test_chat_prompt_greedy_matches_transformers(ours, hf_model, chat):
    ids = ours.tokenizer.encode_chat(chat)
    result = generate(ours, ids, SamplingParams(max_tokens=NEW_TOKENS))
    assert result.token_ids == hf_greedy(hf_model, ids)
    assert result.text.strip()  # an actual answer, not an immediate end of turn
