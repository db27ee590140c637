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
reaches the summary. The ranks stream through their node's relay (traceml/launcher/relay.py,
the default): the cut also breaks node 1's relay call, which comes back with the session.

And node 1's launcher SIGKILLed mid-run: its relay dies with it (and its torchrun and rank), node
1 is reported lost with its rank, node 0's summary is written, and nothing of node 0 is lost.
And node 1's launcher SIGSTOPped past the bound while its rank trains on: lost with its session
stream still open, back as it thaws without a new session, nothing lost.
Needs root and ``ip`` (iproute2); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from conftest import (
    SCRIPTS,
    assert_all_gone,
    load_summary,
    process_family,
    query,
    reaped,
    start_traceml,
    wait_for,
    wait_training_started,
)
from helpers.aggregator import relay_calls
from helpers.netns import node_args, two_hosts

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


def assert_every_step_stored(summary: dict, steps: int) -> None:
    """Both ranks completed ``steps`` steps and the summary received every one."""
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert {r: v["steps_completed"] for r, v in ranks.items()} == {0: steps, 1: steps}
    assert {r: v["records_received"] for r, v in ranks.items()} == {0: steps, 1: steps}


@pytest.fixture
def hosts():
    """Namespaces joined by a training and a telemetry link (tests/netns_hosts.py)."""
    with two_hosts("tmls", TRAIN, TELEMETRY) as two:
        yield two


def start_nodes(
    hosts, tmp_path, name: str, script_args: list[str], extra: list[str], **env_of_run: str
) -> dict:
    """Node 1's launcher, then node 0's, on their hosts: ``SCRIPT`` with ``script_args``,
    run ``name``, the aggregator on node 0's telemetry address, ``extra`` flags;
    ``env_of_run``: more environment variables of both (over this module's)."""
    procs = {}
    for node in (1, 0):
        args = node_args(
            node,
            SCRIPT,
            name,
            f"--aggregator-host={TELEMETRY[0]}",
            *extra,
            *script_args,
            nproc=1,
            master_addr=TRAIN[0],
            logs_dir=tmp_path / f"host{node}",
        )
        if node == 0:
            args.append(f"--aggregator-bind-host={TELEMETRY[0]}")
        env = {
            "GLOO_SOCKET_IFNAME": hosts.links["train"][node],
            "TRACEML_RUN_TOKEN": f"{name}-token",
            settings.NODE_LOST_AFTER_SEC.name: f"{LOST_AFTER_S:g}",
            settings.GRPC_KEEPALIVE_TIMEOUT_MS.name: str(KEEPALIVE_TIMEOUT_MS),
            **env_of_run,
        }
        procs[node] = start_traceml(
            args,
            tmp_path,
            tmp_path / f"node{node}",
            prefix=hosts.prefix(node),
            env=env,
        )
    return procs


def test_cut_session_is_lost_within_the_bound_then_resumes_with_nothing_lost(hosts, tmp_path):
    procs = start_nodes(
        hosts, tmp_path, "cut", ["--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP_S)], []
    )
    run_dir = tmp_path / "host0" / "cut"
    with reaped(procs):
        wait_training_started(run_dir, procs[0], tmp_path / "node0.err", 180)
        time.sleep(2 * NODE_HEARTBEAT_INTERVAL_S)  # node 1's session and ranks are streaming
        hosts.set_link("tel", 1, "down")
        cut_at = time.time()
        time.sleep(CUT_S)  # past the bound: the aggregator marks node 1 lost meanwhile
        assert procs[0].poll() is None and procs[1].poll() is None  # training goes on
        hosts.set_link("tel", 1, "up")
        up_at = time.time()
        codes = {node: p.wait(300) for node, p in procs.items()}
    assert codes == {0: 0, 1: 0}, (tmp_path / "node1.err").read_text()

    summary = load_summary(run_dir)
    assert summary["run"]["complete"] is True and summary["run"]["nodes"] == [0, 1]
    assert_every_step_stored(summary, STEPS)
    ends = {r["rank"]: r["end"]["state"] for r in summary["ranks"]}
    assert ends == {0: "completed", 1: "completed"}
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
    # Each node's ranks and sampler went through its relay: node 0's one call, node 1's first
    # and the one it opened again after the cut (or more: each failure of it is one more).
    assert relay_calls((run_dir / "aggregator" / "process.stderr.log").read_text()) >= 3
    assert "the node relay lost node 0's aggregator" in err1
    streams = {
        (e["sender"], e["id"]): e for e in summary["run"]["telemetry_health"]["sender_streams"]
    }
    assert streams[("rank", 1)]["streams"] >= 2 and streams[("rank", 0)]["streams"] == 1
    assert {k: (e["state"], e["finished"]) for k, e in streams.items() if k[0] == "rank"} == {
        ("rank", 0): ("closed", True),
        ("rank", 1): ("closed", True),
    }


#: The frozen-launcher run: its ``NODE_LOST_AFTER_S`` (s), and node 0's keepalive interval (ms),
#: long enough that no ping of node 0's meets the frozen launcher (one left unanswered would
#: drop the session after the keepalive timeout, and the new session after the thaw would be
#: what resumes the node): the session stream outlives the freeze, as it may in a real stall.
FREEZE_LOST_AFTER_S, FREEZE_SERVER_KEEPALIVE_MS = 3.0, 600_000
FREEZE_STEPS, FREEZE_STEP_SLEEP_S = 30, 0.5


def test_a_frozen_launcher_on_node_1_is_lost_then_back_as_it_thaws_and_nothing_is_lost(
    hosts, tmp_path
):
    """Node 1's launcher stopped (SIGSTOP: a stalled host, a paused VM) past the bound while
    its torchrun and rank train on: node 0 marks the node lost with its session stream still
    open, and back as soon as the launcher speaks again (on that session or through its relay:
    no new session comes); both ranks' every step stored, both launchers exit 0, and the loss
    is a warning."""
    procs = start_nodes(
        hosts,
        tmp_path,
        "freeze",
        ["--steps", str(FREEZE_STEPS), "--step-sleep", str(FREEZE_STEP_SLEEP_S)],
        [],
        **{
            settings.NODE_LOST_AFTER_SEC.name: f"{FREEZE_LOST_AFTER_S:g}",
            settings.GRPC_SERVER_KEEPALIVE_MS.name: str(FREEZE_SERVER_KEEPALIVE_MS),
        },
    )
    run_dir = tmp_path / "host0" / "freeze"
    aggregator_log = run_dir / "aggregator" / "process.stderr.log"
    with reaped(procs):
        wait_training_started(run_dir, procs[0], tmp_path / "node0.err", 180)
        time.sleep(2 * NODE_HEARTBEAT_INTERVAL_S)  # node 1's relay carries its heartbeats
        os.kill(procs[1].pid, signal.SIGSTOP)
        frozen_at = time.time()
        wait_for(lambda: "lost: nothing from its launcher" in aggregator_log.read_text(), 30)
        thawed_at = time.time()  # before: the thawed launcher may be heard at once
        os.kill(procs[1].pid, signal.SIGCONT)
        codes = {node: p.wait(300) for node, p in procs.items()}
    assert codes == {0: 0, 1: 0}, (tmp_path / "node1.err").read_text()

    summary = load_summary(run_dir)
    assert_every_step_stored(summary, FREEZE_STEPS)
    (loss,) = summary["run"]["telemetry_health"]["node_losses"]
    assert (loss["node_rank"], loss["lost_after_s"]) == (1, FREEZE_LOST_AFTER_S)
    # the record's times are rounded to the ms
    assert frozen_at < loss["lost_unix_s"] < thawed_at
    assert round(thawed_at, 3) <= loss["resumed_unix_s"] < thawed_at + 10
    (finding,) = [f for f in summary["findings"]["health"] if f["kind"] == "NODE_LOST"]
    assert (finding["severity"], finding["nodes"]) == ("warning", [1])
    log = aggregator_log.read_text()
    assert "its session stream is still open but silent" in log
    assert "node 1's session broke" not in log  # no new session: the kept one, or the relay
    assert " is back: " in log


#: Steps and step time of the killed-launcher run: long enough that node 1 is killed mid-run.
KILL_STEPS, KILL_STEP_SLEEP_S = 400, 0.05


@pytest.mark.parametrize("lost_after_s", [LOST_AFTER_S, 60.0], ids=["bound", "summary-first"])
def test_a_killed_launcher_on_node_1_is_lost_its_rank_stopped_and_nothing_is_lost(
    hosts, tmp_path, lost_after_s
):
    """Node 1's launcher SIGKILLed mid-run: node 1 is lost, its rank stopped (its end sent
    straight to node 0), nothing lost. Rank 0 fails at once in gloo, so the run ends within
    seconds: with a 60 s bound (default 25 s) the summary comes before it, and node 1, whose
    session broke and who reported no exit, is marked lost then (it was missing from the
    summary before: no NODE_LOST, its exit code unknown)."""
    step_log = tmp_path / "steps"
    step_log.mkdir()
    script_args = ["--steps", str(KILL_STEPS), "--step-sleep", str(KILL_STEP_SLEEP_S)]
    procs = start_nodes(
        hosts,
        tmp_path,
        "kill",
        [*script_args, "--step-log", str(step_log)],
        [f"--finalize-timeout-sec={LOST_AFTER_S + 3 * NODE_HEARTBEAT_INTERVAL_S:g}"],
        **{settings.NODE_LOST_AFTER_SEC.name: f"{lost_after_s:g}"},
    )
    run_dir = tmp_path / "host0" / "kill"
    with reaped(procs):
        wait_training_started(run_dir, procs[0], tmp_path / "node0.err", 180)
        rank1_log = step_log / "rank1.log"
        wait_for(lambda: rank1_log.exists() and len(rank1_log.read_text().splitlines()) >= 40, 60)
        node1 = process_family(procs[1].pid)  # the launcher (ip netns exec execs it), torchrun,
        assert "run" in node1[0].cmdline() and len(node1) >= 3  # its rank
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.time()
        assert procs[1].wait(30) == -signal.SIGKILL
        assert_all_gone(node1)  # torchrun and its rank die with their launcher
        code0 = procs[0].wait(180)  # rank 0 fails in gloo as its peer vanished
    assert code0 != 0, (tmp_path / "node0.err").read_text()[-3000:]

    summary = load_summary(run_dir)
    run = summary["run"]
    # Rank 1 was stopped by its torchrun as the launcher died (SIGTERM): its relay gone, it
    # sent its last steps and its end straight to node 0, so the run is complete.
    assert run["complete"] is True and run["missing_ranks"] == []
    (loss,) = run["telemetry_health"]["node_losses"]
    assert loss["node_rank"] == 1 and loss["resumed_unix_s"] is None
    assert killed_at < loss["lost_unix_s"] <= killed_at + lost_after_s + 2 * LOST_CHECK_S + 1
    if lost_after_s > LOST_AFTER_S:  # marked lost as the summary was written, not by the bound
        assert loss["lost_after_s"] < lost_after_s
    findings = {f["kind"]: f for f in summary["findings"]["health"]}
    assert (findings["NODE_LOST"]["severity"], findings["NODE_LOST"]["nodes"]) == ("critical", [1])
    ends = {r["rank"]: (r["end"]["state"], r["end"]["reason"]) for r in summary["ranks"]}
    assert ends[0][0] == "failed" and ends[1] == ("signaled", "SIGTERM")
    streams = {
        (e["sender"], e["id"]): (e["state"], e["streams"])
        for e in run["telemetry_health"]["sender_streams"]
    }
    # Node 1's sampler was lost with its relay's call; rank 1's channel too, then its own
    # stream to node 0 closed; node 0's closed.
    assert streams == {
        ("rank", 0): ("closed", 1),
        ("rank", 1): ("closed", 2),
        ("node", 0): ("closed", 1),
        ("node", 1): ("lost", 1),
    }
    # Nothing is lost: every step each rank logged is stored, none dropped.
    health = {r["rank"]: r for r in run["telemetry_health"]["ranks"]}
    for rank in (0, 1):
        produced = len((step_log / f"rank{rank}.log").read_text().splitlines())
        assert (health[rank]["steps_produced"], health[rank]["steps_received"]) == (
            produced,
            produced,
        )
        assert health[rank]["steps_dropped"] == 0 and health[rank]["final"] is True
        assert query(run_dir, f"SELECT COUNT(*) FROM steps WHERE rank = {rank}") == [(produced,)]
    assert relay_calls((run_dir / "aggregator" / "process.stderr.log").read_text()) == 2
