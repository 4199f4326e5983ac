"""Quantised linear layers on PyTorch's own weight-only kernels.

- ``Int8Linear``: ``aten._weight_int8pack_mm`` (int8 weights, per-output-channel scales).
- On CPU, inputs of 2..``cpu_ops.multi_row_max()`` rows (32 with the AVX-512 BF16 loops or on an AVX2
  build without AVX-512, else 16) take ``cpu_ops.int8_mm`` / ``int4_mm`` instead: the same layouts,
  each weight block read once for all rows (ATen's kernels pay the weights again per row).
- ``Int4Linear``: ``aten._weight_int4pack_mm_for_cpu`` on CPU, ``aten._weight_int4pack_mm`` on
  CUDA (bf16 activations only there), with weights repacked into each kernel's tiled layout at
  load time.

Neither dequantises in Python: the kernels read the packed weights directly. The activation dtype
decides whether that pays: on an AVX-512-BF16 CPU both kernels beat bf16 ``F.linear`` with bf16
activations, but with fp32 activations they are *slower* than fp32 ``F.linear`` (see
docs/quantization.md for the per-shape numbers). The layers run in whatever dtype the model runs
in; ``edge_rtgi.device.resolve_dtype`` picks bf16 where the CPU has it.
"""

from __future__ import annotations

import abc
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.quant.schemes import PackedWeight

log = logging.getLogger(__name__)

_CUDA_INNER_K_TILES = 8  # gpt-fast / torchao default for the CUDA int4 tile layout


class QuantLinear(nn.Module, abc.ABC):
    """Base: a frozen weight-only quantised ``nn.Linear`` (bias kept in the activation dtype)."""

    scheme_name: str
    max_kernel_rows: int = 0  # inputs with more rows use dense_weight, when there is one
    # Buffers (register_buffer), declared for the type checker.
    dense_weight: Tensor | None

    def __init__(self, packed: PackedWeight, bias: Tensor | None, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.scheme_name = packed.scheme.name
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)
        )
        self.register_buffer("dense_weight", None, persistent=False)  # see keep_dense_copy

    # The buffers the kernel reads, besides dense_weight (what a prepared copy stores).
    kernel_buffers: tuple[str, ...] = ()

    @classmethod
    def from_buffers(
        cls,
        in_features: int,
        out_features: int,
        scheme_name: str,
        buffers: dict[str, Tensor],
        bias: Tensor | None = None,
        group_size: int | None = None,
        max_kernel_rows: int = 0,
    ) -> QuantLinear:
        """A CPU layer on buffers already in the kernel's layout (``llm.prepared`` memory-maps
        them), so nothing is packed or dequantised again."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.scheme_name = in_features, out_features, scheme_name
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("dense_weight", buffers.get("dense_weight"), persistent=False)
        self.max_kernel_rows = max_kernel_rows
        for name in cls.kernel_buffers:
            self.register_buffer(name, buffers[name])
        if isinstance(self, Int4Linear):
            if group_size is None:
                raise ValueError("an int4 layer needs its group size")
            self.group_size, self.on_cuda = group_size, False
            self.register_buffer("i8_packed", None, persistent=False)
        return self

    def keep_dense_copy(self, max_kernel_rows: int) -> None:
        """Run inputs of more than ``max_kernel_rows`` rows through ``F.linear`` on a dequantised
        copy of the weights, in the activation dtype.

        The weight-only kernels cost time in proportion to the rows (they dequantise inside),
        so they win at batch-1 decode and lose badly to bf16 GEMM for prefill chunks and wide
        decode batches (9x at 256 rows on this CPU). The copy holds the *dequantised* weights,
        so both paths compute with the same weight values; it costs memory (not saved in
        checkpoints, but counted by ``resident_bytes``). ``keep_dense_copies`` does a whole
        model; after single layers, call ``cpu_ops.forget_plan(model)``.
        """
        dtype = self._activation_dtype()
        self.dense_weight = self.dequantized_weight(dtype)
        self.max_kernel_rows = max_kernel_rows

    def forward(self, x: Tensor) -> Tensor:
        # Batch-1 decode calls this four times per layer, and at one row the Python around the
        # kernel cost more than the kernel itself (module attribute reads, ``torch.ops`` lookups,
        # no-op reshapes), so each attribute is read once and 2-D inputs skip the reshapes.
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        dense = self.dense_weight
        if dense is not None and x2.shape[0] > self.max_kernel_rows:
            y = cpu_ops.linear(x2 if x2.dtype == dense.dtype else x2.to(dense.dtype), dense)
        else:
            y = self._matmul(x2)
        return y if x2 is x and self.bias is None else self._out(y, x.shape)

    def forward_float32(self, x: Tensor) -> Tensor:
        """``self(x)`` in float32. The base rounds to the activation dtype first; a kernel that
        can hand over its fp32 sums instead overrides this (the LM head: logits)."""
        return self(x).float()

    def _hooked(self) -> bool:
        """Whether calling the module runs hooks (then the kernels are not called around them)."""
        return bool(
            self._forward_hooks
            or self._forward_pre_hooks
            or torch.nn.modules.module._global_forward_hooks
            or torch.nn.modules.module._global_forward_pre_hooks
        )

    @abc.abstractmethod
    def _matmul(self, x2: Tensor) -> Tensor:
        """``x2 @ W^T`` for a 2-D input, on the subclass's kernel."""

    @abc.abstractmethod
    def gather_rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Dequantised rows ``ids`` of the [N, K] weight matrix, in ``dtype``."""

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        """The full [N, K] weight matrix as the kernel sees it (via each subclass's ``gather_rows``)."""
        return self.gather_rows(torch.arange(self.out_features, device=self._activation_device()), dtype)

    def _activation_dtype(self) -> torch.dtype:
        # The scales (and zeros) are kept in the activation dtype; codes are integers.
        return next(b.dtype for b in self.buffers() if b.is_floating_point())

    def _activation_device(self) -> torch.device:
        return next(self.buffers()).device

    def _out(self, y: Tensor, shape: torch.Size) -> Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def resident_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme_name}"


class Int8Linear(QuantLinear):
    """int8 per-output-channel weights; y = x @ (q * scale)^T, computed inside the kernel."""

    qweight: Tensor
    scales: Tensor
    kernel_buffers = ("qweight", "scales")
    fused_kind = 1  # its kind in cpu_ops' layer loop (csrc/cpu_ops.cpp)

    def __init__(self, packed: PackedWeight, bias: Tensor | None, dtype: torch.dtype, device: torch.device):
        super().__init__(packed, bias, dtype, device)
        self.register_buffer("qweight", packed.qweight.to(device))  # int8 [N, K]
        self.register_buffer("scales", packed.scales.to(device, dtype))  # [N], dtype must match x

    def _matmul(self, x2: Tensor) -> Tensor:
        scales = self.scales
        if x2.dtype != scales.dtype:
            x2 = x2.to(scales.dtype)
        if x2.is_cuda:
            return _int8_mm_cuda(x2, self.qweight, scales)
        if cpu_ops.int8_kernel_usable(x2, self.qweight.numel()):
            return cpu_ops.int8_mm(x2, self.qweight, scales)
        return self._aten(x2)

    def _aten(self, x2: Tensor) -> Tensor:
        """ATen's CPU kernel for any row count (the multi-row kernels' reference and baseline)."""
        return _INT8PACK_MM(x2, self.qweight, self.scales)

    def forward_float32(self, x: Tensor) -> Tensor:
        # Logits rounded to bf16 (steps of 0.125 at the head's magnitudes) tie often, and which of
        # two tied tokens greedy decoding takes then hangs on the last bits of the hidden state:
        # a verification step and a plain step, or two batch shapes, chose differently.
        # Only where one row takes the kernel too (else it takes ATen's, rounded to bf16): a row's
        # logits must not depend on the rows beside it.
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        scales = self.scales
        weights = self.qweight.numel()
        if (
            self.bias is None
            and x2.dtype == scales.dtype
            and (self.dense_weight is None or x2.shape[0] <= self.max_kernel_rows)
            and cpu_ops.int8_kernel_usable(x2[:1], weights)
            and cpu_ops.int8_kernel_usable(x2, weights)
            and not self._hooked()
        ):
            y = cpu_ops.int8_mm(x2, self.qweight, scales, float_out=True)
            return y if x2 is x else y.view(*x.shape[:-1], self.out_features)
        return super().forward_float32(x)

    def gather_rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Dequantised rows (for a tied embedding): only len(ids) rows are touched."""
        return self.qweight[ids].to(dtype) * self.scales[ids, None].to(dtype)


_INT8PACK_MM = torch.ops.aten._weight_int8pack_mm.default
_INT4PACK_MM_CPU = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def _int8_mm_cuda(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    if not _cuda_int8_kernel_available():
        # No fused int8 weight-only kernel in this CUDA build: weights stay int8 in memory and
        # are widened per call. Correct but not fast; int4 is the CUDA fast path.
        return F.linear(x, qweight.to(x.dtype)) * scales
    return _INT8PACK_MM(x, qweight, scales)


@functools.lru_cache(maxsize=1)
def _cuda_int8_kernel_available() -> bool:
    try:
        x = torch.zeros(1, 32, device="cuda", dtype=torch.bfloat16)
        torch.ops.aten._weight_int8pack_mm(
            x,
            torch.zeros(32, 32, dtype=torch.int8, device="cuda"),
            torch.ones(32, device="cuda", dtype=torch.bfloat16),
        )
        return True
    except (RuntimeError, NotImplementedError):
        log.warning("this PyTorch build has no CUDA _weight_int8pack_mm; int8 layers widen weights per call")
        return False


class Int4Linear(QuantLinear):
    """Group-wise int4 weights with a scale and zero per group: w = (code - 8) * scale + zero."""

    qweight: Tensor
    scales_and_zeros: Tensor
    row_codes: Tensor  # CUDA only
    i8_packed: Tensor | None  # the int8-activation layout (use_int8_activations), else None
    kernel_buffers = ("qweight", "scales_and_zeros")
    fused_kind = 2  # its kind in cpu_ops' layer loop (csrc/cpu_ops.cpp)
    group_size: int
    on_cuda: bool

    def __init__(self, packed: PackedWeight, bias: Tensor | None, dtype: torch.dtype, device: torch.device):
        super().__init__(packed, bias, dtype, device)
        self.group_size = packed.scheme.group
        codes = packed.codes()  # int32 [N, K]
        # Kernel layout: [K/G, N, 2] (scale, zero) pairs.
        sz = torch.stack((packed.scales, packed.int4_zeros()), dim=-1).transpose(0, 1).contiguous()
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            if dtype != torch.bfloat16:
                raise ValueError(
                    "the CUDA int4 kernel needs bf16 activations; load the model with dtype bf16"
                )
            nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
            wq = torch.ops.aten._convert_weight_to_int4pack(nibbles, _CUDA_INNER_K_TILES)
            # The tiled CUDA layout cannot be row-gathered; a tied embedding keeps the portable copy.
            self.register_buffer("row_codes", packed.qweight.to(device), persistent=False)
        else:
            wq = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.register_buffer("qweight", wq)
        self.register_buffer("scales_and_zeros", sz.to(device, dtype))
        self.register_buffer("i8_packed", None, persistent=False)

    def int8_activations_unusable(self) -> str | None:
        """Why ``use_int8_activations`` cannot apply to this layer, or None when it can."""
        if self.on_cuda or self.qweight.device.type != "cpu":
            return "the int8-activation kernel is CPU-only"
        if cpu_ops.int8_activation_loops() not in cpu_ops.FAST_INT8_ACTIVATION_LOOPS:
            return "the fused CPU kernels were built without AVX-512 VNNI or AVX2 (or are not loaded)"
        if self.out_features % 64 or self.group_size % 32:
            return (
                f"{self.out_features} outputs in groups of {self.group_size} inputs "
                "(needs outputs a multiple of 64 and groups of 32)"
            )
        return None

    def use_int8_activations(self, on: bool = True) -> None:
        """Run this layer's CPU matmuls of 1..``cpu_ops.multi_row_max()`` rows with its activations
        rounded to int8 per 32 inputs (``cpu_ops.int4_i8_mm``, lossy), on a copy of the weights
        repacked for that kernel (as many bytes again as ``qweight``, plus the scales); ``on=False``
        drops the copy. Raises ValueError where ``int8_activations_unusable`` gives a reason.
        ``set_int8_activations`` switches a whole model; after switching single layers, call
        ``cpu_ops.forget_plan(model)``."""
        if not on:
            self.i8_packed = None
            return
        reason = self.int8_activations_unusable()
        if reason is not None:
            raise ValueError(f"int8 activations: {reason}")
        if self.i8_packed is None:
            self.i8_packed = self.int8_activation_pack()

    def int8_activation_pack(self) -> Tensor:
        """This layer's weights repacked for ``cpu_ops.int4_i8_mm`` (what ``use_int8_activations``
        keeps). The kernel reads bf16 (scale, zero) pairs: an fp32 model's are rounded to bf16 there."""
        pairs = self.scales_and_zeros.to(torch.bfloat16)
        return cpu_ops.int4_pack_i8(self.qweight, self.group_size, pairs)

    def _matmul(self, x2: Tensor) -> Tensor:
        scales_and_zeros = self.scales_and_zeros
        if x2.dtype != scales_and_zeros.dtype:
            x2 = x2.to(scales_and_zeros.dtype)
        if self.on_cuda:
            return torch.ops.aten._weight_int4pack_mm(x2, self.qweight, self.group_size, scales_and_zeros)
        packed_i8 = self.i8_packed
        if packed_i8 is not None and cpu_ops.int8_activation_rows_usable(x2):
            return cpu_ops.int4_i8_mm(x2, packed_i8, self.group_size, self.out_features)
        if cpu_ops.multi_row_usable(x2):
            return cpu_ops.int4_mm(x2, self.qweight, self.group_size, scales_and_zeros)
        return self._aten(x2)

    def _aten(self, x2: Tensor) -> Tensor:
        """ATen's CPU kernel for any row count (the multi-row kernels' reference and baseline)."""
        return _INT4PACK_MM_CPU(x2, self.qweight, self.group_size, self.scales_and_zeros)

    def gather_rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Dequantised rows for a tied embedding, read from the packed weights (no second copy on CPU)."""
        codes = self._row_codes(ids).float()  # [T, K]
        g = self.group_size
        sz = self.scales_and_zeros[:, ids].float()  # [K/G, T, 2]
        scale = sz[..., 0].transpose(0, 1).repeat_interleave(g, dim=1)
        zero = sz[..., 1].transpose(0, 1).repeat_interleave(g, dim=1)
        return ((codes - 8) * scale + zero).to(dtype)

    def _row_codes(self, ids: Tensor) -> Tensor:
        if self.on_cuda:
            packed = self.row_codes[ids]
            return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(len(ids), self.in_features)
        layout = cpu_int4_layout()
        if layout is None:
            raise RuntimeError("this PyTorch packs int4 for the CPU in a layout edge-rtgi does not know")
        return layout.codes(self.qweight, self.out_features, self.in_features, ids)


@dataclass(frozen=True)
class CpuInt4Layout:
    """How ATen's CPU int4 pack lays out output rows: blocks of ``block_rows`` rows one after
    another, each [K, block_rows / 2] bytes. In a block, byte d of a column holds rows d and
    d + block_rows / 2 (low, high nibble), or rows 2d and 2d + 1 where ``adjacent_pairs``."""

    block_rows: int
    adjacent_pairs: bool

    @property
    def key(self) -> str:
        """A short name, for the keys of prepared copies (which store the pack as it is)."""
        return f"{self.block_rows}{'-adjacent-pairs' if self.adjacent_pairs else ''}"

    def codes(self, packed: Tensor, out_features: int, in_features: int, ids: Tensor) -> Tensor:
        """The 4-bit codes (0..15, uint8) of output rows ``ids``: [len(ids), in_features]."""
        half = self.block_rows // 2
        blocks = packed.view(out_features // self.block_rows, in_features, half)
        d = ids % self.block_rows
        column, high = (d // 2, d % 2 == 1) if self.adjacent_pairs else (d % half, d >= half)
        raw = blocks[ids // self.block_rows, :, column]  # [T, K]
        return (raw >> (high.to(torch.uint8)[:, None] * 4)) & 0x0F


# The layouts ATen has: its AVX-512 code (64), its AVX2 code (32), its generic code
# (ATEN_CPU_CAPABILITY=default, and presumably Arm: 32 in adjacent pairs); docs/cpu_kernels.md.
KNOWN_CPU_INT4_LAYOUTS = (CpuInt4Layout(64, False), CpuInt4Layout(32, False), CpuInt4Layout(32, True))


@functools.lru_cache(maxsize=1)
def cpu_int4_layout() -> CpuInt4Layout | None:
    """This PyTorch's CPU int4 pack layout, read off a probe once: ATen lays it out by the CPU it
    runs on. None for a layout ``_row_codes`` and the fused kernels do not read."""
    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    if packed.shape != (128, 32) or packed.dtype != torch.uint8:
        return None
    ids = torch.arange(128)
    for layout in KNOWN_CPU_INT4_LAYOUTS:
        if torch.equal(layout.codes(packed, 128, 64, ids).to(torch.int32), codes):
            return layout
    return None


def cpu_int4_layout_ok() -> bool:
    """Whether this PyTorch packs int4 for the CPU in a layout ``_row_codes`` reads."""
    return cpu_int4_layout() is not None


def make_quant_linear(
    packed: PackedWeight, bias: Tensor | None, dtype: torch.dtype, device: torch.device
) -> QuantLinear:
    """Build the kernel-backed layer for a packed weight."""
    cls = Int8Linear if packed.scheme.bits == 8 else Int4Linear
    return cls(packed, bias, dtype, device)


class TiedQuantEmbedding(nn.Module):
    """Token embedding that reads its rows from a quantised, tied LM head.

    With tied weights the embedding table *is* the LM head matrix; once the head is quantised the
    lookup dequantises just the rows it needs, so the 28 M-parameter table is stored once.
    """

    def __init__(self, head: QuantLinear):
        super().__init__()
        self.head = [head]  # a list, so the head is not registered (and counted) twice
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        head = self.head[0]
        # Rows come out in the head's activation dtype, which follows model.to(dtype).
        if isinstance(head, Int8Linear):
            dtype = head.scales.dtype
        elif isinstance(head, Int4Linear):
            dtype = head.scales_and_zeros.dtype
        else:
            raise TypeError(f"no tied embedding for a {type(head).__name__} head")
        return head.gather_rows(flat, dtype).view(*ids.shape, self.embedding_dim)


def set_int8_activations(model: nn.Module, on: bool) -> int:
    """``use_int8_activations(on)`` on every int4 layer of ``model`` that can take it; returns how
    many layers now round their activations to int8 (0 where none can: no AVX-512 VNNI, CUDA,
    fp32 scales). The layer loop's cached plan is dropped, as the layers' kind changes."""
    count = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            if on and module.int8_activations_unusable() is None:
                module.use_int8_activations(True)
                count += 1
            else:  # off, or no longer usable (a model moved to fp32 or CUDA): drop any old copy
                module.use_int8_activations(False)
    cpu_ops.forget_plan(model)
    return count


def int8_activation_max_rows(model: nn.Module) -> int | None:
    """The most rows a matmul input may have for every layer of ``model`` that rounds its
    activations to int8 to still take ``int4_i8_mm`` (wider inputs take the dense copies or ATen,
    unrounded); None when none of them rounds. Cached on the model until ``cpu_ops.forget_plan``,
    which every switch in this module calls (the engine asks before each step)."""
    cached = model.__dict__.get(cpu_ops.INT8_ROWS_CACHE_KEY, False)
    if cached is not False:
        return cached
    most, kernel_rows = None, cpu_ops.multi_row_max()
    for m in model.modules():
        if isinstance(m, Int4Linear) and m.i8_packed is not None:
            rows = kernel_rows
            if m.dense_weight is not None:
                rows = min(rows, m.max_kernel_rows)
            most = rows if most is None else min(most, rows)
    model.__dict__[cpu_ops.INT8_ROWS_CACHE_KEY] = most
    return most


@dataclass
class Int8ActivationSwitch:
    """A model's int4 layers that can take int8 activations, with their repacked copies made once,
    switched on and off without repacking: benchmarks compare both kernels on one engine."""

    model: nn.Module
    layers: list[Int4Linear]
    packed: list[Tensor]

    @classmethod
    def build(cls, model: nn.Module) -> Int8ActivationSwitch:
        """Make the copies of every layer that can take them (none: an empty switch); left on."""
        set_int8_activations(model, True)
        layers, packed = [], []
        for m in model.modules():
            if isinstance(m, Int4Linear) and m.i8_packed is not None:
                layers.append(m)
                packed.append(m.i8_packed)
        return cls(model, layers, packed)

    def set(self, on: bool) -> None:
        """Int8 activations on every switched layer (True) or none (False)."""
        for layer, packed in zip(self.layers, self.packed, strict=True):
            layer.i8_packed = packed if on else None
        cpu_ops.forget_plan(self.model)


def apply_int8_activations(model: nn.Module, setting: bool | str) -> int:
    """The engine's ``int8_activations`` setting on ``model``: False switches the int8-activation
    kernel off; "auto" switches it on for every int4 layer that can take it (CPU kernels built with
    AVX-512 VNNI or AVX2), except where the CPU has AMX tiles; True does the same (AMX or not)
    and logs one warning, with the reason, where no layer can. Returns how many layers now round
    their activations to int8."""
    cpu_ops.forget_plan(model)  # whatever changed the layers since, the engine reads them afresh
    if setting is False:
        if any(isinstance(m, Int4Linear) and m.i8_packed is not None for m in model.modules()):
            set_int8_activations(model, False)
        return 0
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if layers and not layers[0].on_cuda:
        cpu_ops.load()  # vnni_built() reads the loaded library
    if setting == "auto" and cpu_ops.build_info() == "avx512-bf16-amx":
        # AMX tiles run 2..32 rows in bf16 at little more than one row's cost; the int8 kernel's
        # rows cost more, and it was never measured against them: auto leaves such CPUs as they are
        set_int8_activations(model, False)
        return 0
    count = set_int8_activations(model, True)
    if count == 0 and setting is True:
        reason = layers[0].int8_activations_unusable() if layers else "the model has no int4 layers"
        log.warning("int8_activations: true, but no layer can take it (%s); kept off", reason)
    return count


def set_max_kernel_rows(model: nn.Module, max_kernel_rows: int) -> None:
    """Send inputs of more than ``max_kernel_rows`` rows to the dense copies already kept
    (``keep_dense_copies``) rather than ``auto``'s own limit: benchmarks A/B the limit in one
    process with it. The layer loop's cached plan holds the old limit, so it is dropped."""
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.dense_weight is not None:
            module.max_kernel_rows = max_kernel_rows
    cpu_ops.forget_plan(model)


def keep_dense_copies(model: nn.Module, max_kernel_rows: int) -> int:
    """``keep_dense_copy`` on every quantised layer; returns the extra bytes this costs."""
    extra = 0
    cpu_ops.forget_plan(model)  # the rows each kernel takes change
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.keep_dense_copy(max_kernel_rows)
            dense = module.dense_weight
            if dense is None:  # keep_dense_copy has just set it
                raise RuntimeError(f"{type(module).__name__}.keep_dense_copy left no dense copy")
            extra += dense.numel() * dense.element_size()
    return extra
