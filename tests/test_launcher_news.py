"""What the launcher hears from its aggregator comes down the node session, never from a file.

1. A real aggregator (hang timeout 1 s, finalization budget 2 s), two ranks' real SDK clients
   (rank 0 completes 1 step and finishes; rank 1 completes 1 step, then none) and real launcher
   sessions (:class:`traceml.launcher.session.NodeSession`): node 0's session hears the stall
   record naming rank 1, then the watchdog's partial summary naming rank 1 missing; node 1's
   session, opened after both, hears the same two (the latest of each kind is pushed to a
   session that opens later); once rank 1 moves, both hear that the stall is over.
2. ``traceml run`` of a job whose rank 1 hangs after its last step, with the run's
   ``aggregator/stall.json`` made unreadable (a directory of that name, so the aggregator
   cannot mirror the record there): node 0's launcher still prints the hang line once, the
   partial summary line, and, after SIGTERM, the final summary. Before the stall record came
   down the session, the launcher read it from that file and printed no hang line.
"""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
from conftest import SCRIPTS, start_traceml, wait_for
from helpers.batches import node_claim
from helpers.jobs import HANG_AFTER_THE_LAST_STEP, HANG_TIMING_ENV, run_args
from live_aggregator import LiveAggregator, finish, step

from traceml import wire
from traceml.launcher.session import NodeSession
from traceml.sdk import client as client_mod
from traceml.sdk.client import ClientConfig, TelemetryClient

pytestmark = [pytest.mark.slow, pytest.mark.aggregator]

HANG_S = 1.0
BUDGET_S = 2.0


def claim(node_rank: int) -> wire.NodeClaim:
    hostname = socket.gethostname() if node_rank == 0 else "node1"
    return node_claim(node_rank, nnodes=2, hostname=hostname, launcher_pid=os.getpid())


def stalled_ranks(session: NodeSession) -> list[int] | None:
    return (
        [e["rank"] for e in json.loads(session.hang_record)["ranks"]]
        if session.hang_record
        else None
    )


def test_stall_and_partial_summary_come_down_every_session(tmp_path):
    run_dir = tmp_path / "run"
    flags = (
        "--nnodes",
        "2",
        "--hang-timeout-sec",
        str(HANG_S),
        "--finalize-timeout-sec",
        str(BUDGET_S),
    )
    agg = LiveAggregator(run_dir, "r", world_size=2, extra_args=flags)
    with agg:
        node0 = NodeSession(agg.target, claim(0)).start()
        node1 = None
        assert node0.wait_claim(30).accepted
        assert (node0.hang_record, node0.partial_summary) == (None, None)
        config = ClientConfig(
            flush_interval_s=0.02, rpc_timeout_s=2.0, heartbeat_s=0.2, max_backoff_s=0.5
        )
        progress = {0: (1, "forward"), 1: (1, "forward")}
        ranks = {
            r: TelemetryClient(
                agg.target, "r", rank=r, config=config, warn=print, progress=lambda r=r: progress[r]
            )
            for r in (0, 1)
        }
        try:
            for rank in ranks.values():
                rank.submit(client_mod.STEPS, step(0))
            assert ranks[0].close(finish(1), timeout_s=30) is True
            wait_for(lambda: stalled_ranks(node0), 60, "the stall down node 0's session")
            record = json.loads(node0.hang_record)
            assert record["suspects"] == [1]
            assert [(e["rank"], e["steps_completed"]) for e in record["ranks"]] == [(1, 1)]
            wait_for(lambda: node0.partial_summary, 60, "the partial summary")
            partial = node0.partial_summary
            assert list(partial.missing_ranks) == [1] and partial.complete is False
            assert partial.summary_json_path == str(run_dir / "final_summary.json")
            assert (partial.error, partial.summary_text) == ("", "")  # paths only, no text

            node1 = NodeSession(agg.target, claim(1)).start()
            assert node1.wait_claim(30).accepted
            wait_for(lambda: node1.hang_record and node1.partial_summary, 30, "node 1's replay")
            assert json.loads(node1.hang_record) == json.loads(node0.hang_record)
            assert list(node1.partial_summary.missing_ranks) == [1]

            progress[1] = (2, "forward")  # rank 1 moves: the stall is over
            ranks[1].submit(client_mod.STEPS, step(1))
            wait_for(
                lambda: node0.hang_record == "" and node1.hang_record == "",
                60,
                "the end of the stall",
            )
            assert ranks[1].close(finish(2), timeout_s=30) is True
        finally:
            for session in (node0, node1):
                if session is not None:
                    session.close()
        assert agg.stop() == 0
    assert "the stalled ranks make progress again" in agg.log()


@pytest.mark.torchrun
def test_hang_line_partial_and_final_summary_without_the_stall_file(tmp_path, port):
    run_dir = tmp_path / "logs" / "nofile"
    (run_dir / "aggregator" / "stall.json").mkdir(parents=True)  # unreadable as a record
    args = run_args(
        tmp_path,
        SCRIPTS / "faulty_ddp.py",
        "nofile",
        port,
        "--hang-timeout-sec",
        "2",
        "--finalize-timeout-sec",
        "6",
        *HANG_AFTER_THE_LAST_STEP,
    )
    launcher = start_traceml(args, tmp_path, tmp_path / "launcher", env=HANG_TIMING_ENV)
    err = tmp_path / "launcher.err"
    try:
        wait_for(lambda: "partial summary written" in err.read_text(), 180, "the partial line")
        wait_for(lambda: "hang: rank 1 made no progress" in err.read_text(), 30, "the hang line")
        assert launcher.poll() is None  # TraceML never stops a job
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(90)
    assert code == 1  # torchrun's, stopped
    lines = err.read_text().splitlines()
    [hang] = [line for line in lines if "hang:" in line]
    assert hang.startswith("traceml: hang: rank 1 made no progress for ")
    assert hang.endswith("(rank 1: 6 steps done, in idle); suspect: rank 1")
    [partial] = [line for line in lines if "partial summary written" in line]
    assert partial == (
        f"traceml: partial summary written to {run_dir / 'final_summary.json'}: ranks [1] have "
        "not finished 6 s (--finalize-timeout-sec) after the first rank ended; training keeps "
        "running (TraceML never stops it; Ctrl-C does)"
    )
    assert f"traceml: summary: {run_dir / 'final_summary.json'}" in lines
    text = (run_dir / "final_summary.txt").read_text()
    assert text in (tmp_path / "launcher.out").read_text()  # printed from the stream's reply
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["exit_code"] == 1
    assert manifest["partial_summary"]["missing_ranks"] == [1]
    assert (run_dir / "aggregator" / "stall.json").is_dir()  # the file never existed
