"""The engine's ``quant:`` setting: a quantised engine generates what the plain path does
with the same weights."""

from __future__ import annotations

import copy

from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.quant import apply_quant, save_quantized_checkpoint
from edge_rtgi.llm.quant.kernels import Int4Linear
from edge_rtgi.llm.quant.plan import QuantPlan
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model


def test_engine_quant_checkpoint_matches_plain_quantised_generation(tmp_path):
    folder = make_tiny_hf_model("llama", tmp_path, seed=11)
    loaded = load_model(folder, device="cpu", dtype="fp32")
    ckpt = tmp_path / "m.q.safetensors"
    save_quantized_checkpoint(loaded.model, QuantPlan(default="int4-g32", schemes={"lm_head": "int8"}), ckpt)
    reference = copy.deepcopy(loaded.model)
    apply_quant(reference, str(ckpt))
    prompt = loaded.tokenizer.encode("The quick brown fox")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = generate((reference, loaded.tokenizer), prompt, params).token_ids
    engine = LLMEngine.from_config(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype="fp32",
            quant=str(ckpt),
            block_size=4,
            num_kv_blocks=64,
            int8_activations=False,  # lossy; the plain path's reference runs the weights as stored
        )
    )
    try:
        assert any(isinstance(m, Int4Linear) for m in engine.model.modules())
        assert engine.generate([prompt], params)[0].token_ids == expected
    finally:
        engine.shutdown()
