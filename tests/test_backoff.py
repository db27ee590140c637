"""The reconnect backoff (traceml.core.backoff) that a rank's sender and a node's session share."""

from __future__ import annotations

from traceml.core.backoff import Backoff


def test_waits_double_to_the_bound_jittered_and_start_again_after_a_success():
    backoff = Backoff(0.1, 1.0)
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for step in steps:
        wait = backoff.next()
        assert step / 2 <= wait <= step
    backoff.reset()
    assert 0.05 <= backoff.next() <= 0.1
    waits = {Backoff(0.1, 1.0).next() for _ in range(50)}
    assert len(waits) > 40  # jittered: senders that failed together do not retry in lockstep
