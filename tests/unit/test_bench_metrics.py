"""Metric maths on synthetic traces: known inputs give known percentiles, goodput and attainment."""

import math

import pytest

from edge_rtgi.bench.metrics import (
    SLO,
    Distribution,
    PeakSampler,
    RequestTrace,
    percentile,
    run_duration_s,
    summarise,
    time_calls,
)


def make_trace(i, sent_s, ttft_ms, gap_ms, tokens, chunk=1, error=None):
    t = RequestTrace(request_id=f"r{i}", workload="w", sent_s=sent_s)
    now = sent_s + ttft_ms / 1e3
    t.add_chunk(now, chunk)
    produced = chunk
    while produced < tokens:
        now += gap_ms * chunk / 1e3
        t.add_chunk(now, chunk)
        produced += chunk
    t.end_s = now
    t.error = error
    return t


def test_percentiles_of_known_values():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))
    d = Distribution.of([100.0, 200.0, 300.0, 400.0, 500.0])
    assert (d.count, d.p50, d.max, d.mean) == (5, 300.0, 500.0, 300.0)
    assert d.p95 == pytest.approx(480.0)


def test_ttft_itl_e2e_from_trace():
    t = make_trace(0, sent_s=10.0, ttft_ms=120.0, gap_ms=30.0, tokens=5)
    assert t.ttft_ms == pytest.approx(120.0)
    assert t.itl_ms == pytest.approx([30.0] * 4)
    assert t.e2e_ms == pytest.approx(120.0 + 4 * 30.0)
    assert t.completion_tokens == 5


def test_multi_token_chunks_spread_their_gap():
    t = RequestTrace(request_id="r", sent_s=0.0)
    t.add_chunk(0.1, 1)
    t.add_chunk(0.2, 4)  # 100 ms for 4 tokens -> 25 ms each
    t.add_chunk(0.2, 0)  # an empty final delta is ignored
    t.end_s = 0.2
    assert t.itl_ms == pytest.approx([25.0] * 4)
    assert t.completion_tokens == 5


def test_summary_goodput_and_attainment():
    slo = SLO(ttft_ms=500.0, itl_ms=50.0)
    traces = [
        make_trace(0, 0.0, 100.0, 20.0, 10),  # meets both
        make_trace(1, 0.5, 600.0, 20.0, 10),  # TTFT miss
        make_trace(2, 1.0, 100.0, 80.0, 10),  # ITL miss
        make_trace(3, 1.5, 200.0, 40.0, 10),  # meets both
        make_trace(4, 2.0, 100.0, 20.0, 10, error="timeout"),  # failed
    ]
    m = summarise(traces, slo, duration_s=4.0, offered_rps=1.25)
    assert m.num_requests == 5 and m.num_ok == 4 and m.num_failed == 1
    assert m.slo_attainment == pytest.approx(2 / 5)
    assert m.ttft_attainment == pytest.approx(3 / 5)
    assert m.itl_attainment == pytest.approx(3 / 5)
    assert m.goodput_rps == pytest.approx(2 / 4.0)
    assert m.output_tokens == 50
    assert m.throughput_tok_s == pytest.approx(50 / 4.0)
    # TTFT distribution covers completed requests only: 100, 600, 100, 200
    assert m.ttft_ms.p50 == pytest.approx(150.0)
    assert m.ttft_ms.max == pytest.approx(600.0)


def test_itl_percentile_tolerates_rare_stalls():
    t = make_trace(0, 0.0, 100.0, 10.0, 41)  # 40 gaps of 10 ms
    t.chunk_times_s[-1] += 0.5  # one 510 ms stall at the end
    assert t.meets(SLO(itl_ms=50.0, itl_percentile=95.0))
    assert not t.meets(SLO(itl_ms=50.0, itl_percentile=100.0))


def test_single_token_request_has_no_itl_and_meets_itl():
    t = make_trace(0, 0.0, 100.0, 0.0, 1)
    assert t.itl_ms == []
    assert t.meets(SLO())


def test_run_duration_spans_first_send_to_last_end():
    traces = [make_trace(0, 1.0, 100.0, 10.0, 3), make_trace(1, 2.0, 100.0, 10.0, 3)]
    assert run_duration_s(traces) == pytest.approx(2.0 + 0.1 + 0.02 - 1.0)


def test_slo_rejects_nonsense():
    with pytest.raises(ValueError):
        SLO(ttft_ms=0)
    with pytest.raises(ValueError):
        SLO(itl_percentile=120)


def test_peak_sampler_and_time_calls():
    calls = []
    with PeakSampler(gauge=lambda: len(calls)) as sampler:
        calls.extend([1, 2, 3])
    assert sampler.peak_rss_mb > 0
    assert sampler.gauge_peak == 3
    timing = time_calls(lambda: calls.append(0), runs=3, warmup=2)
    assert timing.num_runs == 3 and len(calls) == 8
    assert timing.median_s >= 0
