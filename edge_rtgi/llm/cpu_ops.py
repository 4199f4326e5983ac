"""Fused CPU kernels for the small operations of a decode step, with the PyTorch ops as fallback.

At batch 1 a small model's decode step is dominated not by its matmuls but by ~40 small tensor
ops per layer (RMSNorm alone is eight ops on CPU), each a few microseconds of dispatch for a few
hundred elements. ``csrc/cpu_ops.cpp`` does each group in one pass:

- ``rms_norm``: ``F.rms_norm`` (same rounding; the mean of squares is summed in another order);
- ``rotate_qk``: ``rope.apply_rope`` in place (bit-identical in bf16);
- ``silu_mul``: ``F.silu(gate) * up`` (bit-identical in bf16 but for exp's last-ulp rounding);
- ``decode_attention``: the new keys/values written at their slots, then one query per row over
  the listed key slots (grouped-query heads; an optional mask per key). Same math as SDPA,
  summed in a different order.
- ``decode_attention_int4``: the same attention over an int4 KIVI cache (``kv/int4.py``),
  reading its codes in place instead of dequantising the cache into a copy first.
- ``int4_mm`` / ``int8_mm``: weight-only int4 / int8 matmuls for 2..32 rows (verification of
  draft tokens, decode batches) that read each weight block once for all rows; one row keeps
  ATen's kernels. Same weight layouts as ATen's; sums in another order.
- ``run_decode_layers``: the whole layer stack of a decode step in one call: the C++ loop runs
  ``DecoderLayer.forward``'s sequence with the kernels above and ATen's (quantised) matmuls, so
  no Python runs between them. ``model.py`` stays the reference; tests compare the two.

The extension is compiled on first use with the machine's C++ compiler (about 10-20 s, cached in
``build_dir()``; ``scripts/setup.sh`` builds it ahead). Where it cannot be built
(no compiler, no ninja) or is switched off (``EDGE_RTGI_CPU_KERNELS=0``), every function here
runs the PyTorch ops it replaces, with one warning. CUDA tensors always take the PyTorch path.

``prepare(device)`` loads it for models placed on the CPU (``weights.load_model`` calls it); until then (and
inside ``disabled()``) the fallbacks run.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import operator
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_rtgi.llm.rope import apply_rope

if TYPE_CHECKING:
    from torch._ops import _OpNamespace

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
ENV_SWITCH = "EDGE_RTGI_CPU_KERNELS"  # "0" / "off": never build or use the kernels
# The -march the kernels are built for: "native" (the machine that runs them), or a baseline such
# as "x86-64-v3" (AVX2 only) to build for a fleet, or to check the portable loops on an AVX-512 CPU.
ENV_MARCH = "EDGE_RTGI_KERNEL_MARCH"


# Above this many keys per query, SDPA's flash kernel (tiled GEMMs) beats the fused loop, which
# has no GEMM, over a contiguous cache; the crossover measurement is in docs/cpu_kernels.md.
DECODE_ATTENTION_MAX_KEYS = 384
# The same cut-off for a paged cache, where SDPA must first gather the keys and values into a
# copy: the fused loop, which reads them at their slots, won at every length measured (None: no
# cut-off; docs/cpu_kernels.md). A setting so that a benchmark can restore the old rule.
PAGED_DECODE_ATTENTION_MAX_KEYS: int | None = None


def target_arch() -> str:
    """The ``-march`` the kernels are built for (``$EDGE_RTGI_KERNEL_MARCH``, default "native")."""
    return os.environ.get(ENV_MARCH) or "native"


_lock = threading.Lock()
_ops: _OpNamespace | None = None  # torch.ops.edge_rtgi once loaded
_multi_row_max = 0  # _ops.multi_row_max(), read once at load: multi_row_usable runs per matmul
_int8_one_row = False  # the library has int8_mm's AVX-512 BF16 loops (read at load)
_failure: str | None = None
_disabled_depth = 0  # disabled() blocks currently open, in any thread
# steps run_decode_layers has run, per thread: engines step on threads of their own
_layer_loop_steps = threading.local()
# Kernels that disabled(name) can switch off alone, and how many such blocks are open for each.
SWITCHABLE = ("decode_attention_int4",)
_disabled_kernels = dict.fromkeys(SWITCHABLE, 0)


def build_dir() -> Path:
    """Where the compiled extension lives: ``$EDGE_RTGI_KERNEL_DIR``, else
    ``$XDG_CACHE_HOME/edge-rtgi/kernels`` or ``~/.cache/edge-rtgi/kernels``; one folder per torch
    version (the library links against torch), CPU (it is built with -march=native, so a
    cache shared between different CPUs must not hand one CPU another's instructions) and
    source checkout (torch's loader rebuilds whenever the source path in its build file changes,
    so two checkouts sharing one folder would rebuild each other's library on every start)."""
    root = os.environ.get("EDGE_RTGI_KERNEL_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg).expanduser() if xdg else Path.home() / ".cache") + "/edge-rtgi/kernels"
    folder = _cpu_fingerprint() if target_arch() == "native" else f"march-{target_arch()}"
    checkout = hashlib.sha256(str(SOURCE.resolve().parent).encode()).hexdigest()[:8]
    torch_version = torch.__version__.replace("+", "-")
    return Path(root).expanduser() / f"torch-{torch_version}" / f"{folder}-src{checkout}"


def _cpu_fingerprint() -> str:
    import platform

    try:
        info = Path("/proc/cpuinfo").read_text()
        # The model name and feature flags of the first CPU: what -march=native is derived from.
        keys = ("model name", "flags", "Features", "CPU part")
        wanted = [line for line in info.split("\n\n")[0].splitlines() if line.split(":")[0].strip() in keys]
    except OSError:
        wanted = []
    digest = hashlib.sha256("\n".join([platform.machine(), *wanted]).encode()).hexdigest()[:12]
    return f"{platform.machine()}-{digest}"


# Far longer than any build takes (docs/cpu_kernels.md). A lock older than this was left by a
# build that was killed, and torch's loader would wait on it forever.
STALE_LOCK_S = 300


def load() -> bool:
    """Build (first time) and load the extension; True when the fused kernels are usable.

    Never raises: a build failure is logged once, with what to install, and the PyTorch ops
    are used from then on.
    """
    global _ops, _failure, _multi_row_max, _int8_one_row
    if _ops is not None:
        return True
    if _failure is not None:
        return False
    with _lock:
        if _ops is not None or _failure is not None:
            return _ops is not None
        if os.environ.get(ENV_SWITCH, "").lower() in ("0", "off", "false", "no"):
            _failure = f"switched off by {ENV_SWITCH}"
            log.info("fused CPU kernels %s", _failure)
            return False
        try:
            ops = _build()
            _multi_row_max = int(ops.multi_row_max())
            _int8_one_row = str(ops.build_info()).startswith("avx512-bf16")
            _ops = ops
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch ops
            _failure = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            )
            log.warning(
                "fused CPU kernels unavailable (%s); decoding uses the plain PyTorch ops, "
                "slower per token (docs/cpu_kernels.md). They need a C++ compiler and ninja: "
                "apt-get install g++ ninja-build (scripts/setup.sh installs both).",
                _failure,
            )
            return False
    return True


def _build() -> _OpNamespace:
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(directory / "lock")
    started = time.perf_counter()
    build_library("edge_rtgi_cpu_ops", SOURCE, directory)
    ops = torch.ops.edge_rtgi
    log.info(
        "fused CPU kernels (%s loops) ready in %.1f s (%s)",
        ops.build_info(),
        time.perf_counter() - started,
        directory,
    )
    return ops


def build_library(name: str, source: Path, directory: Path) -> None:
    """Compile (or reuse) and load the kernel library ``name`` from ``source`` in ``directory``
    with the flags the kernels are built with (also ``scripts/bench_kernel_ab.py``'s baseline)."""
    from torch.utils.cpp_extension import load as load_extension

    # -march=native (by default): the library is built on, and cached for, the machine that runs it.
    # -fopenmp: at::parallel_for is inlined from ATen's headers and runs serially without it; the
    # library then needs libgomp.so.1, which resolves to the copy torch has already loaded.
    load_extension(
        name=name,
        sources=[str(source)],
        extra_cflags=["-O3", f"-march={target_arch()}", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def _clear_stale_lock(lock: Path) -> None:
    """Wait for another process's build to finish, at most until its lock is STALE_LOCK_S old;
    then remove the lock (torch's loader would otherwise wait on it for ever)."""
    while True:
        try:
            age_s = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age_s > STALE_LOCK_S:
            log.warning(
                "removing a stale kernel build lock %s (%.0f s old: a build was interrupted)", lock, age_s
            )
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def build_info() -> str | None:
    """Which inner loops the loaded library was compiled with: "avx512-bf16-amx" (AVX-512 BF16 and
    AMX tiles, which the multi-row matmuls use), "avx512-bf16" (AVX-512 with its BF16 dot
    products), "avx512" or "portable" (None: not loaded)."""
    return _ops.build_info() if _ops is not None else None


def prepare(device: torch.device) -> bool:
    """Load (building on first use) the kernels when ``device`` is the CPU.

    True when they will be used; False on CUDA, when switched off (``EDGE_RTGI_CPU_KERNELS=0``),
    or when they cannot be built, in which case ``load`` has logged why and the model runs on
    the PyTorch ops it would have replaced.
    """
    return device.type == "cpu" and load()


def available() -> bool:
    """True when the kernels are loaded and not switched off by ``disabled()``."""
    return _disabled_depth == 0 and _ops is not None


def failure() -> str | None:
    """Why the kernels could not be loaded, or None."""
    return _failure


@contextlib.contextmanager
def disabled(*kernels: str) -> Iterator[None]:
    """Run the PyTorch ops inside this block (equivalence tests and A/B benchmarks).

    ``kernels``: switch off only these (names from ``SWITCHABLE``), e.g.
    ``disabled("decode_attention_int4")`` to time int4 KV's gather + SDPA against the fused
    kernel with every other kernel on. Process-wide, not per thread: an engine thread sharing the
    model runs the PyTorch ops too while any ``disabled()`` block is open. Blocks may nest and
    overlap across threads.
    """
    global _disabled_depth
    unknown = [k for k in kernels if k not in _disabled_kernels]
    if unknown:
        raise ValueError(
            f"cpu_ops.disabled: unknown kernel(s) {unknown}; these can be switched off alone: {SWITCHABLE}"
        )
    with _lock:
        if kernels:
            for k in kernels:
                _disabled_kernels[k] += 1
        else:
            _disabled_depth += 1
    try:
        yield
    finally:
        with _lock:
            if kernels:
                for k in kernels:
                    _disabled_kernels[k] -= 1
            else:
                _disabled_depth -= 1


def _use(x: Tensor) -> bool:
    # The kernels have no backward: with gradients on, the PyTorch ops run (inference runs under
    # torch.inference_mode, where they are off).
    return (
        _disabled_depth == 0
        and _ops is not None
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and not torch.is_grad_enabled()
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``F.rms_norm`` over the last dimension."""
    ops = _ops  # _use checks it too; the local narrows it for the type checker
    if ops is not None and _use(x) and weight.dtype == x.dtype:
        return ops.rms_norm.default(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate_qk(qk: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """``rope.apply_rope`` on ``qk`` [T, H, D]. The fused kernel rotates in place (``qk`` must be
    a temporary, such as a view of the q/k/v projection's output) and returns it."""
    ops = _ops
    if ops is not None and _use(qk) and qk.stride(-1) == 1 and cos.dtype == qk.dtype:
        ops.rotary_.default(qk, cos, signed_sin)
        return qk
    return apply_rope(qk, cos, signed_sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's ``F.silu(gate) * up`` for ``gate_up`` = [..., gate | up]."""
    ops = _ops
    if ops is not None and _use(gate_up):
        return ops.silu_mul.default(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _few_enough_keys(num_keys: int, paged: bool) -> bool:
    max_keys = PAGED_DECODE_ATTENTION_MAX_KEYS if paged else DECODE_ATTENTION_MAX_KEYS
    return max_keys is None or num_keys <= max_keys


def decode_attention_usable(q: Tensor, k_store: Tensor, num_keys: int, paged: bool = False) -> bool:
    """Whether ``decode_attention`` should run: kernels loaded, CPU, one dtype, a contiguous store,
    and few enough keys that the fused loop beats SDPA (``DECODE_ATTENTION_MAX_KEYS``, or
    ``PAGED_DECODE_ATTENTION_MAX_KEYS`` for a ``paged`` cache, whose SDPA path gathers first)."""
    return (
        _use(q) and _few_enough_keys(num_keys, paged) and k_store.dtype == q.dtype and k_store.is_contiguous()
    )


def decode_attention(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_store: Tensor,
    v_store: Tensor,
    new_slots: Tensor,
    key_slots: Tensor,
    key_mask: Tensor | None,
    scale: float,
) -> Tensor:
    """Write ``k_new``/``v_new`` ([B, Hkv, D]) at ``new_slots`` ([B]) of the stores ([N, Hkv, D]),
    then attend: row b's query heads ``q[b]`` ([Hq, D]) over the keys at ``key_slots[b]``
    ([B, S] int64), skipping keys whose ``key_mask`` ([B, S] bool) is False. -> [B, Hq, D].

    Only call it where ``decode_attention_usable`` said yes; there is no PyTorch fallback here
    because the callers already have one (their SDPA path).
    """
    if _ops is None:
        raise RuntimeError("decode_attention called without the fused CPU kernels loaded")
    return _ops.decode_attention.default(
        q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask, scale
    )


@dataclass(frozen=True)
class Int4KVLayer:
    """One layer of an int4 KIVI cache (``kv.int4.Int4KIVIPagedKVStorage``) as
    ``decode_attention_int4`` reads it: N slots in NB blocks of ``block_size``, Hkv heads of D."""

    k_codes: Tensor  # [N, Hkv, D/2] uint8, two channels per byte (even channel low nibble)
    k_scale: Tensor  # [NB, Hkv, D] fp16, per block and channel
    k_zero: Tensor  # [NB, Hkv, D] fp16
    k_open: Tensor  # [R, block_size, Hkv, D] full-precision keys of blocks not yet full
    open_row: Tensor  # [NB] int64: a block's row in k_open, -1 when closed (its codes valid)
    v_codes: Tensor  # [N, Hkv, D/2] uint8
    v_scale: Tensor  # [N, Hkv, D/value_group] fp16, per slot and channel group
    v_zero: Tensor  # [N, Hkv, D/value_group] fp16
    block_size: int
    value_group: int


def decode_attention_int4_usable(q: Tensor, k_open: Tensor) -> bool:
    """Whether ``decode_attention_int4`` should run: kernels loaded, CPU, float32 or bfloat16
    queries in the cache's full-precision dtype. No key-count cut-off, unlike
    ``decode_attention_usable``: the alternative dequantises the whole cache per layer first,
    which costs more than the fused loop at every length (docs/engine.md, int4 KV). Off inside
    ``disabled()`` and ``disabled("decode_attention_int4")``."""
    return _use(q) and k_open.dtype == q.dtype and _disabled_kernels["decode_attention_int4"] == 0


def decode_attention_int4(
    q: Tensor, kv: Int4KVLayer, key_slots: Tensor, key_mask: Tensor | None, scale: float
) -> Tensor:
    """Attention of row b's query heads ``q[b]`` ([Hq, D]) over the int4 keys and values at
    ``key_slots[b]`` ([B, S] int64), skipping keys whose ``key_mask`` ([B, S] or [B, 1, 1, S]
    bool) is False; -> [B, Hq, D] in q's dtype. Reads the codes in place (no dequantised copy of
    the cache): ``q.k = (q*scale).codes + q.zero`` per block, values likewise per channel group;
    keys of blocks not yet full come from ``kv.k_open``. fp32 sums, so it differs from
    ``gather`` + SDPA by the order of the sums and, in bf16, by the rounding of the dequantised
    keys and values to bf16 that gather does and this does not.

    The caller writes the step's new keys and values first (``storage.write``, which keeps the
    open-block bookkeeping). Only call it where ``decode_attention_int4_usable`` said yes.
    """
    if _ops is None:
        raise RuntimeError("decode_attention_int4 called without the fused CPU kernels loaded")
    return _ops.decode_attention_int4.default(
        q,
        kv.k_codes,
        kv.k_scale,
        kv.k_zero,
        kv.k_open,
        kv.open_row,
        kv.v_codes,
        kv.v_scale,
        kv.v_zero,
        key_slots,
        key_mask,
        scale,
        kv.block_size,
        kv.value_group,
    )


# --- weight-only matmuls for a few rows -----------------------------------------------------------

# One row stays on ATen's kernels (but for int8 LM heads, int8_kernel_usable); the most rows the
# kernels take is the build's (multi_row_max).
MULTI_ROW_MIN = 2


# Matmuls of up to this many rows run unpadded: decode batches and draft verification see few
# distinct row counts, and the weight-only kernels take most of them.
_UNPADDED_ROWS = 16


def padded_rows(rows: int) -> int:
    """The row count ``linear`` pads a ``rows``-row bf16/fp16 CPU matmul to.

    Unchanged up to 16 rows; beyond, the next multiple of 16, or of 1/32 of the power of two at or
    below ``rows`` from 1,024 rows up, so padding is at most 15 rows or about 3 % of them.
    """
    if rows <= _UNPADDED_ROWS:
        return rows
    step = max(_UNPADDED_ROWS, 1 << max(0, rows.bit_length() - 6))
    return -(-rows // step) * step


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` over the last dimension, with bf16/fp16 CPU inputs padded to ``padded_rows``.

    oneDNN runs those matmuls and JIT-compiles, then caches (up to 1,024 entries), a kernel for
    every distinct row count; prefill chunks of every length made a long-running daemon grow by
    that cache (docs/reliability.md, "RSS: what grows"). Padding bounds the shapes it sees. The
    padded rows are zeros and are cut from the result, which is a view of the first rows.
    """
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return F.linear(x, weight, bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    padded = padded_rows(rows)
    if padded == rows:
        return F.linear(x, weight, bias)
    xp = x2.new_empty((padded, x2.shape[1]))
    xp[:rows].copy_(x2)
    xp[rows:].zero_()
    y = F.linear(xp, weight, bias)[:rows]
    return y if x2 is x else y.view(*x.shape[:-1], y.shape[-1])


def multi_row_max() -> int:
    """The most rows ``int4_mm`` / ``int8_mm`` take in the layers and the layer loop (csrc
    kMultiRowMax): 32 where the library has the AVX-512 BF16 loops (AMX or not) or is built for
    AVX2 without AVX-512 (the plain loops take 32 there too), else 16; 0 when not loaded."""
    return _multi_row_max


def multi_row_usable(x: Tensor) -> bool:
    """Whether ``int4_mm`` / ``int8_mm`` should run for the 2-D input ``x``: kernels loaded, CPU,
    float32 or bfloat16, no gradients, and 2..``multi_row_max()`` rows."""
    return _use(x) and MULTI_ROW_MIN <= x.shape[0] <= _multi_row_max


# One-row int8 matmuls over at least this many weights (an LM head) run int8_mm's AVX-512 BF16
# loops, which fetch the weights ahead of use; ATen's kernel stays faster on small ones, which the
# caches hold (docs/cpu_kernels.md, "One row through an int8 LM head").
INT8_ONE_ROW_MIN_WEIGHTS = 1 << 24


def int8_kernel_usable(x: Tensor, weights: int) -> bool:
    """Whether ``int8_mm`` should run for the 2-D input ``x`` against an int8 matrix of ``weights``
    elements: ``multi_row_usable``; one fp32 row (ATen's kernel takes about ten times as long for
    fp32 activations, docs/cpu_kernels.md); or one bf16 row (K a multiple of 32) against at least
    ``INT8_ONE_ROW_MIN_WEIGHTS`` weights where the library has the AVX-512 BF16 loops."""
    if x.shape[0] != 1:
        return multi_row_usable(x)
    if x.dtype == torch.float32:
        return _use(x)
    return (
        _int8_one_row
        and weights >= INT8_ONE_ROW_MIN_WEIGHTS
        and x.dtype == torch.bfloat16
        and x.shape[1] % 32 == 0
        and _use(x)
    )


def int8_activation_rows_usable(x: Tensor) -> bool:
    """Whether ``int4_i8_mm`` should run for the 2-D input ``x`` of a layer that has the int8
    activation layout: kernels loaded, CPU, float32 or bfloat16, no gradients, and
    1..``multi_row_max()`` rows (wider inputs take the dense copies or ATen)."""
    return _use(x) and 1 <= x.shape[0] <= _multi_row_max


def multi_row_calls() -> int:
    """How many ``int4_mm`` / ``int8_mm`` / ``int4_i8_mm`` calls this process has made, from Python or
    from the layer loop (tests check with it that a step really took them); 0 when not loaded."""
    return _ops.multi_row_calls() if _ops is not None else 0


LOOPS = ("best", "avx512", "portable")


def int4_mm(
    x: Tensor, qweight: Tensor, group_size: int, scales_and_zeros: Tensor, loops: str = "best"
) -> Tensor:
    """``aten._weight_int4pack_mm_for_cpu(x, qweight, group_size, scales_and_zeros)`` for a
    [M, K] ``x``, reading each weight block once for all M rows. ``loops`` (tests, benchmarks):
    "best" (AMX tiles where the CPU and kernel allow, else AVX-512 BF16, else plain loops),
    "avx512" (the AVX-512 BF16 loops even where AMX is there) or "portable" (plain loops).
    Only call it where ``multi_row_usable`` said yes (or for any row count in tests)."""
    if _ops is None:
        raise RuntimeError("int4_mm called without the fused CPU kernels loaded")
    return _ops.int4_mm.default(x, qweight, group_size, scales_and_zeros, loops)


def int8_mm(
    x: Tensor, qweight: Tensor, scales: Tensor, loops: str = "best", float_out: bool = False
) -> Tensor:
    """``aten._weight_int8pack_mm(x, qweight, scales)`` for a [M, K] ``x``, reading each weight
    row once for all M rows (``loops``: see ``int4_mm``). ``float_out``: the result in float32
    whatever ``x``'s dtype (each output's fp32 sum times its scale, not rounded to bf16)."""
    if _ops is None:
        raise RuntimeError("int8_mm called without the fused CPU kernels loaded")
    return _ops.int8_mm.default(x, qweight, scales, loops, float_out)


def int4_pack_i8(qweight: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    """ATen's CPU int4 pack and its bf16 ``[K/G, N, 2]`` scales and zeros repacked into the layout
    ``int4_i8_mm`` reads (csrc/cpu_ops.cpp: tiles of 64 outputs, scales inside; same size plus the
    scales). N must be a multiple of 64, the group size a multiple of 32."""
    if _ops is None:
        raise RuntimeError("int4_pack_i8 called without the fused CPU kernels loaded")
    return _ops.int4_pack_i8.default(qweight, group_size, scales_and_zeros)


def int4_i8_mm(x: Tensor, packed: Tensor, group_size: int, out_features: int, loops: str = "best") -> Tensor:
    """``x @ W^T`` for an int4 ``W`` in ``int4_pack_i8``'s layout, with the activations rounded to
    int8 per 32 inputs (lossy; docs/cpu_kernels.md, "int8 activations"). ``loops``: "best" (AVX-512
    VNNI or AVX2 where built, ``int8_activation_loops()``) or "portable" (plain loops, the same bits)."""
    if _ops is None:
        raise RuntimeError("int4_i8_mm called without the fused CPU kernels loaded")
    return _ops.int4_i8_mm.default(x, packed, group_size, out_features, loops)


def vnni_built() -> bool:
    """Whether the loaded library has ``int4_i8_mm``'s AVX-512 VNNI loops (False when not loaded)."""
    return bool(_ops.vnni_built()) if _ops is not None else False


# The int4_i8_mm loops that beat the weight-only kernels (the plain loops do not: docs/cpu_kernels.md)
FAST_INT8_ACTIVATION_LOOPS = ("avx512-vnni", "avx2")


def int8_activation_loops() -> str | None:
    """Which loops ``int4_i8_mm`` runs with ``loops="best"``: "avx512-vnni", "avx2" (vpmaddubsw,
    the same bits) or "portable" (None when not loaded)."""
    return str(_ops.i8_loops()) if _ops is not None else None


# --- the layer stack in one call -----------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSlots:
    """What ``decode_attention`` needs from a KV cache for every layer of one decode step."""

    k_stores: Sequence[Tensor]  # per layer [N, Hkv, D]
    v_stores: Sequence[Tensor]
    new_slots: Tensor  # [B] int64
    key_slots: Tensor  # [B, S] int64
    key_mask: Tensor | None  # [B, S] (or [B, 1, 1, S]) bool
    paged: bool = False  # a paged cache: PAGED_DECODE_ATTENTION_MAX_KEYS is its cut-off


@dataclass(frozen=True)
class _LayerPlan:
    dtype: torch.dtype
    params: list  # 14 per layer, see csrc/cpu_ops.cpp
    meta: list[int]  # 8 per layer
    max_rows: int  # more rows than this take the Python layers (dense copies for wide inputs)
    # (container dict, key, object) for every module, parameter and buffer the plan was read from:
    # the plan is valid while each container still holds that very object. Checked every step
    # with dict lookups (cheap against a step: docs/cpu_kernels.md), so no way of swapping a
    # weight or a module (setattr, load_state_dict(assign=True), functional_call, model.to) can
    # leave it stale.
    bindings: tuple[tuple[dict, str, object], ...]
    modules: tuple[torch.nn.Module, ...]  # hooks or a patched forward on any of these: Python layers
    # Derived from bindings and modules in __post_init__ (for _plan_valid).
    _containers: list[dict] = field(init=False, repr=False, compare=False)
    _keys: list[str] = field(init=False, repr=False, compare=False)
    _values: list[object] = field(init=False, repr=False, compare=False)
    _hook_dicts: list[dict] = field(init=False, repr=False, compare=False)
    _instance_dicts: list[dict] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The same checks laid out for map() over C-level callables, which beat a Python loop.
        object.__setattr__(self, "_containers", [c for c, _, _ in self.bindings])
        object.__setattr__(self, "_keys", [k for _, k, _ in self.bindings])
        object.__setattr__(self, "_values", [v for _, _, v in self.bindings])
        object.__setattr__(
            self, "_hook_dicts", [d for m in self.modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        )
        object.__setattr__(self, "_instance_dicts", [m.__dict__ for m in self.modules])


def _build_plan(model) -> _LayerPlan | None:
    params: list = []
    meta: list[int] = []
    max_rows = 1 << 30
    bindings: list[tuple[dict, str, object]] = [(model._modules, "layers", model.layers)]
    modules: list[torch.nn.Module] = [model.layers]

    def bind(module: torch.nn.Module, names: tuple[str, ...]) -> list:
        modules.append(module)
        values = []
        for name in names:
            container = module._parameters if name in module._parameters else module._buffers
            value = container.get(name)
            bindings.append((container, name, value))
            values.append(value)
        return values

    for index, layer in enumerate(model.layers):
        if getattr(type(layer), "fused_layout", None) != "llama":
            return None  # Gemma's layer (extra norms, GeGLU, two RoPEs): the Python layers run it
        bindings.append((model.layers._modules, str(index), layer))
        modules.append(layer)
        for parent, child in (
            (layer, "input_layernorm"),
            (layer, "self_attn"),
            (layer, "post_attention_layernorm"),
            (layer, "mlp"),
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            bindings.append((parent._modules, child, parent._modules[child]))
        modules += [layer.self_attn, layer.mlp]
        params += bind(layer.input_layernorm, ("weight",)) + bind(layer.post_attention_layernorm, ("weight",))
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            kind = type(linear)
            # model.Linear and the quantised layers (quant/kernels.py; both import this module)
            # say which C++ kind they are; a subclass, which may compute otherwise, does not
            # inherit the claim.
            fused_kind = 0 if kind is torch.nn.Linear else vars(kind).get("fused_kind")
            if fused_kind == 0:
                params += [*bind(linear, ("weight",)), None, *bind(linear, ("bias",))]
                meta += [0, 0]
                continue
            if fused_kind not in (1, 2) or (fused_kind == 2 and linear.on_cuda):
                return None  # a layer type the C++ loop does not know: keep the Python layers
            dense = bind(linear, ("dense_weight",))[0]
            if dense is not None:
                max_rows = min(max_rows, linear.max_kernel_rows)
            # bound either way, so that switching the layer's int8 activations drops the plan
            packed_i8 = bind(linear, ("i8_packed",))[0] if fused_kind == 2 else None
            if packed_i8 is not None:
                # kind 3: int4 weights against int8 activations (int4_i8_mm, scales inside), which
                # takes as many rows as the Python layers give it (int8_activation_rows_usable)
                max_rows = min(max_rows, _multi_row_max)
                params += [packed_i8, None, *bind(linear, ("bias",))]
                meta += [3, linear.group_size]
                continue
            names = (
                ("qweight", "scales_and_zeros", "bias") if fused_kind == 2 else ("qweight", "scales", "bias")
            )
            params += bind(linear, names)
            meta += [2, linear.group_size] if fused_kind == 2 else [1, 0]
    dtype = model.dtype
    if any(p is not None and p.is_floating_point() and p.dtype != dtype for p in params):
        return None
    return _LayerPlan(dtype, params, meta, max_rows, tuple(bindings), tuple(modules))


def _plan_valid(plan: _LayerPlan) -> bool:
    return (
        all(map(operator.is_, map(dict.get, plan._containers, plan._keys), plan._values))
        and not any(plan._hook_dicts)
        and not any(map(operator.contains, plan._instance_dicts, itertools.repeat("forward")))
    )


# quant.kernels.int8_activation_max_rows caches its answer on the model under this key
INT8_ROWS_CACHE_KEY = "_int8_activation_max_rows"


def forget_plan(model) -> None:
    """Drop a model's cached layer-loop arguments (and the references they hold to its weights),
    and the int8-activation row limit cached beside them: call it after changing a layer's kernel."""
    model.__dict__.pop("_fused_decode_plan", None)
    model.__dict__.pop(INT8_ROWS_CACHE_KEY, None)


def _current_plan(model, dtype: torch.dtype) -> _LayerPlan | None:
    """The model's cached layer-loop arguments, rebuilt when stale (None: the C++ loop cannot run it)."""
    plan = model.__dict__.get("_fused_decode_plan")
    if plan is None or plan.dtype != dtype or not _plan_valid(plan):
        forget_plan(model)
        plan = _build_plan(model)
        if plan is None or not _plan_valid(plan):  # hooks present: nothing to cache
            return None
        model.__dict__["_fused_decode_plan"] = plan
    return plan


def layer_loop_steps() -> int:
    """How many steps ``run_decode_layers`` has run on the C++ layer loop in the calling thread
    (the runner compares it across a step to learn which path the step took)."""
    return getattr(_layer_loop_steps, "n", 0)


def fused_decode_max_rows(model) -> int:
    """How many one-token rows a step of ``model`` may carry on the fused decode path (0 where
    the path does not run: kernels off or not built, not a CPU model, a layer the C++ loop does
    not know, hooks). The attention side has its own conditions (``decode_slots()``)."""
    with torch.inference_mode():  # as the engine runs it (with gradients on, nothing fuses)
        usable = _use(torch.empty(0, dtype=model.dtype, device=model.device))
    if not usable:
        return 0
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return 0
    plan = _current_plan(model, model.dtype)
    return 0 if plan is None else plan.max_rows


def run_decode_layers(model, x: Tensor, cos: Tensor, signed_sin: Tensor, backend) -> Tensor | None:
    """``for layer in model.layers: x = layer(x, cos, signed_sin, backend)`` in one C++ call, or
    None where that does not apply (kernels off or gradients on, not a decode step the backend
    can describe with ``decode_slots()``, too many keys or rows, forward hooks, or a layer type
    the C++ loop does not know): the caller then runs the Python layers.
    """
    if not _use(x):
        if x.device.type != "cpu":
            forget_plan(model)  # moved off the CPU: do not keep the CPU weights alive
        return None
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return None
    describe = getattr(backend, "decode_slots", None)
    slots: DecodeSlots | None = describe() if describe is not None else None
    if (
        slots is None
        or not _few_enough_keys(slots.key_slots.shape[1], slots.paged)
        or slots.k_stores[0].dtype != x.dtype
    ):
        return None
    plan = _current_plan(model, x.dtype)
    if plan is None:
        return None
    if x.shape[0] > plan.max_rows or len(slots.k_stores) != len(plan.meta) // 8:
        return None
    cfg = model.config
    ops = _ops
    if ops is None:  # _use(x) said the kernels are loaded
        raise RuntimeError("fused CPU kernels unloaded during a decode step")
    out = ops.decode_layers.default(
        x,
        cos,
        signed_sin,
        plan.params,
        plan.meta,
        slots.k_stores,
        slots.v_stores,
        slots.new_slots,
        slots.key_slots,
        slots.key_mask,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.rms_norm_eps,
        cfg.head_dim**-0.5,
    )
    _layer_loop_steps.n = getattr(_layer_loop_steps, "n", 0) + 1
    return out
