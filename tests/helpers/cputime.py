"""CPU seconds per test, children included: the figure that says what a test costs on a
loaded machine (wall time grows with the load; CPU seconds barely do).

``pytest --cpu-times=N`` (tests/conftest.py) measures each test from its setup to the end of
its teardown: this process's user + system time (:data:`resource.RUSAGE_SELF`, the gRPC and
pytest threads included) plus that of every child it waited for
(:data:`resource.RUSAGE_CHILDREN`: a child's figure holds the children it waited for in
turn, so ``traceml run`` carries torchrun's, its ranks' and its aggregator's). A module or
session fixture's job counts in the test that made it. Not counted: a process no waiting
parent reaped (an orphan re-parented to init) and one still running at the end of the
teardown (it counts in the test that reaps it).

The figure travels as the test's ``user_properties`` entry ``cpu_s`` (seconds), so xdist's
workers hand it to the controller, which prints the N heaviest tests and the total at the
end, and ``--junitxml`` keeps it (``tools/slowest_tests.py``).
"""

from __future__ import annotations

import resource

#: The ``user_properties`` name of a test's CPU seconds.
PROPERTY = "cpu_s"


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children, so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def table(figures: list[tuple[float, str]], n: int) -> list[str]:
    """The lines of the ``n`` heaviest of ``figures`` (CPU seconds, test id), heaviest first,
    under a header with the number of tests and their summed CPU seconds."""
    ranked = sorted(figures, reverse=True)
    header = (
        f"===== heaviest {min(n, len(ranked))} of {len(ranked)} tests by CPU seconds, "
        f"children included (summed: {sum(s for s, _ in ranked):.0f} s) ====="
    )
    lines = [header]
    lines += [f"{seconds:8.2f}s  {name}" for seconds, name in ranked[:n]]
    return lines
