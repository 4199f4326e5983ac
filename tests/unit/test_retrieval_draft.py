"""The ``retrieval`` draft's store: lookups equal a brute-force scan, proposals follow the majority
continuation and stop where they should, and store files are checked at load."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from edge_rtgi.errors import ModelFileError, ModelNotFoundError
from edge_rtgi.llm.engine import _catalogue_draft, build_speculator
from edge_rtgi.llm.request import Request
from edge_rtgi.llm.retrieval import ReplyStore, RetrievalDraft, read_reply_store, save_reply_store
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.speculative import NgramDraft, SpeculativeConfig
from edge_rtgi.llm.weights import load_model
from tests.tiny_models import make_tiny_hf_model

FINGERPRINT = "ab" * 32


def brute_force(replies: list[list[int]], context: list[int], min_n: int, max_n: int):
    """(n, sorted (reply, index after the match)) by scanning every reply; a match may end its
    reply (the index after it is then the reply's length)."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        suffix = context[-n:]
        hits = [
            (r, i + n)
            for r, reply in enumerate(replies)
            for i in range(len(reply) - n + 1)
            if reply[i : i + n] == suffix
        ]
        if hits:
            return n, sorted(hits)
    return 0, []


def test_longest_suffix_lookup_equals_a_brute_force_scan():
    rng = random.Random(0)
    replies = [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(40)]
    store = ReplyStore.of(replies, min_n=2, max_n=6)
    starts = np.cumsum([0] + [len(r) + 1 for r in replies])  # where each reply begins in the store
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
        n, positions = store.occurrences(context)
        want_n, want = brute_force(replies, context, 2, 6)
        reply_of = np.searchsorted(starts, positions, "right") - 1
        got = sorted(zip(reply_of.tolist(), (positions - starts[reply_of]).tolist(), strict=True))
        assert (n, got) == (want_n, want), context


def test_proposals_follow_the_majority_and_stop_when_unsure_or_at_a_reply_end():
    replies = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 9], [7, 1, 2]]
    draft = RetrievalDraft(ReplyStore.of(replies), min_confidence=0.5)

    def propose(tokens: list[int], k: int = 8) -> list[int]:
        return draft.propose(Request("r", tokens, SamplingParams()), k)

    # "1 2" is followed by 3 three times and ends the last reply once (3 of 4), then 4 in 2 of 3,
    # then 5 and 6 once each (a tie at 0.5: the lower id), then the reply ends
    assert propose([0, 1, 2]) == [3, 4, 5]
    assert propose([0, 1, 2], k=1) == [3]
    assert propose([3, 4]) == [5]
    strict = RetrievalDraft(ReplyStore.of(replies), min_confidence=0.6)
    assert strict.propose(Request("r", [0, 1, 2], SamplingParams()), 8) == [3, 4]
    assert strict.propose(Request("r", [3, 4], SamplingParams()), 8) == []
    assert propose([8, 8]) == []  # nothing matches
    assert propose([5]) == []  # shorter than min_n
    assert propose([9, 7]) == []  # no n-gram crosses the end of a reply
    # an n-gram that mostly ends replies: its one continuation has 1 of 3, too unsure
    ending = RetrievalDraft(ReplyStore.of([[5, 1, 2], [6, 1, 2], [1, 2, 9]]))
    assert ending.propose(Request("r", [0, 1, 2], SamplingParams()), 4) == []


def test_the_requests_own_text_comes_before_the_store():
    store = ReplyStore.of([[1, 2, 3, 4], [5, 6, 7]])
    draft = RetrievalDraft(store, own=NgramDraft())
    # "1 2" was followed by 9 in the request itself: prompt lookup's proposal wins
    assert draft.propose(Request("r", [1, 2, 9, 1, 2], SamplingParams()), 4) == [9, 1, 2, 9]
    # no match in the request: the store's continuation
    assert draft.propose(Request("q", [0, 5, 6], SamplingParams()), 4) == [7]
    assert RetrievalDraft(store).propose(Request("r", [1, 2, 9, 1, 2], SamplingParams()), 4) == [3, 4]
    # the engine's n-gram draft is the same instance: asked again for the same text, it answers
    # from memory, and a caller that changes the list it got changes nothing
    own = draft.own
    assert own is not None
    request = Request("r", [1, 2, 9, 1, 2], SamplingParams())
    first = own.propose(request, 4)
    first.append(0)
    assert own.propose(request, 4) == [9, 1, 2, 9] and own.propose(request, 2) == [9, 1]
    request.append_output_token(7)  # new text: a new proposal
    assert own.propose(request, 4) == []
    draft.release("r")
    draft.release("q")
    assert own._index == {} and own._last == {}


def test_store_files_round_trip_and_bad_files_are_refused(tmp_path):
    path = tmp_path / "replies.safetensors"
    save_reply_store(path, [[1, 2, 3], [4, 5]], {"target": "tiny", "tokenizer_sha256": FINGERPRINT})
    tokens, meta = read_reply_store(path)
    assert tokens.tolist() == [1, 2, 3, -1, 4, 5, -1] and meta["target"] == "tiny"
    draft = RetrievalDraft.from_file(path, FINGERPRINT, vocab_size=10)
    assert draft.propose(Request("r", [0, 1, 2], SamplingParams()), 4) == [3]

    with pytest.raises(ModelFileError, match="another tokenizer"):
        RetrievalDraft.from_file(path, "cd" * 32, vocab_size=10)
    with pytest.raises(ModelFileError, match="token ids this model does not have"):
        RetrievalDraft.from_file(path, FINGERPRINT, vocab_size=5)
    with pytest.raises(ModelFileError, match="does not exist"):
        read_reply_store(tmp_path / "missing.safetensors")
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ModelFileError, match="damaged"):
        read_reply_store(damaged)
    other = tmp_path / "other.safetensors"
    from safetensors.numpy import save_file

    save_file({"tokens": np.array([1, 2, -1], dtype=np.int32)}, str(other), metadata={"format": "x"})
    with pytest.raises(ModelFileError, match="not an edge-rtgi reply store"):
        read_reply_store(other)
    with pytest.raises(ValueError, match="meta needs tokenizer_sha256"):
        save_reply_store(path, [[1]], {"target": "tiny"})


def test_a_refused_store_turns_a_fixed_retrieval_setting_off_with_one_warning(tmp_path, caplog):
    tiny_loaded = load_model(
        make_tiny_hf_model("llama", tmp_path / "tiny", seed=3), device="cpu", dtype="fp32"
    )
    damaged = tmp_path / "replies.safetensors"
    damaged.write_bytes(b"not a store")
    spec = SpeculativeConfig("fixed", "retrieval", 4, draft_model=str(damaged))
    with caplog.at_level(logging.WARNING, logger="edge_rtgi.llm.engine"):
        built = build_speculator(spec, tiny_loaded.model, tiny_loaded.tokenizer, "tiny")
    assert built is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "reply store" in warnings[0] and "damaged" in warnings[0]
    # under auto a model without a store in the catalogue runs the n-gram draft, without a
    # warning; so does a model loaded under the name of one that has a store (from_loaded keeps
    # the config's model name), whose store is then refused for its tokenizer
    for name in ("tiny", "smollm2-135m-instruct"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="edge_rtgi.llm.engine"):
            auto = build_speculator(SpeculativeConfig("auto"), tiny_loaded.model, tiny_loaded.tokenizer, name)
        assert auto is not None and list(auto.policy.drafts) == ["ngram"]
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_catalogue_names_each_kind_of_draft_for_smollm2():
    assert _catalogue_draft("eagle", "smollm2-135m-instruct") == "smollm2-135m-instruct-eagle"
    assert _catalogue_draft("retrieval", "smollm2-135m-instruct") == "smollm2-135m-instruct-replies"
    with pytest.raises(ModelNotFoundError, match="no retrieval draft for 'tiny'"):
        _catalogue_draft("retrieval", "tiny")


def test_store_files_of_another_kind_are_refused_before_their_tensors_are_read(tmp_path):
    from safetensors.numpy import save_file

    floats = tmp_path / "floats.safetensors"
    save_file({"tokens": np.array([1.5, -1.0], dtype=np.float32)}, str(floats))
    with pytest.raises(ModelFileError, match="not an edge-rtgi reply store"):
        read_reply_store(floats)
    header = {"format": "edge-rtgi-reply-store", "version": "1", "meta": "{}"}
    save_file({"tokens": np.array([1.5, -1.0], dtype=np.float32)}, str(floats), metadata=header)
    with pytest.raises(ModelFileError, match="holds no token list"):
        read_reply_store(floats)
