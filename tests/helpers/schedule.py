"""The order in which the ``serial`` phase hands its tests to its xdist workers.

``tools/test.sh`` runs the ``serial`` tests (faults with a bound of seconds, mostly waiting on
their fault) on 4 workers, with ``--dist loadgroup`` and ``--no-loadscope-reorder``: xdist
then queues the work units (a test, or a group of tests that share a job) in collection
order, gives each worker two at the start (one running, one waiting) and another each time
one ends. In collection order the longest units came last, so the phase took as long as its
last long test after everything else (121-124 s on 2026-12-05 against ~85 s of work a worker).

:func:`snake` puts the units in the order that evens out the workers under that rule: the
``workers`` longest first (one each), the next ``workers`` in reverse (the longest of them
to the worker whose first unit is shortest), then the rest longest first. The seconds are
:data:`SERIAL_SECONDS`, measured; a test not named there counts as short.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

#: Wall seconds of the longest ``serial`` tests (node id without its group), measured in the
#: serial phase of ``tools/test.sh`` on this 2-core machine (2026-12-05: docs/testing.md).
SERIAL_SECONDS = {
    "tests/test_node_session.py::"
    "test_cut_session_is_lost_within_the_bound_then_resumes_with_nothing_lost": 55,
    "tests/test_telemetry_loss.py::"
    "test_a_partition_between_node_1_and_node_0_costs_training_nothing": 49,
    "tests/test_outage.py::test_a_paused_aggregator_costs_training_nothing_and_loses_nothing": 38,
    "tests/test_node_session.py::"
    "test_a_killed_launcher_on_node_1_is_lost_its_rank_stopped_and_nothing_is_lost[bound]": 35,
    # Added on 2026-12-07, measured that day.
    "tests/test_node_session.py::test_a_killed_launcher_on_node_1_is_lost_its_rank_stopped_and_"
    "nothing_is_lost[summary-first]": 28,
    "tests/test_fault_sequence.py::test_1_aggregator_sigkill_is_restarted_with_replay": 28,
    "tests/test_crashes.py::test_rank_death_on_node_1_ends_both_nodes": 26,
    "tests/test_telemetry_loss.py::"
    "test_ctrl_c_while_finalizing_against_a_stopped_aggregator_returns_within_seconds": 24,
    "tests/test_fault_sequence.py::test_3_sigterm_to_every_process": 14,
    "tests/test_node_claims.py::test_claims_over_node_sessions_and_the_run_failure_is_pushed": 12,
    "tests/test_fault_sequence.py::test_2_rank_sigsegv_on_the_same_port": 8,
    "tests/test_fault_sequence.py::test_4_plain_run_on_the_same_port": 7,
}


def snake(units: Sequence[T], seconds: Callable[[T], float], workers: int) -> list[T]:
    """``units`` in the order that evens out ``workers`` xdist workers that each hold two
    units at a time (see the module): the ``workers`` longest by ``seconds`` first, the next
    ``workers`` shortest first, then the rest longest first; units of equal seconds keep
    their order."""
    ranked = sorted(units, key=seconds, reverse=True)  # stable: equal ones keep their order
    first, second, rest = ranked[:workers], ranked[workers : 2 * workers], ranked[2 * workers :]
    return first + second[::-1] + rest
