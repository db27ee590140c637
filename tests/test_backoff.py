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


def test_the_jitter_leaves_the_trainings_random_state_alone():
    """The backoff draws from the operating system, never from the process's shared
    ``random``: a seeded script draws the same numbers with TraceML, and two processes seeded
    alike still jitter apart."""
    import random

    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    waits = []
    for _ in range(2):
        random.seed(1234)  # two ranks seeded alike
        waits.append(Backoff(0.1, 1.0).next())
    assert waits[0] != waits[1]
    random.seed(1234)
    backoff = Backoff(0.1, 1.0)
    for _ in range(5):
        backoff.next()
    assert [random.random() for _ in range(3)] == expected
