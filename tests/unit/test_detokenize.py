"""IncrementalDetokenizer and StopStringMatcher on real tokenizers (no model)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers

from edge_rtgi.llm.detokenize import IncrementalDetokenizer, StopStringMatcher
from edge_rtgi.llm.tokenizer import Tokenizer
from tests.tiny_models import make_tiny_tokenizer

TEXTS = [
    "Hello world, how are you?",
    "Caf\u00e9 na\u00efve \u00fcber se\u00f1or",
    "\u65e5\u672c\u8a9e\u3068\u4e2d\u6587",
    "emoji \U0001f600\U0001f680 and a family \U0001f468\u200d\U0001f469\u200d\U0001f467 end",
    "  leading spaces\n\nand\tnewlines  ",
]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory) -> Tokenizer:
    backend = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return Tokenizer(backend=backend, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def sentencepiece_like() -> Tokenizer:
    """A Llama-2-style tokenizer: Metaspace, byte fallback, and a decoder that strips the first space."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for ch in "\u2581abcdefghijklmnopqrstuvwxyzHW,.?":
        vocab.setdefault(ch, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(backend=backend)


def stream(tok: Tokenizer, prompt: list[int], generated: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(t) for t in generated]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_stream_equals_full_decode_and_never_splits_chars(byte_bpe, text):
    prompt = byte_bpe.encode("Say:")
    generated = byte_bpe.encode(" " + text)
    deltas = stream(byte_bpe, prompt, generated)
    assert "".join(deltas) == byte_bpe.decode(prompt + generated)[len(byte_bpe.decode(prompt)) :]
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_is_really_split_across_byte_tokens(byte_bpe):
    # Guards the test above: the emoji must need several tokens, or nothing was exercised.
    ids = byte_bpe.encode("\U0001f680")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(byte_bpe)
    assert [detok.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "\U0001f680"


def test_byte_fallback_and_leading_space_with_prompt_context(sentencepiece_like):
    tok = sentencepiece_like
    prompt = tok.encode("Hello")
    generated = tok.encode("Hello world \U0001f600 ok?")[len(prompt) :]
    assert len([t for t in generated if 1 <= t <= 256]) == 4  # the emoji is four byte-fallback tokens
    deltas = stream(tok, prompt, generated)
    assert "".join(deltas) == " world \U0001f600 ok?"
    assert deltas[0] == " "  # the space survives although the decoder strips a leading one
    assert all("\ufffd" not in d for d in deltas)


def test_without_prompt_matches_full_decode(sentencepiece_like):
    tok = sentencepiece_like
    ids = tok.encode("Hello world")
    assert "".join(stream(tok, [], ids)) == tok.decode(ids) == "Hello world"


def test_unfinished_character_is_flushed_as_replacement(byte_bpe):
    ids = byte_bpe.encode("\U0001f680")
    detok = IncrementalDetokenizer(byte_bpe, byte_bpe.encode("x"))
    assert detok.push(ids[0]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped(byte_bpe):
    end = byte_bpe.token_to_id("<|im_end|>")
    ids = byte_bpe.encode("ok")
    assert "".join(stream(byte_bpe, [], [*ids, end])) == "ok"


# --- stop strings ----------------------------------------------------------------------------


def run_matcher(stops, pieces):
    m = StopStringMatcher(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return out, hit


def test_stop_string_inside_one_piece():
    out, hit = run_matcher(("STOP",), ["abc STOP def"])
    assert hit and "".join(out) == "abc "


def test_stop_string_split_across_pieces_is_never_emitted():
    out, hit = run_matcher(("</s>",), ["Hello <", "/", "s", "> after"])
    assert hit and out == ["Hello ", "", "", ""]


def test_partial_match_that_fails_is_released():
    out, hit = run_matcher(("\n\n",), ["line\n", "next", " more\n"])
    assert not hit
    assert out == ["line", "\nnext", " more", "\n"]


def test_earliest_of_several_stops_wins():
    out, hit = run_matcher(("world", "lo w"), ["hello world"])
    assert hit and out == ["hel"]


def test_no_stops_passes_text_through():
    out, hit = run_matcher((), ["a", "b"])
    assert not hit and out == ["a", "b", ""]


def test_after_stop_nothing_more_comes_out():
    m = StopStringMatcher(("x",))
    assert m.push("axb") == ("a", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""
