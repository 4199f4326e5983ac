// The edge-rtgi browser client: microphone -> native protocol (docs/protocol.md) -> captions,
// reply text and reply audio. Plain JavaScript, no build step, nothing fetched from elsewhere.
"use strict";

const LABELS = {
  "voice-assistant": "assistant",
  transcribe: "transcription",
};
const PARTS = [
  ["endpointing_ms", "endpointing"],
  ["asr_final_ms", "ASR final"],
  ["llm_ttft_ms", "LLM first token"],
  ["first_clause_ms", "first chunk"],
  ["tts_first_chunk_ms", "TTS first audio"],
  ["voice_to_voice_ms", "voice-to-voice"],
];
const PLAYBACK_LEAD_S = 0.05; // schedule a little ahead so chunks join without a click

const $ = (id) => document.getElementById(id);

const state = {
  ws: null,
  audio: null, // AudioContext, made on the first click (browsers allow sound only after one)
  mic: null, // MediaStream
  node: null, // the capture AudioWorkletNode
  token: sessionStorage.getItem("edge-rtgi-token") || "",
  pendingAudio: null, // the response.audio header whose PCM frame comes next
  playhead: 0,
  playedMs: 0,
  sources: new Map(), // response_id -> scheduled AudioBufferSourceNodes
  turns: new Map(), // turn_id -> <li>
  responses: new Map(), // response_id -> <li>
  pipeline: null,
  bargeIns: 0,
};

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.dataset.state = kind || "idle";
}

function showError(message) {
  $("error").textContent = message || "";
}

function roleNames(pipeline) {
  if (pipeline.startsWith("translate")) return ["source", "translation"];
  if (pipeline === "transcribe") return ["heard", ""];
  return ["you", "assistant"];
}

async function loadPipelines() {
  const select = $("pipeline");
  try {
    const health = await (await fetch("/healthz")).json();
    select.textContent = "";
    for (const name of health.pipelines) {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = LABELS[name] || (name.startsWith("translate-") ? `translation (${name.slice(10)})` : name);
      select.append(option);
    }
  } catch (err) {
    showError(`cannot reach the daemon: ${err}`);
  }
}

async function ticket() {
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  const resp = await fetch("/v1/tickets", { method: "POST", headers });
  if (resp.status === 401) {
    $("login").hidden = false;
    throw new Error("this daemon needs its token");
  }
  const body = await resp.json();
  if (!resp.ok) throw new Error(body.error ? body.error.message : `HTTP ${resp.status}`);
  $("login").hidden = true;
  return body.ticket;
}

function turnFor(turnId, responseId) {
  let li = turnId != null ? state.turns.get(turnId) : null;
  if (!li && responseId) li = state.responses.get(responseId);
  if (!li) {
    li = $("turn-template").content.firstElementChild.cloneNode(true);
    const [heard, reply] = roleNames(state.pipeline);
    li.querySelector(".heard .who").textContent = heard ? `[${heard}]` : "";
    li.querySelector(".reply .who").textContent = reply ? `[${reply}]` : "";
    $("turns").prepend(li);
    if (turnId != null) state.turns.set(turnId, li);
  }
  if (responseId) state.responses.set(responseId, li);
  return li;
}

function setText(li, part, text) {
  li.querySelector(`.${part} .text`).textContent = text;
}

function playPcm(head, data) {
  const ctx = state.audio;
  const pcm = new Int16Array(data);
  const samples = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
  const buffer = ctx.createBuffer(1, samples.length, head.sample_rate_hz);
  buffer.copyToChannel(samples, 0);
  const src = ctx.createBufferSource();
  src.buffer = buffer;
  src.connect(ctx.destination);
  const at = Math.max(ctx.currentTime + PLAYBACK_LEAD_S, state.playhead);
  src.start(at);
  state.playhead = at + buffer.duration;
  const list = state.sources.get(head.response_id) || [];
  list.push(src);
  state.sources.set(head.response_id, list);
  src.onended = () => {
    if (src.cut) return;
    state.playedMs += buffer.duration * 1000;
    const out = $("played");
    out.dataset.ms = String(Math.round(state.playedMs));
    out.textContent = `${(state.playedMs / 1000).toFixed(1)} s`;
  };
}

function cutPlayback(responseId) {
  for (const src of state.sources.get(responseId) || []) {
    src.cut = true;
    try {
      src.stop();
    } catch (err) {
      // already ended
    }
  }
  state.sources.delete(responseId);
  state.playhead = state.audio ? state.audio.currentTime : 0;
}

function flashBargeIn() {
  const el = $("barge-in");
  state.bargeIns += 1;
  el.dataset.count = String(state.bargeIns);
  el.textContent = `barge-in ×${state.bargeIns}`;
  el.dataset.on = "true";
  setTimeout(() => (el.dataset.on = "false"), 2000);
}

const CUT_STATUSES = new Set(["interrupted", "cancelled"]);

function onEvent(ev) {
  switch (ev.type) {
    case "session.created":
      state.pipeline = ev.pipeline;
      setStatus(`live: ${LABELS[ev.pipeline] || ev.pipeline}`, "live");
      break;
    case "session.updated":
      if (ev.session && ev.session.pipeline) state.pipeline = ev.session.pipeline;
      break;
    case "input.speech_started":
      $("speech").dataset.on = "true";
      break;
    case "input.speech_stopped":
      $("speech").dataset.on = "false";
      break;
    case "transcript.partial":
      $("partial").textContent = ev.text;
      break;
    case "transcript.final":
      $("partial").textContent = "";
      setText(turnFor(ev.turn_id), "heard", ev.text);
      break;
    case "response.created": {
      const li = turnFor(ev.turn_id, ev.response_id);
      if (ev.source_text && !li.querySelector(".heard .text").textContent) setText(li, "heard", ev.source_text);
      li.dataset.status = "in_progress";
      break;
    }
    case "response.text.delta": {
      const el = turnFor(null, ev.response_id).querySelector(".reply .text");
      el.textContent += ev.delta;
      break;
    }
    case "response.text.done":
      setText(turnFor(null, ev.response_id), "reply", ev.text);
      break;
    case "response.audio":
      state.pendingAudio = ev; // its PCM is the next (binary) message
      break;
    case "response.interrupted": {
      cutPlayback(ev.response_id);
      if (ev.reason === "barge_in") flashBargeIn();
      // the text may be complete, but the user heard only part of it: that is what the turn shows
      const li = turnFor(null, ev.response_id);
      li.dataset.status = ev.reason === "client_cancel" ? "cancelled" : "interrupted";
      break;
    }
    case "response.done": {
      const li = turnFor(null, ev.response_id);
      if (!CUT_STATUSES.has(li.dataset.status)) li.dataset.status = ev.status; // a cut stays cut
      const stats = ev.stats || {};
      li.querySelector(".parts").textContent = PARTS.filter(([k]) => stats[k] != null)
        .map(([k, label]) => `${label} ${Math.round(stats[k])} ms`)
        .join(" · ");
      break;
    }
    case "error":
      showError(`${ev.code}: ${ev.message}`);
      break;
    default:
      break;
  }
}

async function startMic() {
  state.mic = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false },
  });
  const ctx = state.audio;
  await ctx.audioWorklet.addModule("/static/pcm-worklet.js");
  const source = ctx.createMediaStreamSource(state.mic);
  state.node = new AudioWorkletNode(ctx, "pcm-capture", { numberOfInputs: 1, numberOfOutputs: 0 });
  state.node.port.onmessage = (e) => {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(e.data);
  };
  source.connect(state.node);
}

async function start() {
  showError("");
  if (!state.audio) state.audio = new AudioContext();
  await state.audio.resume();
  const pipeline = $("pipeline").value;
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const query = new URLSearchParams({ pipeline, ticket: await ticket() });
  const ws = new WebSocket(`${proto}//${location.host}/v1/native?${query}`);
  ws.binaryType = "arraybuffer";
  state.ws = ws;
  setStatus("connecting", "idle");
  ws.onmessage = (e) => {
    if (typeof e.data === "string") {
      onEvent(JSON.parse(e.data));
    } else if (state.pendingAudio) {
      playPcm(state.pendingAudio, e.data);
      state.pendingAudio = null;
    }
  };
  ws.onclose = (e) => {
    setStatus(e.code === 1000 || e.code === 1005 ? "idle" : `closed (${e.code})`, e.code > 1001 ? "error" : "idle");
    stopMic();
    setButton(false);
  };
  await new Promise((resolve, reject) => {
    ws.addEventListener("open", resolve, { once: true });
    ws.addEventListener("error", () => reject(new Error("the WebSocket was refused")), { once: true });
  });
  await startMic();
  setButton(true);
}

function stopMic() {
  if (state.mic) state.mic.getTracks().forEach((t) => t.stop());
  if (state.node) state.node.disconnect();
  state.mic = state.node = null;
}

function stop() {
  stopMic();
  if (state.ws) state.ws.close(1000, "bye");
  state.ws = null;
  setButton(false);
}

function setButton(running) {
  const button = $("start");
  button.dataset.running = String(running);
  button.textContent = running ? "Stop" : "Start";
}

$("start").addEventListener("click", () => {
  if (state.ws) {
    stop();
    return;
  }
  start().catch((err) => {
    showError(err.message || String(err));
    setStatus("error", "error");
    stop();
  });
});

$("pipeline").addEventListener("change", () => {
  const pipeline = $("pipeline").value;
  if (state.ws && state.ws.readyState === WebSocket.OPEN) {
    state.ws.send(JSON.stringify({ type: "session.update", session: { pipeline } }));
  }
});

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem("edge-rtgi-token", state.token);
  $("start").click();
});

loadPipelines();
