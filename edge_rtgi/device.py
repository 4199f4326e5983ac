"""Device and dtype choices, in one place.

Rules (measured on the 2-core AVX-512 dev box, see docs/benchmarks.md):
- CUDA when present: fp16 on pre-Ampere / Jetson Nano class, bf16 on Ampere and later.
- CPU: bf16 activations when the CPU has native bf16 (AVX512_BF16 or AMX), because the
  int8/int4 weight kernels are only fast with bf16 activations; otherwise fp32.
- Weights (``quant: auto``): int8 per-channel weight-only on a CPU running bf16, because a
  batch-1 decode step reads every weight once and ``_weight_int8pack_mm`` with bf16 activations
  beats both fp32 and bf16 ``F.linear`` there (KL 0.005 nats from the fp32 model on SmolLM2,
  docs/quantization.md); full precision everywhere else (fp32 activations make the int8
  kernel slower than fp32 ``F.linear``; on CUDA the int4 path is opt-in). The weight-only
  kernels slow down in proportion to the rows of their input, so ``auto`` also keeps a
  dequantised bf16 copy for inputs of more than ``AUTO_QUANT_KERNEL_MAX_ROWS`` rows (prefill
  chunks, wide decode batches); see ``keep_dense_copy`` in edge_rtgi/llm/quant/kernels.py.
  Weights the file already stores as 4-bit blocks that a kernel scheme reproduces (GGUF Q4_1:
  ``SOURCE_ALIGNED_SCHEMES``) keep that precision instead of being widened to int8: the same
  codes at 5 bits per weight instead of 8, fewer bytes to read per token.
- CPU threads: torch's OpenMP (libgomp) gives every thread that runs a parallel op its own
  worker pool, and once the pools hold more threads than there are CPUs, *every* pool stops
  spin-waiting between ops. An idle pool left behind by a loader thread made each parallel op
  of the engine 2.5-3x slower (7-9 us -> 20-22 us for a 64k-element add, 2 threads, 2 cores).
  ``release_cpu_workers`` frees the calling thread's pool; threads that finish their torch work
  (loaders, warm-up, an idle engine loop) call it.
Everything that places tensors asks ``resolve_device`` / ``resolve_dtype`` rather than
deciding for itself.
"""

from __future__ import annotations

import ctypes
import functools
import logging
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
def _openmp_pause() -> object | None:
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
    new pool (~0.1 ms). Returns False where torch's OpenMP runtime was not found (no-op)."""
    pause = _openmp_pause()
    return pause is not None and pause(1) == 0  # 1: omp_pause_soft


def prepare_cpu_kernels(device: torch.device) -> bool:
    """Load (building on first use) the fused CPU decode kernels when ``device`` is the CPU.

    True when they will be used; False on CUDA, when switched off (``EDGE_RTGI_CPU_KERNELS=0``),
    or when they cannot be built, in which case ``edge_rtgi.llm.cpu_ops`` has logged why and the
    model runs on the PyTorch ops it would have replaced.
    """
    if device.type != "cpu":
        return False
    from edge_rtgi.llm import cpu_ops

    return cpu_ops.load()


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


# Rows up to which the int8 weight-only kernel beat bf16 F.linear on a 576x3072 weight here:
# 4 rows 0.54x the time, 16 rows 3.3x, 256 rows 8.9x (1 thread, medians of 5).
AUTO_QUANT_KERNEL_MAX_ROWS = 8


# GGUF Q4_1 stores each block of 32 weights as d * q + m, q in 0..15, with the block's min and max
# both on the grid; asymmetric int4 with group 32 (min/max scaling) recovers the same codes, and
# only d and m are rounded from fp16 to bf16 (KL 0.0015 per layer group alone vs 0.0011 for bf16
# itself, docs/quantization.md). Q4_0 and the K-quants do not map onto one kernel group exactly.
SOURCE_ALIGNED_SCHEMES = {"Q4_1": "int4-g32"}


def source_aligned_scheme(source_format: str | None) -> str | None:
    """The kernel scheme that re-encodes weights stored as ``source_format`` in the model file
    (a GGUF type name), or None when there is none and ``auto`` should use its default."""
    return SOURCE_ALIGNED_SCHEMES.get(source_format or "")


def resolve_weight_quant(name: str | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """Map a config ``quant`` value to an ``edge_rtgi.llm.quant.apply_quant`` spec, or None.

    "auto" picks int8 weights where they are the faster decode path (CPU with bf16
    activations) and full precision elsewhere; "none" (or None) keeps full precision; any
    other value (a scheme name, a plan YAML, a quantised checkpoint) is passed through.
    """
    if name in (None, "", "none"):
        return None
    if name == "auto":
        return "int8" if device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_bf16() else None
    return name
