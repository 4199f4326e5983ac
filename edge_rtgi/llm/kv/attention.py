"""Attention over the paged KV cache, for a flat batch that mixes decodes and prefill chunks.

The runner lays out a step's tokens with all decodes first (one token each, tokens
``0..B-1``) followed by prefill chunks. Per layer, ``attend`` then:

1. writes every new key/value into its slot (one ``index_copy_`` for the whole batch, so a
   chunk attending to its own earlier tokens finds them);
2. decodes: gathers each sequence's slots into a padded ``[B, S_max]`` batch and runs one
   SDPA call with a padding mask (or one SDPA per sequence, see ``decode_mode``). A step of
   decodes only, on the CPU, instead runs the fused kernel ``cpu_ops.decode_attention``, which
   writes step 1 and reads the keys at their slots without gathering them;
3. prefill chunks: gathers each sequence's slots and runs one SDPA per chunk, causal.

Under ``kv_window`` with sinks (``kv.window``), a sequence whose window has slid past its sinks
gets its gathered sink keys rotated next to the window (``SinkRope``); such a step skips the
fused decode kernel, which reads keys where they are stored.

Everything a layer needs (slot mapping, gather indices, masks) is built once per step and per
KV group in ``PagedAttentionMetadata`` and shared by all layers of the group; ``layer_map``
says which group and storage layer a model layer uses (Gemma 3's local and global layers
see different keys). The same code runs on CUDA (SDPA over
gathered blocks); a paged kernel can replace steps 2-3 there without touching the runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_rtgi.llm import cpu_ops
from edge_rtgi.llm.kv.storage import PagedKVStorage
from edge_rtgi.llm.rope import apply_rope


@dataclass(frozen=True)
class SinkRope:
    """Rotation that moves gathered sink keys next to the window (``kv.window.sink_shift``):
    (cos, signed_sin) [1, 1, D] for a chunk, [B, 1, 1, D] for the decodes (identity rows where a
    sequence has not slid)."""

    cos: Tensor
    sin: Tensor


@dataclass(frozen=True)
class ChunkAttention:
    """One prefill chunk: query tokens ``[q_start, q_start+q_len)`` of the flat batch."""

    q_start: int
    q_len: int
    slots: Tensor  # [S] int64 slots of all keys this chunk may see (including its own)
    mask: Tensor | None  # [q_len, S] bool, or None when plain causal from position 0 applies
    causal: bool
    sink_rope: SinkRope | None = None


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Per-step layout of one KV group, shared by all its layers."""

    slot_mapping: Tensor  # [T] int64: where each new token's k/v goes
    num_decodes: int  # tokens 0..num_decodes-1 are single-token decodes
    decode_slots: Tensor | None  # [B, S_max] int64 (padded with slot 0) in "padded" mode
    decode_mask: Tensor | None  # [B, 1, 1, S_max] bool, None when no padding/window applies
    decode_seq_slots: list[Tensor] | None  # per-sequence [S_b] in "per_seq" mode
    chunks: list[ChunkAttention]
    # attention sinks (kv_window): the first num_sinks gathered keys of a sequence are its sinks
    num_sinks: int = 0
    decode_sink_rope: SinkRope | None = None  # None: no decode of the step has slid


class PagedAttentionBackend:
    """``AttentionBackend`` for ``Transformer.forward`` over a ``PagedKVStorage``.

    ``metadata``: one per KV group; ``layer_map[layer] = (group, storage layer)`` (None: one
    group, storage layer = model layer).
    """

    def __init__(
        self,
        storage: PagedKVStorage,
        metadata: PagedAttentionMetadata | Sequence[PagedAttentionMetadata],
        layer_map: Sequence[tuple[int, int]] | None = None,
    ):
        self.storage = storage
        self.groups = [metadata] if isinstance(metadata, PagedAttentionMetadata) else list(metadata)
        self.md = self.groups[0]
        self.layer_map = layer_map

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]
        if self.layer_map is not None:
            group, layer = self.layer_map[layer]
            md = self.groups[group]
        else:
            md = self.md
        if not md.chunks and md.decode_slots is not None and md.decode_sink_rope is None:
            k_store = self.storage.k[layer]
            if cpu_ops.decode_attention_usable(q, k_store, md.decode_slots.shape[1]):
                # Writes the new keys/values too; an int8 store (other dtype) never gets here.
                return cpu_ops.decode_attention(
                    q,
                    k,
                    v,
                    k_store,
                    self.storage.v[layer],
                    md.slot_mapping,
                    md.decode_slots,
                    md.decode_mask,
                    q.shape[-1] ** -0.5,
                )
        self.storage.write(layer, md.slot_mapping, k, v)
        if not md.chunks:
            return self._decodes(md, layer, q)
        out = torch.empty_like(q)
        if md.num_decodes:
            out[: md.num_decodes] = self._decodes(md, layer, q[: md.num_decodes])
        for c in md.chunks:
            keys, values = self.storage.gather(layer, c.slots)  # [S, Hkv, D]
            if c.sink_rope is not None:
                s = md.num_sinks
                keys[:s] = apply_rope(keys[:s], c.sink_rope.cos, c.sink_rope.sin)
            # 4-D inputs ([1, H, T, D]) select PyTorch's fused CPU flash kernel; 3-D ones fall
            # back to the unfused math path.
            o = F.scaled_dot_product_attention(
                q[c.q_start : c.q_start + c.q_len].transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=c.mask,
                is_causal=c.causal,
                enable_gqa=True,
            )
            out[c.q_start : c.q_start + c.q_len] = o[0].transpose(0, 1)
        return out

    def decode_slots(self) -> cpu_ops.DecodeSlots | None:
        """The fused CPU decode path's view of this step: decodes only, padded mode, plain store,
        one KV group (every layer reads the same keys)."""
        md = self.md
        if (
            len(self.groups) != 1
            or md.chunks
            or md.decode_slots is None
            or md.decode_sink_rope is not None
            or type(self.storage) is not PagedKVStorage
        ):
            return None
        return cpu_ops.DecodeSlots(
            self.storage.k, self.storage.v, md.slot_mapping, md.decode_slots, md.decode_mask
        )

    def _decodes(self, md: PagedAttentionMetadata, layer: int, q: Tensor) -> Tensor:
        # q: [B, Hq, D], one query per sequence -> [B, Hq, D]
        rope, s = md.decode_sink_rope, md.num_sinks
        if md.decode_seq_slots is not None:
            outs = []
            for b, slots in enumerate(md.decode_seq_slots):
                keys, values = self.storage.gather(layer, slots)  # [S, Hkv, D]
                if rope is not None:
                    keys[:s] = apply_rope(keys[:s], rope.cos[b], rope.sin[b])
                outs.append(
                    F.scaled_dot_product_attention(
                        q[b, None, :, None],
                        keys.transpose(0, 1)[None],
                        values.transpose(0, 1)[None],
                        enable_gqa=True,
                    )
                )  # [1, Hq, 1, D]
            return torch.cat(outs, dim=0).squeeze(2)
        if md.decode_slots is None:  # the runner sets one of the two for every decode step
            raise RuntimeError("a decode step without key slots")
        keys, values = self.storage.gather(layer, md.decode_slots)  # [B, S, Hkv, D]
        if rope is not None:
            keys[:, :s] = apply_rope(keys[:, :s], rope.cos, rope.sin)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=md.decode_mask,
            enable_gqa=True,
        )  # [B, Hq, 1, D]
        return o.squeeze(2)
