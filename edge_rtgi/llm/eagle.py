"""The trained draft: one small decoder layer that reads the target's own features (EAGLE).

EAGLE (Li et al., 2024) drafts at the feature level. The draft's input at position i is the
target's final hidden state f_i (after its last norm, what the LM head reads) joined with the
embedding of the token x_{i+1} the target chose after it; one decoder layer maps them to a guess
of f_{i+1}, and the target's own LM head, restricted here to the ``head_token_count`` most frequent
tokens of its replies, turns that into the next token x_{i+2}. Drafting more tokens feeds the
guessed feature back in. The draft shares the target's embedding and head, so its file holds only
the joining projection and the layer (int8 per output row, a few MB).

The runner hands the draft the target's features of every position it computed
(``ModelRunner.collect_features``); the draft keeps its own small KV cache over the last
``window_tokens`` positions, filled from true features, and rolls back whatever it guessed.

Trained by ``scripts/train_draft.py`` (docs/engine.md, "The trained draft").
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from edge_rtgi.errors import ModelFileError
from edge_rtgi.llm.model import (
    AttentionBackend,
    DecoderLayer,
    ModelConfig,
    Transformer,
    causal_window_mask,
    sdpa,
)
from edge_rtgi.llm.request import Request
from edge_rtgi.llm.rope import RotaryEmbedding
from edge_rtgi.llm.tokenizer import Tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)

DRAFT_FORMAT = "edge-rtgi-eagle-draft"
DRAFT_FORMAT_VERSION = 1
# The draft stops proposing when its own probability for the next token falls below this: a
# guess it doubts is usually rejected, and each one costs a draft pass and a verification row.
MIN_DRAFT_CONFIDENCE = 0.35


@dataclass(frozen=True)
class EagleDraftSpec:
    """Shape of a draft and what it was trained for (stored in the file's metadata)."""

    target: str  # the target model's name (catalogue name or file stem)
    tokenizer_sha256: str  # ``tokenizer_fingerprint`` of the target's tokenizer
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    window_tokens: int  # the draft attends over this many positions back
    head_token_count: int

    def model_config(self) -> ModelConfig:
        """The draft layer's shape as a one-layer ``ModelConfig`` (windowed attention)."""
        return ModelConfig(
            arch="llama",
            vocab_size=self.head_token_count,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            sliding_window=self.window_tokens,
        )

    @classmethod
    def for_target(
        cls, cfg: ModelConfig, target: str, tokenizer_sha256: str, window_tokens: int, head_token_count: int
    ) -> EagleDraftSpec:
        """A draft shaped like one of the target's layers."""
        return cls(
            target=target,
            tokenizer_sha256=tokenizer_sha256,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            max_position_embeddings=cfg.max_position_embeddings,
            window_tokens=window_tokens,
            head_token_count=head_token_count,
        )


class SequenceBackend:
    """Causal windowed attention over the rows of one forward pass (training, no cache)."""

    def __init__(self, positions: Tensor, window: int, segment: Tensor | None = None):
        mask = causal_window_mask(positions, positions, window)
        if segment is not None:  # packed sequences attend within their own
            mask &= segment[:, None] == segment[None, :]
        self.mask = mask

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, self.mask)


class DraftKVCache:
    """The draft layer's keys and values for one request: a growable [N, Hkv, D] store where
    row j holds position ``base + j``. Implements ``model.AttentionBackend`` (one layer)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, capacity: int = 256):
        self.window = cfg.sliding_window or 0
        self.k = torch.zeros(capacity, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.base = 0  # position of row 0
        self.length = 0  # rows written

    @property
    def end_position(self) -> int:
        """The position after the last row written."""
        return self.base + self.length

    def reset(self, base: int) -> None:
        self.base, self.length = base, 0

    def truncate(self, end_position: int) -> None:
        """Forget rows at ``end_position`` and after (guessed features, rolled back)."""
        self.length = max(0, min(self.length, end_position - self.base))

    def _make_room(self, rows: int) -> None:
        if self.length + rows <= self.k.shape[0]:
            return
        keep = min(self.length, self.window)  # rows older than the window are never read again
        drop = self.length - keep
        old_k, old_v = self.k[drop : self.length].clone(), self.v[drop : self.length].clone()
        if keep + rows > self.k.shape[0] // 2:  # shifting would not leave room for long: grow
            size = 2 * (keep + rows) + 16
            self.k = self.k.new_zeros((size, *self.k.shape[1:]))
            self.v = self.v.new_zeros((size, *self.v.shape[1:]))
        self.k[:keep], self.v[:keep] = old_k, old_v
        self.base, self.length = self.base + drop, keep

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rows = q.shape[0]
        self._make_room(rows)
        start, end = self.length, self.length + rows
        self.k[start:end], self.v[start:end] = k, v
        self.length = end
        first = max(0, start + 1 - self.window)  # the first query's window
        keys, values = self.k[first:end], self.v[first:end]
        if rows == 1:
            return sdpa(q, keys, values, None)
        q_pos = torch.arange(start, end, device=q.device)
        k_pos = torch.arange(first, end, device=q.device)
        return sdpa(q, keys, values, causal_window_mask(q_pos, k_pos, self.window))


class EagleDraftModel(nn.Module):
    """fc([embedding of x_{i+1}, f_i]) -> one decoder layer -> the guess of f_{i+1}."""

    head_token_ids: Tensor  # [N] the token ids the head scores (register_buffer)

    def __init__(self, spec: EagleDraftSpec):
        super().__init__()
        self.spec = spec
        cfg = spec.model_config()
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg, 0)
        self.rotary = RotaryEmbedding(cfg.rope())
        self.register_buffer("head_token_ids", torch.zeros(spec.head_token_count, dtype=torch.long))

    def forward(
        self, embeds: Tensor, features: Tensor, positions: Tensor, backend: AttentionBackend
    ) -> Tensor:
        """embeds, features: [T, H]; positions [T] -> guessed next features [T, H]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        return self.layer(x, cos, sin, backend)


# --- the file ----------------------------------------------------------------------------------


def save_draft(path: Path, model: EagleDraftModel, meta: dict[str, object]) -> None:
    """Write ``model`` as safetensors: 2-D weights int8 per output row (``.q8`` + ``.scale``),
    the rest fp32, the spec and ``meta`` (training conditions) in the header."""
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
        value = value.detach().cpu()
        if value.dim() == 2 and value.is_floating_point():
            w = value.float()
            scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
            tensors[f"{name}.q8"] = (
                torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            )
            tensors[f"{name}.scale"] = scale.contiguous()
        elif value.is_floating_point():
            tensors[name] = value.float().contiguous()
        else:
            tensors[name] = value.to(torch.int64).contiguous()
    header = {
        "format": DRAFT_FORMAT,
        "version": str(DRAFT_FORMAT_VERSION),
        "spec": json.dumps(asdict(model.spec)),
        "meta": json.dumps(meta),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=header)


def read_draft(path: Path) -> tuple[EagleDraftModel, dict[str, object]]:
    """The draft in ``path`` (fp32) and its training ``meta``. ModelFileError when the file is
    missing, not a draft file, or damaged."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ModelFileError(
            f"draft file {path} does not exist", hint="run scripts/train_draft.py or edge-rtgi models pull"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelFileError(
            f"draft file {path} is damaged or not a safetensors file: {exc}",
            hint="delete it and pull or train it again",
        ) from exc
    if header.get("format") != DRAFT_FORMAT or header.get("version") != str(DRAFT_FORMAT_VERSION):
        raise ModelFileError(
            f"{path} is not an edge-rtgi draft file of version {DRAFT_FORMAT_VERSION} "
            f"(format {header.get('format')!r}, version {header.get('version')!r})",
            hint="train one with scripts/train_draft.py",
        )
    try:
        spec = EagleDraftSpec(**json.loads(header["spec"]))
        meta = json.loads(header.get("meta", "{}"))
        model = EagleDraftModel(spec)
        state: dict[str, Tensor] = {}
        for name in model.state_dict():
            if f"{name}.q8" in tensors:
                state[name] = tensors[f"{name}.q8"].float() * tensors[f"{name}.scale"][:, None]
            else:
                state[name] = tensors[name]
        model.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ModelFileError(
            f"draft file {path} does not hold a complete draft: {exc}", hint="train it again"
        ) from exc
    if not all(bool(t.isfinite().all()) for t in state.values() if t.is_floating_point()):
        raise ModelFileError(f"draft file {path} holds NaN or inf weights", hint="train it again")
    if not isinstance(meta, dict):
        raise ModelFileError(f"draft file {path} has a malformed header", hint="train it again")
    check_draft_file(model, path)
    return model, meta


def check_draft_fits(model: EagleDraftModel, cfg: ModelConfig, tokenizer_sha256: str, path: Path) -> None:
    """ModelFileError unless the draft fits a target of ``cfg`` with that tokenizer."""
    spec = model.spec
    if spec.tokenizer_sha256 != tokenizer_sha256:
        raise ModelFileError(
            f"draft {path} was trained for another tokenizer (for {spec.target!r})",
            hint="use a draft trained for this model, or train one with scripts/train_draft.py",
        )
    if spec.hidden_size != cfg.hidden_size:
        raise ModelFileError(
            f"draft {path} reads {spec.hidden_size}-wide features; this model's are {cfg.hidden_size}",
            hint="use a draft trained for this model",
        )
    if int(model.head_token_ids.max()) >= cfg.vocab_size:
        raise ModelFileError(f"draft {path} holds token ids this model does not have", hint="train it again")


def check_draft_file(model: EagleDraftModel, path: Path) -> None:
    """ModelFileError unless the draft's own settings are usable (head ids, window)."""
    ids = model.head_token_ids
    spec = model.spec
    if spec.window_tokens < 1 or spec.head_token_count < 1 or len(ids) != spec.head_token_count:
        raise ModelFileError(
            f"draft {path} has an unusable window ({spec.window_tokens}) or head ({len(ids)} ids)",
            hint="train it again",
        )
    if int(ids.min()) < 0:
        raise ModelFileError(f"draft {path} holds negative token ids", hint="train it again")


def head_rows(target: Transformer, token_ids: Tensor) -> Tensor:
    """The target's LM head rows for ``token_ids`` [N] -> [N, H] (dequantised where packed)."""
    with torch.no_grad():
        if target.config.tie_word_embeddings:
            return target.embed_tokens(token_ids.to(target.device)).to(target.dtype)
        weight = getattr(target.lm_head, "weight", None)
        if isinstance(weight, Tensor) and weight.is_floating_point():
            return weight.index_select(0, token_ids.to(weight.device)).to(target.dtype)
    raise ModelFileError(
        "the EAGLE draft needs the model's LM head in a float dtype or tied to its embedding",
        hint="load the model with quant: none, or run speculative: ngram",
    )


# --- the draft at run time -------------------------------------------------------------------


def _int8_cpu(weight: Tensor) -> bool:
    # bf16 activations on the CPU: the int8 weight kernels read half the bytes of bf16 (the
    # draft's matrix-vector products are bandwidth-bound); elsewhere the float layer stays
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def _head_layer(rows: Tensor) -> nn.Module:
    head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    head.weight.data = rows
    return _as_int8(head) if _int8_cpu(rows) else head


def _as_int8(linear: nn.Linear) -> nn.Module:
    from edge_rtgi.llm.quant.kernels import make_quant_linear
    from edge_rtgi.llm.quant.schemes import parse_scheme, quantize_weight

    w = linear.weight
    return make_quant_linear(quantize_weight(w, parse_scheme("int8")), linear.bias, w.dtype, w.device)


def _use_int8_kernels(model: EagleDraftModel) -> None:
    """Swap the draft's linear layers for int8 ones where that is faster (the file's weights
    are int8 per output row already, so this loses nothing the file kept)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and _int8_cpu(child.weight):
                setattr(parent, name, _as_int8(child))


@dataclass
class _RequestState:
    cache: DraftKVCache
    # true features not yet turned into draft KV: positions [feature_base, feature_base + rows)
    feature_base: int
    features: list[Tensor]
    rows: int = 0


@dataclass
class _Timing:
    ms_per_token: float = 0.0
    samples: int = 0

    def observe(self, ms: float, tokens: int) -> None:
        per = ms / max(1, tokens)
        self.samples += 1
        weight = max(0.1, 1.0 / self.samples)
        self.ms_per_token += weight * (per - self.ms_per_token)


class EagleDraft:
    """The ``eagle`` draft behind ``speculative.Draft``, over one target model.

    Needs the target's features of every position (``add_features``), which the engine passes on
    from ``ModelRunner.collect_features``. Its cost per drafted token is measured
    (``cost_ms_per_token``) so that the policy pays for it.
    """

    name = "eagle"

    def __init__(
        self, model: EagleDraftModel, target: Transformer, min_confidence: float = MIN_DRAFT_CONFIDENCE
    ):
        self.model = model.to(device=target.device, dtype=target.dtype).eval()
        self.cfg = model.spec.model_config()
        # .to(dtype) cast the rotary frequencies too; rebuilt in fp32 as the target's are
        self.model.rotary = RotaryEmbedding(self.cfg.rope()).to(target.device)
        self.target = target
        self.window = model.spec.window_tokens
        ids = model.head_token_ids.to(target.device)
        self.head_token_ids = ids.tolist()
        self.head = _head_layer(head_rows(target, ids))  # h [1, H] -> scores [1, N]
        _use_int8_kernels(self.model)
        self.min_confidence = min_confidence
        self._states: dict[str, _RequestState] = {}
        self.timing = _Timing()

    @classmethod
    def from_file(cls, path: Path, target: Transformer, tokenizer: Tokenizer) -> EagleDraft:
        """Load and check a draft file for ``target``; ModelFileError with the reason otherwise."""
        model, _ = read_draft(path)
        check_draft_fits(model, target.config, tokenizer_fingerprint(tokenizer), path)
        return cls(model, target)

    @property
    def cost_ms_per_token(self) -> float | None:
        """Measured run time per drafted token (None before the first proposal)."""
        return self.timing.ms_per_token if self.timing.samples else None

    def add_features(self, request_id: str, start_position: int, features: Tensor) -> None:
        """The target's features [T, H] for positions ``start_position`` on. A write that does not
        continue where the last one ended (preemption and recompute, a rolled-back step) starts
        the request's draft state again from it."""
        state = self._states.get(request_id)
        expected = None if state is None else state.feature_base + state.rows
        if state is None or expected != start_position or state.cache.end_position != state.feature_base:
            cache = DraftKVCache(self.cfg, self.target.dtype, self.target.device)
            cache.reset(start_position)
            state = _RequestState(cache, start_position, [])
            self._states[request_id] = state
        state.features.append(features)
        state.rows += len(features)
        if state.rows > 2 * self.window:  # only the last window of positions is ever read
            joined = torch.cat(state.features)[-self.window :].clone()
            state.feature_base += state.rows - len(joined)
            state.features, state.rows = [joined], len(joined)
            state.cache.reset(state.feature_base)

    def propose(self, request: Request, k: int) -> list[int]:
        state = self._states.get(request.request_id)
        tokens = request.all_token_ids
        last = len(tokens) - 1  # position of the token the target has not run yet
        if state is None or not state.features or k <= 0:
            return []
        if state.feature_base + state.rows != last:  # features lag the tokens: skip this step
            return []
        pending = torch.cat(state.features) if len(state.features) > 1 else state.features[0]
        t0 = time.perf_counter()
        with torch.inference_mode():
            start = state.feature_base
            if len(pending) > self.window:  # only the last window is ever read
                pending, start = pending[-self.window :], last - self.window
                state.cache.reset(start)
            positions = torch.arange(start, last, device=self.target.device)
            next_ids = torch.tensor(tokens[start + 1 : last + 1], device=self.target.device)
            embeds = self.target.embed_tokens(next_ids).to(self.target.dtype)
            out = self.model(embeds, pending, positions, state.cache)
            state.features, state.feature_base, state.rows = [], last, 0
            h = out[-1:]
            drafts: list[int] = []
            for j in range(k):
                probs = torch.softmax(self.head(h).float(), dim=-1)
                best, where = probs.max(dim=-1)
                p, index = torch.cat([best, where.to(best.dtype)]).tolist()  # one sync (indices < 2**24)
                if p < self.min_confidence:
                    break
                token = self.head_token_ids[int(index)]
                drafts.append(token)
                if j == k - 1:
                    break
                embed = self.target.embed_tokens(torch.tensor([token], device=self.target.device))
                h = self.model(
                    embed.to(self.target.dtype), h, torch.tensor([last + j], device=h.device), state.cache
                )
            state.cache.truncate(last)  # guessed entries go; true ones come with the next features
        self.timing.observe((time.perf_counter() - t0) * 1e3, max(1, len(drafts)))
        return drafts

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
