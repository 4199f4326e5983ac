"""The real Gemma 3 270M GGUF (catalogue: gemma-3-270m) through our loader, against transformers'
own GGUF loading of the same file, and what ``quant: auto`` keeps of its Q4_K blocks."""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.catalog import resolve_model
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model("gemma-3-270m", role="llm")


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path, device="cpu", dtype="fp32")


def test_greedy_text_matches_transformers_gguf_loading(ours, gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    assert (
        ours.config.arch == "gemma3" and ours.config.vocab_size == 262_144 and ours.config.tie_word_embeddings
    )
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt, add_special_tokens=True)
        assert ids == hf_tok.encode(prompt) and ids[0] == ours.tokenizer.bos_token_id == 2
        got = generate(ours, ids, SamplingParams(max_tokens=16, ignore_eos=True))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        assert got.text == hf_tok.decode(ref, skip_special_tokens=True), prompt
        assert len(got.text) > 12


def test_chat_template_and_end_of_turn(ours):
    tok = ours.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode_chat([{"role": "user", "content": "Hi"}])[:2] == [2, 105]  # one BOS, from the template
    assert tok.token_to_id("<end_of_turn>") in tok.eos_token_ids


def test_auto_keeps_the_files_q4_k_blocks(ours):
    """``quant: auto``'s plan gives Q4_K groups int4-g32, and their codes land on the file's grid."""
    from edge_rtgi.llm.quant import model_groups, source_aligned_plan, source_grids
    from edge_rtgi.llm.quant.schemes import parse_scheme, quantize_weight

    model = ours.model
    q4k = [name for name, kind in model.source_weight_formats.items() if kind == "Q4_K"]
    plan = source_aligned_plan(model, "int8")
    grids = source_grids(model, plan)
    assert len(q4k) == 27 and len(grids) == 27 and set(plan.schemes.values()) == {"int4-g32"}
    paths = {g.name: g.module_path for g in model_groups(model)}
    for group in sorted(grids)[:4]:
        file_weights = model.get_parameter(f"{paths[group]}.weight")
        packed = quantize_weight(file_weights, parse_scheme("int4-g32"), grid=grids[group])
        err = packed.dequantize() - file_weights
        # the file's codes on its own grid: only the bf16 rounding of scales and zeros is lost
        assert err.pow(2).mean().sqrt() < 0.005 * file_weights.pow(2).mean().sqrt(), group
