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


def test_the_crash_headline_names_the_first_failure_in_time():
    """Rank 2 (node 1) was killed by SIGSEGV; ranks 0 and 1 raised afterwards when their
    all-reduce lost its peer. The headline names rank 2, not the lowest failed rank."""
    from traceml.analysis.health import findings, last_seen_us
    from traceml.analysis.rundata import RunData, StepColumns
    from traceml.analysis.summary import rank_summary

    def failed(r: int, finish_us: int) -> RankData:
        return RankData(
            rank=r,
            end={"end_state": "failed", "exit_code": 1, "signal": None, "reason": "gloo: peer"},
            finish={"end_state": "failed", "reason": "RuntimeError: peer closed",
                    "received_unix_us": finish_us, "steps_completed": 5},
        )

    segv = RankData(
        rank=2,
        identity={"start_unix_us": 1_000_000_000},
        steps=StepColumns.from_dicts([{"step": 4, "end_us": 5_000_000, "step_us": 900_000}]),
        end={"end_state": "signaled", "exit_code": None, "signal": 11, "reason": None},
        process_samples=[
            {"unix_us": t, "cpu_percent": 90.0, "rss_bytes": 1 << 30,
             "gpu_allocated_bytes": None, "gpu_reserved_bytes": None}
            for t in (1_004_000_000, 1_005_200_000)
        ],
    )
    ranks = {0: failed(0, 1_007_000_000), 1: failed(1, 1_006_500_000), 2: segv}
    assert [last_seen_us(ranks[r]) for r in (0, 1, 2)] == [1_007_000_000, 1_006_500_000,
                                                         1_005_200_000]
    run = RunData("r", 3, ranks, {}, {}, {}, [])
    summaries = [
        rank_summary(rd, None, missing=set(), live=False, gpu_totals={}, span=None)
        for rd in ranks.values()
    ]
    crash = next(f for f in findings(run, summaries, live=False) if f.kind == "RANK_CRASHED")
    assert crash.summary == "Ranks 0, 1, 2 failed; rank 2 ended with signal 11."
    assert [r["rank"] for r in crash.evidence["ranks"]] == [2, 1, 0]


def test_last_seen_falls_back_to_the_end_of_the_last_stored_step():
    """Without a finish marker or a process sample, a rank was last seen at the end of its
    last stored step: its start plus that step's ``end_us`` (the last of the column)."""
    from traceml.analysis.health import last_seen_us
    from traceml.analysis.rundata import StepColumns

    steps = StepColumns.from_dicts(
        [{"step": i, "end_us": 1_000_000 * (i + 1), "step_us": 1_000_000} for i in range(3)]
    )
    rd = RankData(rank=0, identity={"start_unix_us": 5_000_000}, steps=steps)
    assert last_seen_us(rd) == 8_000_000
    assert last_seen_us(RankData(rank=1, steps=steps)) == float("inf")
