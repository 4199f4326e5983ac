"""``release_cpu_workers`` frees the calling thread's OpenMP worker pool (and only that).

Checked through the process's thread count, not timing: a thread that runs a parallel torch op
with 2 threads gets a pool with one worker thread; releasing it ends that worker."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from edge_rtgi.device import release_cpu_workers

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_threads(expected: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while _threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


def test_release_ends_the_calling_threads_openmp_workers():
    if not release_cpu_workers():
        pytest.skip("torch's OpenMP runtime has no omp_pause_resource_all here")
    counts: dict[str, int] = {}
    done = threading.Event()

    def worker() -> None:
        torch.set_num_threads(2)
        a = torch.randn(1 << 18)
        counts["before"] = _threads()
        torch.add(a, a, out=a)  # large enough to run in parallel: this thread gets a pool
        counts["with_pool"] = _threads()
        assert release_cpu_workers()
        counts["released"] = _settled_threads(counts["before"])
        torch.add(a, a, out=a)  # a later parallel op makes a new pool
        counts["again"] = _threads()
        release_cpu_workers()
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(30)
    assert done.is_set()
    assert counts["with_pool"] > counts["before"]
    assert counts["released"] == counts["before"]
    assert counts["again"] > counts["before"]
