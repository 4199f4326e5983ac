"""Importance eviction under a per-request KV budget (``kv_budget_tokens`` + ``kv_eviction``).

A request whose cached tokens pass its budget after a step drops its least important tokens
and its survivors are compacted into fewer blocks (``KVCacheManager.compact``). Importance is
attention mass, gathered by the attention backend for these requests only
(``kv.attention``, ``ModelRunner``), summed over layers and heads, because one block table
serves every layer:

- ``h2o``: mass from every query so far (Heavy-Hitter Oracle), evicting during prefill as the
  chunks arrive, so a request never holds more than its budget plus one step's tokens;
- ``snapkv``: mass from the last ``observation_tokens`` queries of the prompt (the question at
  its end sees what matters), pooled over neighbouring keys; the prompt is held whole until
  its end, then cut to the budget; decode queries add their mass afterwards;
- ``segment``: the unit is a segment (a conversation turn, from the chat template's turn-start
  token, or a sentence), scored by the mean mass of its tokens, so a fact is kept or dropped
  whole; the first segment (the system prompt) is pinned where it fits (unless ``pin_system``
  is off). Scored like snapkv by
  default (``score: observation``), but observed by the current turn (the question and the
  reply's header) rather than a fixed number of last queries, which would reach back into the
  previous turn and favour it: a turn's importance shows when a later question attends to it,
  and no earlier query can know which turn that will be, so online (h2o) scores drop far facts
  before the question arrives; ``score: accumulated`` scores it the h2o way instead.

The first ``sink_tokens`` and the last ``recent_tokens`` cached tokens are never evicted.
Eviction trims to one block below the budget (``slack_tokens``), so during decode a request
compacts once per block of new tokens, not once per token. No torch here: the scheduler and its tests use it.

Positions: keys are stored rotated at their absolute position and a kept key keeps its
rotation, so a query-key score still depends on their true offset (the model's view of the
survivors is exact); nothing is re-rotated. Without ``kv_window`` positions never pass
``max_model_len``, which the model's trained range caps, so they stay in range.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

EVICTION_MODES = ("h2o", "snapkv", "segment")
SEGMENT_UNITS = ("turn", "sentence")
SCORE_SOURCES = ("accumulated", "observation")


@dataclass(frozen=True)
class KVEviction:
    """``kv_eviction`` engine setting: how a request over ``kv_budget_tokens`` picks what to drop.

    ``mode``: h2o | snapkv | segment (module docstring). ``sink_tokens`` first and
    ``recent_tokens`` last cached tokens are protected. ``observation_tokens``: the prompt's
    last queries that score keys under snapkv. ``segment``: the unit under segment mode, a
    conversation ``turn`` or a ``sentence`` (turns split at sentence ends). ``score``: where the
    mass comes from, ``accumulated`` (every query, h2o's default) or ``observation`` (the prompt's
    last queries, then decode queries: the default of snapkv and segment); None: the mode's.
    ``pin_system``: under segment mode the first segment (the system prompt) ranks before every
    other where it fits; False: it competes by its mass like the rest (a long system prompt
    that fits a small budget otherwise leaves little room for the conversation's facts).
    ``slack_tokens``: how far below the budget a trim goes (None: one block), so that decode
    compacts once per that many new tokens rather than after every token; 0 keeps the whole
    budget in use, at a compaction per decode step under h2o (segment modes drop whole
    segments, so they compact far less often).
    ``contrast_tokens``: 0 ranks by raw attention mass; N divides each key's mass by the median
    mass of the cached keys within N positions of it before ranking (``local_contrast``).
    """

    mode: str = "h2o"
    sink_tokens: int = 4
    recent_tokens: int = 32
    observation_tokens: int = 32
    segment: str = "turn"
    score: str | None = None
    pin_system: bool = True
    slack_tokens: int | None = None
    contrast_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in EVICTION_MODES:
            raise ValueError(
                f"kv_eviction.mode must be one of {', '.join(EVICTION_MODES)}, got {self.mode!r}"
            )
        if self.segment not in SEGMENT_UNITS:
            raise ValueError(
                f"kv_eviction.segment must be one of {', '.join(SEGMENT_UNITS)}, got {self.segment!r}"
            )
        if self.score not in (None, *SCORE_SOURCES):
            raise ValueError(
                f"kv_eviction.score must be one of {', '.join(SCORE_SOURCES)}, got {self.score!r}"
            )
        for key in ("sink_tokens", "recent_tokens", "contrast_tokens"):
            if getattr(self, key) < 0:
                raise ValueError(f"kv_eviction.{key} must be >= 0, got {getattr(self, key)}")
        if self.slack_tokens is not None and self.slack_tokens < 0:
            raise ValueError(
                f"kv_eviction.slack_tokens must be >= 0 (or unset: one block), got {self.slack_tokens}"
            )
        if self.observation_tokens < 1:
            raise ValueError(f"kv_eviction.observation_tokens must be >= 1, got {self.observation_tokens}")

    @property
    def protected_tokens(self) -> int:
        return self.sink_tokens + self.recent_tokens

    def check_budget(self, budget_tokens: int, block_size: int) -> None:
        """Raise ValueError unless ``budget_tokens`` holds a block and more than the protected tokens."""
        low = max(block_size, self.protected_tokens + 1)
        if budget_tokens < low:
            raise ValueError(
                f"kv_budget_tokens must be >= {low} (one block of {block_size} tokens, and more than "
                f"kv_eviction.sink_tokens + recent_tokens = {self.protected_tokens}), got {budget_tokens}"
            )

    def trim_target(self, budget_tokens: int, block_size: int) -> int:
        """Tokens a request keeps after an eviction: ``slack_tokens`` (default one block) below
        the budget, never fewer than the protected tokens plus one."""
        slack = block_size if self.slack_tokens is None else self.slack_tokens
        return max(self.protected_tokens + 1, budget_tokens - slack)

    def scores_every_query(self) -> bool:
        """Whether every query's attention mass counts (``score: accumulated``), or only the
        prompt's last ``observation_tokens`` and decode queries (``observation``: the prompt is
        then held whole until its end)."""
        return (self.score or ("accumulated" if self.mode == "h2o" else "observation")) == "accumulated"


def segment_ids(
    token_ids: Sequence[int], turn_starts: Collection[int], sentence_ends: Collection[int] = ()
) -> list[int]:
    """Segment index of every token: a new segment starts at each turn-start token, and after
    each sentence-end token (pass none for turn segments)."""
    out, seg, prev_end = [], 0, False
    for i, tok in enumerate(token_ids):
        if i and (tok in turn_starts or prev_end):
            seg += 1
        out.append(seg)
        prev_end = tok in sentence_ends
    return out


def local_contrast(scores: Sequence[float], radius_tokens: int) -> list[float]:
    """Each score divided by the median score of the keys within ``radius_tokens`` of it.

    Why: attention mass falls with distance (rotary positions favour near keys), so raw mass
    ranks the last turns first whatever they say, and a fact 12 turns back loses to small talk
    2 turns back. A fact the question looks up stands out from its neighbours instead; dividing
    by the local median (not the mean, which the fact itself and sink-like tokens would raise)
    measures that.
    """
    n, out = len(scores), []
    for i in range(n):
        window = sorted(scores[max(0, i - radius_tokens) : i + radius_tokens + 1])
        out.append(scores[i] / max(window[len(window) // 2], 1e-12))
    return out


def select_keep(
    scores: Sequence[float],
    keep_tokens: int,
    policy: KVEviction,
    segments: Sequence[int] | None = None,
) -> list[int]:
    """Indices (ascending) of the cached tokens to keep: the protected sinks and recent tokens,
    then the highest-scored tokens (or whole segments, when ``segments`` gives each token's
    segment) up to ``keep_tokens`` in all.

    Segments are taken best mean score first while they fit whole; a segment cut by the
    protected range competes with its unprotected part only. Room no whole segment fits stays
    empty (a fact is never kept in part), so segment mode may hold less than the others at the
    same budget. Ties keep the older token.
    """
    n = len(scores)
    if keep_tokens >= n:
        return list(range(n))
    if policy.contrast_tokens:
        scores = local_contrast(scores, policy.contrast_tokens)
    sinks = min(policy.sink_tokens, n)
    recent_start = max(sinks, n - policy.recent_tokens)
    keep = set(range(sinks)) | set(range(recent_start, n))
    room = keep_tokens - len(keep)
    if room <= 0:
        return sorted(keep)
    free = range(sinks, recent_start)
    if segments is None:
        ranked = sorted(free, key=lambda i: (-scores[i], i))
        keep.update(ranked[:room])
        return sorted(keep)
    members: dict[int, list[int]] = {}
    for i in free:
        members.setdefault(segments[i], []).append(i)
    # the first segment (the system prompt) is pinned: it ranks before every other one
    first = segments[0] if n and policy.pin_system else None
    units = sorted(
        members.items(),
        key=lambda kv: (kv[0] != first, -sum(scores[i] for i in kv[1]) / len(kv[1]), kv[0]),
    )
    for _, idx in units:
        if len(idx) <= room:
            keep.update(idx)
            room -= len(idx)
        if room == 0:
            break
    return sorted(keep)


def observation_queries(policy: KVEviction, prompt: Sequence[int], turn_starts: Collection[int]) -> int:
    """How many of the prompt's last queries score the cache under ``score: observation``:
    ``observation_tokens``, or under segment mode the current turn (from the start of the
    second-to-last turn, the question, through the reply's header) where the prompt has one."""
    if policy.mode != "segment":
        return policy.observation_tokens
    starts = [i for i, t in enumerate(prompt) if t in turn_starts]
    return len(prompt) - starts[-2] if len(starts) >= 2 else policy.observation_tokens
