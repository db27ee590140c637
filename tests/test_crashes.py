"""A rank that dies: the launcher returns fast, with plain torchrun's exit code, and says who died.

Rank 1 of ``tests/scripts/faulty_ddp.py`` ends itself at the start of step 5 (after 5 completed
steps, once every rank's telemetry of them was flushed) and writes the wall time of its death.
Each case runs the same script under plain ``python -m torch.distributed.run`` too, side by
side with the launcher's run (they share nothing: each has its own rendezvous port): the
launcher's exit code must equal torchrun's. Rank 0, blocked in step 5's all-reduce, is stopped
by torchrun (or fails in gloo) and completed exactly 5 steps.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import (
    SCRIPTS,
    free_port,
    load_summary,
    run_args,
    run_traceml,
    start_traceml,
    traceml_env,
    wait_for,
)
from helpers.aggregator import listening_port

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
#: Flush telemetry well within the script's 1.5 s settle time before a failure.
ENV = {"TRACEML_FLUSH_INTERVAL_SEC": "0.2"}
#: The issue's bound: the command returns at most this long after a rank's death, s.
RETURN_BOUND_S = 30.0

CASES = {
    # --fail: (end state of rank 1, its exit code, its signal, text in its reason)
    "segv": ("signaled", None, 11, "SIGSEGV"),
    "exit3": ("failed", 3, None, None),
    "sysexit7": ("failed", 7, None, None),
    "raise": ("failed", 1, None, "RuntimeError: injected failure"),
}


def plain_torchrun(
    args: list[str], cwd, master_port: int, nnodes: int = 1, node_rank: int = 0, nproc: int = 2
):
    """Start the script under torch.distributed.run itself (no TraceML endpoint), ``nproc``
    ranks per node, its rendezvous on 127.0.0.1:``master_port``."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
    ]
    return subprocess.Popen(
        argv + [SCRIPT] + args,
        cwd=cwd,
        env=traceml_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def death_time(mark) -> float:
    return float(mark.read_text())


@pytest.mark.parametrize("fail", list(CASES))
def test_rank_death(tmp_path, port, fail):
    state, code, sig, reason = CASES[fail]
    script_args = ["--fail", fail, "--fail-rank", "1", "--fail-step", "5", "--steps", "20"]
    plain = plain_torchrun(script_args, tmp_path, free_port())

    mark = tmp_path / "death"
    args = (
        [
            "run",
            SCRIPT,
            "--nproc-per-node=2",
            "--run-name",
            f"crash-{fail}",
            "--aggregator-port",
            str(port),
            "--logs-dir",
            str(tmp_path / "logs"),
        ]
        + script_args
        + ["--mark", str(mark)]
    )
    result = run_traceml(args, tmp_path, env=ENV)
    returned = time.time()

    assert plain.wait(120) != 0
    assert result.returncode == plain.returncode, result.stderr
    assert returned - death_time(mark) < RETURN_BOUND_S, result.stderr[-4000:]
    summary = load_summary(tmp_path / "logs" / f"crash-{fail}")
    assert summary["run"]["complete"] is True
    assert summary["run"]["missing_ranks"] == []
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert set(ranks) == {0, 1}
    dead = ranks[1]["end"]
    assert (dead["state"], dead["exit_code"], dead["signal"]) == (state, code, sig)
    if reason:
        assert reason in dead["reason"]
    survivor = ranks[0]
    assert survivor["end"]["state"] in ("terminated", "failed")
    assert survivor["steps_completed"] == 5
    assert ranks[1]["steps_completed"] == 5
    assert [n["exit_code"] for n in summary["nodes"]] == [plain.returncode]
    # The text report names the dead rank and how it ended.
    text = (tmp_path / "logs" / f"crash-{fail}" / "final_summary.txt").read_text()
    assert f"rank 1: {state}" in text


def test_a_rendezvous_port_in_use_is_said_as_the_verdict_not_as_ranks_terminated(tmp_path, port):
    """torchrun cannot start: its --master-port is held by another process. The launcher exits
    1 as plain torchrun does, and the summary says the run failed before training: the
    verdict is NODE_FAILED with torchrun's error, both ranks ``not_started`` (before:
    ``terminated``, "stopped by torchrun after another rank failed", and a verdict asking to
    instrument the script)."""
    with listening_port() as master_port:
        plain = plain_torchrun(["--steps", "3"], tmp_path, master_port)
        result = run_traceml(
            [
                *run_args(tmp_path, SCRIPT, "rdzv", port),
                f"--master-port={master_port}",
                "--steps",
                "3",
            ],
            tmp_path,
        )
        assert plain.wait(120) == 1
    assert result.returncode == 1, result.stderr[-4000:]
    summary = load_summary(tmp_path / "logs" / "rdzv")
    assert summary["run"]["status"] == "failed"
    ends = [(r["rank"], r["end"]["state"], r["steps_completed"]) for r in summary["ranks"]]
    assert ends == [(0, "not_started", 0), (1, "not_started", 0)]
    reason = summary["ranks"][0]["end"]["reason"]
    assert reason.startswith("torchrun failed: DistNetworkError: ")
    assert "EADDRINUSE" in reason and f"port: {master_port}" in reason, reason
    verdict = summary["primary_diagnosis"]
    assert (verdict["kind"], verdict["severity"]) == ("NODE_FAILED", "critical")
    host = socket.gethostname()
    said = f"torchrun on node 0 ({host}) exited with 1 before it started ranks 0, 1 ({reason})."
    assert verdict["summary"] == said
    assert verdict["evidence"]["not_started"] == verdict["ranks"] == [0, 1]
    findings = summary["findings"]
    assert [f["kind"] for f in findings["step_time"]] == ["INSUFFICIENT_DATA"]
    assert [f["kind"] for f in findings["health"]] == [], findings["health"]
    assert f"  ranks 0, 1: not_started ({reason[:30]}" in result.stdout, result.stdout


# Alone: two torchruns' teardown in a chain (5-7 s here, 4 jobs beside it included) took 32 s
# once with the whole parallel suite on 2 cores, past the bound it checks.
@pytest.mark.serial
def test_rank_death_on_node_1_ends_both_nodes(tmp_path):
    """Two launchers (2 nodes x 1 rank): rank 1 on node 1 segfaults at step 5. Node 1's
    torchrun exits, node 0's rank fails in gloo as its peer's connections close; both
    launchers return within the bound with plain torchrun's exit codes. (One rank a node: a
    peer stopped by its own torchrun is test_rank_death's; every rank is a torch start-up.)"""
    script_args = ["--fail", "segv", "--fail-rank", "1", "--fail-step", "5", "--steps", "20"]
    master_port = free_port()
    plain = [
        plain_torchrun(script_args, tmp_path, master_port, 2, node_rank, nproc=1)
        for node_rank in (1, 0)
    ]

    mark = tmp_path / "death"
    common = (
        [
            "run",
            SCRIPT,
            "--nnodes=2",
            "--nproc-per-node=1",
            "--run-name",
            "crash-2n",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            f"--aggregator-port={free_port()}",
            "--logs-dir",
            str(tmp_path / "logs"),
        ]
        + script_args
        + ["--mark", str(mark)]
    )
    nodes = {
        n: start_traceml(common + [f"--node-rank={n}"], tmp_path, tmp_path / f"node{n}", env=ENV)
        for n in (1, 0)
    }
    returned = {}
    deadline = time.monotonic() + 240
    while len(returned) < 2 and time.monotonic() < deadline:
        for n, proc in nodes.items():
            if n not in returned and proc.poll() is not None:
                returned[n] = time.time()
        time.sleep(0.1)
    for proc in nodes.values():
        if proc.poll() is None:
            proc.kill()
    assert len(returned) == 2, "a launcher did not return"
    plain_codes = [p.wait(120) for p in plain]  # node 1, node 0

    assert [nodes[1].returncode, nodes[0].returncode] == plain_codes
    for n in (0, 1):  # on failure, the launcher's log (torch's lines carry their times)
        took = returned[n] - death_time(mark)
        assert took < RETURN_BOUND_S, (n, took, (tmp_path / f"node{n}.err").read_text()[-4000:])
    summary = load_summary(tmp_path / "logs" / "crash-2n")
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert (ranks[1]["end"]["state"], ranks[1]["end"]["signal"]) == ("signaled", 11)
    # Rank 0: stopped by its torchrun, or failed in gloo when rank 1's connections closed.
    assert ranks[0]["end"]["state"] in {"terminated", "failed"}
    assert {r: ranks[r]["steps_completed"] for r in ranks} == {0: 5, 1: 5}
    assert {n["node_rank"]: n["exit_code"] for n in summary["nodes"]} == {
        0: plain_codes[1],
        1: plain_codes[0],
    }


def test_a_ctrl_c_after_a_crash_ends_the_launch_interrupted_and_the_run_failed(tmp_path, port):
    """Rank 1 exits 3 while rank 0, ignoring torchrun's SIGTERM, sleeps in its step: torchrun
    waits out its grace for it, and the user's Ctrl-C (SIGINT) comes then, cutting torchrun's
    stop short. The launch was interrupted; the run failed, of rank 1's crash: rank 1 keeps
    its exit code 3, rank 0 is the one the signal ended. The run manifest says both, the
    summary's status as ``run_status`` (before: only ``status: interrupted``)."""
    mark = tmp_path / "death"
    args = run_args(tmp_path, SCRIPT, "crash-then-stop", port) + [
        "--",
        "--fail",
        "exit3",
        "--fail-step",
        "0",
        "--step-sleep",
        "60",
        "--ignore-sigterm",
        "--mark",
        str(mark),
    ]
    launcher = start_traceml(args, tmp_path, tmp_path / "launcher", env=ENV)
    run_dir = tmp_path / "logs" / "crash-then-stop"
    torchrun_log = run_dir / "nodes" / "node_0" / "training.stderr.log"
    try:
        wait_for(mark.exists, 180, "rank 1's death")
        # torchrun saw it and asked rank 0 to stop (ignored): the Ctrl-C comes now
        wait_for(lambda: "closing signal SIGTERM" in torchrun_log.read_text(), 60, "the stop")
    finally:
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(90)
    err = (tmp_path / "launcher.err").read_text()
    assert code == 1, err  # torchrun's, stopped in its close
    summary = load_summary(run_dir)
    assert summary["run"]["status"] == "failed", err
    interrupted = "interrupted: the launcher got SIGINT (scancel, preemption or Ctrl-C)"
    assert [r["end"] for r in summary["ranks"]] == [
        {"state": "terminated", "exit_code": None, "signal": 2, "reason": interrupted},
        {"state": "failed", "exit_code": 3, "signal": None, "reason": None},
    ]  # before: both terminated by the signal, the crash lost (torchrun recorded nothing)
    assert summary["primary_diagnosis"]["kind"] == "RANK_CRASHED"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["run_status"]) == ("interrupted", "failed")
    node = json.loads((run_dir / "nodes" / "node_0" / "manifest.json").read_text())
    assert node["status"] == "interrupted" and "run_status" not in node
