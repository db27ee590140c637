"""A node's session stream cut by a real link going down, and coming back.

Two network namespaces (two hosts) joined by two veth pairs: one carries torch's rendezvous
and gloo (``10.241.0.0/24``), the other the telemetry (``10.242.0.0/24``): node 0's aggregator
listens only there, so node 1's launcher session and its ranks' batches cross only that link.
Setting that link down cuts node 1's session while training goes on over the other one; the
aggregator must mark node 1 lost (read from its store while the run goes on) within the
documented bound (traceml_aggregator/sessions.py: between ``NODE_LOST_AFTER_S`` - heartbeat
and ``NODE_LOST_AFTER_S`` + heartbeat + 1 s after the cut, ``NODE_LOST_AFTER_S`` set to
:data:`LOST_AFTER_S` through its setting so the cut is short; asserted from the time the
aggregator itself recorded in its store, whose lock keeps readers out while it serves), and
once the link is back, the session resumes and nothing is lost: every rank's exact step count
reaches the summary.
Needs root and ``ip`` (iproute2); skipped otherwise.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from conftest import SCRIPTS, load_summary, query, start_traceml, wait_training_started
from helpers.netns import two_hosts

from traceml import settings
from traceml.core.transport import NODE_HEARTBEAT_INTERVAL_S
from traceml_aggregator.sessions import LOST_CHECK_S

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.netns, pytest.mark.serial]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
#: The aggregator's ``NODE_LOST_AFTER_S`` in this test, s (``TRACEML_NODE_LOST_AFTER_SEC``;
#: default 25): five heartbeats missed.
LOST_AFTER_S = 5 * NODE_HEARTBEAT_INTERVAL_S
#: The keepalive timeout in this test, ms (``TRACEML_GRPC_KEEPALIVE_TIMEOUT_MS``; default 20 s):
#: node 1's launcher sees its stream broken this long after its first unanswered heartbeat
#: (gRPC bounds unacknowledged data by it too) and opens a new session, which is what resumes
#: the node, once the link is back. The order of the defaults is kept: broken, then lost.
KEEPALIVE_TIMEOUT_MS = 4_000
STEPS = 35  # at 1 s a step, training outlasts the cut by more than 10 s
STEP_SLEEP_S = 1.0
#: How long the telemetry link stays down, s: past the bound, so node 1 is lost for a while.
CUT_S = LOST_AFTER_S + NODE_HEARTBEAT_INTERVAL_S + LOST_CHECK_S + 4.0
TRAIN = ("10.241.0.1", "10.241.0.2")
TELEMETRY = ("10.242.0.1", "10.242.0.2")


@pytest.fixture
def hosts():
    """Namespaces joined by a training and a telemetry link (tests/netns_hosts.py)."""
    with two_hosts("tmls", TRAIN, TELEMETRY) as two:
        yield two


def test_cut_session_is_lost_within_the_bound_then_resumes_with_nothing_lost(hosts, tmp_path):
    procs = {}
    for node in (0, 1):
        args = [
            "run",
            SCRIPT,
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            f"--master-addr={TRAIN[0]}",
            "--run-name=cut",
            f"--logs-dir={tmp_path / f'host{node}'}",
            f"--aggregator-host={TELEMETRY[0]}",
            "--steps",
            str(STEPS),
            "--step-sleep",
            str(STEP_SLEEP_S),
        ]
        if node == 0:
            args.append(f"--aggregator-bind-host={TELEMETRY[0]}")
        env = {
            "GLOO_SOCKET_IFNAME": hosts.links["train"][node],
            "TRACEML_RUN_TOKEN": "cut-token",
            settings.NODE_LOST_AFTER_SEC.name: f"{LOST_AFTER_S:g}",
            settings.GRPC_KEEPALIVE_TIMEOUT_MS.name: str(KEEPALIVE_TIMEOUT_MS),
        }
        procs[node] = start_traceml(
            args,
            tmp_path,
            tmp_path / f"node{node}",
            prefix=hosts.prefix(node),
            env=env,
        )
    run_dir = tmp_path / "host0" / "cut"
    try:
        wait_training_started(run_dir, procs[0], tmp_path / "node0.err", 180)
        time.sleep(2 * NODE_HEARTBEAT_INTERVAL_S)  # node 1's session and ranks are streaming
        hosts.set_link("tel", 1, "down")
        cut_at = time.time()
        time.sleep(CUT_S)  # past the bound: the aggregator marks node 1 lost meanwhile
        assert procs[0].poll() is None and procs[1].poll() is None  # training goes on
        hosts.set_link("tel", 1, "up")
        up_at = time.time()
        codes = {node: p.wait(300) for node, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert codes == {0: 0, 1: 0}, (tmp_path / "node1.err").read_text()

    summary = load_summary(run_dir)
    assert summary["run"]["complete"] is True and summary["run"]["nodes"] == [0, 1]
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert {r: v["steps_completed"] for r, v in ranks.items()} == {0: STEPS, 1: STEPS}
    assert {r: v["records_received"] for r, v in ranks.items()} == {0: STEPS, 1: STEPS}
    assert {r: v["end"]["state"] for r, v in ranks.items()} == {0: "completed", 1: "completed"}
    assert {n["node_rank"]: n["exit_code"] for n in summary["nodes"]} == {0: 0, 1: 0}
    # The aggregator's own record (its store's node_losses, which the summary reports).
    (loss,) = summary["run"]["telemetry_health"]["node_losses"]
    assert json.loads(query(run_dir, "SELECT value FROM meta WHERE key = 'node_losses'")[0][0]) == [
        loss
    ]
    assert loss["node_rank"] == 1 and loss["hostname"] == socket.gethostname()
    assert loss["lost_after_s"] == LOST_AFTER_S
    lost_in_s = loss["lost_unix_s"] - cut_at
    # The documented bound: NODE_LOST_AFTER_S after node 1's last message, which came at most
    # one heartbeat before the cut; the watch looks every LOST_CHECK_S (1 s of slack for load).
    assert LOST_AFTER_S - NODE_HEARTBEAT_INTERVAL_S <= lost_in_s, lost_in_s
    assert lost_in_s <= LOST_AFTER_S + NODE_HEARTBEAT_INTERVAL_S + LOST_CHECK_S + 1.0, lost_in_s
    assert loss["lost_unix_s"] - loss["last_heard_unix_s"] >= LOST_AFTER_S
    assert loss["lost_unix_s"] < up_at  # marked while the link was down, not after
    # Resumed once the link was back: the launcher's backoff is at most 2 s.
    assert loss["resumed_unix_s"] is not None and 0 < loss["resumed_unix_s"] - up_at < 10.0
    (finding,) = [f for f in summary["findings"]["health"] if f["kind"] == "NODE_LOST"]
    assert finding["severity"] == "warning" and finding["nodes"] == [1]
    assert finding["summary"].startswith("The aggregator lost node 1 (")
    assert (
        f"s later: nothing came from the node's launcher for {LOST_AFTER_S:g} s"
        in finding["summary"]
    )
    err1 = (tmp_path / "node1.err").read_text()
    assert "could not report" not in err1
