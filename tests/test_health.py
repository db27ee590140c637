"""How a rank's end state is decided from its two witnesses (launcher and finish marker)."""

from traceml.analysis.health import end_state
from traceml.analysis.rundata import RankData


def _rank(end=None, finish=None) -> RankData:
    return RankData(rank=1, end=end, finish=finish)


def test_launcher_failure_beats_the_ranks_own_completed_marker():
    # sys.exit(7) after the finish marker: only the launcher sees the code.
    rd = _rank(
        end={"end_state": "failed", "exit_code": 7, "signal": None, "reason": None},
        finish={"end_state": "completed", "reason": None},
    )
    assert end_state(rd, set()) == {"state": "failed", "exit_code": 7, "signal": None, "reason": None}


def test_bare_terminated_does_not_hide_a_completed_finish():
    # torchrun stopped as a whole (SIGTERM) leaves no per-rank record.
    rd = _rank(
        end={"end_state": "terminated", "exit_code": None, "signal": None, "reason": None},
        finish={"end_state": "completed", "reason": None},
    )
    assert end_state(rd, set())["state"] == "completed"


def test_terminated_with_a_signal_stays_terminated():
    rd = _rank(
        end={"end_state": "terminated", "exit_code": None, "signal": 15, "reason": None},
        finish={"end_state": "completed", "reason": None},
    )
    assert end_state(rd, set())["state"] == "terminated"


def test_no_witness_is_running_when_given_up_on_else_never_reported():
    assert end_state(_rank(), {1})["state"] == "running"
    assert end_state(_rank(), set())["state"] == "never_reported"
