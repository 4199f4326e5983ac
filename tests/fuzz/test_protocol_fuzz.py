"""Protocol fuzzing (issue #18): hostile frame batches for the native protocol and
``/v1/realtime`` against a light daemon on loopback. Each batch must end with the connection
usable (the protocol's marker answered) or cleanly closed; the daemon logs no error or
traceback, a bystander session is unaffected, and valid requests still work afterwards.

CI runs a couple of hundred batches per protocol; ``scripts/fuzz.py`` runs tens of thousands.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.harness import FuzzClient, Outcome, ThreadedDaemon
from tests.fuzz.strategies import native_frames, realtime_frames

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples on every CI run; scripts/fuzz.py explores
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    daemon = ThreadedDaemon(tmp_path_factory.mktemp("fuzz"))
    yield daemon
    daemon.close()


@pytest.mark.parametrize("protocol", ["native", "realtime"])
def test_fuzzed_frames_never_hurt_the_daemon(fuzzed, protocol):
    bystander = FuzzClient(fuzzed.port, "native")
    quiet = Outcome()
    bystander.send_batch([], quiet)
    client = FuzzClient(fuzzed.port, protocol)
    outcome = Outcome()
    strategy = native_frames if protocol == "native" else realtime_frames

    @FUZZ
    @given(frames=strategy)
    def batch(frames):
        client.send_batch(frames, outcome)
        assert outcome.ok(), (frames, outcome)

    batch()
    bystander.send_batch([], quiet)  # the other session never noticed
    assert quiet.ok() and quiet.clean_closes == 0 and quiet.error_events == 0
    assert outcome.frames >= 120 and outcome.error_events > 0
    assert client.turn_works(), "a valid request after the fuzzing"
    client.close()
    bystander.close()
    assert fuzzed.errors() == []
