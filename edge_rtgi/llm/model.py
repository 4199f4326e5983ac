"""A Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) in one readable file.

Shapes use a flat token dimension, as vLLM does: a forward pass takes ``T`` tokens that may
belong to several sequences, each with its own position. Attention itself (writing the new
keys and values into a cache and attending over it) is delegated to an ``AttentionBackend``,
so the same model runs with a contiguous cache (plain generation) or a paged cache (engine).

Linear layers are fused where the math allows it (q/k/v, gate/up): fewer, larger matmuls are
what a small model decoding at batch 1 on a CPU needs, and the fused groups are exactly the
groups the quantiser assigns bits to. ``weights.py`` maps HF names onto this layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.rope import RopeSpec, RotaryEmbedding

if TYPE_CHECKING:
    from edge_rtgi.llm.quant.kernels import TiedQuantEmbedding

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family model (a subset of HF's config.json)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def rope(self) -> RopeSpec:
        """The rotary embedding this config describes."""
        return RopeSpec(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from an HF ``config.json`` dict. Raises ValueError for other architectures."""
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = hf.get("model_type") if hf.get("model_type") in ("llama", "mistral", "qwen2") else None
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
        # transformers 5 writes `rope_parameters` (theta inside); older files `rope_scaling` + `rope_theta`.
        scaling = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(scaling.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        default_rope = scaling.get("rope_type", scaling.get("type")) in (None, "default")
        rope_scaling = None if default_rope else scaling
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


class AttentionBackend(Protocol):
    """Writes new keys/values into a cache and attends over it, for one layer at a time.

    A backend may also offer ``decode_slots() -> cpu_ops.DecodeSlots | None``, describing a
    step of one query per sequence to the fused CPU decode path.
    """

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (already rotated) -> out [T, Hq, D]."""
        ...


# --- Layers ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.normalized_shape = (dim,)

    def forward(self, x: Tensor) -> Tensor:
        # F.rms_norm, or its one-pass CPU kernel (F.rms_norm is eight small ops on CPU). Both
        # accumulate in fp32 for bf16/fp16 inputs, as HF does; HF also rounds to the activation
        # dtype before the weight product, so bf16 results may differ from HF's by one ulp.
        return cpu_ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        # x: [T, hidden]
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads are rotated together: half the small kernels per layer at batch 1
        qk = cpu_ops.rotate_qk(qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        out = backend.attend(self.layer, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(cpu_ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder. ``forward`` returns final hidden states; ``compute_logits`` projects them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # A quantised tied head replaces the table with a view of itself (quant.plan.install_packed).
        self.embed_tokens: nn.Embedding | TiedQuantEmbedding = embed
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = embed.weight
        self.rotary = RotaryEmbedding(cfg.rope())
        # Parameter name -> storage format in the file it was loaded from (weights.load_model).
        self.source_weight_formats: dict[str, str] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend) -> Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        # A CPU decode step runs these same layers as one C++ loop (cpu_ops.run_decode_layers).
        fused = cpu_ops.run_decode_layers(self, x, cos, sin, backend)
        if fused is not None:
            return self.norm(fused)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .float() replace weights; the fused decode path's cached references to the old
        # ones would keep them in memory until its next step (it would not use them: it checks).
        cpu_ops.forget_plan(self)
        return super()._apply(fn, *args, **kwargs)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] in fp32, so sampling sees full precision
        return self.lm_head(hidden).float()


# --- Attention over a contiguous cache (the plain path every optimisation is checked against) ---


def causal_window_mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Boolean mask [Tq, Tk]: True where query at q_pos may attend key at k_pos."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Grouped-query attention. q: [Tq, Hq, D], k/v: [Tk, Hkv, D], mask: [Tq, Tk] -> [Tq, Hq, D]."""
    # 4-D inputs let PyTorch pick its fused CPU flash kernel (3-D ones fall back to the slower
    # unfused math path); enable_gqa shares each KV head across its
    # query group without copying the cache prefix Hq/Hkv times.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


class ContiguousKVCache:
    """One sequence's keys and values in preallocated [L, max_len, Hkv, D] tensors.

    Tokens must arrive in order (positions continue from ``length``). This is the reference
    the paged cache and every KV optimisation are compared with.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.window = cfg.sliding_window
        self.max_len = max_len
        self.scale = cfg.head_dim**-0.5
        self.length = 0  # tokens fully written (all layers)
        self._pending = 0
        self._slots = torch.arange(max_len, device=device)  # row i of the cache is slot i
        self._new_slots, self._key_slots = self._slots[:0], self._slots[None, :0]
        self._layer_k, self._layer_v = self.k.unbind(0), self.v.unbind(0)  # [max_len, Hkv, D] views

    def begin(self, num_new_tokens: int) -> None:
        """Declare how many tokens the next forward pass appends."""
        if self.length + num_new_tokens > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {num_new_tokens} > {self.max_len}")
        self._pending = num_new_tokens
        # Slot views for the fused decode kernel, made once per step rather than once per layer.
        end = self.length + num_new_tokens
        first_key = 0 if self.window is None else max(0, end - self.window)
        self._new_slots, self._key_slots = self._slots[self.length : end], self._slots[None, first_key:end]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def decode_slots(self) -> cpu_ops.DecodeSlots | None:
        """The fused decode path's view of this cache for a one-token step (None otherwise)."""
        if self._pending != 1:
            return None
        return cpu_ops.DecodeSlots(self._layer_k, self._layer_v, self._new_slots, self._key_slots, None)

    def truncate(self, length: int) -> None:
        """Forget tokens after ``length`` (scripts/bench_cpu_kernels.py rewinds a cache to replay a step)."""
        self.length = min(self.length, length)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        start, end = self.length, self.length + q.shape[0]
        key_slots = self._key_slots
        if q.shape[0] == 1 and cpu_ops.decode_attention_usable(q, self.k, key_slots.shape[1]):
            return cpu_ops.decode_attention(
                q,
                k,
                v,
                self._layer_k[layer],
                self._layer_v[layer],
                self._new_slots,
                key_slots,
                None,
                self.scale,
            )
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        keys, values = self.k[layer, :end], self.v[layer, :end]
        if q.shape[0] == 1 and (self.window is None or end <= self.window):
            return sdpa(q, keys, values, None)
        q_pos = torch.arange(start, end, device=q.device)
        k_pos = torch.arange(0, end, device=q.device)
        return sdpa(q, keys, values, causal_window_mask(q_pos, k_pos, self.window))
