"""The engine's ``quant: auto`` policy: which weight scheme a device and dtype get.

- A CPU running bf16 activations gets weight-only int8, because a batch-1 decode step reads
  every weight once and ``_weight_int8pack_mm`` with bf16 activations beats fp32 and bf16
  ``F.linear`` there. A CPU without native bf16 (fp32 activations) gets the same where the fused
  kernels have ``int4_i8_mm``'s AVX2 or AVX-512 VNNI loops: its int4 layers then round their
  activations to int8 (``int8_activations``) and ``int8_mm`` takes the fp32 LM head, where ATen's
  weight-only kernels with fp32 activations are slower than fp32 itself. Without those loops, and
  on CUDA (where the int4 path is opt-in), weights stay in full precision.
- The weight-only kernels slow down with the rows of their input, so ``auto`` also keeps a
  dequantised bf16 copy for inputs of more than ``auto_quant_kernel_max_rows()`` rows (prefill
  chunks, wide decode batches; 32 where the multi-row kernels run on AMX tiles or the CPU has
  no AMX for the dense copy either, and with AVX2's int8-activation loops up to the kernels' widest
  input, else 8); see
  ``keep_dense_copy`` in ``kernels.py``.
- Weights the file already stores as 4-bit blocks that a kernel scheme reproduces exactly
  (``SOURCE_ALIGNED_SCHEMES``) keep that precision rather than widening to int8: the same codes
  at 5 bits per weight instead of 8, fewer bytes to read per token.

The measurements behind each rule are in docs/quantization.md and docs/engine.md.
"""

from __future__ import annotations

import torch

from edge_rtgi import device as devices

# Inputs of more rows than this run on the dense copy: where bf16 F.linear has AMX (oneDNN) and
# the multi-row kernels do not, ATen's weight-only kernels and the kernels' AVX-512 loops lose to
# it somewhere between 8 and 16 rows on the shapes measured (docs/engine.md, docs/cpu_kernels.md).
AUTO_QUANT_KERNEL_MAX_ROWS = 8
# The multi-row kernels beat the dense copy up to their widest input (32 rows) where they run on
# AMX tiles (two 16-row tiles per pass over the weights), and where neither has AMX (their AVX-512
# BF16 loops against F.linear without tiles; docs/cpu_kernels.md, "Row passes without AMX").
AUTO_QUANT_KERNEL_MAX_ROWS_WIDE = 32


# With AVX2's int8-activation loops, int4 layers on int8 activations beat the dense fp32 copy up to the
# kernels' widest input: 32 rows on a build without AVX-512, 16 on an AVX-512 build without VNNI
# (docs/cpu_kernels.md, "CPUs without AVX-512"). Prompt chunks of up to 32 rows round their activations
# too; task retention held with every prompt row rounded (docs/benchmarks.md, "A CPU without AVX-512").
AUTO_QUANT_KERNEL_MAX_ROWS_AVX2 = 32


def auto_quant_kernel_max_rows() -> int:
    """Widest input ``quant: auto`` runs on the weight-only kernels rather than the dense copy:
    ``AUTO_QUANT_KERNEL_MAX_ROWS_WIDE`` where the fused CPU kernels are loaded with AMX tiles, or
    with their AVX-512 BF16 loops on a CPU without AMX (``cpu_ops.build_info()``,
    ``device.cpu_has_amx()``), ``AUTO_QUANT_KERNEL_MAX_ROWS_AVX2`` (at most ``cpu_ops.multi_row_max()``)
    where the int8-activation loops are AVX2's, else ``AUTO_QUANT_KERNEL_MAX_ROWS``. It is part of a prepared
    copy's key (``llm.prepared``): the layers store it."""
    from edge_rtgi.llm import cpu_ops

    info = cpu_ops.build_info() or ""
    if info.endswith("amx") or (info.startswith("avx512-bf16") and not devices.cpu_has_amx()):
        return AUTO_QUANT_KERNEL_MAX_ROWS_WIDE
    if cpu_ops.int8_activation_loops() == "avx2":
        return min(AUTO_QUANT_KERNEL_MAX_ROWS_AVX2, cpu_ops.multi_row_max())
    return AUTO_QUANT_KERNEL_MAX_ROWS


# GGUF Q4_1 stores each block of 32 weights as d * q + m with q in 0..15, so asymmetric int4 with
# group 32 (min/max scaling) recovers the same codes; only d and m are rounded from fp16 to bf16.
# Q4_K stores 32-weight groups as scale * q - min inside 256-weight blocks: the same form, but its
# grid is fitted, so min/max does not find it; the loader hands the file's grid over
# (``Transformer.source_grids``) and the codes are kept on it. Q4_0, Q5_0, Q6_K and Q8_0 have no
# int4 kernel form that reproduces them: ``auto`` gives those int8, and says so.
SOURCE_ALIGNED_SCHEMES = {"Q4_1": "int4-g32", "Q4_K": "int4-g32"}


def source_aligned_scheme(source_format: str | None) -> str | None:
    """The kernel scheme that re-encodes weights stored as ``source_format`` in the model file
    (a GGUF type name), or None when there is none and ``auto`` should use its default."""
    return SOURCE_ALIGNED_SCHEMES.get(source_format or "")


def resolve_weight_quant(name: str | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """Map a config ``quant`` value to an ``edge_rtgi.llm.quant.apply_quant`` spec, or None.

    "auto" picks int8 weights where they are the faster decode path (CPU with bf16
    activations, or with ``int8_activations_fast``) and full precision elsewhere; "none" (or
    None) keeps full precision; any other value (a scheme name, a plan YAML, a quantised
    checkpoint) is passed through.
    """
    if name in (None, "", "none"):
        return None
    if name == "auto":
        if device.type != "cpu":
            return None
        if dtype == torch.bfloat16 and devices.cpu_has_bf16():
            return "int8"
        return "int8" if dtype in (torch.float32, torch.bfloat16) and int8_activations_fast() else None
    return name


def int8_activations_fast() -> bool:
    """Whether the fused CPU kernels have ``int4_i8_mm``'s fast loops (AVX-512 VNNI or AVX2): then
    ``auto``'s int4 layers round their activations to int8 (``int8_activations``) and beat full
    precision whatever the activation dtype, which on a CPU without native bf16 is fp32."""
    from edge_rtgi.llm import cpu_ops

    return cpu_ops.load() and cpu_ops.int8_activation_loops() in cpu_ops.FAST_INT8_ACTIVATION_LOOPS
