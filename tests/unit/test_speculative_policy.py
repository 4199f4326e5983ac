"""Speculative decoding without a model: settings, the scheduler's draft accounting and KV
rollback, the n-gram draft, and the adaptive policy's choices."""

from __future__ import annotations

import pytest

from edge_rtgi.config import from_dict
from edge_rtgi.errors import ConfigError, RequestError
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.request import Request, RequestClass
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.scheduler import ModelRunnerOutput
from edge_rtgi.llm.speculative import (
    AdaptivePolicy,
    FeatureRows,
    NgramDraft,
    SpeculativeConfig,
    Speculator,
    StepCostTable,
    StepSize,
    expected_tokens,
    parse_speculative,
)
from edge_rtgi.pipeline.config import AssistantStageConfig
from tests.unit.test_scheduler import make, req, step


def test_settings_parse_and_bad_ones_name_the_key():
    assert parse_speculative("off") == SpeculativeConfig("off")
    assert parse_speculative("auto").enabled
    assert parse_speculative({"draft": "ngram", "k": 6}) == SpeculativeConfig("fixed", "ngram", 6)
    assert parse_speculative("ngram:3").as_setting() == "ngram:3"
    assert parse_speculative(False).mode == "off"  # YAML 1.1: a bare `off`
    assert parse_speculative({"draft": "eagle", "k": 4, "draft_model": "d.safetensors"}) == SpeculativeConfig(
        "fixed", "eagle", 4, "d.safetensors"
    )
    assert parse_speculative({"draft": "auto", "draft_model": "x"}) == SpeculativeConfig(
        "auto", draft_model="x"
    )
    for bad, named in (
        ({"draft": "ngram", "k": 0}, "speculative.k"),
        ({"draft": "ngram", "k": 17}, "speculative.k"),
        ({"draft": "ngram", "k": True}, "speculative.k"),
        ({"draft": "ngram", "k": "4"}, "speculative.k"),
        ("ngram:0", "speculative.k"),
        ("ngram:17", "speculative.k"),
        ("ngram:-1", "speculative.k"),
        ({"draft": "medusa", "k": 4}, "speculative.draft"),
        ({"draft": "eagle", "draft_model": 3}, "speculative.draft_model"),
        ({"draft": "ngram", "n": 4}, "unknown key"),
        ("sometimes", "'auto', 'off'"),
    ):
        with pytest.raises(ValueError, match=named):
            parse_speculative(bad)
    with pytest.raises(ConfigError, match=r"speculative\.k must be an integer in 1\.\.16"):
        from_dict(EngineConfig, {"speculative": {"draft": "ngram", "k": 20}})
    assert from_dict(EngineConfig, {"speculative": {"draft": "ngram", "k": 2}}).speculation().k == 2
    with pytest.raises(ConfigError, match="speculative.draft"):
        from_dict(AssistantStageConfig, {"speculative": {"draft": "medusa"}})
    with pytest.raises(ConfigError, match=r"speculative\.k must be an integer in 1\.\.16"):
        from_dict(AssistantStageConfig, {"speculative": {"draft": "ngram", "k": 0}})
    with pytest.raises(RequestError, match="speculative.k"):
        SamplingParams(speculative="ngram:99")


def test_drafts_count_against_the_budget_and_every_decode_comes_first():
    s = make(budget=8, max_seqs=4)
    a, b = req("a", 4, max_tokens=20), req("b", 3, max_tokens=20, base=50)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prefills (7 tokens)
    a.draft_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    b.draft_token_ids = [9, 9]
    out = s.schedule()
    rows = {r.request_id: r for r in out.scheduled}
    assert out.num_batched_tokens == 8
    # a is served first and may take the spare budget but must leave b its one token
    assert rows["a"].num_draft_tokens == 6 and rows["a"].token_ids[1:] == [1, 2, 3, 4, 5, 6]
    assert rows["b"].num_draft_tokens == 0 and len(rows["b"].token_ids) == 1
    assert rows["a"].sample and rows["b"].sample


def test_accepted_drafts_become_tokens_and_rejected_slots_are_released():
    s = make(budget=16, block_size=4)
    a = req("a", 3, max_tokens=20)
    s.add_request(a)
    step(s, token=7)  # prompt (3) -> first token; computed 3, tokens 4
    a.draft_token_ids = [11, 12, 13, 14, 15, 16]
    out = s.schedule()
    assert out.scheduled[0].num_draft_tokens == 6 and out.num_batched_tokens == 7
    assert s.kv.num_held_blocks("a") == [3]  # slots up to position 9
    result = ModelRunnerOutput({"a": 99}, num_accepted={"a": 2})
    (update,) = s.update_from_output(out, result)
    assert update.new_token_ids == [11, 12, 99]
    assert a.all_token_ids[3:] == [7, 11, 12, 99]
    assert a.num_computed_tokens == 6 == a.num_tokens - 1
    assert s.kv.num_held_blocks("a") == [2]  # the block that held only rejected drafts went back
    assert a.num_draft_tokens == 6 and a.num_accepted_draft_tokens == 2
    assert s.num_draft_tokens == 6 and s.num_accepted_draft_tokens == 2
    assert a.draft_token_ids == []


def test_drafts_never_pass_max_tokens_and_eos_inside_them_ends_the_request():
    s = make(budget=16)
    a = req("a", 3, max_tokens=4)
    s.add_request(a)
    step(s, token=7)
    a.draft_token_ids = [1, 2, 3, 4, 5]
    out = s.schedule()
    assert out.scheduled[0].num_draft_tokens == 2  # 1 output so far; 2 drafts + 1 = 4
    b = req("b", 3, max_tokens=10, base=40)
    s.add_request(b)
    step(s, token=7)
    b.draft_token_ids = [5, 0, 6]  # EOS (0) is the second draft
    out = s.schedule()
    updates = s.update_from_output(out, ModelRunnerOutput({"a": 8, "b": 9}, num_accepted={"a": 2, "b": 3}))
    by_id = {u.request_id: u for u in updates}
    assert by_id["b"].new_token_ids == [5, 0] and by_id["b"].finish_reason == "stop"
    assert s.kv.num_held_blocks("b") == [0]


def test_ngram_draft_stops_where_it_is_unsure():
    draft = NgramDraft(min_n=1, max_n=3, min_confidence=0.6)
    r = Request("r", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2], SamplingParams())
    # "1 2" was followed by 3 both times; "2 3" then by 4 and 5 (0.5 < 0.6): stop there
    assert draft.propose(r, 4) == [3]
    draft.release("r")


def test_adaptive_policy_drafts_when_it_pays_and_falls_back_when_not():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    cheap, dear = StepCostTable(), StepCostTable()
    for n in range(1, 18):
        cheap.observe(n, 10.0 + 0.5 * n)  # verification nearly free
        dear.observe(n, 10.0 * n)  # every row costs a whole step
    r = Request("r", [1, 2, 3], SamplingParams(), request_class=RequestClass.TRANSLATION)
    policy = AdaptivePolicy([NgramDraft()], cheap)
    for _ in range(20):
        policy.observe(r, "ngram", 4, 4)  # always accepted
    choice = policy.choose(r, 1)
    assert choice is not None and choice[0] == "ngram" and choice[1] >= 4
    assert AdaptivePolicy([NgramDraft()], dear).choose(r, 1) is None
    low = AdaptivePolicy([NgramDraft()], cheap)
    for _ in range(50):
        low.observe(r, "ngram", 4, 0)  # never accepted
    assert low.choose(r, 1) is None
    # what a request learnt seeds the next request of its class
    low.release(r)
    r2 = Request("r2", [1, 2, 3], SamplingParams(), request_class=RequestClass.TRANSLATION)
    assert low._arm(r2, "ngram").mean < 0.1


def measured_costs() -> StepCostTable:
    """Step times shaped like SmolLM2's on this machine: a k-draft step costs 1.4-1.5x a plain one."""
    costs = StepCostTable()
    for n, ms in ((1, 7.0), (2, 9.9), (3, 10.1), (4, 10.2), (5, 10.4), (7, 10.6), (9, 10.8)):
        costs.observe(n, ms)
    return costs


def test_adaptive_policy_pays_only_for_tokens_the_draft_has():
    policy = AdaptivePolicy([NgramDraft()], measured_costs())
    r = Request("r", [1, 2, 3], SamplingParams(), request_class=RequestClass.TRANSLATION)
    for _ in range(20):  # about a third of draft tokens accepted
        policy.observe(r, "ngram", 4, 1)
        policy.observe(r, "ngram", 4, 0)
    # several drafts at that rate pay for a 1.4-1.5x step, one draft does not
    choice = policy.choose(r, 1)
    assert choice is not None and choice[1] >= 2
    assert policy.choose(r, 1, available={"ngram": 1}) is None
    assert policy.choose(r, 1, available={"ngram": 0}) is None
    three = policy.choose(r, 1, available={"ngram": 3})
    assert three is not None and three[1] <= 3


def test_speculator_verifies_a_prefix_of_the_proposal_and_scores_it_when_plain():
    speculator = Speculator(SpeculativeConfig("auto"))
    speculator.costs = speculator.policy.costs = measured_costs()
    r = Request("r", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(), request_class=RequestClass.BULK)
    whole = NgramDraft().propose(r, 8)
    speculator.propose([(r, None)])
    assert r.draft_token_ids and r.draft_token_ids == whole[: len(r.draft_token_ids)]
    # a request whose drafts keep failing stops verifying; its proposal is scored in the shadow
    for _ in range(30):
        speculator.policy.observe(r, "ngram", 4, 0)
    r.draft_token_ids = []
    speculator.propose([(r, None)])
    assert r.draft_token_ids == [] and speculator.policy._arms["r"]["ngram"].pending == whole[:1]
    speculator.observe({"r": r}, {}, {}, {"r": [whole[0]]}, StepSize(1, 1), 7.0)
    assert speculator.stats.plain_steps == 1 and speculator.policy._arms["r"]["ngram"].pending == []


def test_a_class_whose_drafts_fail_starts_its_next_request_pessimistic():
    policy = AdaptivePolicy([NgramDraft()], measured_costs())
    first = Request("r0", [1, 2, 3], SamplingParams(), request_class=RequestClass.TRANSLATION)
    assert policy.choose(first, 1, available={"ngram": 3}) is not None  # the prior: try it
    policy.release(first)  # observed nothing: the class has no evidence, the prior is not evidence
    assert policy._class_totals[RequestClass.TRANSLATION, "ngram"] == [0.0, 0.0]
    for i in range(10):  # each request: one verification of 3 drafts, none accepted
        r = Request(f"r{i + 1}", [1, 2, 3], SamplingParams(), request_class=RequestClass.TRANSLATION)
        policy.observe(r, "ngram", 3, 0)
        policy.release(r)
    nxt = Request("next", [1, 2, 3], SamplingParams(), request_class=RequestClass.TRANSLATION)
    assert policy.choose(nxt, 1, available={"ngram": 3}) is None
    # another class keeps its own prior
    other = Request("other", [1, 2, 3], SamplingParams(), request_class=RequestClass.BULK)
    assert policy.choose(other, 1, available={"ngram": 3}) is not None


class CostlyDraft:
    """A draft that runs a model (``FeatureDraft``): proposes a fixed run, at a set cost."""

    name = "eagle"

    def __init__(self, cost_ms_per_token: float):
        self.cost_ms_per_token = cost_ms_per_token
        self.calls: list[int] = []
        self.features: list[tuple[str, int]] = []

    def propose(self, request: Request, k: int) -> list[int]:
        self.calls.append(k)
        return [5] * k

    def release(self, request_id: str) -> None:
        pass

    def add_features(self, request_id: str, start_position: int, features) -> None:
        self.features.append((request_id, start_position))


def test_a_model_running_draft_is_charged_its_cost_and_asked_only_when_chosen():
    costs = StepCostTable()
    for n, ms in ((1, 10.0), (2, 13.0), (3, 14.0), (4, 14.5), (5, 15.0), (7, 16.0), (9, 17.0)):
        costs.observe(n, ms)
    r = Request("r", [1, 2, 3, 4], SamplingParams(), request_class=RequestClass.BULK)
    cheap_draft, dear_draft = CostlyDraft(0.5), CostlyDraft(20.0)
    for draft, chosen in ((cheap_draft, True), (dear_draft, False)):
        spec = Speculator(SpeculativeConfig("auto"), [draft])
        spec.costs = spec.policy.costs = costs
        spec.propose([(r, None)])
        assert bool(r.draft_token_ids) is chosen
        # asked once, for the k it was chosen for (never a shadow guess on a plain step)
        assert draft.calls == ([len(r.draft_token_ids)] if chosen else [])
        r.draft_token_ids = []
    assert spec.wants_features
    spec.add_features({"r": FeatureRows(4, None)})  # type: ignore[arg-type]
    assert dear_draft.features == [("r", 4)]
    assert not Speculator(SpeculativeConfig("auto")).wants_features
    with pytest.raises(ValueError, match="needs a file or the model"):
        Speculator(SpeculativeConfig("fixed", "eagle", 4))


class DoubtingDraft(CostlyDraft):
    """Chosen, it proposes nothing (its confidence is low), or fails outright."""

    def __init__(self, fail: bool = False):
        super().__init__(0.1)
        self.fail = fail

    def propose(self, request: Request, k: int) -> list[int]:
        self.calls.append(k)
        if self.fail:
            raise RuntimeError("out of memory")
        return []


@pytest.mark.parametrize("fail", [False, True])
def test_a_model_draft_that_declines_or_fails_counts_against_it_and_the_cheap_draft_runs_on(fail, caplog):
    costs = StepCostTable()
    for n, ms in ((1, 10.0), (2, 11.0), (3, 11.5), (5, 12.0), (9, 13.0)):
        costs.observe(n, ms)
    model_draft = DoubtingDraft(fail)
    spec = Speculator(SpeculativeConfig("auto"), [NgramDraft(), model_draft])
    spec.costs = spec.policy.costs = costs
    r = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(), request_class=RequestClass.BULK)
    spec.policy._arm(r, "eagle").accepted = 50.0  # it has been right so far: the policy prefers it
    start = spec.policy._arm(r, "eagle").rejected
    spec.propose([(r, None)])
    assert model_draft.calls and spec.policy._arm(r, "eagle").rejected == start + 1
    assert r.draft_token_ids[:2] == [3, 1]  # the n-gram draft's proposal was verified instead
    assert ("failed" in caplog.text) is fail


def test_in_a_batch_drafts_are_placed_while_the_shared_step_still_gains():
    """Eight decodes share one step: every draft row slows all eight. Rows nearly free up to a
    few, then each costing 1/10 of a step (compute-bound): alone a request drafts, in a batch
    of eight no one does; with rows free everywhere all eight do."""
    bound, free = StepCostTable(), StepCostTable()
    for sequences in (1, 8):
        for n in range(sequences, 80):
            bound.observe(n, 7.0 + 0.4 * min(n, 8) + 1.0 * max(n - 8, 0), sequences)
            free.observe(n, 7.0 + 0.05 * n, sequences)
    for costs, alone_drafts, batch_drafts in ((bound, True, 0), (free, True, 8)):
        speculator = Speculator(SpeculativeConfig("auto"))
        speculator.costs = speculator.policy.costs = costs
        prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
        reqs = [Request(f"r{i}", prompt, SamplingParams(), request_class=RequestClass.BULK) for i in range(8)]
        for r in reqs:
            for _ in range(10):  # half of the draft tokens accepted
                speculator.policy.observe(r, "ngram", 2, 1)
        speculator.propose([(reqs[0], None)])
        assert bool(reqs[0].draft_token_ids) == alone_drafts
        for r in reqs:
            r.draft_token_ids = []
        speculator.propose([(r, None) for r in reqs])
        assert sum(bool(r.draft_token_ids) for r in reqs) == batch_drafts


def test_in_a_batch_no_proposal_is_made_where_no_draft_could_pay():
    """A proposal costs the store's lookup and the n-gram walk (tens of us a request), more than a
    step's share of what it could give in a batch whose rows are dear: there the draft is not asked
    at all. Alone it is still asked, and its proposal scored in the shadow when the step is plain."""

    class CountingNgram(NgramDraft):
        calls = 0

        def propose(self, request: Request, k: int) -> list[int]:
            CountingNgram.calls += 1
            return super().propose(request, k)

    bound, free = StepCostTable(), StepCostTable()
    for sequences in (1, 8):
        for n in range(sequences, 80):
            bound.observe(n, 7.0 + 0.4 * min(n, 8) + 1.0 * max(n - 8, 0), sequences)
            free.observe(n, 7.0 + 0.05 * n, sequences)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    for costs, batch, asked in ((bound, 8, 0), (free, 8, 8), (bound, 1, 1)):
        speculator = Speculator(SpeculativeConfig("auto"), [CountingNgram()])
        speculator.costs = speculator.policy.costs = costs
        reqs = [
            Request(f"r{i}", prompt, SamplingParams(), request_class=RequestClass.BULK) for i in range(batch)
        ]
        for r in reqs:
            for _ in range(10):  # half of the draft tokens accepted
                speculator.policy.observe(r, "ngram", 2, 1)
        CountingNgram.calls = 0
        speculator.propose([(r, None) for r in reqs])
        assert CountingNgram.calls == asked, (batch, asked)
    # the cost table's answers are kept between observations only
    for _ in range(20):  # the plain step of eight
        bound.observe(8, 10.2, 8)
    before = bound.ratio(8, 2)
    for _ in range(5):
        bound.observe(10, 30.0, 8)
    assert bound.ratio(8, 2) > before


def test_a_step_carries_no_more_draft_tokens_than_it_is_given_room_for():
    """``max_draft_tokens`` (the engine's room within the int8 kernel's rows) caps the step's drafts
    in all, for the policy's choices and for a pinned draft alike; 0 proposes nothing."""
    free = StepCostTable()
    for n in range(3, 80):
        free.observe(n, 7.0 + 0.05 * n, 3)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]
    for config in (SpeculativeConfig("auto"), SpeculativeConfig("fixed", "ngram", 8)):
        for room, want in ((None, None), (5, 5), (3, 3), (0, 0)):
            speculator = Speculator(config)
            speculator.costs = speculator.policy.costs = free
            reqs = [
                Request(f"r{i}", prompt, SamplingParams(), request_class=RequestClass.BULK) for i in range(3)
            ]
            for r in reqs:
                for _ in range(10):  # nearly every draft token accepted
                    speculator.policy.observe(r, "ngram", 4, 4)
            speculator.propose([(r, None) for r in reqs], room)
            drafted = sum(len(r.draft_token_ids) for r in reqs)
            if want is None:
                assert drafted > 5  # unlimited: every request drafts
            else:
                assert drafted == want, (config, room, [r.draft_token_ids for r in reqs])


def test_step_cost_ratios_follow_the_machine_not_its_drift():
    """Drafted steps were last timed while the machine was fast; it has since slowed by 60 % and
    only plain steps ran. The cost of four drafts is still 1.48x a plain step: the drift-following
    table says so, plain per-size EMAs compare old and new times and call the drafts free."""

    def step_ms(tokens: int, speed: float) -> float:
        return speed * 7.0 * (1.0 + 0.12 * (tokens - 1))

    following, plain = StepCostTable(), StepCostTable(follow_speed=False)
    for table in (following, plain):
        for _ in range(30):  # fast: plain and 5-token steps interleaved
            table.observe(1, step_ms(1, 1.0))
            table.observe(5, step_ms(5, 1.0))
        for i in range(200):  # slowing down to 1.6x, plain steps only
            table.observe(1, step_ms(1, 1.0 + 0.6 * min(i / 100, 1.0)))
    assert abs(following.ratio(1, 4) - 1.48) < 0.01
    assert abs(following.cost_ms(5) - step_ms(5, 1.6)) < 0.1  # type: ignore[operator]
    # 10.36 ms then against 11.2 ms now: "free", but for the table's floor
    assert plain.ratio(1, 4) == 1.0 + 4 * StepCostTable.MIN_SHARE_OF_PRIOR * plain.prior_ratio_per_token
    # a drafted step timed now corrects a size's own cost, whatever the speed
    for _ in range(40):
        following.observe(1, step_ms(1, 1.6))
        following.observe(5, 1.6 * 7.0 * 1.8)
    assert abs(following.ratio(1, 4) - 1.8) < 0.02


def test_the_cost_table_follows_a_change_of_traffic_and_shrugs_off_a_stall():
    def step_ms(tokens: int, speed: float) -> float:
        return speed * 7.0 * (1.0 + 0.125 * (tokens - 1))

    table = StepCostTable()
    for _ in range(1000):  # a long spell at batch 1: size 1 is the anchor
        table.observe(1, step_ms(1, 1.0))
    for i in range(600):  # then batch 3 (plain: 3 tokens; with drafts: 7), slowing to 1.6x
        speed = 1.0 + 0.6 * min(i / 300, 1.0)
        table.observe(3, step_ms(3, speed), 3)
        if i % 3 == 0:
            table.observe(7, step_ms(7, speed), 3)
    assert abs(table.ratio(3, 4) - step_ms(7, 1.0) / step_ms(3, 1.0)) < 0.02
    assert abs(table.cost_ms(3, 3) - step_ms(3, 1.6)) < 0.2  # type: ignore[operator]

    stalled = StepCostTable()
    for _ in range(30):
        stalled.observe(1, 7.0)
        stalled.observe(5, 10.5)
    stalled.observe(1, 2000.0)  # a 2 s stall on a plain step
    for _ in range(10):
        stalled.observe(1, 7.0)
        stalled.observe(5, 10.5)
    assert stalled.ratio(1, 4) > 1.4  # 1.5 before the stall; not "free"
    stalled.observe(5, 0.0)  # a clock that did not move is ignored, not a division by zero
    stalled.observe(9, 0.0)
    assert StepSize(1, 9) not in stalled.relative


def test_step_costs_are_kept_by_sequences_as_well_as_tokens():
    """Eight plain decodes and six decodes carrying two drafts both run eight tokens, but the six
    cost 30 % more than their plain step (on the CPU here: docs/benchmarks.md). Kept by tokens
    alone, the table priced those drafts at the eight's plain step: free. Kept apart, drafts at
    half acceptance are not placed at batch six; and sizes not timed take their cost per token
    from their own sequences, else from the nearest sequences that have one."""
    table = StepCostTable()
    for _ in range(50):
        table.observe(8, 10.0, 8)  # eight plain decodes
        table.observe(6, 10.0, 6)
    for _ in range(5):
        table.observe(8, 13.0, 6)  # six decodes, two drafts
    assert abs(table.ratio(6, 2, 6) - 1.3) < 1e-6
    assert abs(table.ratio(6, 4, 6) - 1.6) < 1e-6  # extrapolated at its own sequences' slope
    table.observe(5, 9.0, 5)  # five: plain step only; six's slope lent (0.15 a token)
    assert abs(table.ratio(5, 2, 5) - 1.3) < 1e-6
    assert abs(table.cost_ms(7, 5) - 9.0 * 1.3) < 1e-6  # type: ignore[operator]
    table.observe(9, 12.5, 6)  # a larger size timed cheaper than a smaller: further drafts still cost
    assert abs(table.ratio(6, 6, 6) - 1.5) < 1e-6  # the slope from the plain step: 0.25 / 3 a token
    # the request side: six decodes whose drafts hold half the time stay plain at these costs
    speculator = Speculator(SpeculativeConfig("auto"))
    speculator.costs = speculator.policy.costs = table
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    reqs = [Request(f"r{i}", prompt, SamplingParams(), request_class=RequestClass.BULK) for i in range(6)]
    for r in reqs:
        for _ in range(10):
            speculator.policy.observe(r, "ngram", 2, 1)
    speculator.propose([(r, None) for r in reqs])
    assert not any(r.draft_token_ids for r in reqs)
    # with those drafts priced as free (as the table by tokens alone priced them), they drafted
    by_tokens = StepCostTable()
    for _ in range(50):
        by_tokens.observe(8, 10.0, 6)
        by_tokens.observe(6, 10.0, 6)
    speculator.costs = speculator.policy.costs = by_tokens
    speculator.propose([(r, None) for r in reqs])
    assert any(r.draft_token_ids for r in reqs)


def test_a_drafted_step_is_priced_against_the_plain_steps_just_before_it():
    """Six decodes over short contexts, plain 10 ms and 12 ms with two drafts; later six others over
    long contexts, plain only, 16 ms. Against the six's average plain step the drafts looked free;
    paired with the plain steps just before them they cost 1.2x. A drafted step with no plain step
    of its sequences within the window before or after it teaches nothing."""
    table, by_size = StepCostTable(), StepCostTable(follow_speed=False)
    for t in (table, by_size):
        for _ in range(30):
            t.observe(6, 10.0, 6)
            t.observe(8, 12.0, 6)
        for _ in range(30):
            t.observe(6, 16.0, 6)
    assert abs(table.ratio(6, 2, 6) - 1.2) < 1e-6
    # 12 ms against about 15: "free", but for the table's floor
    assert (
        by_size.ratio(6, 2, 6)
        == 1.0 + 2 * StepCostTable.MIN_SHARE_OF_PRIOR * by_size.prior_ratio_per_token / 6
    )
    assert abs(table.cost_ms(8, 6) - 16.0 * 1.2) < 1e-6  # type: ignore[operator]
    for _ in range(StepCostTable.PAIR_WINDOW_STEPS + 1):
        table.observe(1, 5.0)
    table.observe(8, 100.0, 6)  # no plain step of six for too long: it waits for the next ones
    for _ in range(StepCostTable.PAIR_WINDOW_STEPS + 1):
        table.observe(1, 5.0)
    for _ in range(3):
        table.observe(6, 10.0, 6)  # too late for it: it taught nothing
    assert abs(table.ratio(6, 2, 6) - 1.2) < 1e-6
    # a batch's first steps carry drafts before any plain step: they wait for the three plain
    # steps after them, and their median (one of those stalled: no matter)
    first = StepCostTable()
    first.observe(10, 13.0, 8)
    first.observe(10, 13.0, 8)
    assert first.ratio(8, 2, 8) < 1.1  # nothing timed yet: the prior
    for ms in (10.0, 500.0, 10.0):
        first.observe(8, ms, 8)
    assert abs(first.ratio(8, 2, 8) - 1.3) < 1e-6
    # and sequences with nothing timed take the cost per token of the nearest that have it
    assert abs(first.ratio(6, 2, 6) - 1.3) < 1e-6
    # a new size's first sample, stalled, is held to three times what the table said of it
    first.observe(12, 2000.0, 8)
    assert abs(first.ratio(8, 4, 8) - 3 * 1.6) < 1e-6
    # priced that dear it is not drafted, so not timed again: after a while it is forgotten and
    # priced from the sizes around it again (here none are left: the prior)
    for _ in range(StepCostTable.FORGET_AFTER_STEPS + 512):
        first.observe(8, 10.0, 8)
    assert first.ratio(8, 4, 8) == 1.0 + 0.25 * 4 / 8


def test_where_even_drafts_that_always_hold_cannot_pay_no_one_is_asked_but_a_pinned_draft():
    """Rows as dear as whole sequences: k drafts that all hold give k tokens for k rows' cost, never
    the 3 % the policy asks. One check a step says so, and no request is asked, nor checked on its
    own; a request pinned to a fixed draft still proposes."""

    class CountingNgram(NgramDraft):
        calls = 0

        def propose(self, request: Request, k: int) -> list[int]:
            CountingNgram.calls += 1
            return super().propose(request, k)

    dear = StepCostTable()
    for n in range(8, 40):
        dear.observe(n, 1.25 * n, 8)
    speculator = Speculator(SpeculativeConfig("auto"), [CountingNgram()])
    speculator.costs = speculator.policy.costs = dear
    assert not speculator.policy.could_pay(8)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    reqs = [Request(f"r{i}", prompt, SamplingParams(), request_class=RequestClass.BULK) for i in range(8)]
    chosen = []
    choose = speculator.policy.choose
    speculator.policy.choose = lambda *a, **kw: chosen.append(a) or choose(*a, **kw)  # type: ignore[method-assign]
    speculator.propose([(r, None) for r in reqs])
    # not even the per-request check ran (about 15 us a request)
    assert CountingNgram.calls == 0 and not chosen and not any(r.draft_token_ids for r in reqs)
    speculator.propose(
        [(r, SpeculativeConfig("fixed", "ngram", 2) if i == 0 else None) for i, r in enumerate(reqs)]
    )
    assert (
        CountingNgram.calls == 1 and reqs[0].draft_token_ids and not any(r.draft_token_ids for r in reqs[1:])
    )


def test_the_step_check_gives_way_once_a_pinned_request_has_placed_drafts():
    """A second pass over the weights doubles the step at a ninth row, and holds up to 24 rows:
    alone, drafts never pay at eight (16 tokens for twice the cost at best), but once a request
    pinned to eight drafts has paid for that pass, further rows are free, and requests whose
    drafts always hold are asked again, as without the check."""
    table = StepCostTable()
    for n in range(8, 48):
        table.observe(n, 10.0 if n == 8 else 20.0 + 2.0 * max(n - 24, 0), 8)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]
    placed = []
    for check in (True, False):
        speculator = Speculator(SpeculativeConfig("auto"))
        speculator.costs = speculator.policy.costs = table
        assert not speculator.policy.could_pay(8)
        if not check:
            speculator.policy.could_pay = lambda sequences: True  # type: ignore[method-assign]
        reqs = [Request(f"r{i}", prompt, SamplingParams(), request_class=RequestClass.BULK) for i in range(8)]
        for r in reqs:
            for _ in range(50):
                speculator.policy.observe(r, "ngram", 4, 4)
        speculator.propose(
            [(r, SpeculativeConfig("fixed", "ngram", 8) if i == 0 else None) for i, r in enumerate(reqs)]
        )
        placed.append([len(r.draft_token_ids) for r in reqs])
    assert placed[0] == placed[1] and placed[0][0] == 8 and sum(placed[0][1:]) > 0, placed
