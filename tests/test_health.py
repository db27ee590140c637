"""How a rank's end state is decided from its two witnesses (launcher and finish marker)."""

from dataclasses import replace

from rundata_factory import finish_marker, identity, rank_end

from traceml.analysis.health import end_state
from traceml.analysis.rundata import RankData


def _rank(end=None, finish=None) -> RankData:
    """Rank 1 with its launcher's ``end`` and its own ``finish`` (their fields, None: none)."""
    return RankData(
        rank=1,
        end=rank_end(1, **end) if end else None,
        finish=finish_marker(1, 0, **finish) if finish else None,
    )


def test_launcher_failure_beats_the_ranks_own_completed_marker():
    # sys.exit(7) after the finish marker: only the launcher sees the code.
    rd = _rank(
        end={"end_state": "failed", "exit_code": 7, "signal": None, "reason": None},
        finish={"end_state": "completed", "reason": None},
    )
    assert end_state(rd, set()) == {
        "state": "failed",
        "exit_code": 7,
        "signal": None,
        "reason": None,
    }


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


def test_no_witness_is_running_when_given_up_on_after_it_reported_else_never_reported():
    """A rank without an end that finalization gave up on is ``running`` when anything of it
    came (its identity here), ``never_reported`` when nothing did (its node never connected,
    or its torchrun never started it), as is one finalization did not wait for."""
    heard = replace(_rank(), identity=identity(1))
    assert end_state(heard, {1})["state"] == "running"
    assert end_state(_rank(), {1})["state"] == "never_reported"
    assert end_state(_rank(), set())["state"] == "never_reported"
    assert end_state(_rank(), {1}, live=True)["state"] == "running"


def test_the_crash_headline_names_the_first_failure_in_time():
    """Rank 2 (node 1) was killed by SIGSEGV; ranks 0 and 1 raised afterwards when their
    all-reduce lost its peer. The headline names rank 2, not the lowest failed rank."""
    from traceml.analysis.health import findings, last_seen_us
    from traceml.analysis.rundata import RunData, StepTable
    from traceml.analysis.summary import rank_summary

    def failed(r: int, finish_us: int) -> RankData:
        return RankData(
            rank=r,
            end=rank_end(r, "failed", exit_code=1, reason="gloo: peer"),
            finish=finish_marker(
                r,
                5,
                end_state="failed",
                reason="RuntimeError: peer closed",
                received_unix_us=finish_us,
            ),
        )

    segv = RankData(
        rank=2,
        identity=identity(2, start_unix_us=1_000_000_000),
        steps=StepTable.from_dicts([{"step": 4, "end_us": 5_000_000, "step_us": 900_000}]),
        end=rank_end(2, "signaled", signal=11),
        process_samples=[
            {
                "unix_us": t,
                "cpu_percent": 90.0,
                "rss_bytes": 1 << 30,
                "gpu_allocated_bytes": None,
                "gpu_reserved_bytes": None,
            }
            for t in (1_004_000_000, 1_005_200_000)
        ],
    )
    ranks = {0: failed(0, 1_007_000_000), 1: failed(1, 1_006_500_000), 2: segv}
    assert [last_seen_us(ranks[r]) for r in (0, 1, 2)] == [
        1_007_000_000,
        1_006_500_000,
        1_005_200_000,
    ]
    run = RunData("r", 3, ranks, {}, {}, {}, [])
    summaries = [
        rank_summary(rd, None, missing=set(), live=False, gpu_totals={}, span=None)
        for rd in ranks.values()
    ]
    crash = next(
        f for f in findings(run, summaries, live=False, now_unix_s=2e9) if f.kind == "RANK_CRASHED"
    )
    assert crash.summary == (
        "Rank 2 failed first; it ended with signal 11. Ranks 0, 1 failed after it, most "
        "likely of its end (a collective's peer vanished)."
    )
    assert crash.evidence["first"] == 2
    assert [r["rank"] for r in crash.evidence["ranks"]] == [2, 1, 0]


def _crash(seen_us: dict[int, int | None], **end) -> tuple[str, str, int | None]:
    """The RANK_CRASHED finding's summary, advice and ``evidence.first`` when each rank of
    ``seen_us`` (rank -> its finish marker's arrival, Unix µs; None: no finish, nothing else
    seen of it) failed on node ``rank // 2`` with exit code 1 (``end`` replaces its fields)."""
    from traceml.analysis.health import findings
    from traceml.analysis.rundata import RunData
    from traceml.analysis.summary import rank_summary

    ranks = {
        r: RankData(
            rank=r,
            end=rank_end(r, **{"end_state": "failed", "exit_code": 1, "node_rank": r // 2, **end}),
            finish=None
            if us is None
            else finish_marker(r, 5, end_state="failed", received_unix_us=us),
        )
        for r, us in seen_us.items()
    }
    run = RunData("r", len(ranks), ranks, {}, {}, {}, [])
    summaries = [
        rank_summary(rd, None, missing=set(), live=False, gpu_totals={}, span=None)
        for rd in ranks.values()
    ]
    crash = next(
        f for f in findings(run, summaries, live=False, now_unix_s=2e9) if f.kind == "RANK_CRASHED"
    )
    return crash.summary, crash.action, crash.evidence["first"]


def test_the_crash_names_the_first_failure_as_the_cause_and_the_rest_as_what_followed():
    """Rank 3 (node 1) was last seen alive first: it is named with how it ended and where its
    traceback is; ranks 0 and 1 failed after it, of its end most likely."""
    summary, action, first = _crash({0: 9_000, 1: 8_000, 3: 7_000}, reason="boom")
    assert summary == (
        "Rank 3 failed first; it ended with exit code 1 (boom). Ranks 0, 1 failed after it, "
        "most likely of its end (a collective's peer vanished)."
    )
    assert action == (
        "Read rank 3's traceback in nodes/node_1/training.stderr.log first: the others' errors "
        "most likely follow from it."  # no rank was SIGKILLed: no word of the OOM killer
    )
    assert first == 3


def test_the_crash_names_no_cause_when_the_first_failure_is_not_known():
    """Ranks last seen alive at the same µs, or one never seen alive (it may have died
    first), leave the first failure unknown: no rank is named as the cause."""
    summary, action, first = _crash({0: 9_000, 1: 7_000, 2: 7_000})
    assert summary == (
        "Ranks 0, 1, 2 failed; which failed first is not known (ranks 1, 2 were last seen "
        "alive at the same time)."
    )
    assert action == "Read each failed rank's traceback in nodes/node_<r>/training.stderr.log."
    assert first is None
    summary, _, first = _crash({0: 9_000, 1: None})
    assert summary == (
        "Ranks 0, 1 failed; which failed first is not known (nothing tells when rank 1 was "
        "last alive)."
    )
    assert first is None


def test_one_failed_rank_is_named_with_how_it_ended():
    summary, action, first = _crash({2: None}, end_state="signaled", exit_code=None, signal=9)
    assert summary == "Rank 2 failed; it ended with signal 9."
    assert action == (
        "Read rank 2's traceback in nodes/node_1/training.stderr.log; a signal 9 (SIGKILL) is "
        "often the host's out-of-memory killer."
    )
    assert first == 2


def test_last_seen_falls_back_to_the_end_of_the_last_stored_step():
    """Without a finish marker or a process sample, a rank was last seen at the end of its
    last stored step: its start plus that step's ``end_us`` (the last of the column)."""
    from traceml.analysis.health import last_seen_us
    from traceml.analysis.rundata import StepTable

    steps = StepTable.from_dicts(
        [{"step": i, "end_us": 1_000_000 * (i + 1), "step_us": 1_000_000} for i in range(3)]
    )
    rd = RankData(rank=0, identity=identity(0, start_unix_us=5_000_000), steps=steps)
    assert last_seen_us(rd) == 8_000_000
    assert last_seen_us(RankData(rank=1, steps=steps)) == float("inf")


def _lingering_run(end: dict | None, node_exit_unix_s: float | None, missing=(1,)):
    """Two ranks of 20 steps (the last ends at Unix 1.67 s); rank 0 exited (its finish arrived
    at Unix 2 s), rank 1 did not: ``end`` is its launcher's report, None while it runs;
    ``missing``: the ranks finalization gave up on."""
    from rundata_factory import rank, run_of, steps

    r0 = rank(0, steps(20))
    r0.finish = replace(r0.finish, received_unix_us=2_000_000)
    r1 = rank(1, steps(20), finish=False)
    r1.end = rank_end(1, **end) if end else None
    exits = (
        {
            0: {
                "exit_code": 1,
                "hostname": "host0",
                "restart_count": 0,
                "received_unix_us": int(node_exit_unix_s * 1e6),
            }
        }
        if node_exit_unix_s
        else {}
    )
    return run_of([r0, r1], missing=missing, exits=exits)


def test_a_rank_that_completed_its_steps_and_did_not_exit_is_named_without_a_stall_record():
    """The finalization budget ran out before the hang timeout (no stall record yet): the
    partial summary names rank 1 as one that completed its steps and did not exit, and so does
    the summary written after the user stopped the launcher; the hang is the verdict."""
    from traceml.analysis.summary import build_summary
    from traceml.core.ends import interrupted_reason

    partial = build_summary(_lingering_run(None, None), now_unix_s=3601.67)
    hung = partial["primary_diagnosis"]
    assert (hung["kind"], hung["ranks"]) == ("RANK_HUNG", [1])
    assert hung["summary"].startswith(
        "Rank 1 completed its 20 steps, then did not exit for 3600 s (rank 0 exited at "
        "00:00:02 UTC)."
    )
    assert hung["evidence"]["not_exited"] == [
        {
            "rank": 1,
            "attempt": 0,
            "steps_completed": 20,
            "did_not_exit_s": 3600.0,
            "exited_ranks": [0],
            "exited_unix_s": 2.0,
        }
    ]
    stopped = {
        "node_rank": 0,
        "local_rank": 1,
        "end_state": "terminated",
        "exit_code": None,
        "signal": 15,
        "reason": interrupted_reason("SIGTERM"),
    }
    final = build_summary(_lingering_run(stopped, 101.67, missing=()), now_unix_s=5000.0)
    hung = final["primary_diagnosis"]
    assert hung["summary"].startswith(
        "Rank 1 completed its 20 steps, then did not exit for 100 s (rank 0 exited at "
        "00:00:02 UTC)."
    )
    kinds = [f["kind"] for f in final["findings"]["health"]]
    assert "RUN_INTERRUPTED" not in kinds and "RANK_TERMINATED" not in kinds
    # A live run whose rank 1 is on its way out names nothing.
    live = build_summary(_lingering_run(None, None, missing=()), live=True, now_unix_s=3601.67)
    assert live["primary_diagnosis"]["kind"] != "RANK_HUNG"


def test_a_node_the_user_stopped_did_not_fail_and_one_with_a_failed_rank_did():
    """NODE_FAILED leaves out a node whose ranks that did not complete were all interrupted
    (scancel, Ctrl-C: its torchrun's non-zero exit is the stop's, and RUN_INTERRUPTED says
    so), and names a node where a rank failed beside interrupted ones."""
    from rundata_factory import rank, run_of, steps

    from traceml.analysis.summary import build_summary
    from traceml.core.ends import interrupted_reason

    ranks = [rank(r, steps(20), node=r // 2, finish=False) for r in range(4)]
    for rd in ranks[:3]:
        rd.end = rank_end(
            rd.rank, "terminated", node_rank=rd.rank // 2, signal=15,
            reason=interrupted_reason("SIGTERM"),
        )  # fmt: skip
    ranks[3].end = rank_end(3, "failed", node_rank=1, exit_code=1)
    run = run_of(ranks, exits={0: {"exit_code": 143}, 1: {"exit_code": 1}})
    health = {f["kind"]: f for f in build_summary(run, now_unix_s=100.0)["findings"]["health"]}
    assert health["NODE_FAILED"]["nodes"] == [1]
    assert health["NODE_FAILED"]["evidence"]["exit_codes"] == {"1": 1}
    assert health["RUN_INTERRUPTED"]["summary"].startswith(
        "The run was interrupted: ranks 0, 1, 2 stopped when the launchers of nodes 0, 1 got "
        "signal 15 "
    )
    assert health["RUN_INTERRUPTED"]["action"] == (
        "Resume from the last checkpoint once the failure above is fixed."  # not "Nothing failed"
    )


def test_whose_launchers_stopped_the_run_are_named_by_node():
    """RUN_INTERRUPTED's "who": the node a rank's reason names, else the rank's own node (its
    launcher's own signal); several nodes as one list, not "node 0's launcher, node 1's
    launcher", in node order (not the text's: node 10 after node 9)."""
    from traceml.analysis.health import launchers_text
    from traceml.core.ends import interrupted_reason, interrupting_node

    assert interrupting_node(interrupted_reason("SIGTERM"), 3) == 3
    assert interrupting_node(interrupted_reason("SIGINT", 10), 3) == 10
    assert interrupting_node(interrupted_reason("SIGINT"), None) is None
    assert launchers_text([1, 1]) == "node 1's launcher"
    assert launchers_text([10, 9, 0]) == "the launchers of nodes 0, 9, 10"
    assert launchers_text(list(range(12))) == (
        "the launchers of nodes 0, 1, 2, 3, 4, 5, 6, 7 and 4 more"
    )
    assert launchers_text([0, None]) == "the launcher"
