"""The daemon's warm-up puts every pipeline's fixed prompt part in the engine's prefix cache, not
only the first one's: two assistant pipelines on one tiny seeded model, with different system
prompts, each find theirs cached on their first turn; a prompt nobody warmed finds nothing."""

from __future__ import annotations

from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.pipeline.config import parse_pipeline
from edge_rtgi.pipeline.resources import Resources
from tests.integration.light_daemon import ENGINE, tiny_model

PROMPTS = (
    "You answer in French, briefly and kindly, as a travel guide for the old town would.",
    "You are the cook of a ship. Every answer names a dish from the galley and its main spice.",
    "You only ever reply with a number, and never explain how you got to it, whatever is asked.",
)


async def test_prepare_caches_each_pipelines_system_prompt(tmp_path):
    model = tiny_model(tmp_path)
    pipelines = [
        parse_pipeline(
            f"name: p{i}\nstages:\n  - asr: {{model: whisper-tiny.en, language: en}}\n"
            f"  - assistant:\n      model: {model}\n      system_prompt: '{prompt}'\n",
            f"p{i}.yaml",
        )
        for i, prompt in enumerate(PROMPTS[:2])
    ]
    resources = Resources(ENGINE)
    try:
        for pipeline in pipelines:  # whisper tiny.en loads for the asr stage too
            await resources.prepare(pipeline)
        engine = resources.llm(model)
        cached = []
        for prompt in PROMPTS:
            system = [{"role": "system", "content": prompt}]
            fixed = len(engine.tokenizer.encode_chat(system, add_generation_prompt=False))
            turn = [*system, {"role": "user", "content": "What should I try first?"}]
            (result,) = engine.generate([turn], SamplingParams(max_tokens=1))
            assert result.usage is not None
            cached.append((result.usage.cached_tokens, fixed))
    finally:
        resources.close()
    block = ENGINE.block_size
    for hit, fixed in cached[:2]:  # the warmed prompts: their whole blocks of the fixed part
        assert hit >= fixed // block * block > 0, cached
    assert cached[2][0] < block, cached  # not warmed: at most a chat-template block in common
