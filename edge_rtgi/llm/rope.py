"""Rotary position embeddings (RoPE): the frequency tables, their scaling variants, and the rotation.

Kept apart from ``model.py`` so that the fused CPU kernels (``cpu_ops``), which fall back to
``apply_rope``, and the model, which calls them, do not import each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding: ``theta`` is the base, ``scaling`` HF's ``rope_scaling`` dict (None: plain)."""

    head_dim: int
    theta: float = 10000.0
    scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096


def rope_inverse_frequencies(spec: RopeSpec) -> tuple[Tensor, float]:
    """Per-pair inverse frequencies [D/2] and the attention scaling factor for cos/sin.

    Covers the scaling variants these families use: none, ``linear``, ``llama3`` and ``yarn``.
    Computed on the CPU whatever the default device (the loaders build models on the meta
    device, where ``arange`` would import torch._dynamo: seconds of start-up).
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = spec.scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        return inv_freq.float(), 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv_freq / factor).float(), 1.0
    if kind == "llama3":
        low_ff, high_ff = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        scaled = torch.where(wavelen > old_ctx / low_ff, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_ctx / low_ff) & (wavelen >= old_ctx / high_ff)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(medium, blended, scaled).float(), 1.0
    if kind == "yarn":
        old_ctx = scaling.get("original_max_position_embeddings", spec.max_position_embeddings)
        beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 1e-3)
        extrapolation = 1 - ramp.clamp(0, 1)
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0)
        return inv.float(), float(mscale)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3, yarn")


class RotaryEmbedding(nn.Module):
    """cos and sin tables for a batch of positions (one module per RoPE base a model uses)."""

    inv_freq: Tensor  # [D/2] fp32 buffer (register_buffer: not seen by the type checker)

    def __init__(self, spec: RopeSpec):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inverse_frequencies(spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Past the trained range (only a kv_window session gets there) fp32 angles lose precision
        # (0.06 rad at a million tokens): those are reduced modulo 2 pi in fp64 first.
        self.exact_from_position = spec.max_position_embeddings

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] -> (cos, signed_sin), each [T, 1, D], computed in fp32 like HF, then cast.

        The sine's first half is negated here, once per forward pass, so that ``apply_rope``
        needs no negation or concatenation in each of the model's layers.
        """
        if positions.numel() and int(positions.max()) >= self.exact_from_position:
            wide = positions.double()[:, None] * self.inv_freq.double()[None, :]
            freqs = torch.remainder(wide, 2 * math.pi).float()
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        return torch.cat((cos, cos), dim=-1)[:, None].to(dtype), torch.cat((-sin, sin), dim=-1)[:, None].to(
            dtype
        )

    def shift(self, offsets: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, signed_sin) [N, 1, D] that move already rotated keys ``offsets`` [N] positions on.

        RoPE rotations compose by adding angles, so ``apply_rope`` with these turns a key rotated
        for position p into the key for p + offset. No attention scaling (the key has it once
        already); angles in fp64, since offsets of a long session are large.
        """
        freqs = offsets.double()[:, None] * self.inv_freq.double()[None, :]  # [N, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1)[:, None].to(dtype), torch.cat((-sin, sin), dim=-1)[:, None].to(
            dtype
        )


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """HF's "rotate half" RoPE. x: [T, H, D]; cos, signed_sin: [T, 1, D] from ``RotaryEmbedding``.

    rotate_half(x) * sin == roll(x, D/2) * signed_sin: one roll and one fused multiply-add
    instead of two slices, a negation, a concatenation, two products and a sum.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
