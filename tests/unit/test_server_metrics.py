"""The daemon's Prometheus registry: what each event moves, parsed back with prometheus_client."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from edge_rtgi import frames as F
from edge_rtgi.llm.request import Usage
from edge_rtgi.server.metrics import Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_events_and_requests_move_their_series():
    m = Metrics()
    stats = F.TurnStats(
        asr_final_ms=180.0, tts_first_chunk_ms=130.0, voice_to_voice_ms=870.0, reply_head_start_ms=420.0
    )
    m.observe_event(F.ResponseDone("r1", "completed", "Paris.", stats))
    m.observe_event(F.ResponseDone("r2", "interrupted", "", F.TurnStats()))
    m.observe_event(F.ErrorEvent("stage_failed", "boom"))
    m.observe_request("tiny", "stop", Usage(5, 0, 3, 40.0, (40.0, 52.0, 61.0)))
    m.observe_request("tiny", "error", None)
    s = samples(m)
    assert s[("edge_rtgi_responses_total", (("status", "completed"),))] == 1
    assert s[("edge_rtgi_responses_total", (("status", "interrupted"),))] == 1
    assert s[("edge_rtgi_errors_total", (("code", "stage_failed"),))] == 1
    # only the turn that had the part is observed, in the bucket its value falls in
    assert (
        s[("edge_rtgi_voice_to_voice_ms_count", ())] == 1
        and s[("edge_rtgi_voice_to_voice_ms_sum", ())] == 870
    )
    assert s[("edge_rtgi_voice_to_voice_ms_bucket", (("le", "750.0"),))] == 0
    assert s[("edge_rtgi_voice_to_voice_ms_bucket", (("le", "1000.0"),))] == 1
    assert s[("edge_rtgi_asr_final_ms_count", ())] == 1 and s[("edge_rtgi_tts_first_audio_ms_count", ())] == 1
    # a reply started on the likely final: only that turn has a head start
    assert s[("edge_rtgi_reply_head_start_ms_count", ())] == 1
    assert s[("edge_rtgi_reply_head_start_ms_bucket", (("le", "400.0"),))] == 0
    assert s[("edge_rtgi_reply_head_start_ms_bucket", (("le", "600.0"),))] == 1
    assert s[("edge_rtgi_llm_ttft_ms_sum", (("model", "tiny"),))] == 40.0
    assert s[("edge_rtgi_llm_itl_ms_count", (("model", "tiny"),))] == 2  # two gaps between three tokens
    assert s[("edge_rtgi_llm_itl_ms_sum", (("model", "tiny"),))] == 21.0
    assert s[("edge_rtgi_llm_requests_total", (("finish_reason", "error"), ("model", "tiny")))] == 1
    assert s[("edge_rtgi_up", ())] == 1


def test_each_daemon_has_its_own_registry():
    a, b = Metrics(), Metrics()  # the same names twice: no clash in a global registry
    a.sessions.inc()
    assert samples(a)[("edge_rtgi_sessions_total", ())] == 1
    assert samples(b)[("edge_rtgi_sessions_total", ())] == 0


def test_asr_steps_and_turn_queue_wait_move_their_series():
    from edge_rtgi.asr.batch import StepStats

    m = Metrics()
    m.observe_asr_step("whisper-tiny.en", StepStats(3, 2, 1, (12.0, 40.0, 250.0), (True, True, False), 400.0))
    m.observe_event(
        F.ResponseDone("r", "completed", "Hi.", F.TurnStats(asr_queue_ms=40.0, asr_decode_ms=300.0))
    )
    s = samples(m)
    model = ("model", "whisper-tiny.en")
    assert s[("edge_rtgi_asr_batch_size_sum", (model,))] == 3
    assert s[("edge_rtgi_asr_batch_size_count", (model,))] == 1
    finals = (("kind", "final"), model)
    assert s[("edge_rtgi_asr_queue_wait_ms_count", finals)] == 2
    assert s[("edge_rtgi_asr_queue_wait_ms_sum", (("kind", "partial"), model))] == 250.0
    assert s[("edge_rtgi_asr_final_queue_ms_sum", ())] == 40.0
