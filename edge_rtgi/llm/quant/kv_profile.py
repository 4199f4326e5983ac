"""KV sensitivity profiling: how much each layer's KV cache, quantised alone, moves the output.

For every layer and every KV precision (int8, int4), that layer alone keeps its keys and values in
the precision and the mean KL divergence KL(full || quantised) of the next-token distributions is
measured over calibration windows: the same metric, table (``profile.SensitivityTable``, rows
``layers.{i}.kv``) and allocator (``allocate.allocate_kv``) as the weight plans.

Each window runs as one prefill chunk through the engine's own attention backend
(``kv.attention.PagedAttentionBackend``) over a per-layer store (``kv.mixed``), so a trial quantises
exactly as the engine does (int8 per slot; int4 keys per channel over each full 16-token block, the
last open block in full precision, values per token). The reference is the same path with every
layer in the model's dtype, so the KL of "auto" is 0 by construction and every measured KL is the
quantisation's alone. A layer's KV changes only layers from it on: each trial re-runs layers
``l..L-1`` from the cached input of layer ``l``.

What this does not see: in decode a token attends to earlier blocks already quantised, as here, but
the profile is teacher-forced over text, not generated replies; the dialogue recall set
(``scripts/bench_kv.py --kv-plans``) is what judges a plan.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor
from tqdm import tqdm

from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.kv.attention import ChunkAttention, PagedAttentionBackend, PagedAttentionMetadata
from edge_rtgi.llm.kv.mixed import MixedPagedKVStorage
from edge_rtgi.llm.model import Transformer
from edge_rtgi.llm.quant.plan import kv_layer_name
from edge_rtgi.llm.quant.profile import SensitivityTable, calibration_text, mean_kl, token_windows

KV_SCHEMES = ("int8", "int4")  # the measured precisions; "auto" (the model's dtype) is the reference


class _Window:
    """One calibration window laid out in slots 0..W-1 of a store, as one causal prefill chunk."""

    def __init__(self, model: Transformer, ids: Tensor, block_size: int):
        self.model, self.block_size = model, block_size
        self.ids = ids.to(model.device)
        n = len(ids)
        slots = torch.arange(n, device=model.device)
        self.metadata = PagedAttentionMetadata(
            slot_mapping=slots,
            num_decodes=0,
            decode_slots=None,
            decode_mask=None,
            decode_seq_slots=None,
            chunks=[ChunkAttention(0, n, slots, None, True)],
        )
        positions = torch.arange(n, device=model.device)
        self.rope = model.rotary(positions, model.dtype)
        local = model.rotary_local
        self.local_rope = local(positions, model.dtype) if local is not None else self.rope

    def embed(self) -> Tensor:
        """The first layer's input (``Transformer.forward``'s)."""
        x = self.model.embed_tokens(self.ids)
        scale = self.model.embed_scale
        return x * float(torch.tensor(scale, dtype=x.dtype)) if scale is not None else x

    def run(self, x: Tensor, start: int, layer_dtypes: list[str]) -> Tensor:
        """Final hidden states from layer ``start``'s input ``x``, over a fresh store."""
        cfg = self.model.config
        blocks = -(-len(self.ids) // self.block_size)
        storage = MixedPagedKVStorage(
            layer_dtypes,
            blocks,
            self.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.model.dtype,
            self.model.device,
        )
        backend = PagedAttentionBackend(storage, self.metadata)
        for layer in self.model.layers[start:]:
            x = layer(x, *(self.local_rope if layer.local_rope else self.rope), backend)
        return self.model.norm(x)


@torch.inference_mode()
def profile_kv_sensitivity(
    model: Transformer,
    tokenizer,
    schemes: tuple[str, ...] = KV_SCHEMES,
    window_tokens: int = 256,
    max_windows: int = 4,
    text: str | None = None,
    block_size: int = 16,
    progress: bool = True,
) -> SensitivityTable:
    """The KV rows of a sensitivity table (``layers.{i}.kv`` x ``schemes``) of ``model`` as it is
    (weights quantised or not: the KV sees the activations the engine will). Models with several
    KV groups (per-layer windows) are refused: a KV plan is per model layer."""
    cfg = model.config
    if len(cfg.kv_groups()) > 1:
        raise ConfigError(
            f"{cfg.arch} has several KV groups (per-layer windows); per-layer KV plans need one",
            hint="use kv_dtype auto, int8 or int4 for this model",
        )
    bad = [s for s in schemes if s not in KV_SCHEMES]
    if bad:
        raise ConfigError(f"unknown KV schemes {bad}", hint=f"allowed: {', '.join(KV_SCHEMES)}")
    started = time.perf_counter()
    windows = token_windows(
        tokenizer, text if text is not None else calibration_text(), window_tokens, max_windows
    )
    num_layers = cfg.num_layers
    plain = ["auto"] * num_layers
    runs, inputs, refs = [], [], []
    for ids in windows:
        run = _Window(model, ids, block_size)
        per_layer: list[Tensor] = []
        hooks = [
            layer.register_forward_pre_hook(lambda _m, args, keep=per_layer: keep.append(args[0]))
            for layer in model.layers
        ]
        try:
            hidden = run.run(run.embed(), 0, plain)
        finally:
            for hook in hooks:
                hook.remove()
        runs.append(run)
        inputs.append(per_layer)
        refs.append(torch.log_softmax(model.compute_logits(hidden).float(), dim=-1))
    num_tokens = sum(len(w) for w in windows)
    trials = [(layer, scheme) for layer in range(num_layers) for scheme in schemes]
    kl: dict[str, dict[str, float]] = {kv_layer_name(i): {} for i in range(num_layers)}
    bar = tqdm(trials, desc="kv sensitivity", unit="trial", disable=not progress)
    for layer, scheme in bar:
        bar.set_postfix_str(f"{kv_layer_name(layer)} {scheme}")
        dtypes = list(plain)
        dtypes[layer] = scheme
        total = 0.0
        for w, run in enumerate(runs):
            hidden = run.run(inputs[w][layer], layer, dtypes)
            total += mean_kl(refs[w], model.compute_logits(hidden)) * len(run.ids)
        kl[kv_layer_name(layer)][scheme] = total / num_tokens
    info = {
        "kv_calibration": {
            "tokens": num_tokens,
            "windows": len(windows),
            "window_tokens": window_tokens,
            "block_size": block_size,
            "reference": "the same paged path with every layer's KV in the model's dtype (auto: KL 0)",
        },
        "kv_dtype": str(model.dtype).replace("torch.", ""),
        "kv_seconds": round(time.perf_counter() - started, 1),
    }
    shapes = {kv_layer_name(i): (cfg.num_kv_heads, cfg.head_dim) for i in range(num_layers)}
    return SensitivityTable(kl, shapes, info)
