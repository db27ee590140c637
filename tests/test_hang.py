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
import signal
import time

from conftest import SCRIPTS, load_summary, query, start_traceml

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
BUDGET_S = 6.0
HANG_S = 2.0
#: Progress every 0.5 s and batches every 0.2 s: the hang is timed to within a fraction of a second.
FAST = {"TRACEML_FLUSH_INTERVAL_SEC": "0.2", "TRACEML_HEARTBEAT_SEC": "0.5"}


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def start_job(tmp_path, port, name: str, *script_args: str):
    """``traceml run`` of the 2-rank faulty job named ``name``, hang timeout HANG_S."""
    args = [
        "run", SCRIPT, "--nproc-per-node=2", "--run-name", name,
        "--hang-timeout-sec", str(HANG_S), "--aggregator-port", str(port),
        "--logs-dir", str(tmp_path / "logs"), *script_args,
    ]
    return start_traceml(args, tmp_path, tmp_path / "launcher", env=FAST)


def test_hung_rank_is_named_in_a_partial_summary(tmp_path, port):
    run_dir = tmp_path / "logs" / "hang"
    launcher = start_job(
        tmp_path, port, "hang", "--finalize-timeout-sec", str(BUDGET_S),
        "--fail", "hang", "--fail-rank", "1", "--steps", "6",
    )
    try:
        partial = wait_for(lambda: read_json(run_dir / "final_summary.json"), 180, "the summary")
        seen_unix_s = time.time()
        # The job is still running: the partial summary did not stop it.
        time.sleep(2.0)
        assert launcher.poll() is None
        wait_for(
            lambda: "partial summary written" in (tmp_path / "launcher.err").read_text(),
            10, "the launcher's notice",
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
    # steps; the final one no longer calls it collateral of another rank's failure.
    for summary in (partial, final):
        hung = finding(summary, "RANK_HUNG")
        assert hung["ranks"] == [1] and hung["evidence"]["suspects"] == [1]
        [entry] = hung["evidence"]["ranks"]
        assert (entry["rank"], entry["steps_completed"], entry["last_step"], entry["phase"],
                entry["alive"]) == (1, 6, 5, "idle", True)
        assert entry["silent_s"] >= HANG_S
        assert hung["summary"].startswith("Rank 1 stopped making progress at ")
    assert not [f for f in final["findings"]["health"] if f["kind"] == "RANK_TERMINATED"]
    assert "hang: rank 1 made no progress for" in err and "suspect: rank 1" in err


def finding(summary: dict, kind: str) -> dict:
    [found] = [f for f in summary["findings"]["health"] if f["kind"] == kind]
    return found


def test_a_rank_stuck_in_forward_is_the_suspect_of_a_hang_inside_training(tmp_path, port):
    run_dir = tmp_path / "logs" / "stall"
    launcher = start_job(
        tmp_path, port, "stall",
        "--fail", "stall", "--fail-rank", "1", "--fail-step", "3", "--steps", "10",
    )
    try:
        wait_for(lambda: "hang: ranks 0, 1 made no progress" in
                 (tmp_path / "launcher.err").read_text(), 180, "the hang line")
        line_at = time.time()
        live = read_json(run_dir / "aggregator" / "stall.json")
        time.sleep(2.0)
        assert launcher.poll() is None  # TraceML never stops a job
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(60)
    assert code == 1

    [line] = [l for l in (tmp_path / "launcher.err").read_text().splitlines() if "hang:" in l]
    assert line.startswith("traceml: hang: ranks 0, 1 made no progress for ")
    assert line.endswith("(rank 0: 3 steps done, in backward; rank 1: 3 steps done, in "
                         "forward); suspect: rank 1")
    assert live["suspects"] == [1]
    final = load_summary(run_dir)
    hung = finding(final, "RANK_HUNG")
    assert hung["ranks"] == [1] and hung["evidence"]["suspects"] == [1]
    where = {e["rank"]: (e["steps_completed"], e["phase"], e["alive"])
             for e in hung["evidence"]["ranks"]}
    assert where == {0: (3, "backward", True), 1: (3, "forward", True)}
    # Silent since its step count last moved: at least the timeout, and the stall went on
    # (refreshed every second) until the job was stopped.
    silent = [e["silent_s"] for e in hung["evidence"]["ranks"]]
    assert all(HANG_S <= s for s in silent), silent
    assert all(s >= time.time() - line_at - 30 for s in silent), silent
    assert {r["rank"]: r["steps_completed"] for r in final["ranks"]} == {0: 3, 1: 3}
    assert not [f for f in final["findings"]["health"] if f["kind"] == "RANK_TERMINATED"]
