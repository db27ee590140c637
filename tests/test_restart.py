"""A torchrun restart (``--max-restarts 1``): both attempts' telemetry is kept apart.

tests/scripts/fail_once.py: in attempt 0 both ranks trace 3 steps, then rank 1 raises and
torchrun restarts the worker group; in attempt 1 both trace 5 steps and exit 0. Every table
keys its rows by (rank, restart), so nothing of attempt 0 is overwritten or counted twice.
Each attempt joins a gloo process group, rank 1 late in attempt 1: under torchrun's shared
rendezvous store rank 0 would read attempt 0's address of rank 1 and fail (or hang) in
``init_process_group`` (``traceml.launcher.torchrun.UNSHARED_RDZV_STORE_ENV``).
"""

from __future__ import annotations

import pytest
from conftest import SCRIPTS, free_port, load_summary, query, run_traceml
from helpers.jobs import run_args

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

FIRST_STEPS, STEPS = 3, 5


@pytest.fixture(scope="module")
def restarted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    result = run_traceml(
        run_args(
            tmp,
            SCRIPTS / "fail_once.py",
            "restart",
            free_port(),
            "--max-restarts",
            "1",
            "--",
            "--first-steps",
            str(FIRST_STEPS),
            "--steps",
            str(STEPS),
        ),
        cwd=tmp,
        env={"TRACEML_FLUSH_INTERVAL_SEC": "0.2", "TRACEML_SAMPLE_INTERVAL_SEC": "0.2"},
    )
    assert result.returncode == 0, result.stderr
    return tmp / "logs" / "restart"


@pytest.mark.slow
def test_steps_of_each_attempt_kept_apart(restarted_run):
    counts = query(
        restarted_run,
        "SELECT rank, restart, COUNT(*), MIN(step), MAX(step) FROM steps "
        "GROUP BY rank, restart ORDER BY restart, rank",
    )
    assert counts == [
        (0, 0, FIRST_STEPS, 0, FIRST_STEPS - 1),
        (1, 0, FIRST_STEPS, 0, FIRST_STEPS - 1),
        (0, 1, STEPS, 0, STEPS - 1),
        (1, 1, STEPS, 0, STEPS - 1),
    ]


@pytest.mark.slow
def test_identities_and_finishes_per_attempt(restarted_run):
    ranks = query(restarted_run, "SELECT rank, restart, pid FROM ranks ORDER BY restart, rank")
    assert [(r, a) for r, a, _ in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert len({pid for _, _, pid in ranks}) == 4  # new processes for the second attempt
    finishes = query(
        restarted_run,
        "SELECT rank, restart, steps_completed, end_state FROM rank_finish ORDER BY restart, rank",
    )
    # Rank 0 of attempt 0 was stopped by torchrun (SIGTERM): its handler sent what it had and
    # a finish marker saying so (traceml/sdk/sigterm.py) before it died of the signal.
    assert finishes == [
        (0, 0, FIRST_STEPS, "signaled"),
        (1, 0, FIRST_STEPS, "failed"),
        (0, 1, STEPS, "completed"),
        (1, 1, STEPS, "completed"),
    ]


@pytest.mark.slow
def test_process_samples_name_their_attempt(restarted_run):
    attempts = query(
        restarted_run,
        "SELECT DISTINCT rank, restart FROM process_samples ORDER BY restart, rank",
    )
    assert attempts == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.slow
def test_summary_counts_the_last_attempt_once(restarted_run):
    summary = load_summary(restarted_run)
    for rank in summary["ranks"]:
        assert rank["restart"] == 1
        assert rank["steps_completed"] == STEPS
        assert rank["earlier_attempts"] == {"0": FIRST_STEPS}
