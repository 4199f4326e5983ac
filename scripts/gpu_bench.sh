#!/usr/bin/env bash
# Key benchmarks in one command: the four workloads (quality retention, RTIQ), a ramp to
# saturation, ablations and the peers, written as a report (markdown, JSON, PNGs) to OUT_DIR.
#
#   scripts/gpu_bench.sh OUT_DIR            full run on a CUDA machine (bounded to 8 minutes)
#   scripts/gpu_bench.sh OUT_DIR --cpu      the reduced CPU mode (a smoke run; tests run it)
#
# Extra arguments after the mode go to `edge-rtgi bench all` (e.g. --quant int8).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:?usage: scripts/gpu_bench.sh OUT_DIR [--cpu] [extra bench flags]}
shift
MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; shift; fi

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
BENCH=("$PY" -m edge_rtgi.cli bench all --report "$OUT_DIR")

if [[ "$MODE" == gpu ]]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_bench: no CUDA device visible to torch; use --cpu for the reduced CPU mode" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  # A GPU serves far more than the CPU defaults: scale the offered loads and ramp further.
  timeout --signal=INT 480 "${BENCH[@]}" --threads "$(nproc)" --rate-scale 4 --num-requests 48 --ramp-requests 64 \
    --ramp-rates 4,8,16,32,64 --peers hf-fp32,hf-bf16,ct2-int8,llamacpp "$@"
else
  # Reduced CPU mode: one workload, few requests, short outputs, one peer.
  timeout --signal=INT 1500 "${BENCH[@]}" --quick --threads 2 --workloads voice,code --peers hf-fp32 \
    --ramp-rates 2,8 "$@"
fi
echo "gpu_bench: report in $OUT_DIR/report.md"
