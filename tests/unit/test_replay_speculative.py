"""scripts/replay_speculative.py: the replay charges each step its cost and keeps the reply whole."""

from __future__ import annotations

from edge_rtgi.llm.request import Request, RequestClass
from edge_rtgi.llm.speculative import NgramDraft, SpeculativeConfig, Speculator
from tests.scripts import load_script

replay_speculative = load_script("replay_speculative")
COSTS = [1.0, 1.1, 1.2, 1.3, 1.4]


def test_a_reply_that_repeats_the_prompt_is_replayed_whole_at_the_drafts_price():
    reply = [5, 6, 7, 8] * 6
    replies = [replay_speculative.Reply([5, 6, 7, 8, 5, 6, 7, 8], reply, RequestClass.BULK)]
    fixed = replay_speculative.replay(
        replies, lambda: Speculator(SpeculativeConfig("fixed", "ngram", 4), [NgramDraft()]), COSTS, "t"
    )
    assert fixed.tokens == len(reply) - 1  # every token after the first, none twice
    # 23 tokens: four steps of 4 held drafts + 1, then 4 drafts for the last 3 tokens (the draft
    # does not know the reply ends there), each step of 5 tokens at 1.4
    assert fixed.verify_steps == 5 and fixed.accepted == 4 * 4 + 3
    assert abs(fixed.cost - 5 * 1.4) < 1e-9
    best = replay_speculative.oracle(replies, NgramDraft(), COSTS, "o")
    assert best.tokens == fixed.tokens and best.cost <= fixed.cost
    # a reply cut at the token limit: as the scheduler does, no draft reaches past the limit, so
    # the last step carries 2 drafts (3 tokens left) at 1.2
    cut = [replay_speculative.Reply(replies[0].prompt, reply, RequestClass.BULK, cut=True)]
    capped = replay_speculative.replay(
        cut, lambda: Speculator(SpeculativeConfig("fixed", "ngram", 4), [NgramDraft()]), COSTS, "c"
    )
    assert capped.tokens == fixed.tokens and capped.accepted == 4 * 4 + 2
    assert abs(capped.cost - (4 * 1.4 + 1.2)) < 1e-9


class WrongDraft(NgramDraft):
    """Proposes a token no reply holds, every time."""

    def propose(self, request: Request, k: int) -> list[int]:
        return [999] * k


def test_drafts_that_never_hold_are_paid_for_by_a_fixed_setting_and_avoided_by_the_oracle():
    reply = list(range(1, 16))
    replies = [replay_speculative.Reply([0], reply, RequestClass.BULK)]
    fixed = replay_speculative.replay(
        replies, lambda: Speculator(SpeculativeConfig("fixed", "ngram", 2), [WrongDraft()]), COSTS, "t"
    )
    assert fixed.tokens == len(reply) - 1 and fixed.accepted == 0 and fixed.verify_steps == len(reply) - 1
    assert abs(fixed.speedup - 1 / 1.2) < 1e-9  # every token paid at a 3-token step's price
    best = replay_speculative.oracle(replies, WrongDraft(), COSTS, "o")
    assert best.speedup == 1.0 and best.verify_steps == 0
