#!/usr/bin/env bash
# The main job, end to end on the embedded default models:
#   1. set everything up (Debian packages, .venv, models) with scripts/setup.sh;
#   2. start the daemon (`edge-rtgi serve`) on a free loopback port;
#   3. speak two WAVs with the Piper voice (made now, not shipped);
#   4. stream them in real time over WebSocket through the voice-assistant and the
#      English->Spanish translation pipelines, printing transcripts, replies, translations
#      and per-turn latencies;
#   5. save the returned audio under ./out/ and stop the daemon (SIGTERM drains it).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
EDGE=.venv/bin/edge-rtgi
mkdir -p out

echo
echo "== speaking the inputs with the Piper voice"
$EDGE speak --voice piper-en_US-joe-medium --out out/question.wav "What is the capital of France?"
$EDGE speak --voice piper-en_US-joe-medium --out out/english.wav \
  "Good morning. I would like a cup of coffee, please. Where is the train station?"

echo
echo "== starting the daemon"
$EDGE serve --port 0 > out/daemon.log 2>&1 &
DAEMON=$!
stop_daemon() {
  if kill -0 "$DAEMON" 2>/dev/null; then
    kill -TERM "$DAEMON"
    wait "$DAEMON" || true
  fi
}
trap stop_daemon EXIT
PORT=""
for _ in $(seq 1 600); do
  PORT=$(sed -n 's/.*ws:\/\/127\.0\.0\.1:\([0-9]*\)\/v1\/native.*/\1/p' out/daemon.log | head -1)
  [ -n "$PORT" ] && break
  kill -0 "$DAEMON" 2>/dev/null || { cat out/daemon.log; echo "demo: the daemon did not start"; exit 1; }
  sleep 0.5
done
[ -n "$PORT" ] || { echo "demo: the daemon did not report its port"; exit 1; }
URL="ws://127.0.0.1:$PORT/v1/native"
http_get() { .venv/bin/python -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" "$1"; }
echo "daemon ready on $URL: $(http_get "http://127.0.0.1:$PORT/healthz")"

echo
echo "== voice assistant: out/question.wav -> reply (audio: out/reply.wav)"
$EDGE voice --connect "$URL" --input out/question.wav --realtime --no-speak --out out/reply.wav

echo
echo "== translation en -> es: out/english.wav -> captions (audio: out/translation.wav)"
$EDGE translate --connect "$URL" --from en --to es --input out/english.wav --realtime --no-speak \
  --out out/translation.wav

echo
echo "== OpenAI-compatible chat API: POST http://127.0.0.1:$PORT/v1/chat/completions"
.venv/bin/python - "$PORT" <<'PY'
import json, sys, urllib.request
body = {"model": "smollm2-135m-instruct", "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
answer = json.loads(urllib.request.urlopen(req).read())
print(answer["choices"][0]["message"]["content"], "|", answer["usage"])
PY

echo
echo "== daemon metrics (excerpt)"
http_get "http://127.0.0.1:$PORT/metrics" \
  | grep -E "^edge_rtgi_(responses_total|voice_to_voice_ms_(sum|count)|engine_requests_per_step|sessions_total)" || true
echo "(the browser client is at http://127.0.0.1:$PORT/ while the daemon runs)"

stop_daemon
trap - EXIT
echo
echo "== done: audio in out/ (reply.wav, translation.wav); daemon log in out/daemon.log"
