"""Quantisation schemes, the quantisers that produce packed weights, and their exact byte cost.

A ``PackedWeight`` is the device-independent form of one quantised matrix: it is what the
checkpoint stores and what every kernel layout is built from at load time, so loading never
re-quantises. Byte costs count what stays resident for the kernels, scales and zeros included:

- ``int8``: one int8 per weight plus a bf16 scale per output channel -> 8 + 16/K bits per weight.
- ``int4-gG`` (asymmetric): a nibble per weight plus a bf16 scale and a bf16 zero per group of G
  inputs -> 4 + 32/G bits (5.0 / 4.5 / 4.25 for G = 32 / 64 / 128).
- ``int4sym-gG``: symmetric scales (zero fixed at 0). PyTorch's int4 kernel still reads a zero per
  group, so it costs the same bytes as asymmetric; it exists to measure where 4 bits really lose.
- ``none``: the matrix stays in 16-bit floats.

There is no 3-bit scheme: PyTorch has no 3-bit (or sub-4-bit) matmul kernel for CPU or CUDA, and
storing 3-bit values in 4-bit containers would save neither bytes nor time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from edge_rtgi.errors import ConfigError

INT4_GROUP_SIZES = (32, 64, 128)
SCALE_BITS = 16  # scales and zeros are kept in bf16 (fp32 copies on a CPU without bf16 are not counted)


@dataclass(frozen=True)
class QuantScheme:
    """How one weight matrix is stored: ``bits`` 16 (none), 8 or 4; ``group_size`` for int4."""

    name: str
    bits: int
    group_size: int | None = None
    symmetric: bool = True

    def fits(self, out_features: int, in_features: int) -> bool:
        """Whether the kernels accept this shape (int4: K % group == 0 and N % 16 == 0)."""
        if self.bits == 4:
            return in_features % self.group_size == 0 and out_features % 16 == 0
        return True

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Resident bytes of the packed matrix, scales and zeros included."""
        n, k = out_features, in_features
        if self.bits == 16:
            return 2 * n * k
        if self.bits == 8:
            return n * k + n * SCALE_BITS // 8
        return n * k // 2 + 2 * (k // self.group_size) * n * SCALE_BITS // 8

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 8.0 * self.nbytes(out_features, in_features) / (out_features * in_features)


_NAME = re.compile(r"^int4(sym)?-g(\d+)$")


def parse_scheme(name: str) -> QuantScheme:
    """``"none"``, ``"int8"``, ``"int4-g64"`` or ``"int4sym-g128"`` -> a QuantScheme."""
    if name == "none":
        return QuantScheme("none", 16)
    if name == "int8":
        return QuantScheme("int8", 8)
    m = _NAME.match(name or "")
    if m and int(m.group(2)) in INT4_GROUP_SIZES:
        return QuantScheme(name, 4, int(m.group(2)), symmetric=bool(m.group(1)))
    raise ConfigError(
        f"unknown quantisation scheme {name!r}",
        hint="use none, int8, int4-g32/64/128 or int4sym-g32/64/128 (no 3-bit kernel exists in PyTorch)",
    )


ALL_SCHEMES = ("int8",) + tuple(f"int4-g{g}" for g in INT4_GROUP_SIZES) + tuple(
    f"int4sym-g{g}" for g in INT4_GROUP_SIZES
)


@dataclass
class PackedWeight:
    """One quantised matrix in its portable form.

    ``qweight``: int8 [N, K] (int8) or uint8 [N, K/2] with two 4-bit codes per byte (low nibble =
    even input index). ``scales``/``zeros``: bf16, [N] for int8, [N, K/G] for int4, where the
    weight is ``(code - 8) * scale + zero``.
    """

    scheme: QuantScheme
    out_features: int
    in_features: int
    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None = None

    def codes(self) -> Tensor:
        """int4 codes unpacked to int32 [N, K] (values 0..15)."""
        low = (self.qweight & 0x0F).to(torch.int32)
        high = (self.qweight >> 4).to(torch.int32)
        return torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> Tensor:
        """The float32 matrix the kernels compute with (for reference and for profiling)."""
        if self.scheme.bits == 8:
            return self.qweight.float() * self.scales.float()[:, None]
        g = self.scheme.group_size
        codes = self.codes().float().view(self.out_features, -1, g)
        w = (codes - 8) * self.scales.float()[..., None] + self.zeros.float()[..., None]
        return w.reshape(self.out_features, self.in_features)


def quantize_weight(weight: Tensor, scheme: QuantScheme) -> PackedWeight:
    """Quantise a float [N, K] matrix. Scales and zeros are rounded to bf16 *before* the codes
    are chosen, so the codes are optimal for the parameters the kernel actually reads."""
    w = weight.detach().float().cpu()
    n, k = w.shape
    if scheme.bits == 8:
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(torch.bfloat16)
        q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
        return PackedWeight(scheme, n, k, q, scales)
    if scheme.bits != 4:
        raise ValueError(f"cannot pack scheme {scheme.name}")
    if not scheme.fits(n, k):
        raise ConfigError(f"{scheme.name} does not fit a {n}x{k} matrix",
                          hint=f"int4 needs in_features % {scheme.group_size} == 0 and out_features % 16 == 0")
    wg = w.view(n, k // scheme.group_size, scheme.group_size)
    if scheme.symmetric:
        scales = (wg.abs().amax(dim=-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
        zeros = torch.zeros_like(scales)
    else:
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scales = ((hi - lo) / 15.0).clamp(min=1e-8).to(torch.bfloat16)
        zeros = (lo + 8 * scales.float()).to(torch.bfloat16)
    codes = torch.round((wg - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
    codes = codes.to(torch.uint8).view(n, k // 2, 2)
    q = codes[..., 0] | (codes[..., 1] << 4)
    return PackedWeight(scheme, n, k, q.contiguous(), scales, zeros)
