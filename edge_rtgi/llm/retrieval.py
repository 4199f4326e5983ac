"""The ``retrieval`` draft: continuations from a store of the target's own replies.

Prompt lookup (``NgramDraft``) finds only what the request itself has said. A small model also
repeats itself *across* requests: the same openings ("Sure! Here is"), the same turns of phrase,
the same code idioms. This draft looks the request's last tokens up in a store of the target's
greedy replies to a prompt corpus (``scripts/build_reply_store.py``) and proposes what followed
them there: retrieval-based speculation after REST (He et al., 2024) and SuffixDecoding (Oliaro
et al., 2024), with the target's own outputs as the datastore.

Lookup: the longest suffix of the request (``max_n`` down to ``min_n`` tokens) that occurs in
the store; then, token by token, the continuation most of its occurrences share. A token's
confidence is that share; drafting stops below ``min_confidence`` (dynamic k), at the end of a
reply, or when the occurrences run out. The index is numpy: per n-gram length, the sorted
64-bit hashes of every n-gram in the store and the position after each, so one lookup is a
binary search. No torch, no model run (its cost and memory: docs/engine.md).

The store file (safetensors) holds the replies' token ids and, in its header, the sha256 of the
tokenizer they were made with (``tokenizer_fingerprint``), so a store made for another model is
refused at load.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_rtgi.errors import ModelFileError
from edge_rtgi.llm.request import Request
from edge_rtgi.llm.speculative import NgramDraft

STORE_FORMAT = "edge-rtgi-reply-store"
STORE_FORMAT_VERSION = 1
_SEPARATOR = -1  # between replies: no n-gram and no continuation crosses it
_HASH_BASE = 1_000_003
_HASH_MASK = (1 << 64) - 1
# Occurrences below which a continuation is walked in plain Python (numpy's per-call cost dominates)
_FEW_OCCURRENCES = 64


class StoreMismatchError(ModelFileError):
    """A sound store file made for another model (its tokenizer or vocabulary differ)."""


def _hash(tokens: Sequence[int]) -> int:
    """The polynomial hash the index uses, in Python integers (numpy's uint64 wraps the same)."""
    h = 0
    for t in tokens:
        h = (h * _HASH_BASE + t + 1) & _HASH_MASK
    return h


@dataclass(frozen=True)
class _NgramTable:
    """Every n-gram of one length in the store: sorted hashes, and the position after each."""

    hashes: np.ndarray  # uint64, sorted
    next_positions: np.ndarray  # int32, same order


def join_replies(replies: Sequence[Sequence[int]]) -> np.ndarray:
    """Replies' token ids as one int64 array, each reply followed by the separator (-1)."""
    flat: list[int] = []
    for reply in replies:
        flat += [*reply, _SEPARATOR]
    return np.asarray(flat or [_SEPARATOR], dtype=np.int64)


class ReplyStore:
    """Token sequences (the target's replies) indexed for longest-suffix lookup. ``tokens``:
    the replies joined, each ending with -1 (``join_replies``; ``ReplyStore.of`` does both)."""

    def __init__(self, tokens: np.ndarray, min_n: int = 2, max_n: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or not len(tokens) or tokens[-1] != _SEPARATOR or (tokens < _SEPARATOR).any():
            raise ValueError("tokens must be token ids >= 0 in replies that each end with -1")
        self.min_n, self.max_n = min_n, max_n
        self.tokens = tokens
        self._tables = self._build()

    @classmethod
    def of(cls, replies: Sequence[Sequence[int]], min_n: int = 2, max_n: int = 8) -> ReplyStore:
        """A store of ``replies`` (token id lists)."""
        return cls(join_replies(replies), min_n, max_n)

    def _build(self) -> dict[int, _NgramTable]:
        tokens = self.tokens
        length = len(tokens)
        is_token = tokens >= 0
        shifted = (tokens + 1).astype(np.uint64)  # + 1 as in _hash
        # h[i], ok[i]: hash of the n-gram tokens[i-n:i], and whether it holds no separator
        h = np.zeros(length, dtype=np.uint64)
        ok = np.ones(length, dtype=bool)
        tables: dict[int, _NgramTable] = {}
        with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 on purpose
            for n in range(1, self.max_n + 1):
                nh = np.zeros(length, dtype=np.uint64)
                nok = np.zeros(length, dtype=bool)
                nh[n:] = h[n - 1 : -1] * np.uint64(_HASH_BASE) + shifted[n - 1 : -1]
                nok[n:] = ok[n - 1 : -1] & is_token[n - 1 : -1]
                h, ok = nh, nok
                if n >= self.min_n:
                    # every n-gram, also one that ends a reply: its end counts against the
                    # confidence of what followed the others (continue_from)
                    positions = np.flatnonzero(ok)
                    order = np.argsort(h[positions], kind="stable")
                    tables[n] = _NgramTable(h[positions][order], positions[order].astype(np.int32))
        return tables

    def occurrences(self, context: Sequence[int]) -> tuple[int, np.ndarray]:
        """(n, positions): the longest suffix of ``context`` (``max_n`` down to ``min_n``
        tokens) found in the store, and the position after each of its occurrences; (0, empty)
        when none is."""
        longest = min(self.max_n, len(context))
        # the hashes of every suffix in one pass: h(t[-n:]) = (t[-n] + 1) * B^(n-1) + h(t[-n+1:])
        suffix_hashes, h, power = [0] * (longest + 1), 0, 1
        for n in range(1, longest + 1):
            h = (h + (context[-n] + 1) * power) & _HASH_MASK
            power = (power * _HASH_BASE) & _HASH_MASK
            suffix_hashes[n] = h
        # A suffix that occurs has every shorter suffix occurring too (inside the same n-gram), so
        # the longest one is found by bisecting on n: about 3 lookups instead of up to 7.
        found: tuple[int, int, int] | None = None  # (n, lo, hi) of the longest suffix seen so far
        low, high = self.min_n, longest
        while low <= high:
            n = (low + high) // 2
            table = self._tables[n]
            key = np.uint64(suffix_hashes[n])
            lo = int(np.searchsorted(table.hashes, key, "left"))
            if lo < len(table.hashes) and table.hashes[lo] == key:
                found = (n, lo, int(np.searchsorted(table.hashes, key, "right")))
                low = n + 1
            else:
                high = n - 1
        if found is None:
            return 0, np.empty(0, dtype=np.int32)
        n, lo, hi = found
        return n, self._tables[n].next_positions[lo:hi]

    def continue_from(self, positions: np.ndarray, k: int, min_confidence: float) -> list[int]:
        """Up to ``k`` tokens that most of the occurrences ending at ``positions`` share next (ties:
        the smallest token id)."""
        out: list[int] = []
        while len(out) < k and len(positions) > _FEW_OCCURRENCES:
            following = self.tokens[positions]
            values, counts = np.unique(following, return_counts=True)
            best = int(counts.argmax())
            token = int(values[best])
            if token == _SEPARATOR or counts[best] / len(following) < min_confidence:
                return out
            out.append(token)
            positions = positions[following == token] + 1
        if len(out) == k or not len(positions):
            return out
        # Few occurrences left: their next tokens read in one gather and walked in plain Python,
        # where numpy's per-call cost would be most of the work. A window running past the store's
        # end reads its last token, the separator that ended that occurrence before it.
        width = k - len(out)
        index = np.minimum(positions[:, None] + np.arange(width), len(self.tokens) - 1)
        alive = self.tokens[index].tolist()
        for j in range(width):
            if len(alive) == 1:  # one occurrence: its own continuation, to its reply's end
                for token in alive[0][j:]:
                    if token == _SEPARATOR:
                        break
                    out.append(token)
                break
            tally = Counter(row[j] for row in alive)
            top = max(tally.values())
            token = min(t for t, c in tally.items() if c == top)
            if token == _SEPARATOR or top / len(alive) < min_confidence:
                break
            out.append(token)
            alive = [row for row in alive if row[j] == token]
        return out


class RetrievalDraft:
    """Proposes what followed the request's longest matching suffix in a ``ReplyStore``.

    As in SuffixDecoding, which keeps one suffix tree per request and one over earlier outputs,
    the request's own tokens come first: where prompt lookup (``own``, an ``NgramDraft``)
    proposes, that is the proposal, and the store is asked where it has nothing. The request's
    own text predicts its continuation better where it matches (a name being copied, a question
    being echoed), the store covers the rest. ``own=None``: the store alone.
    """

    name = "retrieval"

    def __init__(self, store: ReplyStore, min_confidence: float = 0.5, own: NgramDraft | None = None):
        self.store = store
        self.min_confidence = min_confidence
        self.own = own

    def propose(self, request: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        if self.own is not None:
            proposal = self.own.propose(request, k)
            if proposal:
                return proposal
        context = request.all_token_ids[-self.store.max_n :]
        _, positions = self.store.occurrences(context)
        return self.store.continue_from(positions, k, self.min_confidence)

    def release(self, request_id: str) -> None:
        if self.own is not None:
            self.own.release(request_id)

    @classmethod
    def from_file(
        cls, path: Path, tokenizer_sha256: str, vocab_size: int, own: NgramDraft | None = None
    ) -> RetrievalDraft:
        """Load a store file made with the tokenizer of fingerprint ``tokenizer_sha256``;
        ModelFileError with the reason otherwise. ``own``: as in the constructor."""
        tokens, meta = read_reply_store(path)
        if meta.get("tokenizer_sha256") != tokenizer_sha256:
            raise StoreMismatchError(
                f"reply store {path} was made with another tokenizer (for {meta.get('target')!r})",
                hint="use the store made for this model, or build one with scripts/build_reply_store.py",
            )
        if len(tokens) and int(tokens.max()) >= vocab_size:
            raise StoreMismatchError(
                f"reply store {path} holds token ids this model does not have", hint="build it again"
            )
        return cls(ReplyStore(tokens), own=own)


def save_reply_store(path: Path, replies: Sequence[Sequence[int]], meta: dict[str, object]) -> None:
    """Write ``replies`` (token ids) with ``meta`` (must hold ``tokenizer_sha256`` and
    ``target``) as a store file."""
    from safetensors.numpy import save_file

    missing = {"tokenizer_sha256", "target"} - set(meta)
    if missing:
        raise ValueError(f"meta needs {', '.join(sorted(missing))}")
    header = {"format": STORE_FORMAT, "version": str(STORE_FORMAT_VERSION), "meta": json.dumps(meta)}
    save_file({"tokens": join_replies(replies).astype(np.int32)}, str(path), metadata=header)


def read_reply_store(path: Path) -> tuple[np.ndarray, dict[str, object]]:
    """The store's token ids (replies joined by -1) and its header's meta. ModelFileError when
    the file is missing, not a store, or damaged."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ModelFileError(
            f"reply store {path} does not exist",
            hint="run scripts/build_reply_store.py or edge-rtgi models pull",
        )
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata() or {}
            if header.get("format") != STORE_FORMAT or header.get("version") != str(STORE_FORMAT_VERSION):
                raise ModelFileError(
                    f"{path} is not an edge-rtgi reply store of version {STORE_FORMAT_VERSION} "
                    f"(format {header.get('format')!r}, version {header.get('version')!r})",
                    hint="build one with scripts/build_reply_store.py",
                )
            tokens = f.get_tensor("tokens") if "tokens" in f.keys() else None
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        raise ModelFileError(
            f"reply store {path} is damaged or not a safetensors file: {exc}",
            hint="delete it and pull or build it again",
        ) from exc
    try:
        meta = json.loads(header.get("meta", "{}"))
    except ValueError as exc:
        raise ModelFileError(
            f"reply store {path} has a malformed header: {exc}", hint="build it again"
        ) from exc
    if (
        tokens is None
        or tokens.ndim != 1
        or not np.issubdtype(tokens.dtype, np.integer)
        or not isinstance(meta, dict)
    ):
        raise ModelFileError(f"reply store {path} holds no token list", hint="build it again")
    if not len(tokens) or int(tokens.min()) < _SEPARATOR or tokens[-1] != _SEPARATOR:
        raise ModelFileError(f"reply store {path} holds a malformed token list", hint="build it again")
    return tokens.astype(np.int64), meta
