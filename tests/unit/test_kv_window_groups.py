"""kv_window without a model: which KV groups get the window, where the sinks move, the range check."""

from __future__ import annotations

import pytest

from edge_rtgi.llm.kv.manager import KVGroupSpec
from edge_rtgi.llm.kv.window import KVWindow, sink_shift, windowed_groups


def test_groups_wider_than_the_window_get_it_with_the_sinks():
    window = KVWindow(sink_tokens=4, window_tokens=64)
    (one,) = windowed_groups((KVGroupSpec(),), window)
    assert (one.window_tokens, one.sink_tokens) == (64, 4)
    # Gemma-like: a global group and local groups with a narrower window of their own
    groups = (KVGroupSpec((5,)), KVGroupSpec((0, 1), 32), KVGroupSpec((2, 3), 512))
    out = windowed_groups(groups, window)
    assert [(g.layers, g.window_tokens, g.sink_tokens) for g in out] == [
        ((5,), 64, 4),
        ((0, 1), 32, 0),  # narrower than the window: the model's own, without sinks
        ((2, 3), 64, 4),
    ]
    assert windowed_groups(groups, None) == groups


def test_sinks_move_only_once_the_window_has_passed_them():
    # window 8, sinks 4: a query at p sees (p - 8, p] and positions 0..3
    assert [sink_shift(p, 8, 4) for p in (0, 7, 11, 12, 13, 100)] == [0, 0, 0, 1, 2, 89]
    # after the shift the last sink sits right before the window's first position
    p = 100
    assert 3 + sink_shift(p, 8, 4) == p - 8


def test_the_farthest_offset_must_stay_in_the_trained_range():
    KVWindow(4, 1024).check_positions(8192, 256)
    with pytest.raises(ValueError, match=r"allowed window_tokens: 5\.\.7933"):
        KVWindow(4, 8000).check_positions(8192, 256)
