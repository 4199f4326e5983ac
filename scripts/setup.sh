#!/usr/bin/env bash
# Set up edge-rtgi on a fresh Debian/Ubuntu machine: system packages, a virtual environment
# in .venv, the Python packages, and the embedded default models.
#
#   bash scripts/setup.sh            # everything
#   EDGE_RTGI_SKIP_APT=1 ...         # no apt (not root, or packages already there)
#   EDGE_RTGI_SYSTEM_TORCH=1 ...     # CUDA/Jetson: reuse the torch already installed system-wide
#   EDGE_RTGI_SKIP_MODELS=1 ...      # do not pull the default models
set -euo pipefail
cd "$(dirname "$0")/.."

# g++ and ninja-build compile the fused CPU decode kernels (edge_rtgi/llm/csrc/cpu_ops.cpp);
# the daemon runs on libjemalloc2 where it is installed (edge_rtgi/server/memory.py).
APT_PACKAGES=(libportaudio2 espeak-ng apertium apertium-eng-spa pulseaudio pulseaudio-utils sox g++ ninja-build chromium libjemalloc2)

if [ "${EDGE_RTGI_SKIP_APT:-0}" != 1 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "setup: installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if [ "${EDGE_RTGI_SYSTEM_TORCH:-0}" = 1 ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true

# torch: keep a torch that is already importable (a CUDA or Jetson build); otherwise the CPU build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  "$VPY" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
echo "setup: installing edge-rtgi and its Python dependencies"
"$VPY" -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true

# Build the fused CPU kernels now rather than on the first model load (~10-20 s). A failure is
# not fatal: the model then runs on the plain PyTorch ops, and says so.
"$VPY" -c "from edge_rtgi.llm import cpu_ops; ok = cpu_ops.load(); print('setup: fused CPU kernels', 'built' if ok else 'NOT built: ' + str(cpu_ops.failure()))"

if [ "${EDGE_RTGI_SKIP_MODELS:-0}" != 1 ]; then
  .venv/bin/edge-rtgi models pull --defaults
fi
echo "setup: done (activate with: . .venv/bin/activate)"
