"""A sliding window with attention sinks (StreamingLLM) for any model: the setting and its KV groups.

``KVWindow(sink_tokens, window_tokens)``: every query sees the first ``sink_tokens`` positions of
its sequence plus the last ``window_tokens`` (itself included). The KV manager frees the blocks
wholly between the two after every step (``KVCacheManager.release_outside_windows``), so a
session's KV stays bounded however long it runs.

Positions: keys are stored rotated by their absolute position, as everywhere else. RoPE makes a
score depend only on the query-key offset, and a window key's offset is below ``window_tokens``
already; only the sinks drift out of the trained range as the sequence grows. So the attention
backend re-rotates the *gathered* sink keys (a handful of tokens, never the stored ones) to sit
just before the window of the step's first query: ``sink_shift`` below. Nothing stored changes,
so blocks under prefix hashes stay valid, and the fused decode kernel still serves every step in
which no sequence has slid. No torch here: the scheduler and the manager use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from edge_rtgi.llm.kv.manager import KVGroupSpec


@dataclass(frozen=True)
class KVWindow:
    """``kv_window`` engine setting: keep ``sink_tokens`` first tokens and the last ``window_tokens``."""

    sink_tokens: int = 4
    window_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"kv_window.sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.window_tokens < 1 or self.window_tokens <= self.sink_tokens:
            raise ValueError(
                f"kv_window.window_tokens must be > kv_window.sink_tokens ({self.sink_tokens}) "
                f"and >= 1, got {self.window_tokens}"
            )

    def check_positions(self, max_position_embeddings: int, max_step_tokens: int) -> None:
        """Raise ValueError unless every query-key offset stays in the model's trained range.

        A step's queries share one sink shift (that of its first query), so the farthest a sink
        sits from a query is ``window_tokens + sink_tokens + max_step_tokens - 2``.
        """
        farthest = self.window_tokens + self.sink_tokens + max_step_tokens - 2
        if farthest >= max_position_embeddings:
            raise ValueError(
                f"kv_window.window_tokens + kv_window.sink_tokens + max_num_batched_tokens - 2 = "
                f"{farthest} must be < the model's {max_position_embeddings} trained positions; "
                f"allowed window_tokens: {self.sink_tokens + 1}.."
                f"{max_position_embeddings - self.sink_tokens - max_step_tokens + 1}"
            )


def windowed_groups(groups: Sequence[KVGroupSpec], window: KVWindow | None) -> tuple[KVGroupSpec, ...]:
    """The model's KV groups under ``window``: groups that see more than the window get it (and
    the sinks); groups with a model window of their own at most that wide keep it unchanged
    (Gemma 3's local layers, trained without sinks)."""
    if window is None:
        return tuple(groups)
    out = []
    for g in groups:
        if g.window_tokens is None or g.window_tokens > window.window_tokens:
            g = replace(g, window_tokens=window.window_tokens, sink_tokens=window.sink_tokens)
        out.append(g)
    return tuple(out)


def sink_shift(first_query_position: int, window_tokens: int, sink_tokens: int) -> int:
    """How far to move the sinks (positions ``0..sink_tokens-1``) so they sit right before the
    window of a query at ``first_query_position``; 0 until the window has slid past them."""
    return max(0, first_query_position - window_tokens + 1 - sink_tokens)
