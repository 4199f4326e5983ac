"""Attention over the paged KV cache, for a flat batch that mixes decodes and prefill chunks.

The runner lays out a step's tokens with all decodes first (one token each, tokens
``0..B-1``) followed by prefill chunks. Per layer, ``attend`` then:

1. writes every new key/value into its slot (one ``index_copy_`` for the whole batch, so a
   chunk attending to its own earlier tokens finds them);
2. decodes: gathers each sequence's slots into a padded ``[B, S_max]`` batch and runs one
   SDPA call with a padding mask (or one SDPA per sequence, see ``decode_mode``). A step of
   decodes only, on the CPU, instead runs the fused kernel ``cpu_ops.decode_attention``, which
   writes step 1 and reads the keys at their slots without gathering them; on an int4 KIVI
   store (``kv.int4``) such a step writes through the storage and then runs
   ``cpu_ops.decode_attention_int4``, which reads the int4 codes in place;
3. prefill chunks: gathers each sequence's slots and runs one SDPA per chunk, causal.

Under ``kv_window`` with sinks (``kv.window``), a sequence whose window has slid past its sinks
gets its gathered sink keys rotated next to the window (``SinkRope``); such a step skips the
fused decode kernel, which reads keys where they are stored.

Importance eviction (``kv.eviction``): a sequence with an accumulator in the metadata
(``ChunkAttention.scores``, ``decode_scores``) is attended with explicit softmax math instead of
SDPA, and the attention mass its keys receive (summed over heads and the counted queries) is
added to the accumulator at every layer. Steps without such a sequence are untouched.

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
from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
from edge_rtgi.llm.kv.mixed import MixedPagedKVStorage
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
    # eviction: [S] fp32 accumulator of the attention mass each key receives from the chunk's
    # last ``score_queries`` queries, summed over layers and heads (None: not scored)
    scores: Tensor | None = None
    score_queries: int = 0


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
    # eviction: [B, S_max] fp32 accumulator of the decodes' attention mass (padded mode), or
    # one [S_b] per sequence (per_seq mode, None where not scored); None: no decode is scored
    decode_scores: Tensor | None = None
    decode_seq_scores: list[Tensor | None] | None = None


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
        if (
            not md.chunks
            and md.decode_slots is not None
            and md.decode_sink_rope is None
            and md.decode_scores is None
        ):
            # a per-layer plan's int4 layers live in an int4 store of their own
            part, index = (
                self.storage.part_of(layer)
                if isinstance(self.storage, MixedPagedKVStorage)
                else (self.storage, layer)
            )
            if isinstance(part, Int4KIVIPagedKVStorage):
                if cpu_ops.decode_attention_int4_usable(q, part.k_open[index]):
                    # The write keeps the open-block bookkeeping in Python; attention reads codes.
                    part.write(index, md.slot_mapping, k, v)
                    return cpu_ops.decode_attention_int4(
                        q,
                        part.fused_layer(index),
                        md.decode_slots,
                        md.decode_mask,
                        q.shape[-1] ** -0.5,
                    )
            k_store = self.storage.k[layer]
            if cpu_ops.decode_attention_usable(q, k_store, md.decode_slots.shape[1], paged=True):
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
            if c.scores is not None:
                mask = c.mask if c.mask is not None else _causal(c.q_len, keys.shape[0], q.device)
                o = scored_attention(
                    q[c.q_start : c.q_start + c.q_len].transpose(0, 1)[None],
                    keys.transpose(0, 1)[None],
                    values.transpose(0, 1)[None],
                    mask[None, None],
                    c.scores[None],
                    c.score_queries,
                )
                out[c.q_start : c.q_start + c.q_len] = o[0].transpose(0, 1)
                continue
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
        """The fused CPU decode path's view of this step: decodes only, padded mode, every layer
        stored in the model's dtype (a plain store, or a per-layer plan without int layers), one
        KV group (every layer reads the same keys)."""
        md = self.md
        if (
            len(self.groups) != 1
            or md.chunks
            or md.decode_slots is None
            or md.decode_sink_rope is not None
            or md.decode_scores is not None
            or any(k.dtype != self.storage.dtype for k in self.storage.k)  # int8/int4 layers
        ):
            return None
        return cpu_ops.DecodeSlots(
            self.storage.k, self.storage.v, md.slot_mapping, md.decode_slots, md.decode_mask, paged=True
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
                acc = md.decode_seq_scores[b] if md.decode_seq_scores is not None else None
                if acc is not None:
                    outs.append(
                        scored_attention(
                            q[b, None, :, None],
                            keys.transpose(0, 1)[None],
                            values.transpose(0, 1)[None],
                            None,
                            acc[None],
                            1,
                        )
                    )
                    continue
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
        if md.decode_scores is not None:
            mask = md.decode_mask
            return scored_attention(
                q.unsqueeze(2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                None if mask is None else mask[:, 0],
                md.decode_scores,
                1,
            ).squeeze(2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=md.decode_mask,
            enable_gqa=True,
        )  # [B, Hq, 1, D]
        return o.squeeze(2)


def _causal(q_len: int, num_keys: int, device: torch.device) -> Tensor:
    """[q_len, S] causal mask of a chunk whose queries are the last ``q_len`` of ``num_keys``."""
    return torch.ones(q_len, num_keys, dtype=torch.bool, device=device).tril(num_keys - q_len)


def scored_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scores: Tensor, score_queries: int
) -> Tensor:
    """Attention with explicit softmax that also adds, per batch row, the attention mass each key
    receives from the last ``score_queries`` queries (summed over heads) to ``scores`` [B, S].

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D] (GQA: Hq a multiple of Hkv); mask: bool, broadcast to
    [B, T, S] (True = may attend), or None. Returns [B, Hq, T, D]. Computed in fp32 at least
    (fp64 for fp64 models), as SDPA's CPU kernels accumulate.
    """
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, hkv, (hq // hkv) * t, d).to(dt)
    logits = (qg @ k.to(dt).transpose(-1, -2)).mul_(d**-0.5).view(b, hkv, hq // hkv, t, s)
    if mask is not None:
        logits.masked_fill_(~mask.reshape(mask.shape[0], 1, 1, t, s), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    scores += probs[:, :, :, t - score_queries :].sum(dim=(1, 2, 3)).to(scores.dtype)
    out = probs.view(b, hkv, (hq // hkv) * t, s) @ v.to(dt)
    return out.view(b, hq, t, d).to(q.dtype)
