"""The decoders: the Llama family (Llama 2/3, Qwen2, Mistral, SmolLM2) and Gemma 3, in one file.

Shapes use a flat token dimension, as vLLM does: a forward pass takes ``T`` tokens that may
belong to several sequences, each with its own position. Attention itself (writing the new
keys and values into a cache and attending over it) is delegated to an ``AttentionBackend``,
so the same model runs with a contiguous cache (plain generation) or a paged cache (engine).

Linear layers are fused where the math allows it (q/k/v, gate/up): fewer, larger matmuls are
what a small model decoding at batch 1 on a CPU needs, and the fused groups are exactly the
groups the quantiser assigns bits to. ``weights.py`` maps HF names onto this layout.

Gemma 3 is the same skeleton with four changes (``GemmaDecoderLayer``): RMSNorm on each query
and key head, norms after attention and after the MLP as well as before, a GeGLU MLP (tanh
GELU), and per-layer attention: most layers see a sliding window and rotate with a local RoPE
base, every sixth sees the whole context with the global base. Its embeddings are scaled by
sqrt(hidden). Gemma's RMSNorm multiplies by ``1 + weight``; the loader stores ``1 + weight``,
so one RMSNorm serves both families.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.kv.manager import KVGroupSpec
from edge_rtgi.llm.rope import RopeSpec, RotaryEmbedding

if TYPE_CHECKING:
    from edge_rtgi.llm.quant.kernels import TiedQuantEmbedding

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3"}
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 3 makes every sixth layer global; GGUF files do not record the pattern.
GEMMA3_GLOBAL_EVERY = 6


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
    # Per layer SLIDING or FULL (Gemma 3); empty: every layer follows ``sliding_window``.
    layer_types: tuple[str, ...] = ()
    # RoPE base of the sliding-window layers where it differs from the global one (Gemma 3).
    rope_local_theta: float | None = None
    # Attention scores are scaled by this ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must be {SLIDING!r} or {FULL!r}, got {set(self.layer_types)}")

    def rope(self) -> RopeSpec:
        """The rotary embedding this config describes (the global one, where there are two)."""
        return RopeSpec(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    def local_rope(self) -> RopeSpec | None:
        """The sliding-window layers' own rotary embedding, or None where they share ``rope()``."""
        if self.rope_local_theta is None:
            return None
        return RopeSpec(self.head_dim, self.rope_local_theta, None, self.max_position_embeddings)

    def window_of(self, layer: int) -> int | None:
        """The sliding window (tokens) of ``layer``, or None where it sees the whole context."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == SLIDING else None
        return self.sliding_window

    def kv_groups(self) -> tuple[KVGroupSpec, ...]:
        """The KV groups of the paged cache: layers that see the same keys share a block table.

        One group when every layer sees the same span. Otherwise layers are grouped by window,
        global layers first, in groups as large as the smallest kind's layer count (vLLM's
        hybrid allocator): every group then has the same layers per block, and a block freed
        by a local group can hold any group's keys.
        """
        windows = [self.window_of(i) for i in range(self.num_layers)]
        if len(set(windows)) == 1:
            return (KVGroupSpec((), windows[0]),)
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            by_window.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in by_window.values())
        groups = []
        for window in sorted(by_window, key=lambda w: -1 if w is None else w):
            layers = by_window[window]
            groups += [KVGroupSpec(tuple(layers[i : i + size]), window) for i in range(0, len(layers), size)]
        return tuple(groups)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from an HF ``config.json`` dict. Raises ValueError for other architectures."""
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = _MODEL_TYPES.get(hf.get("model_type") or "")
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "gemma3":
            return _gemma3_from_hf(hf)
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


def _gemma3_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Gemma 3 text config: per-layer windows, two RoPE bases, the attention scalar."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:  # Gemma 2 has these; Gemma 3 does not
            raise ValueError(f"Gemma config sets {key}={hf[key]}; soft-capping is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma 3 (an embedding model) is not a causal LM")
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or GEMMA3_GLOBAL_EVERY
    types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    # transformers 5: rope_parameters per layer type; older files: rope_theta + rope_local_base_freq.
    params = hf.get("rope_parameters") or {}
    full = dict(params.get(FULL) or hf.get("rope_scaling") or {})
    local = dict(params.get(SLIDING) or {})
    global_theta = float(full.pop("rope_theta", hf.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
    scaling = None if full.get("rope_type", full.get("type")) in (None, "default") else full
    eos = hf.get("eos_token_id")
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        arch="gemma3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=global_theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        sliding_window=hf.get("sliding_window"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        layer_types=tuple(types),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256),
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


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU matmuls see a bounded set of row counts (``cpu_ops.linear``)."""

    fused_kind = 0  # the C++ decode loop runs it as a dense bf16/fp32 matmul (cpu_ops._build_plan)

    def forward(self, x: Tensor) -> Tensor:
        return cpu_ops.linear(x, self.weight, self.bias)


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
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)

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
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(cpu_ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    local_rope = False  # rotates with the model's global RoPE
    fused_layout = "llama"  # the layer csrc/cpu_ops.cpp's decode loop runs (cpu_ops._build_plan)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaAttention(Attention):
    """Attention with an RMSNorm on every query and key head, before RoPE."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # Backends scale scores by head_dim ** -0.5; Gemma's scalar may differ from head_dim.
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.q_scale = None if scalar == cfg.head_dim else (cfg.head_dim / scalar) ** 0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        # x: [T, hidden]
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        qk = cpu_ops.rotate_qk(torch.cat((q, k), dim=1), cos, sin)  # a temporary: rotated in place
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.q_scale is not None:
            q = q * self.q_scale
        out = backend.attend(self.layer, q, k, v.view(T, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(T, self.q_size))


class GemmaMLP(MLP):
    """GeGLU: gelu_tanh(gate) * up."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Gemma 3's layer: norms before and after attention and MLP; local or global attention."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.local_rope = cfg.window_of(layer) is not None and cfg.rope_local_theta is not None
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, backend))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Transformer(nn.Module):
    """The decoder. ``forward`` returns final hidden states; ``compute_logits`` projects them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # The loaders build on the meta device, where nn.Embedding's random init imports
        # torch._dynamo (seconds of start-up: docs/llm.md); the table is filled only where it is real.
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not table.is_meta:
            table.normal_()
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        # A quantised tied head replaces the table with a view of itself (quant.plan.install_packed).
        self.embed_tokens: nn.Embedding | TiedQuantEmbedding = embed
        layer_cls = GemmaDecoderLayer if cfg.arch == "gemma3" else DecoderLayer
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = embed.weight
        # Gemma scales embeddings by sqrt(hidden), rounded to the activation dtype as HF does.
        self.embed_scale = cfg.hidden_size**0.5 if cfg.arch == "gemma3" else None
        self.rotary = RotaryEmbedding(cfg.rope())
        local = cfg.local_rope()
        self.rotary_local = RotaryEmbedding(local) if local is not None else None
        # Parameter name -> storage format in the file it was loaded from (weights.load_model).
        self.source_weight_formats: dict[str, str] = {}
        # Parameter name -> the file's own int4 grid (scale, zero) [N, K/32], where it has one.
        self.source_grids: dict[str, tuple[Tensor, Tensor]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend) -> Tensor:
        # input_ids, positions: [T] -> hidden: [T, hidden]
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * float(torch.tensor(self.embed_scale, dtype=x.dtype))
        cos, sin = self.rotary(positions, x.dtype)
        # A CPU decode step runs these same layers as one C++ loop (cpu_ops.run_decode_layers).
        fused = cpu_ops.run_decode_layers(self, x, cos, sin, backend)
        if fused is not None:
            return self.norm(fused)
        local = self.rotary_local(positions, x.dtype) if self.rotary_local is not None else (cos, sin)
        for layer in self.layers:
            x = layer(x, *(local if layer.local_rope else (cos, sin)), backend)
        return self.norm(x)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .float() replace weights; the fused decode path's cached references to the old
        # ones would keep them in memory until its next step (it would not use them: it checks).
        cpu_ops.forget_plan(self)
        return super()._apply(fn, *args, **kwargs)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        # hidden: [N, hidden] -> logits: [N, vocab] in fp32, so sampling sees full precision
        # (a quantised head hands over its fp32 sums where its kernel can: forward_float32)
        head_float32 = getattr(self.lm_head, "forward_float32", None)
        return head_float32(hidden) if head_float32 is not None else self.lm_head(hidden).float()


# --- Attention over a contiguous cache (the plain path every optimisation is checked against) ---


def causal_window_mask(q_pos: Tensor, k_pos: Tensor, window: int | None, sink_tokens: int = 0) -> Tensor:
    """Boolean mask [Tq, Tk]: True where query at q_pos may attend key at k_pos (within the
    window, or one of the first ``sink_tokens`` positions)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        in_window = k_pos[None, :] > q_pos[:, None] - window
        if sink_tokens:
            in_window |= k_pos[None, :] < sink_tokens
        allowed &= in_window
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
        self.windows = [cfg.window_of(i) for i in range(cfg.num_layers)]  # per layer (None: global)
        self._uniform = len(set(self.windows)) == 1  # the fused decode path needs one window
        self.max_len = max_len
        self.scale = cfg.head_dim**-0.5
        self.length = 0  # tokens fully written (all layers)
        self._pending = 0
        self._slots = torch.arange(max_len, device=device)  # row i of the cache is slot i
        self._new_slots = self._slots[:0]
        self._key_slots: dict[int | None, Tensor] = {}  # per window
        self._layer_k, self._layer_v = self.k.unbind(0), self.v.unbind(0)  # [max_len, Hkv, D] views

    def begin(self, num_new_tokens: int) -> None:
        """Declare how many tokens the next forward pass appends."""
        if self.length + num_new_tokens > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {num_new_tokens} > {self.max_len}")
        self._pending = num_new_tokens
        # Slot views for the fused decode kernel, made once per step rather than once per layer.
        end = self.length + num_new_tokens
        self._new_slots = self._slots[self.length : end]
        for window in set(self.windows):
            first_key = 0 if window is None else max(0, end - window)
            self._key_slots[window] = self._slots[None, first_key:end]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def decode_slots(self) -> cpu_ops.DecodeSlots | None:
        """The fused decode path's view of this cache for a one-token step (None otherwise)."""
        if self._pending != 1 or not self._uniform:
            return None
        key_slots = self._key_slots[self.windows[0]]
        return cpu_ops.DecodeSlots(self._layer_k, self._layer_v, self._new_slots, key_slots, None)

    def truncate(self, length: int) -> None:
        """Forget tokens after ``length`` (scripts/bench_cpu_kernels.py rewinds a cache to replay a step)."""
        self.length = min(self.length, length)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        start, end = self.length, self.length + q.shape[0]
        window = self.windows[layer]
        key_slots = self._key_slots[window]
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
        if q.shape[0] == 1 and (window is None or end <= window):
            return sdpa(q, keys, values, None)
        q_pos = torch.arange(start, end, device=q.device)
        k_pos = torch.arange(0, end, device=q.device)
        return sdpa(q, keys, values, causal_window_mask(q_pos, k_pos, window))
