"""Telemetry failures after training started are warnings: the exit code stays torchrun's.

Three failures: node 0's aggregator never serves (torchrun starts alongside it, so training is
already under way), it is killed in the middle of the run, and the summary cannot be written
(``final_summary.json`` is a directory, which even root cannot replace with a file).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import SCRIPTS, run_traceml, start_traceml, wait_training_started

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")


def test_aggregator_that_never_serves_leaves_training_alone(tmp_path, port):
    run_dir = tmp_path / "logs" / "agg-late"
    args = [
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--run-name",
        "agg-late",
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
        "--steps",
        "5",
    ]
    # No aggregator serves within 10 ms of being started.
    result = run_traceml(args, tmp_path, env={"TRACEML_AGGREGATOR_START_SEC": "0.01"})
    assert result.returncode == 0, result.stderr
    launcher_lines = [line for line in result.stderr.splitlines() if "the aggregator" in line]
    assert len(launcher_lines) == 1, result.stderr
    assert launcher_lines[0].startswith("traceml: warning: the aggregator did not serve (")
    assert "training continues without telemetry" in launcher_lines[0]
    assert "faulty_ddp: rank 0 trained 5 steps" in result.stdout
    assert not (run_dir / "final_summary.json").exists()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    assert manifest["aggregator"]["status"] == "failed"
    assert manifest["aggregator"]["reason"].startswith("did not serve (")
    assert "aggregator_failed" in manifest["lifecycle"]


def test_aggregator_killed_mid_run_without_restarts_left(tmp_path, port):
    """With no restart allowed (TRACEML_AGGREGATOR_MAX_RESTARTS=0) training goes on without
    telemetry, and the launcher writes the summary from the store at the end: what was
    acknowledged before the kill, and the ranks' end states from this node's report."""
    run_dir = tmp_path / "logs" / "agg-killed"
    args = [
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--run-name",
        "agg-killed",
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
        "--steps",
        "30",
        "--step-sleep",
        "0.2",
    ]
    env = {
        "TRACEML_FLUSH_INTERVAL_SEC": "0.2",
        "TRACEML_FINISH_TIMEOUT_SEC": "2",
        "TRACEML_AGGREGATOR_MAX_RESTARTS": "0",
    }
    launcher = start_traceml(args, tmp_path, tmp_path / "launcher", env=env)
    wait_training_started(run_dir, launcher, tmp_path / "launcher.err", 180)
    time.sleep(2.0)  # some steps stream to the aggregator
    pid = json.loads((run_dir / "manifest.json").read_text())["aggregator"]["pid"]
    os.kill(pid, signal.SIGKILL)
    code = launcher.wait(240)

    err = (tmp_path / "launcher.err").read_text()
    assert code == 0, err
    assert "warning: the aggregator exited with code 137 during the run; training continues" in err
    assert "summary (written from the store: the aggregator was lost)" in err
    assert "faulty_ddp: rank 0 trained 30 steps" in (tmp_path / "launcher.out").read_text()
    summary = json.loads((run_dir / "final_summary.json").read_text())
    assert summary["run"]["complete"] is True and summary["run"]["status"] == "completed"
    for rank in summary["ranks"]:
        assert rank["end"]["state"] == "completed"
        assert 0 < rank["records_received"] < 30  # the steps stored before the kill
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    assert manifest["aggregator"] == {
        "status": "failed",
        "reason": "exited with code 137 during the run",
        "pid": pid,
        "exit_code": 137,
        "restarts": [],
    }
    assert "aggregator_failed" in manifest["lifecycle"]
    assert manifest["artifacts"]["final_summary_json"] == str(run_dir / "final_summary.json")
    node = json.loads((run_dir / "nodes" / "node_0" / "manifest.json").read_text())
    assert node["exit_code"] == 0 and node["telemetry_reported"] is False


def test_unwritable_summary(tmp_path, port):
    run_dir = tmp_path / "logs" / "no-summary"
    (run_dir / "final_summary.json").mkdir(parents=True)
    args = [
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--run-name",
        "no-summary",
        "--steps",
        "4",
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
    ]
    result = run_traceml(args, tmp_path)
    assert result.returncode == 0, result.stderr
    # The summary that cannot be saved still reaches the console, then why it was not saved.
    assert "Rank end states\n  completed: 2 of 2 ranks" in result.stdout
    error = f"{run_dir / 'final_summary.json'} not written (Is a directory)"
    assert f"traceml: warning: the summary above: {error}" in result.stderr.splitlines()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    assert manifest["aggregator"]["status"] == "failed"
    assert manifest["aggregator"]["reason"] == error
    assert manifest["aggregator"]["exit_code"] == 0
    assert "final_summary_json" not in manifest["artifacts"]
