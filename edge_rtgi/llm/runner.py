"""Scheduler output -> flat tensors -> one forward pass -> logits at each sequence's end -> tokens.

The runner holds no scheduling state. Per step it receives the scheduled chunks (token ids,
start position, block table), lays them out as one flat batch (decodes first, then prefill
chunks), builds the attention metadata once, runs ``Transformer.forward`` through a
``PagedAttentionBackend``, projects only the last position of each sequence that samples,
and samples. A failure while sampling one sequence is reported for that sequence alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from edge_rtgi.llm import cpu_ops, sampling
from edge_rtgi.llm.kv.attention import (
    ChunkAttention,
    PagedAttentionBackend,
    PagedAttentionMetadata,
    SinkRope,
)
from edge_rtgi.llm.kv.eviction import KVEviction
from edge_rtgi.llm.kv.manager import KVGroupSpec
from edge_rtgi.llm.kv.storage import PagedKVStorage
from edge_rtgi.llm.kv.window import sink_shift
from edge_rtgi.llm.model import Transformer, causal_window_mask
from edge_rtgi.llm.request import TokenLogprob
from edge_rtgi.llm.rope import RotaryEmbedding
from edge_rtgi.llm.sampling import SamplingParams, sample_token
from edge_rtgi.llm.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, chunk_row_keys
from edge_rtgi.llm.speculative import FeatureRows

log = logging.getLogger(__name__)

DECODE_MODES = ("padded", "per_seq")
# A step whose prompt chunks and decodes come to at most this many tokens runs the chunks as
# one-token rows on the fused CPU decode path (the multi-row kernels' width): a chunk otherwise
# sends the whole step, decodes included, through the slower Python layers.
CHUNK_ROWS_MAX = 32
# ... as long as its rows read at most this many keys in all: each row reads its whole context,
# where the chunk path reads a cached prefix once for all its queries
CHUNK_ROWS_MAX_KEYS = 4096
SNAPKV_POOL_TOKENS = 7  # SnapKV pools observation scores over neighbours, so a fact's tokens go together


@dataclass
class EvictionScores:
    """Per request, in cache order: the attention mass each cached token has received (summed
    over layers, heads and the counted queries) and its position in the sequence."""

    scores: Tensor  # [n] fp32 (fp64 for an fp64 model)
    positions: Tensor  # [n] int64


class ModelRunner:
    """Executes scheduler steps on a model and a paged KV storage.

    ``groups`` are the KV groups of the scheduler's KV manager (default: the model's own,
    ``ModelConfig.kv_groups``); each ``ScheduledRequest.block_ids`` has one table per group.
    """

    def __init__(
        self,
        model: Transformer,
        storage: PagedKVStorage,
        decode_mode: str = "padded",
        groups: tuple[KVGroupSpec, ...] | None = None,
        eviction: KVEviction | None = None,
    ):
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {decode_mode!r}")
        self.model = model
        self.storage = storage
        self.block_size = storage.block_size
        self.device = model.device
        self.groups = groups if groups is not None else model.config.kv_groups()
        self.layer_map = _layer_map(self.groups, model.config.num_layers)
        self._rotary = [_rotary_of(model, g) for g in self.groups]  # moves sinks (kv_window)
        self.decode_mode = decode_mode
        self._offsets = torch.arange(self.block_size, device=self.device)
        self._generators: dict[str, torch.Generator | None] = {}
        # importance eviction: attention mass is gathered for every request (kv.eviction)
        self.eviction = eviction
        self._scores: dict[str, EvictionScores] = {}
        self._observation: dict[str, int] = {}  # per request, when not the policy's own
        # a draft that reads the target's features (llm.eagle) is on: after each step,
        # ``features`` holds every request's final hidden states of the positions it computed
        # (a verifying request's up to its last accepted token)
        self.collect_features = False
        self.features: dict[str, FeatureRows] = {}
        # small prompt chunks run as fused decode rows (CHUNK_ROWS_MAX); False for A/B runs
        self.chunks_as_rows = True
        # whether the last step ran the Python layer stack where a fused decode loop exists (the
        # step-time model's regime; False where there is none: no step pays more than another)
        self.last_step_python_layers = False
        # what the fused decode path needs of the attention side (PagedAttentionBackend.decode_slots)
        group = self.groups[0]
        self._fused_attention = (
            decode_mode == "padded"
            and eviction is None
            and len(self.groups) == 1
            and (group.window_tokens is None or group.sink_tokens == 0)
            and all(k.dtype == storage.dtype == model.dtype for k in storage.k)
        )
        # whether decode steps can run on the fused CPU layer loop at all (the kernels load with
        # the model, before the engine builds its runner; read once, like the scheduler's limits)
        self._fused_path = self.fused_decode_rows() > 0

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling and eviction state."""
        self._generators.pop(request_id, None)
        self._scores.pop(request_id, None)
        self._observation.pop(request_id, None)

    # --- eviction scores ---------------------------------------------------------------------

    def eviction_scores(self, request_id: str) -> EvictionScores | None:
        """The request's gathered attention mass per cached token (None before its first step)."""
        return self._scores.get(request_id)

    def observe(self, request_id: str, num_queries: int) -> None:
        """Score the request's cache with its prompt's last ``num_queries`` queries (``score:
        observation``; ``kv.eviction.observation_queries``)."""
        self._observation[request_id] = num_queries

    def keep_scores(self, request_id: str, keep: list[int]) -> None:
        """Follow a compaction: keep the entries at ``keep`` (cache indices, ascending)."""
        st = self._scores[request_id]
        index = torch.tensor(keep, dtype=torch.long)
        self._scores[request_id] = EvictionScores(st.scores[index], st.positions[index])

    def _score_queries(self, sr: ScheduledRequest) -> int:
        """How many of the chunk's last queries add to its keys' scores (0: not scored)."""
        if self.eviction is None:
            return 0
        if self.eviction.scores_every_query():
            return len(sr.token_ids)
        # observation: the prompt's last queries (the chunk that samples) and every decode query
        observed = self._observation.get(sr.request_id, self.eviction.observation_tokens)
        return min(observed, len(sr.token_ids)) if sr.sample else 0

    def _add_scores(
        self, decodes: list[ScheduledRequest], chunks: list[ScheduledRequest], md: PagedAttentionMetadata
    ) -> None:
        for b, sr in enumerate(decodes):
            if md.decode_scores is not None:
                self._accumulate(sr, md.decode_scores[b])
            else:
                self._accumulate(sr, md.decode_seq_scores[b] if md.decode_seq_scores else None)
        for sr, c in zip(chunks, md.chunks, strict=True):
            self._accumulate(sr, c.scores)

    def _accumulate(self, sr: ScheduledRequest, step: Tensor | None) -> None:
        """Append the chunk's tokens to the request's scores and add the step's mass."""
        start, n = _cache_start(sr), len(sr.token_ids)
        st = self._scores.get(sr.request_id)
        # new, or recomputed after a preemption (which forgets evictions: the cache is then
        # positions 0..start-1, and ascending positions ending at start-1 can only be those)
        stale = st is not None and not sr.num_evicted_tokens and start and int(st.positions[-1]) != start - 1
        if st is None or len(st.scores) != start or stale:
            if sr.num_evicted_tokens:
                raise RuntimeError(f"request {sr.request_id}: eviction scores lost after an eviction")
            dt = torch.promote_types(self.model.dtype, torch.float32)
            st = EvictionScores(torch.zeros(start, dtype=dt), torch.arange(start))
        scores = torch.cat([st.scores, torch.zeros(n, dtype=st.scores.dtype)])
        positions = torch.cat([st.positions, torch.arange(sr.start_position, sr.start_position + n)])
        if step is not None:
            mass = step[: start + n].to(scores.dtype).cpu()
            if self.eviction is not None and self.eviction.mode == "snapkv" and n > 1:
                k = SNAPKV_POOL_TOKENS
                mass = torch.nn.functional.max_pool1d(mass[None, None], k, 1, k // 2)[0, 0]
            scores += mass
        self._scores[sr.request_id] = EvictionScores(scores, positions)

    # --- layout ----------------------------------------------------------------------------

    def _key_slots(self, sr: ScheduledRequest, group: int) -> tuple[Tensor, Tensor]:
        """Slots and positions of every key this chunk can see in ``group``: [S] each, ascending."""
        ctx_len = _cache_start(sr) + len(sr.token_ids)
        num_blocks = -(-ctx_len // self.block_size)
        ids = sr.block_ids[group][:num_blocks]
        table = torch.tensor(ids, dtype=torch.long, device=self.device)
        if -1 not in ids:
            slots = (table[:, None] * self.block_size + self._offsets).flatten()[:ctx_len]
            return slots, torch.arange(ctx_len, device=self.device)
        live = (table >= 0).nonzero().squeeze(1)  # blocks released outside a sliding window
        positions = (live[:, None] * self.block_size + self._offsets).flatten()
        slots = (table[live][:, None] * self.block_size + self._offsets).flatten()
        keep = positions < ctx_len
        return slots[keep], positions[keep]

    def _metadata(
        self, decodes: list[ScheduledRequest], chunks: list[ScheduledRequest], group: int
    ) -> PagedAttentionMetadata:
        window = self.groups[group].window_tokens
        sinks = self.groups[group].sink_tokens if window is not None else 0
        new_slots: list[Tensor] = []
        padded = mask = per_seq = None
        dt = torch.promote_types(self.model.dtype, torch.float32)  # as scored_attention computes
        decode_scores: Tensor | None = None
        seq_scores: list[Tensor | None] | None = None
        if decodes and self.decode_mode == "padded":
            padded, mask, decode_new = self._padded_decodes(decodes, group)
            new_slots.append(decode_new)
            if self.eviction is not None:
                decode_scores = torch.zeros(padded.shape, dtype=dt, device=self.device)
        elif decodes:
            per_seq = []
            seq_scores = [] if self.eviction is not None else None
            for sr in decodes:
                slots, positions = self._key_slots(sr, group)
                new_slots.append(slots[-1:])
                if window is not None:
                    slots = slots[(positions > _cache_start(sr) - window) | (positions < sinks)]
                per_seq.append(slots)
                if seq_scores is not None:
                    seq_scores.append(torch.zeros(len(slots), dtype=dt, device=self.device))
        chunk_md = []
        q_start = len(decodes)
        for sr in chunks:
            slots, positions = self._key_slots(sr, group)
            n = len(sr.token_ids)
            new_slots.append(slots[-n:])
            # a window at least as long as the context hides nothing: plain causal, as without one
            start = _cache_start(sr)  # == start_position unless tokens were evicted
            unwindowed = window is None or start + n <= window
            plain_causal = unwindowed and start == 0 and len(slots) == n
            chunk_mask = None
            if not plain_causal:
                q_pos = torch.arange(start, start + n, device=self.device)
                chunk_mask = causal_window_mask(q_pos, positions, window, sinks)
            shift = sink_shift(sr.start_position, window, sinks) if window is not None and sinks else 0
            rope = self._sink_rope(group, [shift]) if shift else None
            score_q = self._score_queries(sr)
            acc = torch.zeros(len(slots), dtype=dt, device=self.device) if score_q else None
            chunk_md.append(ChunkAttention(q_start, n, slots, chunk_mask, plain_causal, rope, acc, score_q))
            q_start += n
        decode_rope = None
        if decodes and window is not None and sinks:
            shifts = [sink_shift(sr.start_position, window, sinks) for sr in decodes]
            if any(shifts):
                rope = self._sink_rope(group, shifts)
                decode_rope = SinkRope(rope.cos[:, None], rope.sin[:, None])  # [B, 1, 1, D]
        return PagedAttentionMetadata(
            slot_mapping=torch.cat(new_slots) if len(new_slots) > 1 else new_slots[0],
            num_decodes=len(decodes),
            decode_slots=padded,
            decode_mask=mask,
            decode_seq_slots=per_seq,
            chunks=chunk_md,
            num_sinks=sinks,
            decode_sink_rope=decode_rope,
            decode_scores=decode_scores,
            decode_seq_scores=seq_scores,
        )

    def _sink_rope(self, group: int, shifts: list[int]) -> SinkRope:
        """Rotation by ``shifts`` [N] positions -> [N, 1, D] cos/sin (``RotaryEmbedding.shift``)."""
        offsets = torch.tensor(shifts, dtype=torch.long, device=self.device)
        cos, sin = self._rotary[group].shift(offsets, self.model.dtype)
        return SinkRope(cos, sin)

    def _padded_decodes(
        self, decodes: list[ScheduledRequest], group: int
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """All decodes' key slots in ``group`` as one [B, S_max] tensor, a mask, and each new
        token's slot [B].

        Built with a handful of batched ops whatever B is: the per-step cost of a big decode
        batch must not grow with a Python loop of small tensor ops.
        """
        bs, window = self.block_size, self.groups[group].window_tokens
        sinks = self.groups[group].sink_tokens
        ctx = [_cache_start(sr) + 1 for sr in decodes]
        longest = max(ctx)
        if window is not None and longest <= window:
            window = None  # no key is outside any sequence's window yet
        num_blocks = -(-longest // bs)
        tables = [sr.block_ids[group][:num_blocks] for sr in decodes]
        rows = [t + [-1] * (num_blocks - len(t)) for t in tables]
        table = torch.tensor(rows, dtype=torch.long, device=self.device)  # [B, nb]
        slots = (table.clamp_min(0)[:, :, None] * bs + self._offsets).flatten(1)[:, :longest]  # [B, S]
        ctx_len = torch.tensor(ctx, device=self.device)
        new = slots.gather(1, (ctx_len - 1)[:, None]).squeeze(1)
        # Released blocks (sliding window) inside a sequence's own context must be masked out.
        holes = any(-1 in t[: -(-c // bs)] for t, c in zip(tables, ctx, strict=True))
        if holes:
            return self._live_decodes(tables, ctx, window, sinks)
        if min(ctx) == longest and window is None:
            return slots, None, new
        positions = torch.arange(longest, device=self.device)[None, :]
        allowed = positions < ctx_len[:, None]
        if window is not None:
            allowed &= (positions > (ctx_len - 1 - window)[:, None]) | (positions < sinks)
        return slots, allowed[:, None, None, :], new

    def _live_decodes(
        self, tables: list[list[int]], ctx: list[int], window: int | None, sinks: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``_padded_decodes`` where blocks were released: only live blocks are gathered, so a
        windowed sequence's attention costs its sinks and window, not its whole history."""
        bs = self.block_size
        live = [
            [(i, b) for i, b in enumerate(t[: -(-c // bs)]) if b >= 0]
            for t, c in zip(tables, ctx, strict=True)
        ]
        width = max(len(row) for row in live)
        logical = [[i for i, _ in row] + [-1] * (width - len(row)) for row in live]
        ids = [[b for _, b in row] + [-1] * (width - len(row)) for row in live]
        table = torch.tensor(ids, dtype=torch.long, device=self.device)  # [B, w]
        index = torch.tensor(logical, dtype=torch.long, device=self.device)
        slots = (table.clamp_min(0)[:, :, None] * bs + self._offsets).flatten(1)  # [B, w * bs]
        positions = (index[:, :, None] * bs + self._offsets).flatten(1)  # -1 blocks: negative
        ctx_len = torch.tensor(ctx, device=self.device)[:, None]
        allowed = (index >= 0).repeat_interleave(bs, dim=1) & (positions < ctx_len)
        if window is not None:
            allowed &= (positions > ctx_len - 1 - window) | (positions < sinks)
        new = slots.gather(1, (positions == ctx_len - 1).int().argmax(dim=1, keepdim=True)).squeeze(1)
        return slots, allowed[:, None, None, :], new

    # --- the step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, params: Mapping[str, SamplingParams]) -> ModelRunnerOutput:
        """Run one step; ``params`` maps each scheduled request id to its sampling params."""
        verify = [s for s in output.scheduled if s.sample and s.num_draft_tokens]
        self.features = {}
        chunks_as_rows = self._chunks_as_rows(output)
        rows: list[ScheduledRequest] = []
        for s in output.scheduled:
            if s.sample and s.num_draft_tokens:
                # k drafts to verify run as k+1 decode rows (position p+i sees keys up to p+i),
                # so they take the fused decode path and its multi-row kernels; every row's key
                # and value are written before any row attends
                rows.extend(
                    ScheduledRequest(
                        s.request_id, [t], s.start_position + i, s.block_ids, True, 0, s.num_evicted_tokens
                    )
                    for i, t in enumerate(s.token_ids)
                )
            elif chunks_as_rows and len(s.token_ids) > 1:
                # the same for a prompt chunk; only its last row samples
                last = len(s.token_ids) - 1
                rows.extend(
                    ScheduledRequest(
                        s.request_id,
                        [t],
                        s.start_position + i,
                        s.block_ids,
                        s.sample and i == last,
                        0,
                        s.num_evicted_tokens,
                    )
                    for i, t in enumerate(s.token_ids)
                )
            else:
                rows.append(s)
        decodes = [s for s in rows if len(s.token_ids) == 1]
        chunks = [s for s in rows if len(s.token_ids) > 1]
        ordered = decodes + chunks
        token_ids = [t for s in ordered for t in s.token_ids]
        positions = [p for s in ordered for p in range(s.start_position, s.start_position + len(s.token_ids))]
        md = [self._metadata(decodes, chunks, g) for g in range(len(self.groups))]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        backend = PagedAttentionBackend(self.storage, md, self.layer_map)
        loops_before = cpu_ops.layer_loop_steps()
        self.last_step_python_layers = self._fused_path  # until the layer loop is seen (a failed step)
        hidden = self.model(input_ids, pos, backend)  # [T, H]
        self.last_step_python_layers = self._fused_path and cpu_ops.layer_loop_steps() == loops_before
        if self.eviction is not None:
            self._add_scores(decodes, chunks, md[0])
        if self.collect_features:
            self.features = self._features(ordered, hidden)

        # plain rows first (their logits at the last position), then each verifying request's
        # k+1 rows: the logits after its last token and after each draft token
        verifying = {s.request_id for s in verify}
        plain: list[str] = []
        last_index: list[int] = []
        verify_index: dict[str, list[int]] = {rid: [] for rid in verifying}
        end = 0
        for s in ordered:
            end += len(s.token_ids)
            if s.request_id in verifying:
                verify_index[s.request_id].append(end - 1)
            elif s.sample:
                plain.append(s.request_id)
                last_index.append(end - 1)
        if not plain and not verify:
            return ModelRunnerOutput({})
        flat = last_index + [i for s in verify for i in verify_index[s.request_id]]
        index = torch.tensor(flat, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [N, V] fp32
        out = self._sample(plain, logits[: len(plain)], params) if plain else ModelRunnerOutput({})
        row = len(plain)
        for s in verify:
            self._verify(s, logits[row : row + s.num_draft_tokens + 1], params[s.request_id], out)
            row += s.num_draft_tokens + 1
            got = self.features.get(s.request_id) if self.collect_features else None
            if got is not None:  # rejected drafts' features are not the sequence's
                keep = out.num_accepted.get(s.request_id, -1) + 1
                self.features[s.request_id] = FeatureRows(got.start_position, got.rows[:keep])
        return out

    def fused_decode_rows(self) -> int:
        """Decode steps (one-token rows) of at most this many rows run on the fused CPU decode
        loop (0: none do): the layer loop's own limit (``cpu_ops.fused_decode_max_rows``: the
        ``auto`` dense copies' threshold, else no limit) where the attention side allows."""
        return cpu_ops.fused_decode_max_rows(self.model) if self._fused_attention else 0

    def fused_step_tokens(self) -> int:
        """Steps of at most this many tokens run on the fused CPU decode path, prompt chunks
        included (0: none do), as long as those chunks read at most ``CHUNK_ROWS_MAX_KEYS`` keys:
        ``CHUNK_ROWS_MAX`` or the decode loop's limit if narrower."""
        if not self.chunks_as_rows:
            return 0
        return min(CHUNK_ROWS_MAX, self.fused_decode_rows())

    def _chunks_as_rows(self, output: SchedulerOutput) -> bool:
        """Whether this step's prompt chunks run as one-token rows on the fused CPU decode path:
        a small step with a chunk over a short context (a short prompt, or a turn after a short
        cached prefix)."""
        if not (self.chunks_as_rows and self._fused_attention) or output.num_batched_tokens > CHUNK_ROWS_MAX:
            return False
        chunks = [s for s in output.scheduled if len(s.token_ids) > 1 and not s.num_draft_tokens]
        if not chunks:
            return False
        keys = sum(chunk_row_keys(len(s.token_ids), s.start_position) for s in chunks)
        return keys <= CHUNK_ROWS_MAX_KEYS and output.num_batched_tokens <= self.fused_step_tokens()

    def _features(self, ordered: list[ScheduledRequest], hidden: Tensor) -> dict[str, FeatureRows]:
        """Each request's rows of ``hidden`` (its rows are adjacent in ``ordered``), copied."""
        spans: dict[str, list[int]] = {}  # request id -> [first row, end row, first position]
        end = 0
        for s in ordered:
            n = len(s.token_ids)
            span = spans.get(s.request_id)
            if span is None:
                spans[s.request_id] = [end, end + n, s.start_position]
            else:
                span[1] = end + n
            end += n
        copy = hidden.detach().clone()  # one copy for all: the rows outlive this step
        return {rid: FeatureRows(pos, copy[a:b]) for rid, (a, b, pos) in spans.items()}

    def _verify(
        self, s: ScheduledRequest, logits: Tensor, params: SamplingParams, out: ModelRunnerOutput
    ) -> None:
        """Accept a prefix of ``s``'s draft tokens from its logits [k+1, V] and pick the token after
        them: exact match for greedy requests, rejection sampling with the request's own generator
        for sampled ones (drafts are deterministic: one-hot draft distributions)."""
        rid, drafts = s.request_id, s.token_ids[len(s.token_ids) - s.num_draft_tokens :]
        if not bool(logits.sum().isfinite()):
            out.errors[rid] = "the model produced NaN or inf logits for this request"
            return
        try:
            if params.greedy:
                best = logits.argmax(dim=-1).tolist()
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == best[accepted]:
                    accepted += 1
                token = best[accepted]
            else:
                if rid not in self._generators:
                    self._generators[rid] = params.make_generator(logits.device)
                probs = sampling.target_probs(logits, params)
                accepted, token = sampling.speculative_accept(probs, drafts, None, self._generators[rid])
        except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others
            log.warning("verifying drafts failed for request %s: %s", rid, exc)
            out.errors[rid] = f"sampling failed: {exc}"
            return
        out.sampled_token_ids[rid] = token
        out.num_accepted[rid] = accepted

    def _sample(
        self, request_ids: list[str], logits: Tensor, params: Mapping[str, SamplingParams]
    ) -> ModelRunnerOutput:
        tokens: dict[str, int] = {}
        errors: dict[str, str] = {}
        # One reduction per row: NaN or inf anywhere makes the row's sum non-finite.
        finite = logits.sum(dim=-1).isfinite().tolist()
        greedy_rows = [i for i, rid in enumerate(request_ids) if params[rid].greedy and finite[i]]
        if greedy_rows:
            rows = logits if len(greedy_rows) == len(request_ids) else logits[greedy_rows]
            picked = rows.argmax(dim=-1).tolist()
            for i, tok in zip(greedy_rows, picked, strict=True):
                tokens[request_ids[i]] = tok
        for i, rid in enumerate(request_ids):
            if not finite[i]:
                errors[rid] = "the model produced NaN or inf logits for this request"
                continue
            p = params[rid]
            if p.greedy:
                continue
            if rid not in self._generators:
                self._generators[rid] = p.make_generator(logits.device)
            try:
                tokens[rid] = sample_token(logits[i], p, self._generators[rid])
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others
                log.warning("sampling failed for request %s: %s", rid, exc)
                errors[rid] = f"sampling failed: {exc}"
        return ModelRunnerOutput(tokens, errors, _logprobs(request_ids, logits, tokens, params))


def logprobs_of(logits: Tensor) -> Tensor:
    """Log-softmax of fp32 logits [N, V] (the model's raw distribution, temperature 1)."""
    return torch.log_softmax(logits.float(), dim=-1)


def entropy_nats(logprobs: Tensor) -> Tensor:
    """Entropy of each row's distribution [N] from its log-probabilities [N, V]."""
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def _logprobs(
    request_ids: list[str],
    logits: Tensor,
    tokens: dict[str, int],
    params: Mapping[str, SamplingParams],
) -> dict[str, TokenLogprob]:
    """``TokenLogprob`` of the sampled token for the rows whose request asked for it (only
    those rows pay for the softmax)."""
    rows = [i for i, rid in enumerate(request_ids) if params[rid].logprobs and rid in tokens]
    if not rows:
        return {}
    lp = logprobs_of(logits[rows])  # [R, V]
    picked = torch.tensor([tokens[request_ids[i]] for i in rows], device=lp.device)
    chosen = lp.gather(1, picked[:, None]).squeeze(1).tolist()
    entropies = entropy_nats(lp).tolist()
    return {
        request_ids[i]: TokenLogprob(tokens[request_ids[i]], chosen[k], entropies[k])
        for k, i in enumerate(rows)
    }


def _cache_start(sr: ScheduledRequest) -> int:
    """Cache index of the chunk's first token: its position less the tokens evicted before it
    (kept keys are packed in order, so cache order is position order)."""
    return sr.start_position - sr.num_evicted_tokens


def _rotary_of(model: Transformer, group: KVGroupSpec) -> RotaryEmbedding:
    """The rotary embedding the layers of ``group`` use (Gemma 3's local layers have their own)."""
    layers = group.layers or range(model.config.num_layers)
    local = any(getattr(model.layers[i], "local_rope", False) for i in layers)
    return model.rotary_local if local and model.rotary_local is not None else model.rotary


def _layer_map(groups: tuple[KVGroupSpec, ...], num_layers: int) -> list[tuple[int, int]] | None:
    """Model layer -> (KV group, storage layer); None for one group that holds every layer."""
    if len(groups) == 1 and not groups[0].layers:
        return None
    out: dict[int, tuple[int, int]] = {}
    for g, spec in enumerate(groups):
        for slot, layer in enumerate(spec.layers):
            out[layer] = (g, slot)
    missing = [i for i in range(num_layers) if i not in out]
    if missing:
        raise ValueError(f"KV groups leave layers {missing} without a cache")
    return [out[i] for i in range(num_layers)]
