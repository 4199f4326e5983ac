"""A dense reference for paged KV in reduced precision: every layer's keys and values kept in
full precision, rounded at each pass as that layer's precision would round them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_rtgi.llm.kv.int4 import dequantise_int4, quantise_int4
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage
from edge_rtgi.llm.model import Transformer, causal_window_mask
from edge_rtgi.llm.weights import LoadedModel


class PerLayerReference:
    """Dense KV in full precision; each forward pass attends, per layer, over the round trip of
    that layer's precision: int4 as KIVI (keys of each full block per channel, the last unfilled
    block exact, values per token), int8 per slot and head, auto exact."""

    def __init__(self, model: Transformer, layers: list[str], max_len: int, block_size: int):
        cfg = model.config
        self.model, self.layers = model, layers
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)
        self.group = 32 if cfg.head_dim % 32 == 0 else cfg.head_dim
        self.block_size = block_size
        self.length = 0

    def _round_trip(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        keys, values = self.k[layer, :end].clone(), self.v[layer, :end].clone()
        if self.layers[layer] == "int8":
            for x in (keys, values):
                codes, scale = Int8PagedKVStorage._quantise(x)
                x.copy_(codes.float() * scale)
        elif self.layers[layer] == "int4":
            for b in range(end // self.block_size):
                rows = slice(b * self.block_size, (b + 1) * self.block_size)
                keys[rows] = dequantise_int4(*quantise_int4(keys[rows], dim=0)).to(keys.dtype)
            t, h, d = values.shape
            grouped = values.reshape(t, h, d // self.group, self.group)
            values = dequantise_int4(*quantise_int4(grouped, dim=-1)).reshape(t, h, d).to(keys.dtype)
        return keys, values

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        start, end = self.length, self.length + q.shape[0]
        self.k[layer, start:end], self.v[layer, start:end] = k, v
        keys, values = self._round_trip(layer, end)
        mask = causal_window_mask(torch.arange(start, end), torch.arange(end), None)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> int:
        hidden = self.model(torch.tensor(ids), torch.arange(self.length, self.length + len(ids)), self)
        self.length += len(ids)
        return int(self.model.compute_logits(hidden[-1:])[0].argmax())


def reference(
    loaded: LoadedModel, layers: list[str], prompt: list[int], max_tokens: int, block_size: int, chunk: int
) -> list[int]:
    """Greedy tokens of ``PerLayerReference``, the prompt prefilled in chunks of ``chunk``."""
    ref = PerLayerReference(loaded.model, layers, len(prompt) + max_tokens, block_size)
    for i in range(0, len(prompt), chunk):
        token = ref.forward(prompt[i : i + chunk])
    out = [token]
    while len(out) < max_tokens:
        out.append(ref.forward([out[-1]]))
    return out
