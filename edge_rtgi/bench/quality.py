"""Quality retention: an optimised configuration against the full model on the same prompts.

This module holds the parts that run models (KL along continuations); the scores themselves and
their intervals are torch-free, in ``edge_rtgi.scoring.retention``.

"Full model" means the same weights run by the plain reference path in fp32, with no lossy
optimisation. Three measurements, each defined in docs/benchmarks.md:

- Token-level KL divergence, as llama.cpp's ``--kl-divergence`` does it: the full model
  generates a greedy continuation; both models are then fed prompt + continuation (teacher
  forcing) and, at every position that predicts a continuation token, we take
  ``KL(P_full || P_opt) = sum_v P_full(v) (log P_full(v) - log P_opt(v))`` in float64.
  Reported as mean, p99 and max over tokens, with the top-1 agreement rate.
- chrF agreement (sacrebleu, corpus level): the optimised outputs scored against the full
  model's outputs for the same prompts; 100 means identical.
- chrF against references, where a workload has them (translation).

Quality retention = optimised score / full score, capped at 1: with references,
``chrF(opt, refs) / chrF(full, refs)``; without, ``chrF(opt, full) / chrF(full, full)``
= ``chrF agreement / 100``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from edge_rtgi.scoring.retention import KLResult

if TYPE_CHECKING:
    from edge_rtgi.llm.model import Transformer

# token ids -> fp32 logits [len(ids), vocab]; row i predicts token i + 1
LogitsFn = Callable[[Sequence[int]], Tensor]


def model_logits_fn(model: Transformer) -> LogitsFn:
    """All-position logits of one of our ``Transformer`` models over a fresh contiguous cache."""
    from edge_rtgi.llm.model import ContiguousKVCache

    def logits(ids: Sequence[int]) -> Tensor:
        cache = ContiguousKVCache(model.config, len(ids), model.dtype, model.device)
        with torch.inference_mode():
            cache.begin(len(ids))
            positions = torch.arange(len(ids), device=model.device)
            hidden = model(torch.tensor(list(ids), device=model.device), positions, cache)
            cache.commit()
            return model.compute_logits(hidden).float()

    return logits


def kl_rows(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """Per-row KL(P || Q) in float64 from logits [N, V] -> [N]. Exactly 0 where rows are equal."""
    log_p = torch.log_softmax(p_logits.double(), dim=-1)
    log_q = torch.log_softmax(q_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def kl_along_continuations(
    full: LogitsFn, optimised: LogitsFn, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> KLResult:
    """KL over (prompt ids, full model's greedy continuation ids) pairs, teacher-forced."""
    all_kl, agree = [], []
    for prompt, continuation in sequences:
        if not continuation:
            continue
        ids = [*prompt, *continuation]
        rows = slice(len(prompt) - 1, len(ids) - 1)  # positions that predict the continuation
        p, q = full(ids)[rows], optimised(ids)[rows]
        all_kl.append(kl_rows(p, q))
        agree.append(p.argmax(-1) == q.argmax(-1))
    if not all_kl:
        return KLResult(math.nan, math.nan, math.nan, math.nan, 0, 0)
    kl = torch.cat(all_kl)
    return KLResult(
        mean=float(kl.mean()),
        p99=float(torch.quantile(kl, 0.99)),
        max=float(kl.max()),
        top1_agreement=float(torch.cat(agree).double().mean()),
        num_tokens=int(kl.numel()),
        num_sequences=len(all_kl),
    )
