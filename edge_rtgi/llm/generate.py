"""Plain generation: one sequence, a contiguous KV cache, no batching.

This is the reference the engine is checked against, so it stays simple: prefill the whole
prompt, then one token per forward pass. Text comes out through the shared
IncrementalDetokenizer and StopStringMatcher, so deltas never split a character and never
show part of a stop string.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from edge_rtgi.errors import RequestError
from edge_rtgi.llm.detokenize import BoundaryStopper, IncrementalDetokenizer, StopStringMatcher
from edge_rtgi.llm.model import ContiguousKVCache, Transformer
from edge_rtgi.llm.sampling import SamplingParams, sample_token
from edge_rtgi.llm.tokenizer import Tokenizer
from edge_rtgi.llm.weights import LoadedModel

FinishReason = Literal["stop", "length", "budget"]


@dataclass
class GenerationDelta:
    """What one step added: final text (may be ""), the sampled token ids, and why it ended (last delta)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None


@dataclass
class GenerationResult:
    """A whole generation: its text, its token ids, and why it ended."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"


def _unpack(loaded: LoadedModel | tuple[Transformer, Tokenizer]) -> tuple[Transformer, Tokenizer]:
    if isinstance(loaded, LoadedModel):
        return loaded.model, loaded.tokenizer
    model, tokenizer = loaded
    return model, tokenizer


def check_prompt(prompt_ids: Sequence[int], context_tokens: int, vocab_size: int) -> None:
    """Raise RequestError for an empty prompt, a prompt that leaves no room to generate, or bad ids."""
    if len(prompt_ids) == 0:
        raise RequestError("the prompt is empty", hint="give at least one token of prompt")
    if len(prompt_ids) >= context_tokens:
        raise RequestError(
            f"the prompt is {len(prompt_ids)} tokens but the model's context window is "
            f"{context_tokens} tokens",
            hint="shorten the prompt",
        )
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def stop_token_set(tokenizer: Tokenizer, model: Transformer, params: SamplingParams) -> frozenset[int]:
    """Token ids that end generation: the model's EOS ids (unless ignore_eos) plus the request's."""
    eos = () if params.ignore_eos else (*tokenizer.eos_token_ids, *model.config.eos_token_ids)
    return frozenset((*eos, *params.stop_token_ids))


def generate_stream(
    loaded: LoadedModel | tuple[Transformer, Tokenizer], prompt_ids: Sequence[int], params: SamplingParams
) -> Iterator[GenerationDelta]:
    """Generate a continuation of ``prompt_ids``, yielding one delta per sampled token.

    The last delta carries ``finish_reason``: "stop" (EOS, a stop token or a stop string;
    neither is included in the text), "length" (max_tokens or the context window) or "budget"
    (past ``params.token_budget``, at a boundary; ``deadline_ms`` is the engine's alone).
    """
    model, tokenizer = _unpack(loaded)
    cfg = model.config
    check_prompt(prompt_ids, cfg.max_position_embeddings, cfg.vocab_size)
    budget_tokens = min(params.max_tokens, cfg.max_position_embeddings - len(prompt_ids))
    stop_ids = stop_token_set(tokenizer, model, params)
    generator = params.make_generator(model.device)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    stops = StopStringMatcher(params.stop)
    boundary = BoundaryStopper(params.boundary_grace_tokens) if params.token_budget is not None else None
    cache = ContiguousKVCache(cfg, len(prompt_ids) + budget_tokens, model.dtype, model.device)

    def forward(ids: Sequence[int]) -> torch.Tensor:
        # ids -> fp32 logits [V] of the last position
        cache.begin(len(ids))
        positions = torch.arange(cache.length, cache.length + len(ids), device=model.device)
        hidden = model(torch.tensor(ids, device=model.device), positions, cache)
        cache.commit()
        return model.compute_logits(hidden[-1:])[0]

    with torch.inference_mode():
        logits = forward(prompt_ids)
        for step in range(budget_tokens):
            token = sample_token(logits, params, generator)
            if token in stop_ids:
                yield GenerationDelta(_final_text(detok, stops), [token], "stop")
                return
            text, hit = stops.push(detok.push(token))
            if hit:
                yield GenerationDelta(text, [token], "stop")
                return
            if boundary is not None and params.token_budget is not None:
                if step + 1 >= params.token_budget:
                    boundary.arm()
                text, cut = boundary.push(text)
                if cut:
                    yield GenerationDelta(text, [token], "budget")
                    return
            if step == budget_tokens - 1:
                tail, hit = stops.push(detok.flush())
                yield GenerationDelta(
                    text + tail + ("" if hit else stops.flush()), [token], "stop" if hit else "length"
                )
                return
            yield GenerationDelta(text, [token])
            logits = forward([token])


def _final_text(detok: IncrementalDetokenizer, stops: StopStringMatcher) -> str:
    text, hit = stops.push(detok.flush())
    return text if hit else text + stops.flush()


def generate(
    loaded: LoadedModel | tuple[Transformer, Tokenizer], prompt_ids: Sequence[int], params: SamplingParams
) -> GenerationResult:
    """Run ``generate_stream`` to the end and join its deltas."""
    texts, ids = [], []
    reason: FinishReason = "length"
    for delta in generate_stream(loaded, prompt_ids, params):
        texts.append(delta.text)
        ids.extend(delta.token_ids)
        reason = delta.finish_reason or reason
    return GenerationResult(text="".join(texts), token_ids=ids, finish_reason=reason)
