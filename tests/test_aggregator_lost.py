"""Node 0's aggregator lost for good: the summary written from the store says what it lacks.

A real ``traceml run`` of two ranks with ``--aggregator-max-restarts=0``; the aggregator is
SIGKILLed once both ranks have steps stored (asked of it over gRPC, a live Summarize), and
training goes on to its last step. The launcher writes the summary from the store
(``--finalize-only``) and hands it why and when the aggregator was lost: the summary records
it in ``run.telemetry_health.aggregator_loss`` and warns in an ``AGGREGATOR_LOST`` finding
(also in the text report) that it covers only the steps stored until then. Before, it said
nothing of it: a verdict over the run's first steps, with no warning.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import SCRIPTS, start_traceml, wait_for, wait_training_started
from helpers.jobs import run_args
from helpers.waiting import LOADED_CALL_S

from traceml.core import transport
from traceml.launcher import aggregator

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
#: Steps each rank runs, 0.2 s apart: about 8 s of training after the kill's wait.
STEPS = 40
#: Steps each rank has stored when the aggregator is killed (at least).
STORED_BEFORE_KILL = 5
#: The supervisor's words for a SIGKILLed aggregator (its exit code as a shell reports it).
REASON = "exited with code 137 during the run"


def test_aggregator_lost_mid_run_is_in_the_summary(tmp_path, port, monkeypatch):
    name = "agg-lost"
    run_dir = tmp_path / "logs" / name
    args = run_args(
        tmp_path,
        SCRIPT,
        name,
        port,
        "--aggregator-max-restarts=0",
        "--steps",
        str(STEPS),
        "--step-sleep",
        "0.2",
    )
    env = {"TRACEML_FLUSH_INTERVAL_SEC": "0.2", "TRACEML_FINISH_TIMEOUT_SEC": "2"}
    launcher = start_traceml(args, tmp_path, tmp_path / "launcher", env=env)
    err_path = tmp_path / "launcher.err"
    wait_training_started(run_dir, launcher, err_path, 180)
    target = f"127.0.0.1:{port}"
    # the run's token, which the launcher wrote: a Summarize carries it (from the environment)
    monkeypatch.setenv("TRACEML_RUN_TOKEN", transport.read_token_file(run_dir / "run_token"))

    def stored_on_both() -> bool:
        assert launcher.poll() is None, err_path.read_text()
        ranks = aggregator.summarize(target, name, LOADED_CALL_S).ranks
        return len(ranks) == 2 and all(r.steps_stored >= STORED_BEFORE_KILL for r in ranks)

    wait_for(stored_on_both, LOADED_CALL_S, "steps stored on both ranks", poll_s=0.2)
    pid = json.loads((run_dir / "manifest.json").read_text())["aggregator"]["pid"]
    killed_unix_s = time.time()
    os.kill(pid, signal.SIGKILL)
    code = launcher.wait(240)
    ended_unix_s = time.time()

    err = err_path.read_text()
    assert code == 0, err  # training's exit code
    assert f"warning: the aggregator {REASON}; training continues without telemetry" in err
    # The relay told the ranks and the node's sampler that nothing more would be stored: each
    # stopped sending, and none waited at its exit for acknowledgements that could not come
    # (before: "telemetry is kept and resent", then "not delivered at exit" after the wait).
    stopped = f"traceml: telemetry stopped: node 0's aggregator is gone for good ({REASON})"
    assert err.count(stopped + "; sending no more") == 3, err  # 2 ranks and the sampler
    assert "not delivered at exit" not in err
    out = (run_dir / "nodes" / "node_0" / "training.stdout.log").read_text()
    assert f"faulty_ddp: rank 0 trained {STEPS} steps" in out

    summary = json.loads((run_dir / "final_summary.json").read_text())
    stored = [r["records_received"] for r in summary["ranks"]]
    assert all(STORED_BEFORE_KILL <= n < STEPS for n in stored), stored
    assert summary["run"]["status"] == "completed"

    loss = summary["run"]["telemetry_health"]["aggregator_loss"]
    assert loss["reason"] == REASON
    assert killed_unix_s <= loss["lost_unix_s"] <= ended_unix_s
    assert summary["run"]["telemetry_health"]["aggregator_restarts"] == 0

    (lost,) = [f for f in summary["findings"]["health"] if f["kind"] == "AGGREGATOR_LOST"]
    at = time.strftime("%H:%M:%S UTC", time.gmtime(loss["lost_unix_s"]))
    assert lost["severity"] == "warning"
    assert lost["summary"] == (
        f"Node 0's aggregator stopped storing at {at} ({REASON}): this summary covers only the "
        f"steps stored until then (rank 0: {stored[0]}, rank 1: {stored[1]}); the telemetry "
        "sent after it was not stored."
    )
    assert lost["evidence"] == {
        "statistic": "events",
        "aggregator_loss": loss,
        "steps_stored": {"0": stored[0], "1": stored[1]},
    }
    text = " ".join((run_dir / "final_summary.txt").read_text().split())
    assert f"[warning] AGGREGATOR_LOST: {lost['summary']}" in text

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    assert manifest["aggregator"]["status"] == "failed"
    assert manifest["aggregator"]["reason"] == REASON
