"""The daemon's HTTP face with real models: the official ``openai`` client against the chat API,
the browser client in Debian's headless Chromium with a fake microphone, and the Prometheus
histograms after a voice turn.

One daemon for the module (whisper tiny.en + SmolLM2-135M + Piper, the voice-assistant
pipeline prepared, as ``edge-rtgi serve`` does).
"""

from __future__ import annotations

import os
import shutil

import pytest
import pytest_asyncio

from edge_rtgi.catalog import resolve_model
from tests.integration import cdp
from tests.integration.native_client import NativeClient, http_get, speak_16k, steady_voice, wer

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
PROMPT = "The three primary colors are"
LONG_REQUEST = "Tell me a long story about a dragon."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def piper():
    from edge_rtgi.tts.piper import PiperVoice

    return steady_voice(PiperVoice(resolve_model("piper-en_US-joe-medium", role="tts"), intra_op_threads=1))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon():
    from edge_rtgi.pipeline.config import builtin_pipelines_dir, load_pipelines
    from edge_rtgi.pipeline.resources import Resources
    from edge_rtgi.server.app import Daemon
    from edge_rtgi.server.config import DaemonConfig, ServerConfig

    pipelines = load_pipelines([builtin_pipelines_dir()])
    d = Daemon(DaemonConfig(server=ServerConfig(port=0)), pipelines, Resources())
    await d.resources.prepare(pipelines["voice-assistant"])
    await d.start()
    yield d
    await d.drain(timeout_s=1.0)
    d.resources.close()


def client_for(daemon):
    return openai.AsyncOpenAI(api_key="local", base_url=f"http://127.0.0.1:{daemon.port}/v1", max_retries=0)


async def test_official_openai_client_on_the_real_model(daemon):
    # Greedy output against `edge-rtgi generate` / `chat` is checked on a tiny model in
    # test_http_api.py (the same code path; two more SmolLM2 processes cost the suite ~1 min).
    client = client_for(daemon)
    assert MODEL in [m.id for m in (await client.models.list()).data]
    completion = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].text.strip() and completion.usage.completion_tokens <= MAX_TOKENS
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chat = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    answer = chat.choices[0].message.content
    assert "paris" in answer.lower(), answer
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(pieces) == answer and len([p for p in pieces if p]) >= 2


async def test_metrics_parse_and_histograms_move_after_a_voice_turn(daemon, piper):
    from prometheus_client.parser import text_string_to_metric_families

    def counts(text: str) -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(text):  # raises on anything malformed
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    _, before = await http_get(daemon.port, "/metrics")
    c = await NativeClient.open(daemon.port)
    try:
        await c.wait_type("session.created")
        await c.stream(speak_16k(piper, QUESTION), speed=2.0)
        done = await c.wait_type("response.done")
        assert done["status"] == "completed"
    finally:
        await c.close()
    status, after = await http_get(daemon.port, "/metrics")
    assert status == 200
    moved = {k: counts(after).get(k, 0.0) - counts(before).get(k, 0.0) for k in counts(after)}
    for name in (
        "edge_rtgi_voice_to_voice_ms_count",
        "edge_rtgi_asr_final_ms_count",
        "edge_rtgi_tts_first_audio_ms_count",
        "edge_rtgi_llm_ttft_ms_count",
    ):
        assert moved.get(name) == 1, (name, moved)
    assert moved["edge_rtgi_llm_itl_ms_count"] >= 1
    families = {f.name: f for f in text_string_to_metric_families(after)}
    assert families["edge_rtgi_voice_to_voice_ms"].type == "histogram"
    buckets = [s for s in families["edge_rtgi_voice_to_voice_ms"].samples if s.name.endswith("_bucket")]
    assert len(buckets) > 5 and buckets[-1].labels["le"] == "+Inf"
    kv = [s for s in families["edge_rtgi_engine_kv_blocks_total"].samples if s.labels["model"] == MODEL]
    assert kv and kv[0].value > 0
    for name in ("edge_rtgi_engine_spec_draft_tokens", "edge_rtgi_engine_spec_accepted_tokens"):
        assert any(s.labels["model"] == MODEL for s in families[name].samples), name


@pytest.mark.skipif(not cdp.environment_ok(), reason="no Chromium (apt-get install chromium)")
async def test_browser_client_in_headless_chromium(daemon, piper, tmp_path, record_property):
    """The fake microphone asks a question, waits for the spoken answer, asks for a long story
    and talks over it: captions, reply, latency parts, played audio, then the barge-in."""
    import numpy as np

    from edge_rtgi.audio.wav import write_wav

    speech = [
        speak_16k(piper, QUESTION, lead_s=0.5, tail_s=7.0),  # room for the reply to play out
        speak_16k(piper, LONG_REQUEST, lead_s=0.0, tail_s=3.5),  # its reply is still playing...
        speak_16k(piper, "Stop please.", lead_s=0.0, tail_s=2.0),  # ...when this barges in
    ]
    wav = tmp_path / "microphone.wav"
    write_wav(str(wav), np.concatenate(speech), 16000)
    first = "document.querySelector('#turns .turn:last-child')"  # turns are listed newest first
    browser = await cdp.Browser.launch(tmp_path / "profile", wav)
    try:
        await browser.goto(f"http://127.0.0.1:{daemon.port}/")
        await browser.wait_for("!!document.querySelector('#pipeline option[value=\"voice-assistant\"]')", 10)
        await browser.eval("document.querySelector('#pipeline').value = 'voice-assistant'")
        await browser.eval("document.querySelector('#start').click()", user_gesture=True)
        await browser.wait_for("document.querySelector('#status').dataset.state === 'live'", 30)
        heard = await browser.wait_for(f"{first}?.querySelector('.heard .text').textContent", timeout_s=120)
        assert wer(QUESTION, heard) <= 1 / 6, heard
        await browser.wait_for(f"{first}.dataset.status === 'completed'", 120)
        reply = await browser.eval(f"{first}.querySelector('.reply .text').textContent")
        assert "paris" in reply.lower(), reply
        parts = await browser.eval(f"{first}.querySelector('.parts').textContent")
        assert "voice-to-voice" in parts and "ASR final" in parts, parts
        # the reply's audio went through the page's AudioContext to the end of its buffers
        played_ms = await browser.wait_for(
            "Number(document.querySelector('#played').dataset.ms) > 500 && "
            "Number(document.querySelector('#played').dataset.ms)",
            timeout_s=60,
        )
        record_property("browser_played_ms", played_ms)
        await browser.wait_for("Number(document.querySelector('#barge-in').dataset.count) >= 1", 120)
        statuses = await browser.wait_for(
            "(s => s.includes('interrupted') && s)"
            "([...document.querySelectorAll('#turns .turn')].map(t => t.dataset.status))",
            60,
        )
        assert statuses[-1] == "completed" and statuses[-2] == "interrupted", statuses
        shot = await browser.screenshot(tmp_path / "browser-client.png")
        if os.environ.get("EDGE_RTGI_BROWSER_SCREENSHOT"):  # refresh docs/browser-client.png
            shutil.copy(shot, os.environ["EDGE_RTGI_BROWSER_SCREENSHOT"])
        assert shot.stat().st_size > 10_000
    finally:
        console = browser.console
        await browser.close()
    assert not [line for line in console if line.startswith("exception")], console
