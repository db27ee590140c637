"""Hung ranks: localised while the job runs, named in the partial and the final summary.

After its last step: rank 1 of ``tests/scripts/faulty_ddp.py`` trains its 6 steps and then
sleeps forever, which keeps its torchrun (and so the launcher) alive; rank 0 finishes normally.
The aggregator's hang watch finds rank 1 silent for ``--hang-timeout-sec`` while alive (its
sender still ships its progress), and its watchdog writes ``final_summary.json`` naming rank 1
one budget (``--finalize-timeout-sec``) after rank 0 ended; node 0's launcher says both, and
the training keeps running: TraceML never stops a job. The test then stops the job the way a
user would (SIGTERM to the launcher).

Inside training: rank 1 sleeps forever in the forward of step 3, and rank 0 waits for it in
backward's all-reduce. The stall finding names both ranks, where each stands, and rank 1 as
the suspect.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
from conftest import SCRIPTS, load_summary, query, start_traceml, wait_for
from helpers.jobs import HANG_AFTER_THE_LAST_STEP, HANG_TIMING_ENV, run_args

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
BUDGET_S = 6.0
HANG_S = 2.0


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def start_job(tmp_path, port, name: str, *script_args: str, nproc: int = 2, script=SCRIPT):
    """``traceml run`` of the ``nproc``-rank faulty job named ``name``, hang timeout HANG_S."""
    args = run_args(
        tmp_path, script, name, port, "--hang-timeout-sec", str(HANG_S), *script_args, nproc=nproc
    )
    return start_traceml(args, tmp_path, tmp_path / "launcher", env=HANG_TIMING_ENV)


def test_hung_rank_is_named_in_a_partial_summary(tmp_path, port):
    run_dir = tmp_path / "logs" / "hang"
    launcher = start_job(
        tmp_path, port, "hang", "--finalize-timeout-sec", str(BUDGET_S), *HANG_AFTER_THE_LAST_STEP
    )
    try:
        partial = wait_for(lambda: read_json(run_dir / "final_summary.json"), 180, "the summary")
        seen_unix_s = time.time()
        # The job is still running: the partial summary did not stop it.
        time.sleep(2.0)
        assert launcher.poll() is None
        wait_for(
            lambda: "partial summary written" in (tmp_path / "launcher.err").read_text(),
            10,
            "the launcher's notice",
        )
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(60)

    assert partial["run"]["complete"] is False
    assert partial["run"]["missing_ranks"] == [1]
    ranks = {r["rank"]: r for r in partial["ranks"]}
    assert ranks[1]["end"]["state"] == "running"
    assert ranks[1]["steps_completed"] == 6
    assert ranks[0]["end"]["state"] == "completed"
    assert ranks[0]["steps_completed"] == 6
    # Written one budget after rank 0's finish marker arrived (not before; not much later).
    (finished_us,) = query(run_dir, "SELECT received_unix_us FROM rank_finish WHERE rank = 0")[0]
    waited = partial["generated_unix_s"] - finished_us / 1e6
    assert BUDGET_S <= waited < BUDGET_S + 10, waited
    assert seen_unix_s - partial["generated_unix_s"] < 10

    err = (tmp_path / "launcher.err").read_text()
    assert f"ranks [1] have not finished {BUDGET_S:g} s" in err
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["missing_ranks"] == [] and manifest["complete"] is True
    assert "partial_summary" in manifest["lifecycle"]
    assert manifest["partial_summary"]["missing_ranks"] == [1]
    # Stopped by the user: torchrun's exit code (a stopped torchrun exits 1), and the final
    # summary now accounts for every rank (rank 1's node reported its torchrun's exit).
    assert code == 1
    assert manifest["exit_code"] == 1
    final = load_summary(run_dir)
    assert final["run"]["missing_ranks"] == []
    assert {r["rank"]: r["end"]["state"] for r in final["ranks"]}[1] == "terminated"

    # Both summaries say rank 1 stopped making progress after its 6 steps, alive, between
    # steps: it completed its steps and did not exit while rank 0 did (the hang is the
    # verdict: it lost more time than anything else); the final one no longer calls it
    # collateral of another rank's failure.
    exited = time.strftime("%H:%M:%S UTC", time.gmtime(finished_us / 1e6))
    for summary in (partial, final):
        hung = finding(summary, "RANK_HUNG")
        assert summary["primary_diagnosis"] is hung
        assert hung["ranks"] == [1] and hung["evidence"]["suspects"] == [1]
        [entry] = hung["evidence"]["ranks"]
        assert (
            entry["rank"],
            entry["attempt"],
            entry["steps_completed"],
            entry["last_step"],
            entry["phase"],
            entry["alive"],
        ) == (1, 0, 6, 5, "idle", True)
        assert entry["silent_s"] >= HANG_S
        [lingered] = hung["evidence"]["not_exited"]
        assert (lingered["rank"], lingered["steps_completed"], lingered["exited_ranks"]) == (
            1,
            6,
            [0],
        )
        # from rank 1's last step (its count may reach the aggregator a flush after rank 0's
        # finish marker, which starts the budget) to the partial summary, then to its stop
        assert lingered["did_not_exit_s"] >= BUDGET_S - 1
        assert hung["summary"].startswith("Rank 1 stopped making progress at ")
        assert (
            f": rank 1 completed its 6 steps, then did not exit for "
            f"{lingered['did_not_exit_s']:.0f} s (rank 0 exited at {exited})."
        ) in hung["summary"]
    assert not [f for f in final["findings"]["health"] if f["kind"] == "RANK_TERMINATED"]
    assert "hang: rank 1 made no progress for" in err and "suspect: rank 1" in err


def finding(summary: dict, kind: str) -> dict:
    """The finding ``kind``: the primary diagnosis or one of the health findings."""
    [found] = [
        f
        for f in [summary["primary_diagnosis"]] + summary["findings"]["health"]
        if f["kind"] == kind
    ]
    return found


def test_a_rank_stuck_in_forward_is_the_suspect_of_a_hang_inside_training(tmp_path, port):
    run_dir = tmp_path / "logs" / "stall"
    launcher = start_job(
        tmp_path,
        port,
        "stall",
        "--fail",
        "stall",
        "--fail-rank",
        "1",
        "--fail-step",
        "3",
        "--steps",
        "10",
    )
    try:
        wait_for(
            lambda: "hang: ranks 0, 1 made no progress" in (tmp_path / "launcher.err").read_text(),
            180,
            "the hang line",
        )
        line_at = time.time()
        live = read_json(run_dir / "aggregator" / "stall.json")
        time.sleep(2.0)
        assert launcher.poll() is None  # TraceML never stops a job
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(60)
    assert code == 1

    [line] = [ln for ln in (tmp_path / "launcher.err").read_text().splitlines() if "hang:" in ln]
    assert line.startswith("traceml: hang: ranks 0, 1 made no progress for ")
    assert live["ended_unix_s"] is None
    # rank 0 waits in step 3's gradient bucket, the 4th collective of the default group
    at = sits_at("stalled in forward", "forward")
    assert re.search(
        r"\(rank 0: 3 steps done, in backward; rank 1: 3 steps done, in forward\); rank 0 waits "
        r"in ddp_bucket #4 of group default for \d+ s; rank 1 never entered it \(alive, at "
        rf"{re.escape(at)}\); suspect: rank 1$",
        line,
    ), line
    assert live["suspects"] == [1]
    final = load_summary(run_dir)
    hung = finding(final, "RANK_HUNG")
    assert hung["ranks"] == [1] and hung["evidence"]["suspects"] == [1]
    where = {
        e["rank"]: (e["steps_completed"], e["phase"], e["alive"]) for e in hung["evidence"]["ranks"]
    }
    assert where == {0: (3, "backward", True), 1: (3, "forward", True)}
    # Silent since its step count last moved: at least the timeout, and the stall went on
    # (refreshed every second) until the job was stopped.
    silent = [e["silent_s"] for e in hung["evidence"]["ranks"]]
    assert all(HANG_S <= s for s in silent), silent
    assert all(s >= time.time() - line_at - 30 for s in silent), silent
    assert {r["rank"]: r["steps_completed"] for r in final["ranks"]} == {0: 3, 1: 3}
    assert not [f for f in final["findings"]["health"] if f["kind"] == "RANK_TERMINATED"]


def hang_lines(tmp_path) -> list[str]:
    return [ln for ln in (tmp_path / "launcher.err").read_text().splitlines() if "hang:" in ln]


def hang_then_ctrl_c(tmp_path, port, name: str, nproc: int, *script_args: str):
    """Run the faulty job ``name`` on ``nproc`` ranks, wait for node 0's hang line, read the
    live stall record, then stop the launcher with SIGINT as a user would (Ctrl-C); the line,
    the record and the final summary."""
    launcher = start_job(tmp_path, port, name, *script_args, nproc=nproc)
    try:
        [line] = wait_for(lambda: hang_lines(tmp_path), 180, "the hang line")
        live = read_json(tmp_path / "logs" / name / "aggregator" / "stall.json")
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(90)
    return line, live, load_summary(tmp_path / "logs" / name)


def attempt_1(summary: dict | None) -> dict | None:
    return summary if summary and summary["run"]["attempt"] == 1 else None


def hung_in(summary: dict | None) -> dict | None:
    """``summary`` when it has a RANK_HUNG finding, else None."""
    if summary is None:
        return None
    kinds = [f["kind"] for f in [summary["primary_diagnosis"]] + summary["findings"]["health"]]
    return summary if "RANK_HUNG" in kinds else None


def test_a_hang_of_the_attempt_after_a_torchrun_restart_is_found_and_named(tmp_path, port):
    """Attempt 0 fails (rank 1 raises) and torchrun restarts the workers; in attempt 1 rank 1
    stops after 2 steps while rank 0 completes its 5. Attempt 0's finish markers must not
    make attempt 1's ranks done: the hang is found, named with its attempt, and the watchdog's
    partial summary (one budget after rank 0's finish of attempt 1) names rank 1 missing."""
    run_dir = tmp_path / "logs" / "again"
    launcher = start_job(
        tmp_path,
        port,
        "again",
        "--max-restarts",
        "1",
        "--finalize-timeout-sec",
        str(BUDGET_S),
        "--",
        "--first-steps",
        "3",
        "--steps",
        "5",
        "--hang-rank",
        "1",
        "--hang-after",
        "2",
        script=SCRIPTS / "fail_once.py",
    )
    try:
        # (on a loaded machine, attempt 0's rank 0 may wait longer than the budget to be stopped
        # by torchrun: attempt 0 then has its own partial summary and hang line first; written
        # while torchrun restarts the workers, that summary already reads attempt 1's first
        # identities, so attempt 1's partial summary is the one that has its hang)
        partial = wait_for(
            lambda: hung_in(attempt_1(read_json(run_dir / "final_summary.json"))),
            180,
            "attempt 1's partial summary",
        )
        # The launcher says the hang as it hears it (its next second), maybe after the summary.
        [line] = wait_for(
            lambda: [ln for ln in hang_lines(tmp_path) if " in attempt 1 " in ln],
            60,
            "attempt 1's hang line",
        )
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(90)
    assert line.startswith("traceml: hang: rank 1 made no progress for ")
    assert line.endswith(" in attempt 1 (rank 1: 2 steps done, in idle); suspect: rank 1")
    assert partial["run"]["attempt"] == 1
    assert partial["run"]["complete"] is False and partial["run"]["missing_ranks"] == [1]
    final = load_summary(run_dir)
    for summary in (partial, final):
        hung = finding(summary, "RANK_HUNG")
        assert hung["ranks"] == [1] and hung["evidence"]["suspects"] == [1]
        [entry] = hung["evidence"]["ranks"]
        assert (entry["rank"], entry["attempt"], entry["steps_completed"], entry["phase"]) == (
            1,
            1,
            2,
            "idle",
        )
        assert "rank 1 of attempt 1: 2 steps done (last step 1), in idle, alive" in hung["summary"]
    assert {r["rank"]: (r["restart"], r["steps_completed"]) for r in final["ranks"]} == {
        0: (1, 5),
        1: (1, 2),
    }


def test_four_ranks_one_stuck_in_forward_named_the_same_live_and_after_ctrl_c(tmp_path, port):
    """Rank 2 of 4 stops in the forward of step 3; ranks 0, 1 and 3 wait in backward's
    all-reduce. The user presses Ctrl-C once the hang line is out: the final summary names
    the same suspect as the line (not whichever rank died first after the signal), says
    where each rank stood and that each was alive then, and the hang is the verdict."""
    line, live, final = hang_then_ctrl_c(
        tmp_path,
        port,
        "four",
        4,
        "--fail",
        "stall",
        "--fail-rank",
        "2",
        "--fail-step",
        "3",
        "--steps",
        "10",
    )
    at = sits_at("stalled in forward", "forward")
    assert re.search(
        r"\(rank 0: 3 steps done, in backward; rank 1: 3 steps done, in backward; rank 2: 3 "
        r"steps done, in forward; rank 3: 3 steps done, in backward\); ranks 0, 1, 3 wait in "
        r"ddp_bucket #4 of group default for \d+ s; rank 2 never entered it \(alive, at "
        rf"{re.escape(at)}\); suspect: rank 2$",
        line,
    ), line
    assert live["suspects"] == [2]
    hung = final["primary_diagnosis"]
    assert hung["kind"] == "RANK_HUNG" and hung["ranks"] == [2]
    assert hung["evidence"]["suspects"] == [2]
    assert hung["evidence"]["detected_unix_s"] == live["detected_unix_s"]
    assert {
        e["rank"]: (e["steps_completed"], e["last_step"], e["phase"], e["alive"])
        for e in hung["evidence"]["ranks"]
    } == {r: (3, 2, "forward" if r == 2 else "backward", True) for r in range(4)}
    assert hung["evidence"]["lost_s"] >= HANG_S
    for r in (0, 1, 3):
        assert (
            f"rank {r}: 3 steps done (last step 2), in backward, alive (samples still "
            "arriving)" in hung["summary"]
        )
    assert "Look at rank 2 first" in hung["action"]
    assert not [f for f in final["findings"]["health"] if f["kind"] == "RANK_HUNG"]


def test_ranks_waiting_in_an_explicit_collective_are_never_the_culprit(tmp_path, port):
    """Every step starts with an all-reduce inside the traced step. Rank 1 of 3 stops before
    step 4, outside any step, alive; ranks 0 and 2 wait inside step 4, in the all-reduce.
    Neither waiting rank is named, live or in the summary written after Ctrl-C."""
    line, live, final = hang_then_ctrl_c(
        tmp_path,
        port,
        "outside",
        3,
        "--fail",
        "outside",
        "--fail-rank",
        "1",
        "--fail-step",
        "4",
        "--steps",
        "12",
        "--explicit-collective",
    )
    # each of 4 steps: its all-reduce, then its gradient bucket; step 4's all-reduce is #9
    at = sits_at("stopped outside its step", "main")
    assert re.search(
        r"\(rank 0: 4 steps done, in step; rank 1: 4 steps done, in idle; rank 2: 4 steps done, "
        r"in step\); ranks 0, 2 wait in all_reduce #9 of group default for \d+ s; rank 1 never "
        rf"entered it \(alive, at {re.escape(at)}\); suspect: rank 1$",
        line,
    ), line
    assert live["suspects"] == [1]
    hung = finding(final, "RANK_HUNG")
    assert hung["ranks"] == [1] and hung["evidence"]["suspects"] == [1]
    assert {e["rank"]: (e["phase"], e["alive"]) for e in hung["evidence"]["ranks"]} == {
        0: ("step", True),
        1: ("idle", True),
        2: ("step", True),
    }
    named = [
        f
        for f in [
            final["primary_diagnosis"],
            *final["findings"]["step_time"],
            *final["findings"]["health"],
        ]
        if f["kind"].endswith("STRAGGLER") or f["kind"] == "RANK_HUNG"
    ]
    assert all(set(f["ranks"]) <= {1} for f in named), named


def sits_at(marker: str, function: str) -> str:
    """``"<faulty_ddp.py>:<line> in <function>"``: where a rank of faulty_ddp.py stopped at the
    line that ends with comment ``marker`` sits (as its reported stack says it)."""
    lines = open(SCRIPT).read().splitlines()
    [line] = [i for i, text in enumerate(lines, 1) if text.endswith(f"# {marker}")]
    return f"{SCRIPT}:{line} in {function}"


def test_a_hang_is_named_down_to_the_collective_and_the_line_of_the_rank_that_never_entered_it(
    tmp_path, port
):
    """Every step is followed by an all-reduce of one number, outside the step. Rank 2 of 4
    stops after its 3rd step, before that all-reduce, alive; ranks 0, 1 and 3 wait in it: the
    6th collective of the default group (each step's DDP gradient bucket, then the all-reduce).
    All four are between steps with 3 steps done, so only the ranks' reports tell them apart:
    live and in the summary written after Ctrl-C, the three are named as waiting in
    all_reduce #6 of group default, and rank 2 as never entering it, alive, at the script's
    line where its main thread sleeps."""
    line, live, final = hang_then_ctrl_c(
        tmp_path,
        port,
        "coll",
        4,
        "--fail",
        "collective",
        "--fail-rank",
        "2",
        "--fail-step",
        "3",
        "--steps",
        "12",
        "--collective-after-step",
    )
    at = sits_at("stopped before the collective", "main")
    waiting = re.fullmatch(
        r"traceml: hang: ranks 0, 1, 2, 3 made no progress for \d+ s \(rank 0: 3 steps done, in "
        r"idle; rank 1: 3 steps done, in idle; rank 2: 3 steps done, in idle; rank 3: 3 steps "
        r"done, in idle\); ranks 0, 1, 3 wait in all_reduce #6 of group default for (\d+) s; "
        rf"rank 2 never entered it \(alive, at {re.escape(at)}\); suspect: rank 2",
        line,
    )
    assert waiting, line
    assert live["suspects"] == [2]
    assert {
        e["rank"]: (
            e["collective"]
            and (e["collective"]["op"], e["collective"]["group"], e["collective"]["seq"]),
            e["alive"],
        )
        for e in live["ranks"]
    } == {
        0: (("all_reduce", "default", 6), True),
        1: (("all_reduce", "default", 6), True),
        2: (None, True),
        3: (("all_reduce", "default", 6), True),
    }
    [stopped] = [e for e in live["ranks"] if e["rank"] == 2]
    assert stopped["stack"].split("\n")[-1] == at

    hung = finding(final, "RANK_HUNG")
    assert hung["ranks"] == [2] and hung["evidence"]["suspects"] == [2]
    assert hung["evidence"]["detected_unix_s"] == live["detected_unix_s"]
    collective = hung["evidence"]["collective"]
    assert (collective["op"], collective["group"], collective["seq"], collective["waiting"]) == (
        "all_reduce",
        "default",
        6,
        [0, 1, 3],
    )
    [never] = collective["never_entered"]
    assert (never["rank"], never["alive"], never["inside"], never["at"]) == (2, True, None, at)
    assert never["stack"][-1] == at
    assert collective["waited_s"] >= int(waiting.group(1)) - 1
    assert (
        f" Ranks 0, 1, 3 wait in all_reduce #6 of group default for "
        f"{collective['waited_s']:.0f} s; rank 2 never entered it (alive, at {at})."
    ) in hung["summary"]
    assert hung["action"].startswith(
        "Look at rank 2 first: the others wait for it in all_reduce #6 of group default, which "
        f"it never entered (rank 2's main thread sits at {at})."
    )
