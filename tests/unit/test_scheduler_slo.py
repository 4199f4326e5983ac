"""The slo scheduling policy and the step-time model, with fake runner outputs and no model."""

from __future__ import annotations

import random

import pytest

from edge_rtgi.bench.metrics import percentile
from edge_rtgi.config import from_dict
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.kv.manager import KVCacheManager
from edge_rtgi.llm.request import DEFAULT_SLOS, Request, RequestClass, RequestSLO, RequestStatus
from edge_rtgi.llm.scheduler import Scheduler, SchedulerConfig
from edge_rtgi.llm.step_model import StepShape, StepTimeModel
from edge_rtgi.pipeline.config import AssistantStageConfig, SloConfig, TranslateStageConfig
from tests.unit.test_scheduler import EOS, Params, step


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def trained_model(
    fixed=5.0, per_row=10.0, per_token=0.5, per_ktoken=0.0, n=64, seed=0, python_layers=0.0, fused_tokens=0
) -> StepTimeModel:
    """A step-time model fitted on exact synthetic costs of varied step shapes; steps wider than
    ``fused_tokens`` or carrying prefill (beyond it) run on the Python layers at ``python_layers``
    ms more (with ``fused_tokens`` 0, as on a runner with no fused path, every step does)."""
    rng = random.Random(seed)
    model = StepTimeModel()
    for _ in range(n):
        rows, prefill = rng.randint(0, 8), rng.choice([0, 0, 4, 16, 64, 200])
        python = rows + prefill > fused_tokens
        shape = StepShape(rows, prefill, rng.randint(0, 4000), python)
        model.observe(shape, fixed + per_row * rows + per_token * prefill + python_layers * python)
    return model


def make(
    policy="slo",
    model=None,
    clock=None,
    num_blocks=64,
    block_size=4,
    budget=64,
    max_seqs=8,
    order="edf",
    fused_tokens=0,
    fused_decode_rows=None,
    max_model_len=512,
):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(
        budget,
        max_seqs,
        max_model_len,
        True,
        policy=policy,
        slo_waiting_order=order,
        fused_decode_rows=fused_tokens if fused_decode_rows is None else fused_decode_rows,
        fused_step_tokens=fused_tokens,
        fused_chunk_max_keys=4096 if fused_tokens else 0,
    )
    return Scheduler(cfg, kv, model, clock or Clock())


def req(rid, n_prompt, klass=RequestClass.DIALOGUE, t=100.0, max_tokens=4, slo=None, base=1):
    return Request(
        rid,
        list(range(base, base + n_prompt)),
        Params(max_tokens),
        request_class=klass,
        slo=slo,
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=t,
    )


def test_slo_defaults_and_bad_values():
    r = req("a", 4, RequestClass.VOICE, t=10.0)
    assert r.objective == DEFAULT_SLOS[RequestClass.VOICE] and r.ttft_deadline_s == pytest.approx(10.5)
    for bad in (0, -5, float("nan"), True):
        with pytest.raises(ValueError, match="ttft_ms"):
            RequestSLO(ttft_ms=bad, itl_ms=50)
    with pytest.raises(ValueError, match="choose one of voice, translation, dialogue, bulk"):
        RequestClass.parse("urgent")


def test_bad_pipeline_slo_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="itl_ms"):
        from_dict(AssistantStageConfig, {"slo": {"request_class": "voice", "itl_ms": 0}})
    with pytest.raises(ConfigError, match="unknown request class 'urgent'"):
        from_dict(AssistantStageConfig, {"slo": {"request_class": "urgent"}})
    cfg = from_dict(AssistantStageConfig, {"slo": {"request_class": "bulk", "ttft_ms": 2000}})
    assert cfg.slo.klass is RequestClass.BULK and cfg.slo.objective() == RequestSLO(2000, 250)
    assert SloConfig().klass is RequestClass.VOICE


def test_late_requests_wait_by_class_then_earliest_deadline():
    s = make(budget=4, max_seqs=1)  # the clock reads 100 s: every first-token deadline has passed
    s.add_request(req("bulk", 4, RequestClass.BULK, t=1.0))
    s.add_request(req("dialogue-late", 4, RequestClass.DIALOGUE, t=3.0))
    # an earlier arrival with a looser objective has the later deadline
    s.add_request(req("dialogue-loose", 4, RequestClass.DIALOGUE, t=2.0, slo=RequestSLO(5000, 50)))
    s.add_request(req("voice", 4, RequestClass.VOICE, t=4.0))
    assert [r.request_id for r in s.waiting] == ["voice", "dialogue-late", "dialogue-loose", "bulk"]
    fcfs = make(policy="fcfs")
    for r in ("bulk", "dialogue-late", "voice"):
        fcfs.add_request(req(r, 4, t={"bulk": 1.0, "dialogue-late": 3.0, "voice": 4.0}[r]))
    assert [r.request_id for r in fcfs.waiting] == ["bulk", "dialogue-late", "voice"]


def test_decodes_closest_to_their_deadline_go_first_when_the_budget_is_short():
    clock = Clock()
    s = make(clock=clock, budget=2, max_seqs=4)
    for rid, itl in (("relaxed", 200.0), ("tight", 20.0), ("middle", 50.0)):
        s.add_request(req(rid, 1, slo=RequestSLO(1000, itl), max_tokens=8))
    s.config = SchedulerConfig(8, 4, 512, True, policy="slo")
    step(s)  # all three prefill (one token each) and sample
    s.config = SchedulerConfig(2, 4, 512, True, policy="slo")
    clock.now_s += 0.01
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["tight", "middle"]


def test_prefill_is_sized_so_running_decodes_keep_their_itl_unless_a_first_token_is_due():
    clock = Clock()
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.5)  # 15 ms for one decode row
    s = make(model=model, clock=clock, budget=256, num_blocks=512)
    s.add_request(req("voice", 4, RequestClass.VOICE, max_tokens=50))
    step(s)  # prefill + first token: now decoding with a 50 ms ITL objective
    s.add_request(req("long", 400, RequestClass.BULK, base=100, max_tokens=2))
    out, _ = step(s)
    # a prefilling step may take the 50 ms objective: (50 - 15) / 0.5 = 70 tokens of prompt
    assert {r.request_id: len(r.token_ids) for r in out.scheduled} == {"voice": 1, "long": 70}
    # a prompt whose first token is due before the capped pace would reach it lifts the cap
    s.add_request(req("urgent", 400, RequestClass.BULK, base=600, max_tokens=2, slo=RequestSLO(200, 250)))
    out, _ = step(s)
    assert sum(len(r.token_ids) for r in out.scheduled) == 256
    # the same first step under fcfs takes the whole budget
    f = make(policy="fcfs", model=model, clock=clock, budget=256, num_blocks=512)
    f.add_request(req("voice", 4, RequestClass.VOICE, max_tokens=50))
    step(f)
    f.add_request(req("long", 400, RequestClass.BULK, base=100, max_tokens=2))
    out, _ = step(f)
    assert {r.request_id: len(r.token_ids) for r in out.scheduled}["long"] == 255


def test_prefill_goes_through_fused_steps_where_a_step_on_the_python_layers_would_break_the_itl():
    """Steps of up to 32 tokens run on the fused path while their chunk rows read at most 4,096
    keys; any other step pays the Python layers' 40 ms on top. Beside one decode (50 ms ITL), a
    Python-layer step of even 16 tokens would take 55 ms, so a prompt goes through in fused steps
    (31 tokens beside the decode row), fewer as its context grows, and once not even 16 of its
    tokens fit the keys, the rest in one step: several small Python-layer steps would each miss.
    Beside 20 decodes a fused step has room for 12 tokens, under the floor of 16, and a
    Python-layer step misses anyway: one step takes the whole budget."""
    model = trained_model(fixed=5.0, per_row=2.0, per_token=0.5, python_layers=40.0, fused_tokens=32)
    s = make(model=model, budget=256, num_blocks=1024, max_seqs=32, fused_tokens=32)
    s.add_request(req("voice", 4, RequestClass.VOICE, max_tokens=500))
    step(s)
    s.add_request(req("long", 400, RequestClass.BULK, base=100, max_tokens=2))
    chunks = []
    while s.requests["long"].num_computed_tokens < 400:
        out, _ = step(s)
        sizes = {r.request_id: len(r.token_ids) for r in out.scheduled}
        assert sizes["voice"] == 1
        chunks.append(sizes["long"])
    start = 0
    for n in chunks[:-1]:  # each chunk's rows read their context up to themselves
        assert 16 <= n <= 31 and n * (2 * start + n + 1) // 2 <= 4096
        start += n
    assert chunks[:4] == [31] * 4 and chunks[-2] < 31 and chunks[-1] == 400 - start > 31

    # 20 decodes and a long prompt admitted while the model was still learning (the row test
    # would now hold the rows to 16, so that a chunk keeps the fused path beside them)
    wide = make(model=None, budget=256, num_blocks=1024, max_seqs=32, fused_tokens=32)
    for i in range(20):
        wide.add_request(req(f"d{i}", 2, RequestClass.VOICE, base=10 * i + 1, max_tokens=50))
    wide.add_request(req("long", 400, RequestClass.BULK, base=1000, max_tokens=2))
    step(wide)
    assert len(wide.running) == 21 and wide.requests["long"].num_computed_tokens == 256 - 40
    wide.step_model = model
    out, _ = step(wide)
    assert {r.request_id: len(r.token_ids) for r in out.scheduled}["long"] == 400 - 216


def test_prefill_prefers_fused_steps_to_a_python_layer_step_sized_to_the_itl():
    """Beside one decode (50 ms ITL), a Python-layer step could carry (50 - 27) / 0.5 = 46 prompt
    tokens and be predicted to end right at the objective; a fused step carries 31 at a
    predicted 23 ms. The prompt goes through fused steps while their chunk rows fit the keys."""
    model = trained_model(fixed=5.0, per_row=2.0, per_token=0.5, python_layers=20.0, fused_tokens=32)
    s = make(model=model, budget=256, num_blocks=1024, max_seqs=32, fused_tokens=32)
    s.add_request(req("voice", 4, RequestClass.VOICE, max_tokens=500))
    step(s)
    s.add_request(req("turn", 60, RequestClass.VOICE, base=100, max_tokens=2))
    out, _ = step(s)
    assert {r.request_id: len(r.token_ids) for r in out.scheduled} == {"voice": 1, "turn": 31}
    # without a fused path the Python-layer step takes what fits the objective
    plain = make(model=trained_model(fixed=5.0, per_row=2.0, per_token=0.5), budget=256, num_blocks=1024)
    plain.add_request(req("voice", 4, RequestClass.VOICE, max_tokens=500))
    step(plain)
    plain.add_request(req("turn", 60, RequestClass.VOICE, base=100, max_tokens=2))
    out, _ = step(plain)
    assert {r.request_id: len(r.token_ids) for r in out.scheduled} == {"voice": 1, "turn": 60}


def test_a_first_token_late_at_the_fused_pace_takes_the_python_layer_size_before_no_cap():
    """Beside a decode with a loose 200 ms ITL, a 600-token prompt due in 440 ms: 31-token fused
    steps (22.5 ms each) would take 20 steps, 450 ms; Python-layer steps of 346 tokens (200 ms)
    take two, 400 ms. The cap is the Python-layer size, not lifted for one 600-token step."""
    model = trained_model(fixed=5.0, per_row=2.0, per_token=0.5, python_layers=20.0, fused_tokens=32)
    s = make(model=model, budget=1024, num_blocks=1024, max_seqs=32, fused_tokens=32, max_model_len=2048)
    s.add_request(req("bulk", 4, RequestClass.BULK, max_tokens=500, slo=RequestSLO(2000, 200)))
    step(s)
    s.add_request(req("due", 600, RequestClass.BULK, base=100, max_tokens=2, slo=RequestSLO(440, 200)))
    out, _ = step(s)
    sizes = {r.request_id: len(r.token_ids) for r in out.scheduled}
    assert sizes["bulk"] == 1 and 340 <= sizes["due"] <= 350, sizes  # the fit is not exact to a token


def test_rows_leave_room_for_a_fused_prompt_chunk():
    """Decode-only steps stay on the fused path up to its own row limit (here 64), but a row is
    admitted only while a step of the rows plus a ``min_prefill_chunk_tokens`` prompt chunk (16)
    keeps the ITL objective: past 16 rows such a step leaves the 32-token fused path and pays the
    Python layers' 40 ms, so every later prompt would stall the streams."""
    model = trained_model(fixed=5.0, per_row=1.0, per_token=0.5, python_layers=40.0, fused_tokens=32)
    s = make(model=model, budget=64, max_seqs=48, num_blocks=512, fused_tokens=32, fused_decode_rows=64)
    for i in range(40):
        s.add_request(req(f"d{i}", 1, base=i + 1, max_tokens=20))
    step(s)
    step(s)
    assert len(s.running) == 16 and s.num_row_deferrals == 2


def six_offered(model: StepTimeModel | None, policy: str = "slo") -> Scheduler:
    """A scheduler offered six two-token prompts (20-token replies), after its first step."""
    s = make(policy=policy, model=model, budget=64, max_seqs=8, num_blocks=128)
    for i in range(6):
        s.add_request(req(f"d{i}", 2, base=10 * i + 1, max_tokens=20))
    step(s)
    return s


def test_rows_leave_room_for_a_chunk_on_the_python_layers_too():
    # k rows and a 16-token chunk: 5 + 10 k + 8 ms; 3 rows keep 50 ms (43), a 4th would not (53)
    s = six_offered(trained_model(fixed=5.0, per_row=10.0, per_token=0.5))
    assert len(s.running) == 3 and s.num_row_deferrals == 1


def test_draft_tokens_being_verified_count_as_rows_for_admission():
    """Three decodes verifying two drafts each run as nine rows, as the prefill sizing counts
    them: with 1 ms a row, 5 ms fixed and a 16-token chunk at 0.5 ms (8 ms), a fourth request would
    make 5 + 10 + 8 = 23 ms, within 20 ms only without the drafts (17)."""
    model = trained_model(fixed=5.0, per_row=1.0, per_token=0.5)
    s = make(model=model, budget=64, max_seqs=8, num_blocks=128)
    for i in range(3):
        s.add_request(req(f"d{i}", 2, base=10 * i + 1, max_tokens=20, slo=RequestSLO(500, 20)))
    step(s)
    newcomer = req("new", 2, base=90, max_tokens=20, slo=RequestSLO(500, 20))
    assert s._row_fits(newcomer)
    for r in s.running:
        r.draft_token_ids[:] = [7, 7]
    assert not s._row_fits(newcomer)


def test_rows_stay_held_while_those_running_already_miss_their_itl():
    """When the machine slows (the model refits), the rows running may already miss the objective
    where fewer would keep it: a newcomer waits for them to drain instead of deepening the miss."""
    fast = trained_model(fixed=5.0, per_row=10.0, per_token=0.0)  # k rows: 5 + 10 k ms
    s = make(model=fast, budget=64, max_seqs=8, num_blocks=128)
    for i in range(4):
        s.add_request(req(f"d{i}", 2, base=10 * i + 1, max_tokens=20))
    step(s)
    assert len(s.running) == 4
    s.step_model = trained_model(fixed=5.0, per_row=14.0, per_token=0.0)  # 4 rows: 61 ms; one: 19
    s.add_request(req("late", 2, base=90, max_tokens=20))
    step(s)
    assert "late" not in {r.request_id for r in s.running} and s.num_row_deferrals == 1


def test_admission_stops_where_one_more_row_would_break_the_tightest_itl():
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.0)  # k rows: 5 + 10 k ms
    s = six_offered(model)
    # 4 rows: 45 ms <= 50 ms; a 5th would be 55 ms
    assert len(s.running) == 4 and len(s.waiting) == 2 and s.num_row_deferrals == 1
    assert len(six_offered(model, policy="fcfs").running) == 6


def test_a_first_token_does_not_lift_the_cap_over_streams_with_no_late_gap_to_spare():
    """A 16-token reply has 15 gaps: at the 95th percentile not one may be late, so a step that
    stalls it for a first token would cost its objective. The cap holds, the prompt goes on at
    the capped pace; a 50-token reply (two late gaps to spare) lets the cap lift."""
    for max_tokens, lifted in ((16, False), (50, True)):
        model = trained_model(fixed=5.0, per_row=10.0, per_token=0.5)  # 15 ms for one decode row
        s = make(model=model, budget=256, num_blocks=512)
        s.add_request(req("voice", 4, RequestClass.VOICE, max_tokens=max_tokens))
        step(s)
        s.add_request(req("urgent", 400, RequestClass.BULK, base=600, max_tokens=2, slo=RequestSLO(200, 250)))
        out, _ = step(s)
        prefill = {r.request_id: len(r.token_ids) for r in out.scheduled}["urgent"]
        assert prefill == (255 if lifted else 70), max_tokens
        assert s.num_lifts_held == (0 if lifted else 1)


def test_a_held_cap_with_no_room_leaves_the_prompt_waiting_never_a_negative_chunk():
    """No fused path, four 16-token streams at 45 ms of a 50 ms objective: a prompt step that
    keeps the target would carry 10 tokens, under the floor of 16, and the streams have no late gap
    to spare. The prompt waits this step (0 tokens, not a negative count), and the held lift is
    counted only while a first token wants one."""
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.5)
    for with_prompt in (True, False):
        s = make(model=None, budget=64, num_blocks=512)
        for i in range(4):
            s.add_request(req(f"d{i}", 2, RequestClass.VOICE, base=10 * i + 1, max_tokens=16))
        if with_prompt:
            s.add_request(req("long", 400, RequestClass.BULK, base=100, max_tokens=2))
        step(s)  # admitted while the model was still learning
        s.step_model = model
        out, _ = step(s)
        assert {r.request_id: len(r.token_ids) for r in out.scheduled} == {f"d{i}": 1 for i in range(4)}
        assert out.num_batched_tokens == 4 and s.num_lifts_held == (1 if with_prompt else 0)


def test_late_gaps_allowed_keep_the_itl_percentile_the_benchmark_judges():
    """``Request.late_gaps_allowed`` late gaps, however late, leave a reply's 95th-percentile gap
    within the objective (50 ms); one more, late enough (1 s), does not; replies of every length."""
    for max_tokens in (2, 3, 8, 16, 21, 22, 32, 48, 64, 100):
        r = req("r", 2, max_tokens=max_tokens)
        allowed = r.late_gaps_allowed()
        for late in range(max_tokens):
            gaps = [1000.0] * late + [10.0] * (max_tokens - 1 - late)
            assert (percentile(gaps, 95) <= 50.0) == (late <= allowed), (max_tokens, late, allowed)
        r.num_late_gaps = allowed
        assert not r.can_take_late_gap() and not r.missed_objective()
        r.num_late_gaps += 1
        assert r.missed_objective()
    # a context window that leaves less room than max_tokens bounds the reply
    r = req("r", 100, max_tokens=400)
    assert r.late_gaps_allowed() == 19 and r.late_gaps_allowed(context_window=132) == 1


def test_a_row_is_taken_from_bulk_or_a_stream_already_lost_never_from_an_on_time_one():
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.0)  # 4 rows keep 50 ms
    clock = Clock()
    s = make(model=model, clock=clock, budget=64, max_seqs=8, num_blocks=128)
    for i in range(4):
        s.add_request(req(f"chat{i}", 2, RequestClass.DIALOGUE, t=100.0 + i, base=10 * i + 1, max_tokens=20))
    step(s)  # all four stream, on time
    s.add_request(req("voice", 2, RequestClass.VOICE, t=100.0, base=90, max_tokens=20))
    out, _ = step(s)
    assert "voice" not in {r.request_id for r in s.running} and not out.preempted_ids
    s.requests["chat2"].num_late_gaps = 5  # its ITL objective is lost
    out, _ = step(s)
    assert out.preempted_ids == ["chat2"] and "voice" in {r.request_id for r in s.running}


def test_no_cap_or_row_deferral_when_the_itl_objective_is_out_of_reach():
    """On a machine slowed past the ITL objective (other work on the cores), the caps cannot keep
    it; holding prompts and rows back would only add their waits, so slo steps as fcfs does."""
    slow = trained_model(fixed=120.0, per_row=10.0, per_token=0.5)  # one decode row: 130 ms > 50
    s = make(model=slow, budget=256, num_blocks=512)
    s.add_request(req("voice", 4, RequestClass.VOICE, max_tokens=50))
    step(s)
    s.add_request(req("long", 400, RequestClass.BULK, base=100, max_tokens=2))
    out, _ = step(s)
    assert {r.request_id: len(r.token_ids) for r in out.scheduled}["long"] == 255
    rows = six_offered(slow)
    assert len(rows.running) == 6 and rows.num_row_deferrals == 0


def test_an_urgent_request_preempts_a_lower_class_for_a_row():
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.0)
    s = make(model=model, budget=64, max_seqs=8, num_blocks=128)
    for i in range(4):
        s.add_request(req(f"bulk{i}", 2, RequestClass.BULK, t=100.0 + i, base=10 * i + 1, max_tokens=20))
    step(s)
    assert len(s.running) == 4
    s.add_request(req("voice", 2, RequestClass.VOICE, t=105.0, base=90, max_tokens=20))
    out, _ = step(s)
    running = {r.request_id for r in s.running}
    assert "voice" in running and "bulk3" not in running  # the newest bulk request gave way
    assert s.requests["bulk3"].status is RequestStatus.PREEMPTED and out.preempted_ids == ["bulk3"]
    # a request of the same class does not preempt: it waits
    s.add_request(req("voice2", 2, RequestClass.VOICE, t=106.0, base=95, max_tokens=20))
    s.add_request(req("voice3", 2, RequestClass.VOICE, t=107.0, base=97, max_tokens=20))
    step(s)
    step(s)
    classes = sorted(r.request_class.value for r in s.running)
    assert classes.count("voice") >= 2 and len(s.running) == 4


def test_preemption_for_blocks_takes_a_lower_class_and_everything_finishes():
    s = make(model=None, num_blocks=8, block_size=4, budget=64, max_seqs=8)
    s.add_request(req("bulk", 20, RequestClass.BULK, max_tokens=8))
    step(s)
    s.add_request(req("voice", 12, RequestClass.VOICE, base=50, max_tokens=4))
    out, _ = step(s)
    assert "voice" in {r.request_id for r in s.running} and "bulk" in out.preempted_ids
    done = set()
    for _ in range(100):
        _, updates = step(s)
        done |= {u.request_id for u in updates if u.finish_reason}
        if not s.has_unfinished():
            break
    assert done == {"voice", "bulk"} and s.kv.pool.num_used_blocks == 0


def test_step_model_fits_synthetic_costs_and_reports_its_error():
    rng = random.Random(1)
    model = StepTimeModel(min_observations=16)
    assert model.predict_ms(StepShape(1, 0, 10)) is None  # still learning
    true = (4.0, 9.0, 0.3, 2.0, 25.0)
    for _ in range(400):
        rows, prefill = rng.randint(0, 12), rng.choice([0, 4, 16, 64, 128, 256])
        shape = StepShape(rows, prefill, rng.randint(0, 6000), rows + prefill > 16)
        cost = sum(c * f for c, f in zip(true, shape.features(), strict=True))
        model.observe(shape, cost * rng.uniform(0.95, 1.05))  # 5 % noise
    snap = model.snapshot()
    for fitted, want in zip(snap.coefficients_ms, true, strict=True):
        assert fitted == pytest.approx(want, rel=0.15, abs=1.0)
    assert snap.ready and 0.5 < snap.error_pct < 6.0 and snap.error_ms > 0
    assert model.predict_ms(StepShape(4, 64, 1000, True)) == pytest.approx(4 + 36 + 19.2 + 2 + 25, rel=0.05)
    assert model.predict_ms(StepShape(4, 8, 1000)) == pytest.approx(4 + 36 + 2.4 + 2, rel=0.05)


def test_step_model_follows_a_machine_that_slows_down():
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.5, n=100)
    for _ in range(600):  # twice as slow from now on
        model.observe(StepShape(3, 0, 500), 2 * (5.0 + 30.0))
    assert model.predict_ms(StepShape(3, 0, 500)) == pytest.approx(70.0, rel=0.05)


def test_admission_refuses_text_and_bulk_work_that_would_wait_too_long_but_never_voice():
    from edge_rtgi.errors import EngineBusy

    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.5)
    s = make(model=model, num_blocks=4096, budget=64)
    # ten 390-token prompts at 0.5 ms a token: 1.95 s, within 4 x the 500 ms objective: all queued
    for i in range(10):
        s.add_request(req(f"queued{i}", 390, t=100.0 + i, base=1 + 400 * i))
    with pytest.raises(EngineBusy, match=r"10 requests \(4290 prompt tokens with this one\)") as refused:
        s.add_request(req("late", 390, t=111.0, base=9000))
    assert refused.value.code == "busy" and refused.value.retry_after_ms == pytest.approx(2145, rel=0.01)
    assert refused.value.hint == "retry in 2.1 s"
    assert s.num_refused_busy == 1 and "late" not in s.requests
    batch = req("batch", 390, t=112.0, base=9500)
    batch.may_refuse = False  # a caller that waits for every result (LLMEngine.generate) queues
    s.add_request(batch)
    # bulk work is judged by its own, looser objective (10 s); with a tight one it is refused too
    s.add_request(req("background", 400, RequestClass.BULK, base=10000))
    with pytest.raises(EngineBusy, match="bulk request"):
        s.add_request(req("tight", 400, RequestClass.BULK, base=11000, slo=RequestSLO(500, 250)))
    s.add_request(req("voice", 400, RequestClass.VOICE, base=12000))  # voice always queues
    s.add_request(req("live", 400, RequestClass.TRANSLATION, base=13000))
    fcfs = make(policy="fcfs", model=model, num_blocks=4096)
    for i in range(20):
        fcfs.add_request(req(f"q{i}", 400, RequestClass.BULK, base=1 + 400 * i))  # fcfs never refuses


def test_step_model_shrugs_off_stalls_from_outside_the_engine():
    rng = random.Random(2)
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.5, n=200)
    for i in range(400):
        shape = StepShape(rng.randint(1, 8), rng.choice([0, 0, 64, 200]), rng.randint(0, 3000))
        cost = 5.0 + 10.0 * shape.decode_rows + 0.5 * shape.prefill_tokens
        model.observe(shape, cost + (2000.0 if i % 50 == 0 else 0.0))  # a 2 s stall now and then
    for got, want in zip(model.snapshot().coefficients_ms, (5.0, 10.0, 0.5, 0.0, 0.0), strict=True):
        assert got == pytest.approx(want, abs=1.0)


def test_step_model_overshoot_is_the_margin_97_steps_in_100_keep():
    """Steps that run uniformly 0-10 ms past a linear cost: the fit absorbs the mean, so they run
    -5..+5 ms past its predictions, and 97 % of them at most 4.7 ms past. Exact costs: no margin."""
    rng = random.Random(3)
    noisy, exact = StepTimeModel(), StepTimeModel()
    for _ in range(600):
        shape = StepShape(rng.randint(1, 8), rng.choice([0, 0, 16, 64]), rng.randint(0, 3000))
        cost = 5.0 + 10.0 * shape.decode_rows + 0.5 * shape.prefill_tokens
        noisy.observe(shape, cost + rng.uniform(0.0, 10.0))
        exact.observe(shape, cost)
    assert 4.0 < noisy.overshoot_ms() < 5.0 and noisy.snapshot().overshoot_ms == noisy.overshoot_ms()
    assert exact.overshoot_ms() < 0.01


def test_a_request_past_its_first_token_deadline_goes_behind_those_still_on_time():
    clock = Clock()
    s = make(clock=clock, budget=4, max_seqs=1)
    s.add_request(req("late", 4, RequestClass.VOICE, t=99.0))  # due at 99.5: already late
    s.add_request(req("on-time", 4, RequestClass.DIALOGUE, t=100.0, base=20))
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["on-time"]


def _plan(out) -> list[tuple]:
    return [
        (
            [(r.request_id, tuple(r.token_ids), r.start_position, r.sample) for r in out.scheduled],
            tuple(out.preempted_ids),
        )
    ]


def test_fcfs_reads_no_class_slo_or_step_model():
    """Under fcfs a request's class and SLO, a ready step-time model and the clock change nothing:
    step for step the plan equals that of plain requests (priority, then arrival), preemptions
    included."""

    def run(decorated: bool) -> list[tuple]:
        clock = Clock()
        model = trained_model(fixed=5.0, per_row=20.0, per_token=10.0) if decorated else None
        s = make(policy="fcfs", model=model, clock=clock, num_blocks=14, block_size=4, budget=32, max_seqs=4)
        classes = [RequestClass.BULK, RequestClass.VOICE, RequestClass.DIALOGUE, RequestClass.TRANSLATION]
        plans: list[tuple] = []
        for i in range(8):
            klass = classes[i % 4] if decorated else RequestClass.DIALOGUE
            slo = RequestSLO(1.0 if i % 2 else 5000.0, 50.0) if decorated else None
            t = 100.0 + 0.001 * i
            s.add_request(req(f"r{i}", 6 + 3 * i, klass, t=t, max_tokens=6, slo=slo, base=10 * i + 1))
            if i < 3:
                continue  # four queued at once, then one more each step
            out, _ = step(s)
            plans += _plan(out)
            clock.now_s += 0.01  # the odd requests' first-token deadlines pass at once
        while s.has_unfinished():
            out, _ = step(s)
            plans += _plan(out)
            clock.now_s += 0.01
            assert len(plans) < 500
        assert s.num_row_deferrals == 0 and s.num_refused_busy == 0
        return plans

    decorated = run(True)
    assert decorated == run(False)
    assert any(preempted for _, preempted in decorated)  # the pool was tight enough to preempt


@pytest.mark.parametrize(
    ("stage", "fields", "key"),
    [
        (AssistantStageConfig, {"slo": {"ttft_ms": 0}}, "ttft_ms"),
        (AssistantStageConfig, {"slo": {"ttft_ms": -200}}, "ttft_ms"),
        (AssistantStageConfig, {"slo": {"itl_ms": -1}}, "itl_ms"),
        (AssistantStageConfig, {"slo": {"request_class": "urgent"}}, "request_class"),
        (AssistantStageConfig, {"max_reply_tokens": 0}, "max_reply_tokens"),
        (AssistantStageConfig, {"reply_deadline_ms": 0}, "reply_deadline_ms"),
        (AssistantStageConfig, {"token_budget": "guess"}, "token_budget"),
        (TranslateStageConfig, {"slo": {"itl_ms": 0}}, "itl_ms"),
        (TranslateStageConfig, {"slo": {"request_class": "realtime"}}, "request_class"),
        (TranslateStageConfig, {"min_budget_tokens": 0}, "min_budget_tokens"),
    ],
)
def test_a_bad_slo_class_or_budget_in_a_pipeline_is_a_config_error_naming_the_key(stage, fields, key):
    with pytest.raises(ConfigError, match=key):
        from_dict(stage, fields)


@pytest.mark.parametrize(
    ("engine", "key"),
    [
        ({"scheduling": "edf"}, "scheduling"),
        ({"min_prefill_chunk_tokens": 0}, "min_prefill_chunk_tokens"),
        ({"admission_wait_factor": -1.0}, "admission_wait_factor"),
        ({"slo_waiting_order": "fifo"}, "slo_waiting_order"),
    ],
)
def test_a_bad_scheduling_setting_in_the_daemon_config_is_a_config_error_naming_the_key(engine, key):
    from edge_rtgi.server.config import DaemonConfig

    with pytest.raises(ConfigError, match=rf"DaemonConfig\.engine: {key}"):
        from_dict(DaemonConfig, {"engine": engine})


def test_on_time_requests_go_by_deadline_across_classes_and_late_ones_by_class():
    """Global EDF while a first token can still be on time (a dialogue due sooner goes before a
    voice turn due later); past its deadline a request goes behind, where the class decides."""
    arrivals = {
        "late-dialogue": (RequestClass.DIALOGUE, 99.0, None),  # due 99.5
        "late-voice": (RequestClass.VOICE, 99.2, None),  # due 99.7
        "bulk": (RequestClass.BULK, 95.0, None),  # due 105.0
        "voice": (RequestClass.VOICE, 99.95, None),  # due 100.45
        "dialogue": (RequestClass.DIALOGUE, 99.8, None),  # due 100.3
        "code": (RequestClass.DIALOGUE, 99.9, RequestSLO(300, 50)),  # due 100.2
    }

    def queue(order: str, clock: Clock) -> Scheduler:
        s = make(clock=clock, budget=4, max_seqs=1, order=order)
        for i, (rid, (klass, t, slo)) in enumerate(arrivals.items()):
            s.add_request(req(rid, 4, klass, t=t, slo=slo, base=10 * i + 1))
        return s

    clock = Clock()  # now: 100.0
    s = queue("edf", clock)
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["code"]
    assert [r.request_id for r in s.waiting] == ["dialogue", "voice", "bulk", "late-voice", "late-dialogue"]
    clock.now_s = 100.35  # the dialogue's deadline has passed: it goes behind, by class
    s.schedule()  # (the one row is still taken: nothing is admitted)
    assert [r.request_id for r in s.waiting] == ["voice", "bulk", "late-voice", "late-dialogue", "dialogue"]
    # the earlier order (slo_waiting_order: class) put the class first among those on time
    c = queue("class", Clock())
    out, _ = step(c)
    assert [r.request_id for r in out.scheduled] == ["voice"]
    assert [r.request_id for r in c.waiting] == ["code", "dialogue", "bulk", "late-voice", "late-dialogue"]


def test_a_request_preempted_for_a_late_one_sits_out_the_step():
    """A bulk request preempted for a late voice turn sorts ahead of it (its own deadline is far
    off) but is not readmitted in the same step, which would preempt it again without end."""
    model = trained_model(fixed=5.0, per_row=10.0, per_token=0.0)  # 4 rows fit a 50 ms ITL
    s = make(model=model, budget=64, max_seqs=8, num_blocks=128)
    for i in range(4):
        s.add_request(
            req(f"bulk{i}", 2, RequestClass.BULK, t=100.0 + i * 0.001, base=10 * i + 1, max_tokens=20)
        )
    step(s)
    s.add_request(req("voice", 2, RequestClass.VOICE, t=99.0, base=90, max_tokens=20))  # due 99.5: late
    out, _ = step(s)
    assert out.preempted_ids == ["bulk3"] and "voice" in {r.request_id for r in s.running}
    assert [r.request_id for r in s.waiting] == ["bulk3"]
