"""What a cluster does to the telemetry path, on real `traceml run` jobs (gloo ranks, real
signals, real network namespaces), and what is then counted:

* a rank killed by SIGTERM sends its buffered steps and dies of SIGTERM, exactly as without
  TraceML (stored + counted unsent = the steps its own log has);
* a rank SIGKILLed after its buffer overflowed: the summary states its drops per rank from
  the counts its batches carried, though no finish marker came;
* Ctrl-C while node 0 finalizes against an aggregator that no longer answers: the launcher
  returns within seconds and leaves no process and no port behind;
* no Ctrl-C: the launcher waits the finalization's budget and slack, stops the aggregator and
  writes the summary from the store, with every step it held;
* a partition between node 1 and node 0's aggregator, longer than the aggregator's bound for a
  lost node (set short, ``TRACEML_NODE_LOST_AFTER_SEC``) and twice what node 1's buffer holds:
  node 1's step time and memory do not move, it is lost and resumes, its telemetry resumes,
  and received + dropped = produced for every rank.

Every script here is ``tests/scripts/faulty_ddp.py`` with ``--step-log``: each rank's own
count of the steps it completed (one line per step, written inside the step).
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import time
from pathlib import Path

import psutil
import pytest
from conftest import (
    SCRIPTS,
    aggregator_of,
    assert_all_gone,
    load_summary,
    process_family,
    query,
    reaped,
    run_args,
    signal_and_wait,
    start_traceml,
    wait_all,
    wait_for,
    wait_training_started,
)
from helpers.netns import ip, node_args, two_hosts

from traceml import settings

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")


def logged_steps(step_log: Path, rank: int) -> list[str]:
    """The rank's own step log lines (``step <i> <end unix s> <step s>``)."""
    path = step_log / f"rank{rank}.log"
    return path.read_text().splitlines() if path.exists() else []


def wait_logged(step_log: Path, rank: int, steps: int, launcher, err: Path, timeout_s=180):
    """Wait until rank ``rank`` logged ``steps`` steps; fails if the launcher exits first."""

    def logged() -> bool:
        assert launcher.poll() is None, err.read_text()[-3000:]
        return len(logged_steps(step_log, rank)) >= steps

    wait_for(logged, timeout_s, f"rank {rank} to log {steps} steps", poll_s=0.05)


def rank_process(launcher, rank: int) -> psutil.Process:
    """The worker process of global rank ``rank`` under ``launcher`` (torchrun's child whose
    environment says RANK=<rank>)."""

    def found() -> psutil.Process | None:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if "faulty_ddp.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(
                    rank
                ):
                    return p
            except psutil.Error:
                continue
        return None

    return wait_for(found, 60, f"rank {rank}'s process", poll_s=0.1)


def rank_ends(run_dir: Path, node: int = 0) -> dict[int, dict]:
    """Each local rank's end as the node's launcher recorded it (node manifest)."""
    manifest = json.loads((run_dir / "nodes" / f"node_{node}" / "manifest.json").read_text())
    return {r["rank"]: r for r in manifest["ranks"]}


def stored_steps(run_dir: Path, rank: int) -> int:
    return query(run_dir, "SELECT COUNT(*) FROM steps WHERE rank = ?", (rank,))[0][0]


# --- 1. SIGTERM to one rank ---------------------------------------------------------------------
def sigterm_rank_run(tmp_path: Path, port: int, label: str, env: dict) -> tuple:
    """A 2-rank run whose rank 1 gets SIGTERM after 40 logged steps; (launcher exit code,
    rank 1's end as torchrun saw it, run dir, step log dir)."""
    step_log = tmp_path / f"steps-{label}"
    step_log.mkdir()
    args = [
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--run-name",
        label,
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.02",
        "--step-log",
        str(step_log),
    ]
    err = tmp_path / f"{label}.err"
    launcher = start_traceml(args, tmp_path, tmp_path / label, env=env)
    try:
        wait_logged(step_log, 1, 40, launcher, err)
        rank_process(launcher, 1).send_signal(signal.SIGTERM)
        code = launcher.wait(120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    end = rank_ends(tmp_path / "logs" / label)[1]
    return code, {k: end.get(k) for k in ("end_state", "exit_code", "signal")}, step_log


def test_a_rank_killed_by_sigterm_sends_its_last_steps_and_dies_of_sigterm(tmp_path, port):
    # Nothing is sent before the signal (no interval, no batch threshold is reached): without
    # the flush every step would be lost.
    quiet = {"TRACEML_FLUSH_INTERVAL_SEC": "600", "TRACEML_BATCH_MAX_RECORDS": "60000"}
    plain = sigterm_rank_run(tmp_path, port, "plain", {**quiet, "TRACEML_DISABLE": "1"})
    traced = sigterm_rank_run(tmp_path, port, "traced", quiet)
    # The exit torchrun and the launcher see is the one they see without TraceML.
    assert traced[:2] == plain[:2]
    assert traced[1] == {"end_state": "signaled", "exit_code": None, "signal": 15}
    run_dir = tmp_path / "logs" / "traced"
    logged = len(logged_steps(traced[2], 1))
    (finish,) = query(
        run_dir,
        "SELECT steps_completed, records_dropped, end_state, reason FROM rank_finish "
        "WHERE rank = 1",
    )
    assert finish[0] == logged
    assert finish[2:] == ("signaled", "SIGTERM")
    # stored + counted unsent = what the script's own log says it completed
    assert stored_steps(run_dir, 1) + finish[1] == logged
    summary = {r["rank"]: r for r in load_summary(run_dir)["ranks"]}
    assert (summary[1]["steps_completed"], summary[1]["records_dropped"]) == (logged, finish[1])
    assert summary[1]["records_received"] == logged - finish[1]


# --- 3. drops counted without a finish marker ----------------------------------------------------
def test_drops_of_a_rank_sigkilled_after_an_outage_are_in_the_summary(tmp_path, port):
    """Rank 1 overflows its buffer of 40 records while the aggregator is stopped, completes its
    300 steps and hangs; it is SIGKILLed once its telemetry caught up: no finish marker, and
    the summary's figures are the last batch's counts."""
    steps, buffer = 300, 40
    step_log = tmp_path / "steps"
    step_log.mkdir()
    run_dir = tmp_path / "logs" / "dropkill"
    args = [
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--run-name",
        "dropkill",
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
        "--steps",
        str(steps),
        "--step-sleep",
        "0.05",
        "--fail-rank",
        "1",
        "--fail",
        "hang",
        "--settle-sec",
        "0",
        "--step-log",
        str(step_log),
    ]
    env = {
        "TRACEML_BUFFER_MAX_RECORDS": str(buffer),
        "TRACEML_FLUSH_INTERVAL_SEC": "0.2",
        "TRACEML_HEARTBEAT_SEC": "0.5",
        "TRACEML_RPC_TIMEOUT_SEC": "1",
    }
    err = tmp_path / "dropkill.err"
    launcher = start_traceml(args, tmp_path, tmp_path / "dropkill", env=env)
    try:
        wait_logged(step_log, 1, 20, launcher, err)
        aggregator = aggregator_of(launcher)
        logged_at_pause = len(logged_steps(step_log, 1))
        aggregator.send_signal(signal.SIGSTOP)
        # Three buffers' worth of rank 1's steps while stopped: the buffer of 40 overflows.
        wait_logged(step_log, 1, logged_at_pause + 3 * buffer, launcher, err)
        aggregator.send_signal(signal.SIGCONT)
        wait_logged(step_log, 1, steps, launcher, err)
        # Rank 1 hangs now: its last steps go out within a flush (0.2 s), and its heartbeats
        # (every 0.5 s) carry its final counts. The store is the aggregator's alone meanwhile.
        time.sleep(4.0)
        rank_process(launcher, 1).kill()
        code = launcher.wait(120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert code == 1, err.read_text()[-3000:]  # rank 1 was SIGKILLed: torchrun's 1
    assert query(run_dir, "SELECT rank FROM rank_finish") == [(0,)]  # none from rank 1
    summary = load_summary(run_dir)
    health = {r["rank"]: r for r in summary["run"]["telemetry_health"]["ranks"]}
    received = stored_steps(run_dir, 1)
    assert received < steps
    assert health[1] == {
        "rank": 1,
        "steps_produced": steps,
        "steps_received": received,
        "steps_dropped": steps - received,
        "steps_unaccounted": 0,
        "records_dropped": steps - received,
        "final": False,
    }
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert (
        ranks[1]["steps_completed"],
        ranks[1]["records_received"],
        ranks[1]["records_dropped"],
    ) == (steps, received, steps - received)
    assert ranks[1]["end"]["state"] == "signaled" and ranks[1]["end"]["signal"] == 9
    # rank 0 finished: its figures came with its finish marker, and add up as well
    assert health[0]["final"] is True
    assert health[0]["steps_produced"] == len(logged_steps(step_log, 0)) == steps
    assert health[0]["steps_received"] + health[0]["steps_dropped"] == steps
    finding = next(f for f in summary["findings"]["health"] if f["kind"] == "TELEMETRY_DROPPED")
    assert f"rank 1: {steps - received} of {steps} steps not stored" in finding["summary"]
    assert finding["evidence"]["1"] == {
        "steps_completed": steps,
        "records_received": received,
        "records_dropped": steps - received,
    }


# --- 4. Ctrl-C during finalization ---------------------------------------------------------------
@pytest.mark.serial
def test_ctrl_c_while_finalizing_against_a_stopped_aggregator_returns_within_seconds(
    tmp_path, port
):
    """The aggregator is SIGSTOPped while training runs; training ends (the ranks give their
    last batch 1 s), node 0 reports and finalizes against it and would wait for its calls'
    deadlines (10 s, then the finalize budget). One SIGINT: the launcher returns within
    FINALIZE_INTERRUPT_GRACE_S and a little, with torchrun's exit code (0), the aggregator
    killed, the port free."""
    from traceml.launcher.run import FINALIZE_INTERRUPT_GRACE_S

    run_dir = tmp_path / "logs" / "slowfin"
    args = [
        "run",
        SCRIPT,
        "--nproc-per-node=2",
        "--run-name",
        "slowfin",
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
        "--steps",
        "60",
        "--step-sleep",
        "0.05",
    ]
    err = tmp_path / "slowfin.err"
    launcher = start_traceml(
        args, tmp_path, tmp_path / "slowfin", env={"TRACEML_FINISH_TIMEOUT_SEC": "1"}
    )
    try:
        wait_training_started(run_dir, launcher, err)
        aggregator = aggregator_of(launcher)
        family = process_family(launcher.pid)
        aggregator.send_signal(signal.SIGSTOP)
        manifest = run_dir / "nodes" / "node_0" / "manifest.json"
        deadline = time.monotonic() + 120
        while "training_ended" not in json.loads(manifest.read_text())["lifecycle"]:
            assert launcher.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "training never ended"
            time.sleep(0.1)
        time.sleep(1.0)  # the launcher waits on the stopped aggregator now
        assert launcher.poll() is None
        code, took = signal_and_wait(launcher, signal.SIGINT, 120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert code == 0, err.read_text()[-3000:]
    assert took < FINALIZE_INTERRUPT_GRACE_S + 3.0, took
    assert_all_gone(family, timeout_s=5)
    with socket.socket() as s:  # nothing listens on the aggregator's port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    text = err.read_text()
    assert "got SIGINT: writing the summary with what is stored now" in text
    assert "ending now" in text
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "abandoned"


@pytest.mark.serial
def test_an_aggregator_paused_through_the_finalization_is_stopped_and_the_summary_is_written(
    tmp_path, port
):
    """The aggregator is SIGSTOPped while training runs and stays so: node 0's launcher waits
    for its summary the budget (``--finalize-timeout-sec 2``) and FINALIZE_SLACK_S, then stops
    it and writes the summary from the store (``--finalize-only``): torchrun's exit code (0),
    each rank's steps in the summary those the store held when it was paused (some, not all
    of its 200), the aggregator lost when it last answered (its node's heartbeats, every 2 s)
    and the summary warning so, nothing left running, the port free."""
    from traceml.core.transport import FINALIZE_SLACK_S

    budget_s = 2.0
    steps = 200  # 10 s: the aggregator is paused long before the end
    run_dir, step_log = tmp_path / "logs" / "paused", tmp_path / "steps"
    step_log.mkdir()
    args = run_args(
        tmp_path,
        SCRIPT,
        "paused",
        port,
        f"--finalize-timeout-sec={budget_s}",
        f"--steps={steps}",
        "--step-sleep=0.05",
        f"--step-log={step_log}",
    )
    err = tmp_path / "paused.err"
    launcher = start_traceml(
        args, tmp_path, tmp_path / "paused", env={"TRACEML_FINISH_TIMEOUT_SEC": "1"}
    )
    try:
        wait_training_started(run_dir, launcher, err)
        family = process_family(launcher.pid)
        aggregator = aggregator_of(launcher)
        for rank in (0, 1):  # 100 steps: 5 s, past two flushes of each rank's steps
            wait_logged(step_log, rank, steps // 2, launcher, err)
        aggregator.send_signal(signal.SIGSTOP)
        paused_unix_s = time.time()
        code = launcher.wait(timeout=budget_s + FINALIZE_SLACK_S + 120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = err.read_text()
    assert code == 0, text[-3000:]
    assert_all_gone(family, timeout_s=5)
    with socket.socket() as s:  # nothing listens on the aggregator's port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert (
        f"the aggregator did not write the summary (no finalization result within "
        f"{budget_s + FINALIZE_SLACK_S:g} s); writing it from the store"
    ) in text
    assert "summary (written from the store: the aggregator was lost)" in text
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert "finalized" in manifest["lifecycle"], manifest
    assert manifest["aggregator"]["status"] == "failed", manifest
    summary = load_summary(run_dir)
    stored = dict(query(run_dir, "SELECT rank, count(*) FROM steps GROUP BY rank"))
    assert sorted(stored) == [0, 1] and max(stored.values()) < steps, stored  # then paused
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == stored
    loss = summary["run"]["telemetry_health"]["aggregator_loss"]
    assert loss["reason"] == (
        f"gave no answer (no finalization result within {budget_s + FINALIZE_SLACK_S:g} s)"
    )
    assert paused_unix_s - 10 < loss["lost_unix_s"] <= paused_unix_s, loss
    (lost,) = [f for f in summary["findings"]["health"] if f["kind"] == "AGGREGATOR_LOST"]
    assert lost["evidence"]["steps_stored"] == {str(r): n for r, n in stored.items()}


# --- 2. a partition between node 1 and node 0 ---------------------------------------------------
HOST0, HOST1 = "10.233.0.1", "10.233.0.2"  # training (rendezvous, gloo)
TEL0, TEL1 = "10.234.0.1", "10.234.0.2"  # telemetry: node 1 reaches node 0's aggregator here
#: The partition, s: past the run's keepalive timeout and lost-node bound (below), as 30 s was
#: past the defaults' 20 s and 25 s: node 1's streams break, the node is lost, and all of it
#: comes back on new streams once the link is up.
PARTITION_S = 15.0
#: The run's ``TRACEML_GRPC_KEEPALIVE_TIMEOUT_MS``, ms (default 20 s).
PARTITION_KEEPALIVE_TIMEOUT_MS = 4_000
#: The run's ``TRACEML_NODE_LOST_AFTER_SEC``, s (default 25): node 1 is lost inside the partition.
PARTITION_LOST_AFTER_S = 8.0
STEP_SLEEP_S = 0.05
#: Buffer of the partition run, records: half the ~300 steps of the partition.
PARTITION_BUFFER = 150


@pytest.fixture
def two_links():
    """Namespaces joined by a training and a telemetry link (tests/helpers/netns.py): yields
    ``(netns, {link: (ifname in ns 0, ifname in ns 1)})``."""
    with two_hosts("tmlp", (HOST0, HOST1), (TEL0, TEL1)) as two:
        yield two.netns, two.links


def rss_bytes(pid: int) -> int:
    """The process's resident set, bytes (``VmRSS`` of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def step_times(step_log: Path, rank: int) -> list[tuple[float, float]]:
    """(end unix s, step s) of each step the rank logged."""
    return [
        (float(e), float(d)) for _, _, e, d in (ln.split() for ln in logged_steps(step_log, rank))
    ]


@pytest.mark.serial
@pytest.mark.netns
def test_a_partition_between_node_1_and_node_0_costs_training_nothing(two_links, tmp_path):
    from traceml.sdk.client import BUFFERED_RECORD_MAX_BYTES

    netns, links = two_links
    steps = 800  # about 40 s at 0.05 s a step: the partition falls inside, 12 s of steps after
    assert PARTITION_BUFFER * 2 <= PARTITION_S / STEP_SLEEP_S
    assert PARTITION_KEEPALIVE_TIMEOUT_MS / 1000 < PARTITION_LOST_AFTER_S < PARTITION_S - 4
    step_log = tmp_path / "steps"
    step_log.mkdir()
    procs = {}
    env = {
        "TRACEML_RUN_TOKEN": "partition-token",
        "TRACEML_BUFFER_MAX_RECORDS": str(PARTITION_BUFFER),
        "TRACEML_FLUSH_INTERVAL_SEC": "0.5",
        "TRACEML_RPC_TIMEOUT_SEC": "2",
        settings.NODE_LOST_AFTER_SEC.name: f"{PARTITION_LOST_AFTER_S:g}",
        settings.GRPC_KEEPALIVE_TIMEOUT_MS.name: str(PARTITION_KEEPALIVE_TIMEOUT_MS),
    }
    for node in (1, 0):
        args = node_args(
            node,
            SCRIPT,
            "partition",
            f"--aggregator-host={TEL0}",
            "--steps",
            str(steps),
            "--step-sleep",
            str(STEP_SLEEP_S),
            "--step-log",
            str(step_log),
            nproc=1,
            master_addr=HOST0,
            logs_dir=tmp_path / f"host{node}",
        )
        procs[node] = start_traceml(
            args,
            tmp_path,
            tmp_path / f"node{node}",
            prefix=["ip", "netns", "exec", netns[node]],
            env={**env, "GLOO_SOCKET_IFNAME": links["train"][node]},
        )
    err1 = tmp_path / "node1.err"
    rss: list[tuple[float, dict[int, int]]] = []  # (unix s, rank -> RSS bytes)
    with reaped(procs):
        wait_logged(step_log, 1, 100, procs[1], err1)
        pids = {rank: rank_process(procs[rank], rank).pid for rank in (0, 1)}
        end_before = time.time() + 6.0
        while time.time() < end_before:
            rss.append((time.time(), {r: rss_bytes(pid) for r, pid in pids.items()}))
            time.sleep(0.25)
        cut_at = time.time()
        ip("-n", netns[1], "link", "set", links["tel"][1], "down")
        while time.time() < cut_at + PARTITION_S:
            rss.append((time.time(), {r: rss_bytes(pid) for r, pid in pids.items()}))
            time.sleep(0.25)
        ip("-n", netns[1], "link", "set", links["tel"][1], "up")
        restored_at = time.time()
        codes = wait_all(procs, 300)
    assert codes == {0: 0, 1: 0}, (tmp_path / "node0.err").read_text()[-2000:] + err1.read_text()[
        -2000:
    ]
    assert restored_at + 10 < step_times(step_log, 1)[-1][0], "the run ended too soon after"

    # Step time by the script's own clock: inside the partition as outside it (median, 5 %).
    margin = 2.0
    ratios = {}
    for rank in (0, 1):
        times = step_times(step_log, rank)[1:]
        inside = [d for e, d in times if cut_at + margin < e < restored_at - margin]
        outside = [d for e, d in times if not cut_at - margin < e < restored_at + margin]
        ratios[rank] = statistics.median(inside) / statistics.median(outside)
    print(f"\npartition: step time inside/outside {ratios}")
    assert all(abs(ratio - 1) < 0.05 for ratio in ratios.values()), ratios

    # Rank 1's memory grows during the partition by at most its buffer's documented bound
    # beyond rank 0's growth in the same seconds: rank 0 runs the same steps and collectives,
    # not cut off, so its growth is what is not the partition's (the ring of collective events
    # filling, EVENTS_KEPT, and the allocator's churn).
    growth = {}
    for rank in (0, 1):
        before = statistics.median([b[rank] for t, b in rss if t < cut_at])
        growth[rank] = max(b[rank] for t, b in rss if t >= cut_at) - before
    assert growth[1] - growth[0] <= PARTITION_BUFFER * BUFFERED_RECORD_MAX_BYTES, growth

    # received + dropped = produced, exactly, for each rank; drops only where cut off.
    run_dir = tmp_path / "host0" / "partition"
    summary = load_summary(run_dir)
    health = {r["rank"]: r for r in summary["run"]["telemetry_health"]["ranks"]}
    for rank in (0, 1):
        produced = len(logged_steps(step_log, rank))
        assert produced == steps
        h = health[rank]
        assert h["final"] is True and h["steps_produced"] == produced
        assert h["steps_received"] == stored_steps(run_dir, rank)
        assert h["steps_received"] + h["steps_dropped"] == produced, h
    assert health[0]["steps_dropped"] == 0
    assert health[1]["steps_dropped"] > 0  # the small buffer did overflow
    # Node 1 was lost (the aggregator heard nothing from it for PARTITION_LOST_AFTER_S) inside
    # the partition, and resumed after it.
    losses = summary["run"]["telemetry_health"]["node_losses"]
    assert [(n["node_rank"], n["lost_after_s"]) for n in losses] == [(1, PARTITION_LOST_AFTER_S)]
    assert cut_at < losses[0]["lost_unix_s"] < restored_at <= losses[0]["resumed_unix_s"], losses
    print(
        f"partition: rank 1 RSS +{growth[1] / 1024:.0f} KiB, rank 0 "
        f"+{growth[0] / 1024:.0f} KiB (bound "
        f"{PARTITION_BUFFER * BUFFERED_RECORD_MAX_BYTES / 1024:.0f} KiB); rank 1 stored "
        f"{health[1]['steps_received']} + dropped {health[1]['steps_dropped']} = {steps}"
    )

    # Telemetry resumed: every step rank 1 ended once the link was back is stored, and node
    # 1's sampler was heard again.
    ends = dict(enumerate(e for e, _ in step_times(step_log, 1)))
    after = {i for i, e in ends.items() if e > restored_at + 5.0}
    stored = {s for (s,) in query(run_dir, "SELECT step FROM steps WHERE rank = 1")}
    assert after and after <= stored
    (last_sample,) = query(run_dir, "SELECT MAX(unix_us) FROM system_samples WHERE node_rank = 1")[
        0
    ]
    assert last_sample / 1e6 > restored_at + 5.0
