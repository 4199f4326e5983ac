"""edge-rtgi: an on-device runtime for real-time voice and speech translation."""

import os

# onnxruntime (Silero VAD, Piper, the turn model) sends Microsoft 1DS telemetry from its Linux
# builds and keeps a device id and an upload queue under ~/.cache/Microsoft. An on-device
# runtime opts out before onnxruntime starts, unless the operator set the variable
# (docs/daemon.md, "Threat model").
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"
