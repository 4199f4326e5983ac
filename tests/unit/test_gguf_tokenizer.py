"""A SentencePiece-style GGUF vocabulary (Llama 2 / Mistral v0.1 files) against
transformers' GGUF tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_rtgi.llm.weights import _read_gguf, load_gguf_tokenizer

PIECES = [
    "\u2581",
    "\u2581t",
    "\u2581th",
    "\u2581the",
    "he",
    "ll",
    "llo",
    "\u2581he",
    "\u2581hello",
    "\u2581w",
    "or",
    "ld",
    "orld",
    "\u2581world",
    "in",
    "\u2581in",
    "ing",
    "\u2581a",
    "an",
    "\u2581an",
    "\u2581and",
    "er",
    "es",
]
TEXTS = [
    "hello world",
    "The theme in the world",
    "  two leading spaces",
    "caf\u00e9 \U0001f600 and more",
    "<s>hello</s> world",
    "unknownwords zzz",
    "line\nbreak",
]


def write_spm_gguf(path: Path) -> Path:
    from gguf import GGUFWriter

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        chr(c) for c in range(ord("A"), ord("Z") + 1)
    ]
    for rank, piece in enumerate(letters + PIECES):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny spm")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_context_length, 64),
        (writer.add_embedding_length, 8),
        (writer.add_feed_forward_length, 16),
        (writer.add_head_count, 2),
        (writer.add_head_count_kv, 2),
    ):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    _, meta = _read_gguf(path)
    return load_gguf_tokenizer(meta, path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_gguf_matches_transformers(spm_pair, text):
    ours, hf = spm_pair
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_sentencepiece_uses_merges_and_byte_fallback(spm_pair):
    ours, _ = spm_pair
    assert ours.encode("hello world") == [ours.token_to_id("\u2581hello"), ours.token_to_id("\u2581world")]
    assert len(ours.encode("\U0001f600")) == 5  # "\u2581" + four byte tokens
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
