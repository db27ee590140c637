"""Waiting on a condition with a deadline: the tests never sleep a fixed time for an event."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Deadline of a call whose answer waits on the aggregator's live analysis (a Summarize, a
#: dashboard frame) or on a loaded aggregator, s: the analysis process runs at nice 19
#: (traceml_aggregator/live/analysis_process.py), so on a saturated machine it starts, and answers,
#: late. A test asserts the answer, never how soon it came, unless it is ``serial`` or ``alone``.
LOADED_CALL_S = 120.0


def wait_for(
    condition: Callable[[], T],
    timeout_s: float = 30.0,
    what: str = "the condition",
    *,
    poll_s: float = 0.02,
) -> T:
    """Call ``condition`` every ``poll_s`` seconds until it returns a true value, and return
    that value; raises AssertionError naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
