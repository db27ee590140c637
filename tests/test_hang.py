"""A rank that never finishes: a partial summary names it once the finalize budget runs out.

Rank 1 of ``tests/scripts/faulty_ddp.py`` trains its 6 steps and then sleeps forever, which
keeps its torchrun (and so the launcher) alive; rank 0 finishes normally. The aggregator's
watchdog writes ``final_summary.json`` naming rank 1 one budget (``--finalize-timeout-sec``)
after rank 0 ended, node 0's launcher says so, and the training keeps running: TraceML never
stops a job. The test then stops the job the way a user would (SIGTERM to the launcher).
"""

from __future__ import annotations

import json
import signal
import time

from conftest import SCRIPTS, load_summary, query, start_traceml

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
BUDGET_S = 4.0


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


def test_hung_rank_is_named_in_a_partial_summary(tmp_path, port):
    run_dir = tmp_path / "logs" / "hang"
    args = [
        "run", SCRIPT, "--nproc-per-node=2", "--run-name", "hang",
        "--finalize-timeout-sec", str(BUDGET_S), "--aggregator-port", str(port),
        "--logs-dir", str(tmp_path / "logs"),
        "--fail", "hang", "--fail-rank", "1", "--steps", "6",
    ]
    launcher = start_traceml(args, tmp_path, tmp_path / "launcher",
                             env={"TRACEML_FLUSH_INTERVAL_SEC": "0.2"})
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
