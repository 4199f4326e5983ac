"""scripts/bench_kernel_ab.py: a baseline kernel library loads beside the working tree's and stands in."""

from __future__ import annotations

import shutil

import pytest
import torch

from edge_rtgi.llm import cpu_ops
from tests.scripts import ROOT, load_script


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
def test_the_base_library_runs_under_its_own_namespace_and_swaps_in():
    assert cpu_ops.load(), cpu_ops.failure()
    ab = load_script("bench_kernel_ab")
    base_ops, commit = ab.build_base("HEAD")
    assert commit and base_ops.build_info() == cpu_ops.build_info()
    x, weight = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    qweight, scales = torch.randint(-128, 127, (32, 64), dtype=torch.int8), torch.rand(32).bfloat16()
    want = cpu_ops.rms_norm(x, weight, 1e-5), cpu_ops.int8_mm(x, qweight, scales)
    tree = cpu_ops._ops
    # each library counts its own int8_mm / int4_mm calls: the swap must route the calls
    base_calls, tree_calls = base_ops.multi_row_calls(), tree.multi_row_calls()
    try:
        cpu_ops._ops = base_ops
        got = cpu_ops.rms_norm(x, weight, 1e-5), cpu_ops.int8_mm(x, qweight, scales)
    finally:
        cpu_ops._ops = tree
    assert base_ops.multi_row_calls() == base_calls + 1 and tree.multi_row_calls() == tree_calls
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
