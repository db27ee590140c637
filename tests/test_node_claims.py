"""Node-rank claims: the aggregator keeps one launcher per node rank, and a wrong claim stops
the whole run fast instead of leaving node 0 in torchrun's rendezvous.

The registry's rules as unit tests; then over real gRPC against a real aggregator; then a
real node-0 launcher that a second launcher (in a Slurm step's environment, claiming rank 0
on Slurm node 1) makes stop within seconds. tests/test_slurm_lab.py does the same across two
real Slurm nodes.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from functools import partial

import grpc
import pytest
from conftest import EXAMPLES, free_port, run_traceml, start_traceml
from helpers import batches
from helpers.aggregator import aggregator_cmd
from live_aggregator import LiveAggregator
from test_slurm_flags import STEP_ENV

from traceml import wire
from traceml.core.transport import open_channel
from traceml.launcher.aggregator import stop, wait_serving
from traceml.launcher.session import NodeSession
from traceml_aggregator.nodes import NodeRegistry

#: A claim by the launcher of pid 100 on ``n1`` in a run of 3 nodes, unless the test says otherwise.
node_claim = partial(batches.node_claim, nnodes=3, hostname="n1", launcher_pid=100)


# --- the rules --------------------------------------------------------------------------------
def test_first_launcher_holds_a_rank_and_node0_is_the_aggregators_host():
    nodes = NodeRegistry(own_host="n0", nnodes=3, master_port=29500)
    assert nodes.claim(node_claim(0, hostname="n0", launcher_pid=1)) == (True, "")
    assert nodes.claim(node_claim(0, hostname="n0", launcher_pid=1)) == (True, "")  # node 0 renews
    assert nodes.claim(node_claim(1, master_port=29500)) == (True, "")
    assert nodes.claim(node_claim(1)) == (True, "")  # idempotent; no port said: not checked
    ok, reason = nodes.claim(node_claim(1, hostname="n2", launcher_pid=200))
    assert not ok
    assert reason == (
        "the launcher on n2 (pid 200) claims node rank 1, which the launcher on n1 (pid 100) holds"
    )
    # Rank 2 is still unclaimed: node 2 will never join, so the run has failed.
    assert nodes.run_failure == reason and not nodes.complete()
    # Later refusals keep the first reason.
    assert not nodes.claim(node_claim(0, hostname="n2"))[0]
    assert nodes.run_failure == reason


@pytest.mark.parametrize(
    "claim, reason",
    [
        (
            node_claim(0, hostname="n2", launcher_pid=7),
            "the launcher on n2 (pid 7) claims node rank 0, but node 0 is n0, where the aggregator "
            "runs",
        ),
        (
            node_claim(1, nnodes=2),
            "the launcher on n1 (pid 100) runs with --nnodes 2, node 0 with 3",
        ),
        (node_claim(3), "the launcher on n1 (pid 100) claims node rank 3, outside 0..2"),
        (
            node_claim(2, master_port=29501),
            "the launcher on n1 (pid 100) runs with --master-port 29501, node 0 with 29500",
        ),
        (
            node_claim(2, refusal="SLURM_NODEID says 1"),
            "the launcher on n1 (pid 100) refused to start as node 2: SLURM_NODEID says 1",
        ),
    ],
)
def test_refused_claims_fail_a_run_that_is_not_complete(claim, reason):
    nodes = NodeRegistry(own_host="n0", nnodes=3, master_port=29500)
    assert nodes.claim(claim) == (False, reason)
    assert nodes.run_failure == reason


def test_a_stray_claim_never_fails_a_run_whose_nodes_all_joined():
    nodes = NodeRegistry(own_host="n0", nnodes=2)
    assert nodes.claim(node_claim(1, nnodes=2))[0]
    assert nodes.complete()
    assert not nodes.claim(node_claim(1, hostname="late", nnodes=2))[0]
    assert not nodes.claim(node_claim(0, hostname="late", nnodes=2, refusal="wrong"))[0]
    assert nodes.run_failure == ""


# --- over gRPC --------------------------------------------------------------------------------
@pytest.mark.serial
@pytest.mark.aggregator
def test_claims_over_node_sessions_and_the_run_failure_is_pushed(tmp_path):
    """Each claim opens a node session; a refused one fails the run, and the aggregator pushes
    that down node 0's open session at once (no claim renewed, nothing polled)."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    with open(tmp_path / "aggregator.log", "wb") as log:
        aggregator = subprocess.Popen(
            aggregator_cmd(tmp_path / "r", "r", "--port", str(port), "--nnodes", "3"),
            stdin=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    sessions = []

    def session(claim) -> NodeSession:
        sessions.append(NodeSession(target, claim).start())
        return sessions[-1]

    try:
        wait_serving(target, 60, aggregator)
        here = socket.gethostname()
        node0 = session(node_claim(0, hostname=here))
        reply = node0.wait_claim(30)
        assert (reply.accepted, reply.reason, reply.run_failure) == (True, "", "")
        assert session(node_claim(1)).wait_claim(30).accepted
        stray = session(node_claim(1, hostname="n2", launcher_pid=5))
        reply = stray.wait_claim(30)
        refused_at = time.monotonic()
        assert not reply.accepted and reply.run_failure == reply.reason
        assert "which the launcher on n1 (pid 100) holds" in reply.reason
        # Pushed: node 0 hears it well within one heartbeat interval, on the session it
        # opened first (its claim was never sent again).
        while not node0.run_failure and time.monotonic() - refused_at < 5:
            time.sleep(0.01)
        assert time.monotonic() - refused_at < 0.5
        assert node0.run_failure == reply.reason and (node0.opened, node0.breaks) == (1, 0)
        # A session opened later learns it from its claim's verdict.
        late = session(node_claim(0, hostname=here)).wait_claim(30)
        assert late.accepted and late.run_failure == reply.reason
        other = session(node_claim(1, run_name="other"))
        assert other.wait_claim(30) is None
        assert other.error.startswith("FAILED_PRECONDITION: run name 'other'")
    finally:
        for s in sessions:
            s.close()
        stop(aggregator)
    assert (
        "refused a node claim: the launcher on n2 (pid 5)"
        in (tmp_path / "aggregator.log").read_text()
    )


@pytest.mark.aggregator
def test_a_launchers_stop_signal_is_pushed_to_every_node_as_the_runs_interruption(tmp_path):
    """Node 1's launcher says it got a stop signal (here a number that is no signal, as a
    hostile client might send): the aggregator pushes the run's interruption down node 0's
    session at once, in the words of an interrupted rank's reason, and stays up."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    aggregator = subprocess.Popen(
        aggregator_cmd(tmp_path / "r", "r", "--port", str(port), "--nnodes", "2"),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    sessions = []
    try:
        wait_serving(target, 60, aggregator)
        node0 = NodeSession(target, node_claim(0, hostname=socket.gethostname(), nnodes=2))
        node1 = NodeSession(target, node_claim(1, nnodes=2))
        sessions += [node0.start(), node1.start()]
        assert node0.wait_claim(30).accepted and node1.wait_claim(30).accepted
        node1.say_interrupted(99)
        why = "interrupted: node 1's launcher got signal 99 (scancel, preemption or Ctrl-C)"
        assert node0.wait_run_failure(10) == why
        assert node1.wait_run_failure(10) == why
        assert aggregator.poll() is None
    finally:
        for s in sessions:
            s.close()
        stop(aggregator)


@pytest.mark.aggregator
def test_a_session_may_report_its_own_nodes_exit_only(tmp_path):
    """Node 1's session reporting node 2's exit is refused (FAILED_PRECONDITION, counted),
    nothing of it stored, while node 2's own session goes on; its own exit is stored."""

    def session(*ups: wire.NodeUp):
        with open_channel(agg.target) as channel:
            return list(wire.AggregatorStub(channel).NodeSession(iter(ups), timeout=10))

    def claim(rank: int) -> wire.NodeUp:
        return wire.NodeUp(claim=node_claim(rank, hostname=f"n{rank}", launcher_pid=rank))

    def failed(node: int) -> wire.NodeUp:
        """Node ``node``'s exit report: exit code 1, its one rank (rank ``node``) failed."""
        ranks = [batches.rank_end(node, "failed", local_rank=0)]
        return wire.NodeUp(exit=batches.node_exit(ranks, exit_code=1, node_rank=node))

    with LiveAggregator(tmp_path / "r", "r", world_size=3, extra_args=("--nnodes", "3")) as agg:
        with pytest.raises(grpc.RpcError) as refused:
            session(claim(1), failed(2))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == "node 1's session reported the exit of node 2"
        replies = session(claim(1), failed(1), wire.NodeUp(goodbye=wire.NodeGoodbye()))
        assert [r.WhichOneof("kind") for r in replies] == ["claim", "exit_stored"]
        assert replies[0].claim.accepted
        assert agg.stop() == 0
    assert agg.query("SELECT node_rank, exit_code FROM node_exits") == [(1, 1)]
    assert agg.query("SELECT rank, node_rank FROM rank_ends") == [(1, 1)]
    rejected = json.loads(agg.query("SELECT value FROM meta WHERE key = 'rejected'")[0][0])
    assert rejected == {"exit_of_another_node": 1}
    assert "refused node 1's session reported the exit of node 2" in agg.log()


# --- launchers --------------------------------------------------------------------------------
@pytest.mark.torchrun
@pytest.mark.slow
def test_second_node0_stops_the_run_within_seconds(tmp_path):
    """Node 0 waits in torchrun's rendezvous for node 1; a launcher on Slurm node 1 that was
    told --node-rank=0 refuses to start and tells node 0, which stops instead of hanging."""
    agg_port, master_port = free_port(), free_port()
    flags = [
        str(EXAMPLES / "ddp_minimal.py"),
        "--nnodes=2",
        "--node-rank=0",
        "--run-name=twice0",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
        f"--aggregator-port={agg_port}",
        f"--logs-dir={tmp_path / 'logs'}",
    ]
    node0 = start_traceml(["run", *flags], tmp_path, tmp_path / "node0")
    try:
        wait_serving(f"127.0.0.1:{agg_port}", 120, node0)
        started = time.monotonic()
        second = run_traceml(["run", *flags], tmp_path, env=STEP_ENV, timeout=120)
        assert second.returncode == 2
        assert (
            "this is node 1 of Slurm step 77.0 (SLURM_NODEID=1), but --node-rank is 0: "
            "$SLURM_NODEID was expanded once" in second.stderr
        )
        assert (
            f"told node 0's aggregator at 127.0.0.1:{agg_port}: the run stops there too"
            in second.stderr
        )
        code = node0.wait(60)
        stopped_s = time.monotonic() - started
    finally:
        if node0.poll() is None:
            node0.kill()
    assert code != 0
    assert stopped_s < 30, stopped_s
    err = (tmp_path / "node0.err").read_text()
    assert "traceml: error: the run cannot rendezvous: the launcher on" in err
    assert "refused to start as node 0: this is node 1 of Slurm step 77.0" in err
    run_dir = tmp_path / "logs" / "twice0"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert "rendezvous_failed" in manifest["lifecycle"]
    assert manifest["status"] == "failed"
    # The summary says why nothing trained: node 0's rank was stopped before it started, for
    # the refused claim; node 1's launcher never claimed, and its rank is not awaited.
    summary = json.loads((run_dir / "final_summary.json").read_text())
    ends = [(r["rank"], r["end"]["state"]) for r in summary["ranks"]]
    assert ends == [(0, "not_started"), (1, "never_reported")]
    reason = summary["ranks"][0]["end"]["reason"]
    assert reason.startswith("stopped: the run cannot rendezvous: the launcher on "), reason
    assert summary["primary_diagnosis"]["kind"] == "NODE_FAILED"
    assert summary["run"]["missing_ranks"] == []


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_node_with_another_master_port_stops_the_run_within_seconds(tmp_path):
    """Node 1 is given another ``--master-port`` than node 0 (a batch script that derives it on
    each node): its torchrun would wait for a rendezvous store nobody serves, and node 0's for
    it, each until torch's timeout. Node 0's aggregator refuses node 1's claim instead, before
    its torchrun starts, and both launchers stop, saying why."""
    agg_port, port_0, port_1 = free_port(), free_port(), free_port()

    def flags(node_rank: int, master_port: int) -> list[str]:
        return [
            "run",
            str(EXAMPLES / "ddp_minimal.py"),
            "--nnodes=2",
            f"--node-rank={node_rank}",
            "--run-name=ports",
            "--master-addr=127.0.0.1",
            f"--master-port={master_port}",
            f"--aggregator-port={agg_port}",
            f"--logs-dir={tmp_path / 'logs'}",
        ]

    node0 = start_traceml(flags(0, port_0), tmp_path, tmp_path / "node0")
    try:
        wait_serving(f"127.0.0.1:{agg_port}", 120, node0)
        started = time.monotonic()
        node1 = run_traceml(flags(1, port_1), tmp_path, timeout=120)
        code = node0.wait(60)
        stopped_s = time.monotonic() - started
    finally:
        if node0.poll() is None:
            node0.kill()
    why = (
        re.escape(f"the launcher on {socket.gethostname()} (pid ")
        + r"\d+"
        + re.escape(f") runs with --master-port {port_1}, node 0 with {port_0}")
    )
    assert node1.returncode == 2
    assert re.search(rf"^traceml: error: node 0 refused this node: {why}$", node1.stderr, re.M)
    assert code == 1  # plain torchrun's when its rendezvous fails (its SIGTERM's 143 before)
    assert stopped_s < 30, stopped_s
    err = (tmp_path / "node0.err").read_text()
    assert re.search(
        rf"^traceml: error: the run cannot rendezvous: {why}; stopping training on this node$",
        err,
        re.M,
    ), err
    nodes = tmp_path / "logs" / "ports" / "nodes"
    refused = json.loads((nodes / "node_1" / "manifest.json").read_text())
    assert (refused["status"], refused["artifacts"]) == ("claim_refused", {})  # nothing written
    assert sorted(p.name for p in (nodes / "node_1").iterdir()) == ["manifest.json"]
    node0 = json.loads((nodes / "node_0" / "manifest.json").read_text())
    # torchrun died of the launcher's SIGTERM; the launch exits as plain torchrun's rendezvous
    assert (node0["torchrun_exit_code"], node0["exit_code"]) == (143, 1)
    assert node0["artifacts"] == {
        "training_stdout": str(nodes / "node_0" / "training.stdout.log"),
        "training_stderr": str(nodes / "node_0" / "training.stderr.log"),
    }
    summary = json.loads((tmp_path / "logs" / "ports" / "final_summary.json").read_text())
    ends = [(r["rank"], r["end"]["state"]) for r in summary["ranks"]]
    assert ends == [(0, "not_started"), (1, "never_reported")]
    assert summary["primary_diagnosis"]["kind"] == "NODE_FAILED"
    assert summary["primary_diagnosis"]["action"] == (
        "Start every node with the same --nnodes, --master-addr, --master-port and --run-name, "
        "each with its own --node-rank (the reason names the node at fault)."
    )
