"""Two nodes on this machine: two `traceml run` launchers, 2 nodes x 2 ranks, one run directory.

Node 1 starts first and waits for node 0's aggregator; node 0 starts NODE0_DELAY_S after node 1
began to wait (slow environment setup on node 0 must not make node 1 give up: node 1 probes
every 0.05 s plus gRPC's reconnect backoff of at most 0.1 s, traceml/launcher/aggregator.py's
wait_serving, so it has failed dozens of probes by then). Both write into one shared
``--logs-dir``; each file has one writer.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
from conftest import SCRIPTS, free_port, load_summary, start_traceml, wait_all, wait_for
from helpers.aggregator import listening_port
from helpers.jobs import wait_training_started

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
STEPS = 8
NODE0_DELAY_S = 5.0


def node_1_waiting(common: list[str], tmp_path):
    """Node 1's launcher of ``traceml`` arguments ``common``, started (log prefix
    ``tmp_path/node1``) and waiting for node 0's aggregator."""
    launcher = start_traceml(common + ["--node-rank=1"], tmp_path, tmp_path / "node1")
    wait_for(
        lambda: "for node 0's aggregator" in (tmp_path / "node1.err").read_text(),
        120,
        "node 1 to wait for node 0's aggregator",
    )
    return launcher


def test_two_nodes_share_one_run(tmp_path):
    logs = tmp_path / "logs"
    run_dir = logs / "two-nodes"
    common = [
        "run",
        SCRIPT,
        "--nnodes=2",
        "--nproc-per-node=2",
        "--run-name=two-nodes",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        f"--aggregator-port={free_port()}",
        f"--logs-dir={logs}",
        "--steps",
        str(STEPS),
    ]
    procs = {1: node_1_waiting(common, tmp_path)}
    time.sleep(NODE0_DELAY_S)  # node 0 is late on purpose
    # While node 1 waits, it has written only its own files.
    assert procs[1].poll() is None, (tmp_path / "node1.err").read_text()
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")) == [
        "nodes",
        "nodes/node_1",
        "nodes/node_1/manifest.json",
    ]
    procs[0] = start_traceml(common + ["--node-rank=0"], tmp_path, tmp_path / "node0")
    codes = wait_all(procs, 300)
    assert codes == {0: 0, 1: 0}, (tmp_path / "node0.err").read_text()

    summary = load_summary(run_dir)
    assert summary["run"]["world_size"] == 4
    assert summary["run"]["complete"] is True
    assert summary["run"]["nodes"] == [0, 1]
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert {r: v["node_rank"] for r, v in ranks.items()} == {0: 0, 1: 0, 2: 1, 3: 1}
    assert {r: v["steps_completed"] for r, v in ranks.items()} == dict.fromkeys(range(4), STEPS)
    assert {r: v["records_received"] for r, v in ranks.items()} == dict.fromkeys(range(4), STEPS)
    assert {r: v["end"]["state"] for r, v in ranks.items()} == dict.fromkeys(range(4), "completed")
    # Both launchers reported their torchrun's exit before node 0 finalized.
    assert {n["node_rank"]: n["exit_code"] for n in summary["nodes"]} == {0: 0, 1: 0}
    assert "could not report" not in (tmp_path / "node1.err").read_text()

    # Each node's training output, in its own directory (and on its console).
    for node, node_ranks in ((0, (0, 1)), (1, (2, 3))):
        node_dir = run_dir / "nodes" / f"node_{node}"
        out = (node_dir / "training.stdout.log").read_text()
        for rank in node_ranks:
            assert f"faulty_ddp: rank {rank} trained {STEPS} steps" in out
        assert (node_dir / "training.stderr.log").is_file()
        assert out in (tmp_path / f"node{node}.out").read_text()
    assert "waiting up to 300 s for node 0's aggregator" in (tmp_path / "node1.err").read_text()

    # Node 0 alone owns the aggregator: its log, its health fields, the summary.
    assert (
        "traceml-aggregator: serving run 'two-nodes'"
        in (run_dir / "aggregator" / "process.stderr.log").read_text()
    )
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["launch"]["node_rank"] == 0
    assert manifest["launch"]["aggregator_bind_host"] == "0.0.0.0"
    health = manifest["aggregator"]
    assert health["status"] == "stopped" and health["exit_code"] == 0
    assert isinstance(health["pid"], int)
    node1 = json.loads((run_dir / "nodes" / "node_1" / "manifest.json").read_text())
    assert "aggregator" not in node1
    assert node1["status"] == "completed" and node1["telemetry_reported"] is True
    assert [r["end_state"] for r in node1["ranks"]] == ["completed", "completed"]
    # SQLite left one self-contained file: no WAL, no shared-memory index.
    assert sorted(p.name for p in run_dir.glob("telemetry.sqlite*")) == ["telemetry.sqlite"]


def test_node_0_failing_its_rendezvous_stops_node_1_and_the_run_ends_at_once(tmp_path):
    """Node 0's torchrun fails before it starts its ranks (its --master-port is held by
    another process); node 1 waits in the rendezvous node 0 would have hosted. The aggregator
    takes node 0's exit as the run's failure to rendezvous and pushes it to node 1, whose
    launcher stops its torchrun: both end within seconds, and the summary names why (before:
    node 0 waited out its 300 s finalization budget for node 1's rank, and node 1 waited in
    torch's store for 15 min)."""
    logs = tmp_path / "logs"
    with listening_port() as master_port:
        common = [
            "run",
            SCRIPT,
            "--nnodes=2",
            "--nproc-per-node=1",
            "--run-name=rdzv-fail",
            "--master-addr=127.0.0.1",
            f"--master-port={master_port}",
            f"--aggregator-port={free_port()}",
            f"--logs-dir={logs}",
            "--steps",
            str(STEPS),
        ]
        procs = {1: node_1_waiting(common, tmp_path)}
        started = time.monotonic()
        procs[0] = start_traceml(common + ["--node-rank=0"], tmp_path, tmp_path / "node0")
        codes = wait_all(procs, 120)
        took_s = time.monotonic() - started
    err0, err1 = ((tmp_path / f"node{n}.err").read_text() for n in (0, 1))
    assert codes[0] == 1, err0  # plain torchrun's: its rendezvous failed
    assert codes[1] == 1, err1  # plain torchrun's when its rendezvous fails
    assert took_s < 60, (took_s, err0, err1)
    summary = load_summary(logs / "rdzv-fail")
    (rank0, rank1) = (r["end"] for r in summary["ranks"])
    assert rank0["state"] == "not_started" and "EADDRINUSE" in rank0["reason"], rank0
    why = f"node 0's torchrun ended before it started its ranks ({rank0['reason']})"
    assert f"error: the run cannot rendezvous: {why}; stopping training on this node" in err1
    assert rank1 == {
        "state": "not_started",
        "exit_code": None,
        "signal": None,
        "reason": f"stopped: the run cannot rendezvous: {why}",
    }
    assert summary["run"]["status"] == "failed" and summary["run"]["missing_ranks"] == []
    assert summary["primary_diagnosis"]["kind"] == "NODE_FAILED"
    verdict = summary["primary_diagnosis"]
    assert verdict["evidence"]["not_started"] == verdict["ranks"] == [0, 1]


def test_node_0_stopped_in_the_rendezvous_interrupts_the_run_it_fails_nowhere(tmp_path):
    """Three nodes; node 2 never comes, and nodes 0 and 1 wait for it in the rendezvous, as
    each launcher says. The user stops node 0 (scancel of its step, Ctrl-C). Node 1 cannot
    rendezvous without it, and stops too, but nothing failed: the run is ``interrupted``, its
    verdict ``RUN_INTERRUPTED``, and no node ``NODE_FAILED`` (before: node 1's ranks were a
    failure to rendezvous, and the verdict said node 1 failed)."""
    logs = tmp_path / "logs"
    master_port = free_port()
    common = [
        "run",
        SCRIPT,
        "--nnodes=3",
        "--nproc-per-node=1",
        "--run-name=rdzv-stop",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
        f"--aggregator-port={free_port()}",
        f"--logs-dir={logs}",
    ]
    env = {"TRACEML_RENDEZVOUS_WARN_SEC": "1"}
    procs = {1: start_traceml(common + ["--node-rank=1"], tmp_path, tmp_path / "node1", env=env)}
    procs[0] = start_traceml(common + ["--node-rank=0"], tmp_path, tmp_path / "node0", env=env)
    waits = f"it waits in its rendezvous at 127.0.0.1:{master_port} for all 3 nodes"
    for err in (tmp_path / "node0.err", tmp_path / "node1.err"):
        wait_for(lambda err=err: waits in err.read_text(), 120, f"{err.stem} to wait")
    procs[0].send_signal(signal.SIGTERM)
    codes = wait_all(procs, 120)
    err0, err1 = ((tmp_path / f"node{n}.err").read_text() for n in (0, 1))
    # node 1's torchrun was stopped by its launcher, or died as node 0's store closed (plain
    # torchrun's DistNetworkError) just before node 0's word came: the same run either way
    assert codes[0] == 143 and codes[1] in (1, 143), (codes, err0, err1)
    why = "interrupted: node 0's launcher got SIGTERM (scancel, preemption or Ctrl-C)"
    assert f"traceml: the run was {why}; stopping training on this node too\n" in err1
    assert "traceml: error" not in err1, err1
    summary = load_summary(logs / "rdzv-stop")
    assert summary["run"]["status"] == "interrupted"
    for manifest in ("manifest.json", "nodes/node_1/manifest.json"):
        assert json.loads((logs / "rdzv-stop" / manifest).read_text())["status"] == "interrupted"
    ends = [(r["rank"], r["end"]["state"], r["end"]["signal"]) for r in summary["ranks"]]
    assert ends == [
        (0, "not_started", signal.SIGTERM),
        (1, "not_started", None),
        (2, "never_reported", None),
    ]
    assert summary["ranks"][1]["end"]["reason"] == why
    assert summary["primary_diagnosis"]["kind"] == "RUN_INTERRUPTED"
    health = [f["kind"] for f in summary["findings"]["health"]]
    assert health == ["RANK_NEVER_REPORTED"], health


def test_node_0_stopped_while_training_interrupts_node_1_which_fails_nowhere(tmp_path):
    """Two nodes train; the user stops node 0 alone (Ctrl-C in its terminal: SIGINT to its
    launcher). Its launcher tells node 0's aggregator at once, which tells node 1's, which
    stops its torchrun too: node 1's rank ends ``terminated``, interrupted by node 0's
    launcher's signal, not ``failed`` of its collective's closed connection. The run is
    ``interrupted``, and no rank crashed, no node failed (before: status ``failed``, with
    ``RANK_CRASHED`` and ``NODE_FAILED`` on node 1)."""
    logs = tmp_path / "logs"
    common = [
        "run",
        SCRIPT,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--run-name=stop-0",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        f"--aggregator-port={free_port()}",
        f"--logs-dir={logs}",
        "--steps",
        "100000",
    ]
    procs = {1: node_1_waiting(common, tmp_path)}
    procs[0] = start_traceml(common + ["--node-rank=0"], tmp_path, tmp_path / "node0")
    wait_training_started(logs / "stop-0", procs[0], tmp_path / "node0.err")
    procs[0].send_signal(signal.SIGINT)
    codes = wait_all(procs, 120)
    err0, err1 = ((tmp_path / f"node{n}.err").read_text() for n in (0, 1))
    why = "interrupted: node 0's launcher got SIGINT (scancel, preemption or Ctrl-C)"
    # node 1's launcher stopped its torchrun, or its ranks died first of their peers' end
    then = "(stopping training on this node too|this node's training ended with it)"
    assert re.search(rf"^traceml: the run was {re.escape(why)}; {then}$", err1, re.M), err1
    summary = load_summary(logs / "stop-0")
    assert summary["run"]["status"] == "interrupted", (codes, err0, err1)
    ends = {r["rank"]: r["end"] for r in summary["ranks"]}
    assert (ends[0]["state"], ends[0]["signal"]) == ("terminated", signal.SIGINT), ends[0]
    assert ends[0]["reason"].startswith("interrupted: the launcher got SIGINT")
    assert (ends[1]["state"], ends[1]["reason"]) == ("terminated", why), ends[1]
    # the verdict, when too few steps were stored for a diagnosis, else a health finding
    kinds = [summary["primary_diagnosis"]["kind"]] + [
        f["kind"] for f in summary["findings"]["health"]
    ]
    assert "RUN_INTERRUPTED" in kinds, kinds
    assert not {"RANK_CRASHED", "NODE_FAILED", "RANK_TERMINATED"} & set(kinds), kinds
    said = [summary["primary_diagnosis"]] + summary["findings"]["health"]
    interrupted = next(f for f in said if f["kind"] == "RUN_INTERRUPTED")
    assert interrupted["summary"].startswith(
        "The run was interrupted: ranks 0, 1 stopped when node 0's launcher got signal 2 "
    ), interrupted["summary"]
    assert interrupted["action"] == "Nothing failed; resubmit or resume from the last checkpoint."
    for manifest in ("manifest.json", "nodes/node_1/manifest.json"):
        assert json.loads((logs / "stop-0" / manifest).read_text())["status"] == "interrupted"
