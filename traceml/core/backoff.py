"""The wait before a sender opens its connection to the aggregator again: exponential, jittered.

A rank's sender (:mod:`traceml.sdk.client`) and a node launcher's session
(:mod:`traceml.launcher.session`) both reconnect this way when node 0's aggregator is away (a
restart, a partition). The jitter keeps the thousands of senders of a run that lost the
aggregator together from coming back in lockstep.
"""

from __future__ import annotations

import random

#: The jitter's random source: the operating system's (``os.urandom`` at each draw), never the
#: process's shared ``random`` state, which training seeds and uses: a script draws the same
#: numbers with and without TraceML, and ranks seeded alike still jitter apart.
_JITTER = random.SystemRandom()


class Backoff:
    """Waits that double from ``first_s`` to at most ``max_s`` (s), one step per failed
    attempt; each wait is drawn uniformly between half its step and the whole step.

    Args:
        first_s: the first step, s (> 0).
        max_s: the largest step, s (>= first_s).
    """

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._step = 0.0

    def reset(self) -> None:
        """After a success: the next failure waits about ``first_s`` again."""
        self._step = 0.0

    def next(self) -> float:
        """The wait before the next attempt, s (in ``[step / 2, step]``)."""
        self._step = min(2 * self._step, self.max_s) if self._step else self.first_s
        return self._step * _JITTER.uniform(0.5, 1.0)
