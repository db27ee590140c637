"""A paused aggregator (SIGSTOP for OUTAGE_S) in the middle of a real 2-rank job.

Training must not notice: the steps taken while the aggregator was stopped are as long as the
others (within 5 %), every step is stored exactly once after it resumes (received + dropped =
produced, with nothing dropped: the outage fits the buffer), and the job ends as usual. The
time from the last step to the launcher's return is printed (the benchmark figure).
"""

from __future__ import annotations

import signal
import statistics
import time

import pytest
from conftest import (
    SCRIPTS,
    aggregator_of,
    load_summary,
    query,
    start_traceml,
    wait_training_started,
)

from traceml import settings
from traceml.core import transport

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.serial]

#: The pause, s: more than two of a rank's RPC deadlines (``TRACEML_RPC_TIMEOUT_SEC``, 5 s),
#: so the ranks' calls time out and are retried while it lasts, and shorter than the client's
#: keepalive drop (``CLIENT_KEEPALIVE_MS`` + ``KEEPALIVE_TIMEOUT_MS``, 50 s), as 30 s was.
OUTAGE_S = 12.0
STEP_SLEEP_S = 0.05
STEPS = 600  # about 30 s of training: the outage falls inside it, 10 s of steps after it


def test_a_paused_aggregator_costs_training_nothing_and_loses_nothing(tmp_path, port):
    assert (
        2 * float(settings.RPC_TIMEOUT_SEC.default)
        < OUTAGE_S
        < (transport.CLIENT_KEEPALIVE_MS + transport.KEEPALIVE_TIMEOUT_MS) / 1000
    )
    run_dir = tmp_path / "logs" / "outage"
    args = [
        "run",
        str(SCRIPTS / "faulty_ddp.py"),
        "--nproc-per-node=2",
        "--run-name",
        "outage",
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
        "--steps",
        str(STEPS),
        "--step-sleep",
        str(STEP_SLEEP_S),
    ]
    # Nodes lost after 5 s of silence: the pause is longer, and the aggregator must not blame
    # its node for its own (the node's messages wait unread in its sockets meanwhile).
    env = {"TRACEML_NODE_LOST_AFTER_SEC": "5"}
    launcher = start_traceml(args, tmp_path, tmp_path / "launcher", env=env)
    try:
        aggregator = aggregator_of(launcher)
        wait_training_started(run_dir, launcher, tmp_path / "launcher.err", 120)
        time.sleep(5.0)
        paused_at = time.time()
        aggregator.send_signal(signal.SIGSTOP)
        time.sleep(OUTAGE_S)
        aggregator.send_signal(signal.SIGCONT)
        resumed_at = time.time()
        code = launcher.wait(240)
        returned_at = time.time()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert code == 0, (tmp_path / "launcher.err").read_text()[-2000:]
    summary = load_summary(run_dir)
    assert summary["run"]["telemetry_health"]["node_losses"] == []
    assert [f for f in summary["findings"]["health"] if f["kind"] == "NODE_LOST"] == []
    for r in summary["ranks"]:
        # received + dropped = produced, exactly, and nothing dropped
        assert (r["steps_completed"], r["records_received"], r["records_dropped"]) == (
            STEPS,
            STEPS,
            0,
        )
    rows = query(
        run_dir,
        "SELECT s.rank, r.start_unix_us + s.end_us, s.step_us FROM steps s JOIN ranks r "
        "ON r.rank = s.rank AND r.restart = s.restart WHERE s.step > 0",
    )
    during = [us for _, end, us in rows if paused_at * 1e6 < end < resumed_at * 1e6]
    margin_us = 2e6  # leave out the steps around the pause's edges
    outside = [
        us
        for _, end, us in rows
        if not paused_at * 1e6 - margin_us < end < resumed_at * 1e6 + margin_us
    ]
    # Stored once the aggregator came back: at least one rank's worth of the paused steps.
    assert len(during) >= OUTAGE_S / STEP_SLEEP_S, len(during)
    ratio = statistics.median(during) / statistics.median(outside)
    assert abs(ratio - 1) < 0.05, ratio
    last_step_unix_s = max(end for _, end, _ in rows) / 1e6
    print(
        f"\noutage benchmark: step time during/outside the pause {ratio:.3f}; "
        f"last step -> launcher returned {returned_at - last_step_unix_s:.2f} s"
    )
