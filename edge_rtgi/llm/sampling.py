"""Sampling parameters and the token sampler shared by plain generation and the engine.

Logits arrive in fp32. Greedy is ``temperature == 0``. A seeded request owns a
``torch.Generator`` so that its samples do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge_rtgi.errors import RequestError

if TYPE_CHECKING:  # torch is imported lazily so that `edge-rtgi --help` and the CLI start fast
    import torch
    from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``max_tokens`` counts generated tokens. ``stop`` strings end generation and are not
    included in the output; ``stop_token_ids`` are added to the model's EOS ids unless
    ``ignore_eos``. ``logprobs`` asks for each sampled token's log-probability and the
    entropy of the distribution it came from (``RequestDelta.logprobs``); it never changes
    which tokens are picked.

    Dynamic stopping: past ``token_budget`` generated tokens (a soft budget, below the hard
    ``max_tokens``), or ``deadline_ms`` after the request arrived (the engine only), the reply
    ends at the next clause or sentence boundary, or after ``boundary_grace_tokens`` more tokens
    at the next word boundary (``detokenize.BoundaryStopper``), with finish reason "budget" or
    "deadline". Never mid-word.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    token_budget: int | None = None
    deadline_ms: float | None = None
    boundary_grace_tokens: int = 16
    # speculative decoding for this request: None follows the engine's setting; "off" never;
    # "auto" or "<draft>:<k>" where the engine speculates (its setting is not "off")
    speculative: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        self.validate()

    def validate(self) -> None:
        """Raise RequestError naming the bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                hint="ask for at least 1 token",
            )
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise RequestError(f"stop strings must be non-empty strings, got {s!r}")
        if self.token_budget is not None and (
            not isinstance(self.token_budget, int) or self.token_budget < 1
        ):
            raise RequestError(f"token_budget must be a positive integer or None, got {self.token_budget!r}")
        if self.deadline_ms is not None and not self.deadline_ms > 0:
            raise RequestError(f"deadline_ms must be > 0 or None, got {self.deadline_ms!r}")
        if self.boundary_grace_tokens < 0:
            raise RequestError(f"boundary_grace_tokens must be >= 0, got {self.boundary_grace_tokens!r}")
        if self.speculative is not None:
            from edge_rtgi.llm.speculative import parse_speculative

            try:
                parse_speculative(self.speculative)
            except ValueError as exc:
                raise RequestError(str(exc)) from None

    @property
    def stops_at_boundaries(self) -> bool:
        """Whether a budget or deadline may end the reply at a boundary."""
        return self.token_budget is not None or self.deadline_ms is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        import torch

        if self.seed is None:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        return gen


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Apply temperature, top-k and top-p to one row of fp32 logits [V]; returns new logits."""
    import torch

    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick one token id from fp32 logits [V]."""
    import torch

    if params.greedy:
        return int(torch.argmax(logits))
    probs = filter_logits(logits, params).softmax(-1)
    if not torch.isfinite(probs).all():
        raise RequestError("sampling failed: logits contain NaN or inf", hint="check the model's dtype")
    return int(torch.multinomial(probs, 1, generator=generator))


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a sampled request draws from at each row of fp32 logits [N, V] (after
    temperature, top-k and top-p), as probabilities [N, V]."""
    import torch

    return torch.stack([filter_logits(row, params).softmax(-1) for row in logits])


def speculative_accept(
    probs: Tensor,
    draft_token_ids: list[int],
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Rejection sampling of ``k`` draft tokens against the target (Leviathan et al., Chen et al.).

    ``probs`` [k+1, V]: the target's distribution after the context and each draft prefix;
    ``draft_probs`` [k, V]: the draft's (None: a deterministic draft, one-hot at its token).
    Draft token i is accepted with probability min(1, p/q); at the first rejection a token is
    drawn from the normalised max(0, p - q) instead, and after k acceptances from the last row.
    The tokens that come out are distributed exactly as sampling from ``probs`` one at a time.
    Returns (number of drafts accepted, the token that follows them).
    """
    import torch

    k = len(draft_token_ids)
    uniform = torch.rand(k, generator=generator, dtype=torch.float64).tolist() if k else []
    for i, token in enumerate(draft_token_ids):
        p = float(probs[i, token])
        q = float(draft_probs[i, token]) if draft_probs is not None else 1.0
        if uniform[i] * q < p:  # u < p / q without dividing by a zero q
            continue
        if draft_probs is not None:
            residual = (probs[i] - draft_probs[i]).clamp_min(0.0)
        else:
            residual = probs[i].clone()
            residual[token] = 0.0
        if not float(residual.sum()) > 0.0:  # p == q: rejection had probability 0
            residual = probs[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(probs[k], 1, generator=generator))
