"""The launcher's own lifetime under real torchrun runs: a SIGKILLed launcher takes its
aggregator, torchrun and the ranks with it; a second SIGTERM ends it at once; a closed stdout
(``--mode cli | head``) costs only the view; a full disk under the node's logs (a 1 MiB tmpfs)
costs only the logs; ``--no-save-training-output`` writes none."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import (
    SCRIPTS,
    assert_all_gone,
    free_port,
    load_summary,
    query,
    start_traceml,
    traceml_cmd,
    traceml_env,
    wait_training,
)
from conftest import (
    process_family as family,
)
from helpers.jobs import descendant_of, listens, run_args, signal_all, tmp_leftovers
from helpers.waiting import wait_for

from traceml.launcher.torchrun import STOP_WITHOUT_RANKS_GRACE_S

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]

SCRIPT = str(SCRIPTS / "faulty_ddp.py")
CHATTY = str(SCRIPTS / "chatty.py")
ENV = {"TRACEML_FLUSH_INTERVAL_SEC": "0.2"}


def test_sigkilled_launcher_takes_its_processes_with_it(tmp_path, port):
    # one rank: an orphaned rank is an orphaned rank, and a second one is a second torch start-up
    args = run_args(tmp_path, SCRIPT, "orphans", port, nproc=1) + [
        "--",
        "--steps",
        "100000",
        "--step-sleep",
        "0.05",
    ]
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**ENV, "TMPDIR": str(temp)}
    launcher = start_traceml(args, tmp_path, tmp_path / "orphans", env=env)
    wait_training(tmp_path, "orphans", launcher)
    processes = family(launcher.pid)
    names = " ".join(" ".join(p.cmdline()) for p in processes)
    assert "traceml_aggregator" in names and "torchrun_main" in names
    assert len(processes) >= 4  # launcher, aggregator, torchrun, its rank
    assert [name[:17] for name in tmp_leftovers(temp)] == ["traceml-torchrun-"]
    launcher.kill()
    launcher.wait()
    assert_all_gone(processes[1:])
    # the launcher's torchrun log directory, which it could not remove, went with torchrun
    assert tmp_leftovers(temp) == []


def test_a_launcher_sigkilled_as_torchrun_starts_leaves_nothing_in_tmp(tmp_path, port):
    """Killed while torchrun is still importing torch (its first second or so): torchrun gets
    the parent-death SIGTERM before torch's handlers exist, and still removes the log
    directory the launcher made for it."""
    args = run_args(tmp_path, SCRIPT, "early", port, nproc=1) + ["--", "--steps", "100000"]
    temp = tmp_path / "tmp"
    temp.mkdir()
    launcher = start_traceml(args, tmp_path, tmp_path / "early", env={**ENV, "TMPDIR": str(temp)})

    descendant_of(launcher, "torchrun_main", poll_s=0.01)
    processes = family(launcher.pid)
    launcher.kill()
    launcher.wait()
    assert_all_gone(processes[1:])
    assert tmp_leftovers(temp) == []


def test_a_sigkilled_torchrun_takes_its_ranks_with_it(tmp_path, port):
    """torchrun SIGKILLed cannot stop its rank: the kernel sends the rank SIGTERM
    (``PR_SET_PDEATHSIG``, set by the rank's ``traceml.init()``), which ends it as torchrun's
    own SIGTERM would, its telemetry flushed; the launcher then fails as torchrun did."""
    step_log = tmp_path / "steps"
    step_log.mkdir()
    args = run_args(tmp_path, SCRIPT, "headless", port, nproc=1) + [
        "--",
        "--steps",
        "100000",
        "--step-sleep",
        "0.05",
        "--step-log",
        str(step_log),
    ]
    launcher = start_traceml(args, tmp_path, tmp_path / "headless", env=ENV)
    wait_training(tmp_path, "headless", launcher)
    (torchrun,) = [p for p in family(launcher.pid) if "torchrun_main" in " ".join(p.cmdline())]
    ranks = torchrun.children()
    assert len(ranks) == 1
    torchrun.kill()
    assert_all_gone(ranks, timeout_s=15)
    assert launcher.wait(120) == 128 + signal.SIGKILL  # torchrun's end, as a shell reports it
    (rank,) = load_summary(tmp_path / "logs" / "headless")["ranks"]
    assert rank["end"] == {
        "state": "terminated",
        "exit_code": None,
        "signal": None,
        "reason": "SIGTERM",
    }
    # every step the rank completed (its own log) was sent and stored before it ended
    completed = len((step_log / "rank0.log").read_text().splitlines())
    assert (rank["steps_completed"], rank["records_dropped"]) == (completed, 0)


#: A torchrun stand-in: its reaper watches the launcher stand-in (its parent); its one rank, in
#: its own session as torch starts it, lives as long as it is told once the launcher died; its
#: main thread never ends, never stops the rank and ignores SIGTERM, as a torchrun stuck in its
#: own teardown would.
_STUCK_TORCHRUN = r"""
import os, signal, subprocess, sys, threading
from traceml.launcher.torchrun_main import reap_when_orphaned
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(float(input()))"],
                        stdin=subprocess.PIPE, text=True, start_new_session=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # after the rank's start: it inherits no SIG_IGN
threading.Thread(target=reap_when_orphaned, args=(os.getppid(),), daemon=True).start()
print(rank.pid, flush=True)
rank.stdin.write(sys.stdin.readline()); rank.stdin.flush()  # after the launcher's death
threading.Event().wait()
"""


@pytest.mark.parametrize("rank_lives_s", [2.0, 3600.0])
def test_a_torchrun_stuck_after_its_launcher_died_is_killed_once_its_ranks_ended(
    tmp_path, rank_lives_s
):
    """The launcher SIGKILLed, torchrun's main thread never stops its rank nor ends. A rank
    that ends on its own 2 s later: the reaper leaves it alone. One that would run for an
    hour: the reaper sends it SIGTERM ORPHAN_EXIT_GRACE_S after the launcher's death. Either
    way the reaper kills torchrun ORPHAN_EXIT_GRACE_S after the rank ended, not before,
    whatever its signals."""
    from traceml.launcher.torchrun_main import ORPHAN_EXIT_GRACE_S

    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.Popen([sys.executable, "
            f"'-c', {_STUCK_TORCHRUN!r}]).wait()",
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
    )
    rank = psutil.Process(int(launcher.stdout.readline()))
    (torchrun,) = psutil.Process(launcher.pid).children()
    launcher.kill()
    launcher.wait()
    died = time.monotonic()
    launcher.stdin.write(f"{rank_lives_s}\n")  # the pipe the stand-ins share: torchrun reads on
    launcher.stdin.close()
    wait_for(lambda: rank.status() == psutil.STATUS_ZOMBIE, 30, "the rank's end", poll_s=0.01)
    rank_ended = time.monotonic()  # torchrun's main thread never reaps it
    expected = min(rank_lives_s, ORPHAN_EXIT_GRACE_S)
    assert expected - 0.5 < rank_ended - died < expected + 5, rank_ended - died
    torchrun.wait(30)
    lived = time.monotonic() - rank_ended
    assert ORPHAN_EXIT_GRACE_S - 0.5 < lived < ORPHAN_EXIT_GRACE_S + 5, lived


def test_second_sigterm_ends_at_once(tmp_path, port):
    """The ranks ignore SIGTERM, so torchrun would wait its grace period for them: the second
    SIGTERM to the launcher SIGKILLs them all and ends it at once, without a summary."""
    args = run_args(tmp_path, SCRIPT, "twice", port) + [
        "--",
        "--steps",
        "100000",
        "--step-sleep",
        "0.05",
        "--ignore-sigterm",
    ]
    launcher = start_traceml(args, tmp_path, tmp_path / "twice", env=ENV)
    wait_training(tmp_path, "twice", launcher)
    processes = family(launcher.pid)
    err_path = tmp_path / "twice.err"
    launcher.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while "got SIGTERM: stopping training" not in err_path.read_text():
        assert time.monotonic() < deadline and launcher.poll() is None, err_path.read_text()
        time.sleep(0.05)
    time.sleep(1.0)
    assert launcher.poll() is None  # torchrun waits for ranks that ignore SIGTERM
    launcher.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = launcher.wait(60)
    took = time.monotonic() - sent
    err = err_path.read_text()
    assert code == 128 + signal.SIGTERM, err
    assert took < 10, err
    assert_all_gone(processes, 10)
    assert "got SIGTERM again: ending now, without a summary" in err
    run_dir = tmp_path / "logs" / "twice"
    assert not (run_dir / "final_summary.json").exists()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["exit_code"]) == ("abandoned", 143)


def test_a_sigterm_while_torchrun_waits_in_the_rendezvous_ends_it(tmp_path, port):
    """Node 0 of two, node 1 never started: torchrun waits in the static rendezvous, inside
    torch's C++ store, where no signal handler runs (it would wait out the rendezvous
    timeout, 600 s); its launcher says it waits there. The launcher's SIGTERM ends it
    STOP_WITHOUT_RANKS_GRACE_S later, with plain torchrun's exit code there (143: it has no
    handler yet, and dies of the signal), the summary written and nothing left running."""
    master_port = free_port()
    args = run_args(tmp_path, SCRIPT, "rdzv", port, nproc=1) + [
        "--nnodes=2",
        "--node-rank=0",
        f"--master-port={master_port}",
        "--",
        "--steps",
        "5",
    ]
    env = {**ENV, "TRACEML_RENDEZVOUS_WARN_SEC": "1"}
    launcher = start_traceml(args, tmp_path, tmp_path / "rdzv", env=env)
    waiting = re.compile(
        r"traceml: warning: torchrun has started no rank in \d+ s: it waits in its rendezvous "
        rf"at 127\.0\.0\.1:{master_port} for all 2 nodes \(--nnodes\) to join"
    )
    processes = []
    try:
        torchrun = descendant_of(launcher, "torchrun_main")
        # the rendezvous's store listens on the master port once torchrun waits in it
        wait_for(lambda: listens(torchrun, master_port), 120, "torchrun's rendezvous store")
        # and the launcher says so (TRACEML_RENDEZVOUS_WARN_SEC: 1 s here)
        wait_for(lambda: waiting.search((tmp_path / "rdzv.err").read_text()), 120, "the wait")
        processes = family(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(120)  # not the rendezvous timeout's 600 s
    finally:
        if launcher.poll() is None:  # the test failed: leave nothing running
            signal_all(family(launcher.pid), signal.SIGKILL)
    err = (tmp_path / "rdzv.err").read_text()
    assert code == 128 + signal.SIGTERM, err  # as plain torchrun's there (it dies of it)
    assert (
        f"torchrun did not stop within {STOP_WITHOUT_RANKS_GRACE_S:g} s of SIGTERM and runs "
        "no rank (it waits in torch's store, the rendezvous or the exit barrier of several "
        "nodes, where it cannot take the signal): killed"
    ) in err
    manifest = json.loads((tmp_path / "logs" / "rdzv" / "manifest.json").read_text())
    assert "torchrun_killed" in manifest["lifecycle"]
    assert_all_gone(processes, 10)
    # The summary says no rank started (before: rank 0 "terminated" as if it had run, rank 1
    # "running" and missing, "look for a hung rank").
    summary = load_summary(tmp_path / "logs" / "rdzv")
    assert [(n["node_rank"], n["exit_code"]) for n in summary["nodes"]] == [(0, 143)]
    assert summary["run"]["status"] == "interrupted"
    reason = (
        "interrupted: the launcher got SIGTERM (scancel, preemption or Ctrl-C) before torchrun "
        "started its ranks"
    )
    ends = [(r["rank"], r["end"]["state"], r["end"]["reason"]) for r in summary["ranks"]]
    assert ends == [(0, "not_started", reason), (1, "never_reported", None)]
    assert summary["primary_diagnosis"]["kind"] == "RUN_INTERRUPTED"
    health = [f["kind"] for f in summary["findings"]["health"]]
    assert health == ["RANK_NEVER_REPORTED"], health  # no NODE_FAILED: the user stopped it


def test_closed_stdout_costs_only_the_view(tmp_path, port):
    """``traceml run --mode cli ... | head -n 1``: head exits after one line, and every later
    write to stdout fails (EPIPE). Training, the summary files and the exit code are as
    without the pipe, and nothing is left running."""
    args = run_args(tmp_path, SCRIPT, "piped", port) + [
        "--mode",
        "cli",
        "--",
        "--steps",
        "40",
        "--step-sleep",
        "0.2",
    ]
    err_path = tmp_path / "piped.err"
    with open(err_path, "wb") as err:
        launcher = subprocess.Popen(
            traceml_cmd() + args,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=err,
            env=traceml_env({**ENV, "TRACEML_LIVE_REFRESH_SEC": "0.5"}),
        )
    first = launcher.stdout.readline()  # what head -n 1 reads, then it exits
    processes = family(launcher.pid)
    launcher.stdout.close()
    code = launcher.wait(240)
    stderr = err_path.read_text()
    assert first, stderr
    assert code == 0, stderr
    assert_all_gone(processes)
    assert "warning: the live view stopped: stdout is closed" in stderr
    assert "Traceback" not in stderr
    run_dir = tmp_path / "logs" / "piped"
    assert load_summary(run_dir)["run"]["status"] == "completed"
    assert query(run_dir, "SELECT rank, COUNT(*) FROM steps GROUP BY rank") == [(0, 40), (1, 40)]
    assert (
        "faulty_ddp: rank 0 trained 40 steps"
        in (run_dir / "nodes" / "node_0" / "training.stdout.log").read_text()
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_disk_costs_only_the_training_logs(tmp_path, port):
    """The node's log directory is a 1 MiB tmpfs and the rank prints 4 MiB: the log fills,
    the launcher says so once, and the console still gets every line; training completes."""
    steps, lines = 20, 200
    node_dir = tmp_path / "logs" / "full" / "nodes" / "node_0"
    node_dir.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(node_dir)], check=True)
    try:
        args = run_args(tmp_path, CHATTY, "full", port, nproc=1) + [
            "--",
            "--steps",
            str(steps),
            "--lines",
            str(lines),
        ]
        launcher = start_traceml(args, tmp_path, tmp_path / "full", env=ENV)
        code = launcher.wait(240)
        err = (tmp_path / "full.err").read_text()
        assert code == 0, err
        out = (tmp_path / "full.out").read_text().splitlines()
        assert sum(1 for line in out if len(line) == 1023) == steps * lines
        assert "chatty: done" in out
        said = [line for line in err.splitlines() if "cannot save training output" in line]
        assert sum("training.stdout.log" in line for line in said) == 1, err
        assert "No space left on device" in err
        assert "bytes of training output are missing from" in err
        assert (node_dir / "training.stdout.log").stat().st_size < 1024 * 1024
        summary = load_summary(tmp_path / "logs" / "full")
        assert summary["run"]["status"] == "completed"
        assert summary["ranks"][0]["records_received"] == steps
    finally:
        subprocess.run(["umount", str(node_dir)], check=True)


def test_no_save_training_output(tmp_path, port):
    args = run_args(tmp_path, CHATTY, "nosave", port, nproc=1) + [
        "--no-save-training-output",
        "--",
        "--steps",
        "3",
        "--lines",
        "2",
    ]
    launcher = start_traceml(args, tmp_path, tmp_path / "nosave", env=ENV)
    assert launcher.wait(240) == 0, (tmp_path / "nosave.err").read_text()
    assert "chatty: done" in (tmp_path / "nosave.out").read_text()
    node_dir = tmp_path / "logs" / "nosave" / "nodes" / "node_0"
    assert sorted(p.name for p in node_dir.iterdir()) == ["manifest.json", "rank_ends.json"]
    node = json.loads((node_dir / "manifest.json").read_text())
    assert node["artifacts"] == {} and node["launch"]["save_training_output"] is False
