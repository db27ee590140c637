"""The serial phase's order (tests/helpers/schedule.py): the snake over its workers, and the
measured table naming tests that exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import schedule

ROOT = Path(__file__).resolve().parent.parent


def test_snake_gives_each_worker_one_long_and_one_short_then_the_rest_longest_first():
    seconds = {"a": 57, "b": 55, "c": 49, "d": 38, "e": 35, "f": 26, "g": 24, "h": 12}
    units = ["h", "x", "a", "g", "b", "y", "c", "f", "d", "e"]  # x, y: not in the table
    order = schedule.snake(units, lambda u: seconds.get(u, 0), workers=4)
    # xdist hands units 1-4 to workers 1-4, then 5-8 to workers 1-4: 57+12, 55+24, 49+26, 38+35
    assert order == ["a", "b", "c", "d", "h", "g", "f", "e", "x", "y"]
    one_worker = schedule.snake(units, lambda u: seconds.get(u, 0), workers=1)
    assert one_worker == ["a", "b", "c", "d", "e", "f", "g", "h", "x", "y"]  # longest first


def test_the_serial_phase_starts_with_its_measured_longest_tests_in_snake_order():
    """Every test of the table is a collected ``serial`` test (a renamed one would silently
    count as short), and the phase's collection under 4 workers begins with the snake."""
    collect = ["--collect-only", "-q", "-m", "serial", "-p", "no:cacheprovider", "tests"]
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", *collect],
        cwd=ROOT,
        env={**os.environ, "PYTEST_XDIST_WORKER_COUNT": "4"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    ids = [line for line in listed if "::" in line]
    assert set(schedule.SERIAL_SECONDS) <= set(ids)
    fault_sequence = [i for i in ids if i.startswith("tests/test_fault_sequence.py::")]
    assert len(fault_sequence) == 4
    killed = "tests/test_node_session.py::test_a_killed_launcher_on_node_1_is_lost_its_rank_"
    assert ids[:12] == [
        *fault_sequence,  # one unit (a group of 4 on one port): 57 s
        "tests/test_node_session.py::"
        "test_cut_session_is_lost_within_the_bound_then_resumes_with_nothing_lost",
        "tests/test_telemetry_loss.py::test_a_partition_between_node_1_and_node_0_costs_training_nothing",
        "tests/test_outage.py::test_a_paused_aggregator_costs_training_nothing_and_loses_nothing",
        "tests/test_telemetry_loss.py::"
        "test_ctrl_c_while_finalizing_against_a_stopped_aggregator_returns_within_seconds",
        "tests/test_crashes.py::test_rank_death_on_node_1_ends_both_nodes",
        f"{killed}stopped_and_nothing_is_lost[summary-first]",
        f"{killed}stopped_and_nothing_is_lost[bound]",
        "tests/test_node_claims.py::test_claims_over_node_sessions_and_the_run_failure_is_pushed",
    ]
