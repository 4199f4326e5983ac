"""Device and dtype choices, in one place.

Rules (measurements in docs/engine.md and docs/quantization.md):
- CUDA when present: fp16 on pre-Ampere / Jetson Nano class, bf16 on Ampere and later.
- CPU: bf16 activations when the CPU has native bf16 (AVX512_BF16 or AMX), because the
  int8/int4 weight kernels are only fast with bf16 activations; otherwise fp32.
- Weights: the ``quant: auto`` policy built on these choices lives in ``edge_rtgi.llm.quant.policy``.
- CPU threads: torch's OpenMP (libgomp) gives every thread that runs a parallel op its own
  worker pool, and once the pools hold more threads than there are CPUs, *every* pool stops
  spin-waiting between ops, which slows each parallel op of the engine severalfold.
  ``release_cpu_workers`` frees the calling thread's pool; threads that finish their torch work
  (loaders, warm-up, an idle engine loop) call it.

Everything that places tensors asks ``resolve_device`` / ``resolve_dtype`` rather than
deciding for itself.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """True when the CPU executes bf16 natively (AVX512_BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """True when the CPU has AMX-BF16 tiles and Linux grants this process their state: then
    oneDNN's bf16 matmuls, and so ATen's bf16 ``F.linear``, run on them."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if " amx_bf16" not in flags:
        return False
    # torch's own request for the tile state (arch_prctl), as oneDNN needs it; absent: assume granted
    init_amx = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init_amx()) if init_amx is not None else True


@functools.lru_cache(maxsize=1)
def _openmp_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime torch ships with, or None."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for pattern in ("libgomp*.so*", "libiomp5*.so*", "libomp*.so*"):
        for path in sorted(lib_dir.glob(pattern)):
            try:
                pause = ctypes.CDLL(str(path)).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


def release_cpu_workers() -> bool:
    """Free the calling thread's OpenMP worker pool, so that it does not slow the pools of the
    threads still computing (see the module notes). The next parallel op in this thread makes a
    new pool, which is cheap against a step. Returns False where torch's OpenMP runtime was not
    found (no-op)."""
    pause = _openmp_pause()
    return pause is not None and pause(1) == 0  # 1: omp_pause_soft


def resolve_device(name: str | None = "auto") -> torch.device:
    """Map a config value ("auto", "cpu", "cuda", "cuda:1") to a torch device."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        from edge_rtgi.errors import ConfigError

        raise ConfigError(
            f"device {name!r} requested but CUDA is not available", hint="use device: cpu or device: auto"
        )
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """Map a config dtype ("auto", "fp32", "bf16", "fp16") to a torch dtype for ``device``."""
    if name in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    try:
        dtype = DTYPES[name]
    except KeyError:
        from edge_rtgi.errors import ConfigError

        raise ConfigError(f"unknown dtype {name!r}", hint=f"use one of {sorted(DTYPES)}") from None
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_bf16():
        log.warning("this CPU has no native bf16; bf16 will be emulated and slow. Consider dtype: fp32")
    return dtype
