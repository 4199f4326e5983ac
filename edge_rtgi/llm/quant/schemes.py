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

    @property
    def group(self) -> int:
        """The group size of an int4 scheme (ValueError for a scheme without groups)."""
        if self.group_size is None:
            raise ValueError(f"quantisation scheme {self.name} has no group size")
        return self.group_size

    def fits(self, out_features: int, in_features: int) -> bool:
        """Whether the kernels accept this shape (int4: K % group == 0 and N % 16 == 0)."""
        if self.bits == 4:
            return in_features % self.group == 0 and out_features % 16 == 0
        return True

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Resident bytes of the packed matrix, scales and zeros included."""
        n, k = out_features, in_features
        if self.bits == 16:
            return 2 * n * k
        if self.bits == 8:
            return n * k + n * SCALE_BITS // 8
        return n * k // 2 + 2 * (k // self.group) * n * SCALE_BITS // 8

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


ALL_SCHEMES = (
    ("int8",)
    + tuple(f"int4-g{g}" for g in INT4_GROUP_SIZES)
    + tuple(f"int4sym-g{g}" for g in INT4_GROUP_SIZES)
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

    def int4_zeros(self) -> Tensor:
        """``zeros``, which every int4 weight has (ValueError where it is missing)."""
        if self.zeros is None:
            raise ValueError(
                f"{self.scheme.name} weight [{self.out_features}, {self.in_features}] has no zeros"
            )
        return self.zeros

    def dequantize(self) -> Tensor:
        """The float32 matrix the kernels compute with (for reference and for profiling)."""
        if self.scheme.bits == 8:
            return self.qweight.float() * self.scales.float()[:, None]
        g = self.scheme.group
        codes = self.codes().float().view(self.out_features, -1, g)
        w = (codes - 8) * self.scales.float()[..., None] + self.int4_zeros().float()[..., None]
        return w.reshape(self.out_features, self.in_features)


# Importance-weighted fitting (``quantize_weight(..., importance=...)``): each group's grid starts
# from its min..max (or abs-max) range and from that range shrunk by these factors; from each
# start, codes and the least-squares (scale, zero) alternate for ``FIT_STEPS`` rounds. The fit that
# minimises the importance-weighted squared error wins, and the plain min..max grid is one of the
# candidates, so the fitted grid is never worse on that objective. More starts and rounds gained
# little for three times the cost (docs/quantization.md, "Importance-fitted grids").
FIT_RANGE_SHRINKS = (1.0, 0.9, 0.8)  # 1.0 first: the min..max grid is the candidate to beat
FIT_STEPS = 3
# Channels that calibration never excites still get this share of the mean importance, so text
# unlike the calibration text does not meet weights that were ignored entirely.
IMPORTANCE_FLOOR = 0.01


def _grid(scheme: QuantScheme) -> tuple[int, int, float]:
    """(lowest code, highest code, half-range in codes used for the initial scale); the value of
    code ``c`` is ``c * scale + zero``. int4's stored nibble is ``c + 8``."""
    if scheme.bits == 8:
        return -128, 127, 127.0
    return -8, 7, 7.5


def _bf16(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16).float()


def _codes(wg: Tensor, scales: Tensor, zeros: Tensor, lo: int, hi: int) -> Tensor:
    return torch.round((wg - zeros[..., None]) / scales[..., None]).clamp(lo, hi)


def _initial_grid(wg: Tensor, scheme: QuantScheme, shrink: float) -> tuple[Tensor, Tensor]:
    """Scales and zeros spanning the group's range (shrunk by ``shrink`` about its centre)."""
    _, _, half = _grid(scheme)
    if scheme.symmetric or scheme.bits == 8:
        scales = (wg.abs().amax(dim=-1) * shrink / half).clamp(min=1e-8)
        return scales, torch.zeros_like(scales)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    span = (hi - lo) * shrink
    scales = _bf16((span / 15.0).clamp(min=1e-8))  # the zero is placed on the scale the kernel reads
    # lo + (range - span) / 2 rounds to exactly lo when shrink is 1, whatever the CPU's data
    return scales, lo + (hi - lo - span) / 2 + 8 * scales


def _least_squares_grid(
    wg: Tensor, h: Tensor, codes: Tensor, scales: Tensor, zeros: Tensor, symmetric: bool
) -> tuple[Tensor, Tensor]:
    """The (scale, zero) minimising sum h (w - c * scale - zero)^2 for fixed codes ``c``."""
    if symmetric:
        denom = (h * codes * codes).sum(-1)
        fitted = (h * wg * codes).sum(-1) / denom.clamp(min=1e-30)
        ok = (denom > 0) & (fitted > 1e-8)
        return torch.where(ok, fitted, scales), zeros
    sw, sc, scc = h.sum(-1), (h * codes).sum(-1), (h * codes * codes).sum(-1)
    sx, sxc = (h * wg).sum(-1), (h * wg * codes).sum(-1)
    det = sw * scc - sc * sc
    safe = torch.where(det.abs() > 1e-30, det, torch.ones_like(det))
    new_scales, new_zeros = (sw * sxc - sc * sx) / safe, (scc * sx - sc * sxc) / safe
    ok = (det.abs() > 1e-30) & (new_scales > 1e-8)
    return torch.where(ok, new_scales, scales), torch.where(ok, new_zeros, zeros)


def fit_grid(wg: Tensor, importance: Tensor | None, scheme: QuantScheme) -> tuple[Tensor, Tensor]:
    """bf16-exact scales and zeros [N, G] for weight groups ``wg`` [N, G, g].

    Without ``importance``: the grid spans each group's min..max (abs-max when symmetric). With it
    ([G, g], mean squared activation per input channel, llama.cpp's "importance matrix"), the grid
    minimising the importance-weighted squared error over the starts and rounds described above.
    """
    lo, hi, _ = _grid(scheme)
    symmetric = scheme.symmetric or scheme.bits == 8
    scales, zeros = (_bf16(t) for t in _initial_grid(wg, scheme, 1.0))
    if importance is None:
        return scales, zeros
    h = importance.float() + IMPORTANCE_FLOOR * importance.float().mean()
    # FIT_RANGE_SHRINKS starts at 1.0, so the first candidate scored is the min..max grid itself
    best_err = torch.full(scales.shape, torch.inf)
    for shrink in FIT_RANGE_SHRINKS:
        s, z = (_bf16(t) for t in _initial_grid(wg, scheme, shrink))
        for step in range(FIT_STEPS + 1):
            codes = _codes(wg, s, z, lo, hi)
            err = (h * (wg - codes * s[..., None] - z[..., None]) ** 2).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            scales, zeros = torch.where(better, s, scales), torch.where(better, z, zeros)
            if step < FIT_STEPS:
                s, z = (_bf16(t) for t in _least_squares_grid(wg, h, codes, s, z, symmetric))
    return scales, zeros


def quantiser_name(importance: dict | None) -> str:
    """How grids were chosen, as recorded in sensitivity tables, plans and checkpoints."""
    return "min-max" if importance is None else "importance-fitted"


def quantize_weight(
    weight: Tensor,
    scheme: QuantScheme,
    importance: Tensor | None = None,
    grid: tuple[Tensor, Tensor] | None = None,
) -> PackedWeight:
    """Quantise a float [N, K] matrix. Scales and zeros are rounded to bf16 *before* the codes
    are chosen, so the codes are optimal for the parameters the kernel actually reads.

    ``importance`` ([K], the mean squared input activation of each input channel over calibration
    text): fit the grids to minimise the error the activations will see (``fit_grid``) rather
    than spanning each group's range. ``grid`` (asymmetric int4 only: scales and zeros [N, K/G]
    with w = (code - 8) * scale + zero, e.g. a GGUF Q4_K file's own) fixes the grid instead: the
    codes are chosen on it after its bf16 rounding, which gives the file's codes back.
    """
    w = weight.detach().float().cpu()
    n, k = w.shape
    if importance is not None and importance.shape != (k,):
        raise ConfigError(
            f"importance has shape {tuple(importance.shape)}, expected ({k},) for a {n}x{k} matrix",
            hint="collect it on this model with edge_rtgi.llm.quant.profile.collect_importance",
        )
    h = None if importance is None else importance.detach().float().cpu()
    if scheme.bits == 8:
        scales, _ = fit_grid(w[:, None, :], None if h is None else h[None, :], scheme)
        q = _codes(w[:, None, :], scales, torch.zeros_like(scales), -128, 127)[:, 0].to(torch.int8)
        return PackedWeight(scheme, n, k, q, scales[:, 0].to(torch.bfloat16))
    if scheme.bits != 4:
        raise ValueError(f"cannot pack scheme {scheme.name}")
    if not scheme.fits(n, k):
        raise ConfigError(
            f"{scheme.name} does not fit a {n}x{k} matrix",
            hint=f"int4 needs in_features % {scheme.group_size} == 0 and out_features % 16 == 0",
        )
    g = scheme.group
    wg = w.view(n, k // g, g)
    if grid is not None:
        if scheme.symmetric or tuple(grid[0].shape) != (n, k // g) or tuple(grid[1].shape) != (n, k // g):
            raise ValueError(f"a {scheme.name} grid for a {n}x{k} matrix must be asymmetric, [{n}, {k // g}]")
        scales, zeros = _bf16(grid[0].float()), _bf16(grid[1].float())
    else:
        scales, zeros = fit_grid(wg, None if h is None else h.view(k // g, g), scheme)
    codes = (_codes(wg, scales, zeros, -8, 7) + 8).to(torch.uint8).view(n, k // 2, 2)
    q = codes[..., 0] | (codes[..., 1] << 4)
    return PackedWeight(scheme, n, k, q.contiguous(), scales.to(torch.bfloat16), zeros.to(torch.bfloat16))
